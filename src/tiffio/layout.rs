//! The layout of one TIFF image (IFD): size, chunking, samples, colour model, compression and where
//! each strip or tile lies, read with the `tiff` crate's tag reader and checked before anything is
//! sized from it. Unsupported colour models and sample formats are refused in plain words
//! ([`super::unsupported`]).
use std::io::{Read, Seek};

use tiff::decoder::{ChunkType, Decoder};
use tiff::tags::{ByteOrder, Tag};

use super::codec::Compression;
use super::unsupported::{refuse, Hint};

/// Largest raster side accepted (2^20 pixels).
pub(crate) const MAX_RASTER_SIDE: usize = 1 << 20;
/// Largest raster pixel count accepted (2^36).
pub(crate) const MAX_RASTER_PIXELS: u64 = 1 << 36;
/// Largest decoded strip or tile (bytes); bigger chunks cannot be read window by window.
pub(crate) const MAX_CHUNK_BYTES: u64 = 64 << 20;
/// Largest stored (compressed) strip or tile read (bytes): incompressible data grows a little.
pub(crate) const MAX_STORED_BYTES: u64 = 2 * MAX_CHUNK_BYTES;
/// Largest JPEGTables tag accepted (bytes; real tables are under 1 KiB).
const MAX_JPEG_TABLES: usize = 64 << 10;

/// How a pixel's colour samples are to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Colour {
    /// One gray sample; `inverted` for WhiteIsZero.
    Gray { inverted: bool },
    /// Three RGB samples (or the first three bands of a multiband raster).
    Rgb,
    /// JPEG-coded YCbCr, converted to RGB as libjpeg does.
    YCbCr,
}

impl Colour {
    /// Colour samples per pixel.
    pub(crate) fn samples(self) -> usize {
        match self {
            Colour::Gray { .. } => 1,
            Colour::Rgb | Colour::YCbCr => 3,
        }
    }
}

/// One image of a TIFF, as read from its tags and checked.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// Raster width.
    pub(crate) width: usize,
    /// Raster height.
    pub(crate) height: usize,
    /// Strip or tile width.
    pub(crate) chunk_w: usize,
    /// Strip or tile height (rows per strip, at most the raster height).
    pub(crate) chunk_h: usize,
    /// Tiles (or strips).
    pub(crate) tiled: bool,
    /// One chunk per sample (PlanarConfiguration 2).
    pub(crate) planar: bool,
    /// Samples per pixel.
    pub(crate) samples: usize,
    /// Bits per sample: 8 or 16 (1 for a transparency mask).
    pub(crate) bits: u8,
    /// How the colour samples are read.
    pub(crate) colour: Colour,
    /// The sample holding alpha, if any.
    pub(crate) alpha: Option<usize>,
    /// The compression.
    pub(crate) compression: Compression,
    /// Predictor 2 (horizontal differencing).
    pub(crate) horizontal_predictor: bool,
    /// The JPEGTables tag, for JPEG compression.
    pub(crate) jpeg_tables: Option<Vec<u8>>,
    /// Chunk offsets.
    pub(crate) offsets: Vec<u64>,
    /// Chunk byte counts.
    pub(crate) lengths: Vec<u64>,
    /// Multi-byte samples are little-endian.
    pub(crate) little_endian: bool,
}

/// NewSubfileType bits: a reduced-resolution image (an overview) and a transparency mask.
pub(crate) const SUBFILE_REDUCED: u32 = 1;
/// NewSubfileType bit of a transparency mask.
pub(crate) const SUBFILE_MASK: u32 = 4;

/// The NewSubfileType of the decoder's current image (0 when absent).
pub(crate) fn subfile_type<R: Read + Seek>(dec: &mut Decoder<R>) -> Result<u32, String> {
    dec.find_tag_unsigned::<u32>(Tag::NewSubfileType).map_err(|e| format!("TIFF: {e}")).map(|v| v.unwrap_or(0))
}

