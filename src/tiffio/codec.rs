//! TIFF compressions: which are read, and the lossless ones' decompression into at most the bytes a
//! chunk's pixels take — a chunk that would decompress to more (a deflate or ZSTD bomb) is refused
//! once it passes that cap, never allocated. JPEG and WebP are image codecs ([`super::jpeg`],
//! [`super::webp`]).
use std::io::Read;

use super::unsupported::{refuse, Hint};

/// A TIFF compression that is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    /// 1: none.
    None,
    /// 32773: PackBits.
    PackBits,
    /// 5: LZW.
    Lzw,
    /// 8 and 32946: Deflate (zlib).
    Deflate,
    /// 50000: Zstandard.
    Zstd,
    /// 7: JPEG (with or without JPEGTables).
    Jpeg,
    /// 50001: WebP.
    WebP,
}

impl Compression {
    /// The compression of a Compression tag value; others are refused in plain words.
    pub(crate) fn from_tag(v: u16) -> Result<Self, String> {
        Ok(match v {
            1 => Compression::None,
            5 => Compression::Lzw,
            7 => Compression::Jpeg,
            8 | 32946 => Compression::Deflate,
            32773 => Compression::PackBits,
            50000 => Compression::Zstd,
            50001 => Compression::WebP,
            6 => return Err(refuse("old-style JPEG compression (compression 6, from before TIFF 6.0's JPEG)", Hint::Deflate)),
            2..=4 => return Err(refuse("CCITT fax compression (bilevel images)", Hint::Deflate)),
            34925 => return Err(refuse("LZMA compression", Hint::Deflate)),
            34887 => return Err(refuse("LERC compression", Hint::Deflate)),
            50002 | 52546 => return Err(refuse("JPEG XL compression", Hint::Deflate)),
            34712 => return Err(refuse("JPEG 2000 compression", Hint::Deflate)),
            other => return Err(refuse(&format!("compression {other}"), Hint::Deflate)),
        })
    }

    /// Whether the codec is lossy (a predictor tag is then meaningless and ignored).
    pub(crate) fn is_lossy(self) -> bool {
        matches!(self, Compression::Jpeg | Compression::WebP)
    }

    /// Checks that the codec can carry the image's samples.
    pub(crate) fn check(self, bits: u16, planar: bool, samples: usize, photometric: u16) -> Result<(), String> {
        match self {
            Compression::Jpeg if bits != 8 => Err(refuse(&format!("{bits}-bit JPEG compression"), Hint::Deflate)),
            Compression::Jpeg if !planar && samples != 1 && samples != 3 => {
                Err(refuse(&format!("JPEG compression of {samples} samples per pixel (gray or RGB/YCbCr are read)"), Hint::Deflate))
            }
            Compression::WebP if bits != 8 || planar || !(samples == 3 || samples == 4) || photometric != 2 => {
                Err(refuse("WebP compression other than 8-bit RGB or RGBA", Hint::Deflate))
            }
            _ => Ok(()),
        }
    }

    /// The name used in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Compression::None => "uncompressed",
            Compression::PackBits => "PackBits",
            Compression::Lzw => "LZW",
            Compression::Deflate => "Deflate",
            Compression::Zstd => "ZSTD",
            Compression::Jpeg => "JPEG",
            Compression::WebP => "WebP",
        }
    }
}

/// The error of a chunk that decompresses to more than its pixels take.
fn bomb(full: usize) -> String {
    format!("decompresses to more than the {full} bytes its pixels take (a compression bomb or a corrupt file)")
}

/// Reads `r` to its end into at most `full` bytes; more is refused as soon as it appears.
fn read_capped(r: impl Read, full: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(full);
    r.take(full as u64 + 1).read_to_end(&mut out).map_err(|e| format!("cannot decompress: {e}"))?;
    if out.len() > full {
        return Err(bomb(full));
    }
    Ok(out)
}