impl Layout {
    /// Reads and checks the decoder's current image; `mask` for a transparency mask (1- or 8-bit,
    /// one sample). `file_len` bounds the chunks.
    pub(crate) fn read<R: Read + Seek>(dec: &mut Decoder<R>, file_len: u64, mask: bool) -> Result<Self, String> {
        let tiff = |e: tiff::TiffError| format!("TIFF: {e}");
        let (w, h) = dec.dimensions().map_err(tiff)?;
        let (width, height) = (w as usize, h as usize);
        if width == 0 || height == 0 {
            return Err(format!("declared raster size {w}×{h} is empty"));
        }
        if width > MAX_RASTER_SIDE || height > MAX_RASTER_SIDE || (w as u64) * (h as u64) > MAX_RASTER_PIXELS {
            return Err(format!(
                "declared raster size {w}×{h} is beyond what is read window by window ({MAX_RASTER_SIDE} px per side, {MAX_RASTER_PIXELS} pixels)"
            ));
        }
        let samples = dec.find_tag_unsigned::<u16>(Tag::SamplesPerPixel).map_err(tiff)?.unwrap_or(1) as usize;
        if samples == 0 || samples > 64 {
            return Err(format!("{samples} samples per pixel (1 to 64 are read)"));
        }
        let bits_list = dec.find_tag_unsigned_vec::<u16>(Tag::BitsPerSample).map_err(tiff)?.unwrap_or_else(|| vec![1]);
        let bits = bits_list.first().copied().unwrap_or(1);
        if bits_list.iter().any(|&b| b != bits) {
            return Err(refuse(&format!("samples of different bit depths {bits_list:?}"), Hint::Deflate));
        }
        let formats = dec.find_tag_unsigned_vec::<u16>(Tag::SampleFormat).map_err(tiff)?.unwrap_or_default();
        match formats.iter().copied().find(|&f| f != 1) {
            None => {}
            Some(2) => return Err(refuse("signed integer samples", Hint::ToByte)),
            Some(3) => return Err(refuse("floating-point samples", Hint::ToByte)),
            Some(f) => return Err(refuse(&format!("sample format {f}"), Hint::ToByte)),
        }
        let ok_bits = if mask { bits == 1 || bits == 8 } else { bits == 8 || bits == 16 };
        if !ok_bits {
            return Err(refuse(&format!("{bits}-bit samples (8 or 16 bits are read)"), Hint::ToByte));
        }
        let photometric = dec.find_tag_unsigned::<u16>(Tag::PhotometricInterpretation).map_err(tiff)?.unwrap_or(u16::MAX);
        let compression = Compression::from_tag(dec.find_tag_unsigned::<u16>(Tag::Compression).map_err(tiff)?.unwrap_or(1))?;
        let extra = dec.find_tag_unsigned_vec::<u16>(Tag::ExtraSamples).map_err(tiff)?.unwrap_or_default();
        let base = samples.checked_sub(extra.len()).ok_or_else(|| format!("{} extra samples for {samples} samples per pixel", extra.len()))?;
        let (colour, alpha) = if mask {
            if samples != 1 {
                return Err(format!("a transparency mask of {samples} samples per pixel"));
            }
            (Colour::Gray { inverted: false }, None)
        } else {
            colour_model(photometric, samples, base, &extra, compression)?
        };
        let planar = dec.find_tag_unsigned::<u16>(Tag::PlanarConfiguration).map_err(tiff)?.unwrap_or(1) == 2 && samples > 1;
        if colour == Colour::YCbCr && planar {
            return Err(refuse("JPEG-compressed YCbCr with separate colour planes", Hint::Deflate));
        }
        compression.check(bits, planar, samples, photometric)?;
        let predictor = dec.find_tag_unsigned::<u16>(Tag::Predictor).map_err(tiff)?.unwrap_or(1);
        let horizontal_predictor = match (predictor, compression.is_lossy()) {
            (1, _) | (_, true) => false,
            (2, false) => true,
            (3, false) => return Err(refuse("the floating-point predictor (3) without floating-point samples", Hint::Deflate)),
            (p, false) => return Err(format!("unknown predictor {p}")),
        };
        let tiled = dec.get_chunk_type() == ChunkType::Tile;
        let (cw, ch) = dec.chunk_dimensions();
        let (chunk_w, chunk_h) = (cw as usize, (ch as usize).min(height));
        let kind = if tiled { "tiles" } else { "strips" };
        if chunk_w == 0 || chunk_h == 0 {
            return Err(format!("zero-sized {kind} {cw}×{ch}"));
        }
        let per_chunk = if planar { 1 } else { samples as u64 };
        let chunk_bytes = (chunk_w as u64).checked_mul(chunk_h as u64).and_then(|n| n.checked_mul(per_chunk * (bits as u64).div_ceil(8)));
        if chunk_bytes.is_none_or(|n| n > MAX_CHUNK_BYTES) {
            return Err(format!(
                "its {kind} are {cw}×{ch} pixels, more than {} MiB decoded each; rewrite it tiled (e.g. `gdal_translate -co TILED=YES`)",
                MAX_CHUNK_BYTES >> 20
            ));
        }
        let (off_tag, len_tag) = if tiled { (Tag::TileOffsets, Tag::TileByteCounts) } else { (Tag::StripOffsets, Tag::StripByteCounts) };
        let offsets = dec.get_tag_u64_vec(off_tag).map_err(tiff)?;
        let lengths = dec.get_tag_u64_vec(len_tag).map_err(tiff)?;
        let across = if tiled { width.div_ceil(chunk_w) } else { 1 };
        let planes = if planar { samples } else { 1 };
        let expected = across.checked_mul(height.div_ceil(chunk_h)).and_then(|n| n.checked_mul(planes));
        if expected != Some(offsets.len()) || offsets.len() != lengths.len() {
            return Err(format!(
                "{} offsets and {} byte counts for a {width}×{height} raster in {cw}×{ch} chunks (expected {})",
                offsets.len(),
                lengths.len(),
                expected.map(|n| n.to_string()).unwrap_or_else(|| "too many".into())
            ));
        }
        let jpeg_tables = if compression == Compression::Jpeg {
            match dec.find_tag(Tag::JPEGTables).map_err(tiff)? {
                Some(v) => {
                    let t = v.into_u8_vec().map_err(tiff)?;
                    if t.len() > MAX_JPEG_TABLES {
                        return Err(format!("its JPEG tables (tag 347) are {} bytes, more than the {MAX_JPEG_TABLES} accepted", t.len()));
                    }
                    Some(t)
                }
                None => None,
            }
        } else {
            None
        };
        let little_endian = dec.byte_order() == ByteOrder::LittleEndian;
        let layout = Layout {
            width,
            height,
            chunk_w,
            chunk_h,
            tiled,
            planar,
            samples,
            bits: bits as u8,
            colour,
            alpha,
            compression,
            horizontal_predictor,
            jpeg_tables,
            offsets,
            lengths,
            little_endian,
        };
        layout.check_chunks(file_len)?;
        Ok(layout)
    }