/// Decompresses a lossless chunk into at most `full` bytes.
pub(crate) fn decompress(method: Compression, data: &[u8], full: usize) -> Result<Vec<u8>, String> {
    match method {
        Compression::None => Ok(data[..data.len().min(full)].to_vec()),
        Compression::PackBits => unpack_bits(data, full),
        Compression::Lzw => lzw(data, full),
        Compression::Deflate => read_capped(flate2::read::ZlibDecoder::new(data), full),
        Compression::Zstd => {
            // A frame may ask for a window of at most the 64 MiB chunk cap (zstd's streaming levels ask
            // up to 8 MiB); the window fills only as data is decoded, and that stops at the cap.
            let dec = ruzstd::decoding::StreamingDecoder::new_with_max_window_size(data, super::layout::MAX_CHUNK_BYTES)
                .map_err(|e| format!("ZSTD: {e}"))?;
            read_capped(dec, full).map_err(|e| format!("ZSTD: {e}"))
        }
        Compression::Jpeg | Compression::WebP => Err(format!("{} is an image codec", method.name())),
    }
}

/// PackBits: a count byte `n` then `n + 1` literal bytes (`n` ≥ 0), or one byte repeated `1 − n`
/// times (`n` < 0, −128 a no-op).
fn unpack_bits(data: &[u8], full: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(full);
    let mut i = 0;
    while i < data.len() && out.len() <= full {
        let n = data[i] as i8;
        i += 1;
        if n >= 0 {
            let end = (i + n as usize + 1).min(data.len());
            out.extend_from_slice(&data[i..end]);
            i = end;
        } else if n != -128 {
            if let Some(&b) = data.get(i) {
                out.extend(std::iter::repeat_n(b, (1 - n as isize) as usize));
            }
            i += 1;
        }
    }
    if out.len() > full {
        return Err(bomb(full));
    }
    Ok(out)
}

/// TIFF LZW (MSB first, with the early code-size switch), into at most `full` bytes.
fn lzw(data: &[u8], full: usize) -> Result<Vec<u8>, String> {
    let mut dec = weezl::decode::Decoder::with_tiff_size_switch(weezl::BitOrder::Msb, 8);
    let mut out = vec![0u8; full + 1];
    let (mut i, mut o) = (0, 0);
    while o <= full {
        let r = dec.decode_bytes(&data[i..], &mut out[o..]);
        i += r.consumed_in;
        o += r.consumed_out;
        match r.status {
            Ok(weezl::LzwStatus::Ok) if r.consumed_in > 0 || r.consumed_out > 0 => {}
            Ok(_) => break,
            Err(e) => return Err(format!("LZW: {e}")),
        }
    }
    if o > full {
        return Err(bomb(full));
    }
    out.truncate(o);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packbits_literals_runs_and_the_cap() {
        // 2 literals, a run of 3, a no-op.
        let data = [1u8, 10, 11, 0xFE, 7, 0x80];
        assert_eq!(unpack_bits(&data, 16).unwrap(), vec![10, 11, 7, 7, 7]);
        assert!(unpack_bits(&[0x81, 1, 0x81, 1], 100).unwrap_err().contains("more than"));
    }

    #[test]
    fn a_deflate_bomb_is_refused_at_the_cap() {
        use std::io::Write;
        let zeros = vec![0u8; 1 << 20];
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        z.write_all(&zeros).unwrap();
        let deflated = z.finish().unwrap();
        assert_eq!(decompress(Compression::Deflate, &deflated, 1 << 20).unwrap().len(), 1 << 20);
        assert!(decompress(Compression::Deflate, &deflated, 1000).unwrap_err().contains("compression bomb"));
    }

    #[test]
    fn unknown_and_refused_compressions_name_the_conversion() {
        for v in [6u16, 34925, 34887, 4, 9999] {
            let e = Compression::from_tag(v).unwrap_err();
            assert!(e.contains("gdal_translate") && e.contains("COMPRESS=DEFLATE"), "{e}");
        }
    }
}