    /// Checks that every chunk lies inside the file and that an uncompressed one holds its pixels.
    fn check_chunks(&self, file_len: u64) -> Result<(), String> {
        let kind = if self.tiled { "tile" } else { "strip" };
        for (i, (&o, &n)) in self.offsets.iter().zip(&self.lengths).enumerate() {
            if o.checked_add(n).is_none_or(|end| end > file_len) {
                return Err(format!(
                    "{kind} {i} (offset {o}, {n} bytes) lies past the end of the file ({file_len} bytes): the file is truncated or corrupt"
                ));
            }
            if n > MAX_STORED_BYTES {
                return Err(format!("{kind} {i} is stored in {n} bytes, more than the {} MiB a chunk may take", MAX_STORED_BYTES >> 20));
            }
            if self.compression == Compression::None {
                let need = (self.row_bytes() * self.rows_in(i)) as u64;
                if n < need {
                    return Err(format!("uncompressed {kind} {i} holds {n} bytes, {need} needed for its pixels: the file is truncated or corrupt"));
                }
            }
        }
        Ok(())
    }

    /// Samples per pixel in one chunk (1 when planar).
    pub(crate) fn chunk_samples(&self) -> usize {
        if self.planar {
            1
        } else {
            self.samples
        }
    }

    /// Bytes of one decoded chunk row.
    pub(crate) fn row_bytes(&self) -> usize {
        (self.chunk_w * self.chunk_samples() * self.bits as usize).div_ceil(8)
    }

    /// Chunks across the raster.
    pub(crate) fn across(&self) -> usize {
        if self.tiled {
            self.width.div_ceil(self.chunk_w)
        } else {
            1
        }
    }

    /// Chunks down the raster.
    pub(crate) fn down(&self) -> usize {
        self.height.div_ceil(self.chunk_h)
    }

    /// Rows of pixel data chunk `index` must hold: a tile all its rows (padding included), a strip
    /// those left in the raster.
    pub(crate) fn rows_in(&self, index: usize) -> usize {
        if self.tiled {
            self.chunk_h
        } else {
            let y = (index % self.down()) * self.chunk_h;
            self.chunk_h.min(self.height - y)
        }
    }
}

/// The colour model and alpha sample of an image from its photometric interpretation, samples per
/// pixel, colour samples (`base`: samples less extra samples) and ExtraSamples.
fn colour_model(photometric: u16, samples: usize, base: usize, extra: &[u16], compression: Compression) -> Result<(Colour, Option<usize>), String> {
    let declared_alpha = extra.iter().position(|&e| e == 1 || e == 2).map(|i| base + i);
    let (colour, legacy_alpha) = match photometric {
        0 | 1 => {
            let inverted = photometric == 0;
            if samples >= 3 && declared_alpha.is_none_or(|a| a >= 3) && !inverted {
                // A multiband raster: the first three bands are taken as RGB.
                (Colour::Rgb, None)
            } else {
                (Colour::Gray { inverted }, (extra.is_empty() && samples == 2).then_some(1))
            }
        }
        2 | 6 if base < 3 => return Err(format!("an RGB or YCbCr image of {base} colour samples")),
        2 => (Colour::Rgb, (extra.is_empty() && samples == 4).then_some(3)),
        6 if compression == Compression::Jpeg => (Colour::YCbCr, (extra.is_empty() && samples == 4).then_some(3)),
        6 => return Err(refuse("YCbCr colour without JPEG compression", Hint::Rgb)),
        3 => return Err(refuse("palette (colour-mapped) images", Hint::Palette)),
        4 => return Err(refuse("a transparency mask as the main image", Hint::Deflate)),
        5 => return Err(refuse("CMYK (separated) colour", Hint::Cmyk)),
        8..=10 => return Err(refuse("CIE L*a*b* colour", Hint::Rgb)),
        32844 | 32845 => return Err(refuse("LogL/LogLuv high-dynamic-range colour", Hint::ToByte)),
        u16::MAX => return Err("it has no PhotometricInterpretation tag (gray, RGB or YCbCr are read)".into()),
        p => return Err(refuse(&format!("photometric interpretation {p}"), Hint::Rgb)),
    };
    Ok((colour, declared_alpha.or(legacy_alpha)))
}
