//! JPEG-compressed TIFF chunks (compression 7): the JPEGTables tag's quantisation and Huffman
//! tables joined to each chunk's abbreviated stream, decoded (the chunk's size as the size limit) to
//! the stream's own components — a sequential stream by [`crate::jpegdec`] with libjpeg's IDCT and
//! upsampling, a progressive one by zune-jpeg in strict mode — then, for YCbCr photometric,
//! converted to RGB as libjpeg does ([`super::ycbcr`]): what GDAL (through libtiff's
//! JPEGCOLORMODE_RGB) and tifffile/imagecodecs give. RGB photometric is taken as stored.
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// One JPEG marker segment: marker byte and the byte range of the whole segment.
pub(crate) struct Segment {
    /// The byte after 0xFF.
    pub(crate) marker: u8,
    /// Where the segment's 0xFF stands.
    pub(crate) start: usize,
    /// One past its last byte.
    pub(crate) end: usize,
}

/// The marker segments of `b` from just after its SOI up to (not including) the first SOS or EOI,
/// and the offset where that SOS or EOI starts. `what` names the bytes in errors.
pub(crate) fn header_segments(b: &[u8], what: &str) -> Result<(Vec<Segment>, usize), String> {
    let truncated = || format!("{what} are truncated or corrupt");
    if b.len() < 4 || b[0] != 0xFF || b[1] != 0xD8 {
        return Err(format!("{what} do not start with a JPEG SOI marker"));
    }
    let mut segs = Vec::new();
    let mut pos = 2;
    loop {
        if pos + 2 > b.len() || b[pos] != 0xFF {
            return Err(truncated());
        }
        let marker = b[pos + 1];
        match marker {
            0xFF => pos += 1,
            0xDA | 0xD9 => return Ok((segs, pos)),
            0x01 | 0xD0..=0xD7 => pos += 2,
            _ => {
                if pos + 4 > b.len() {
                    return Err(truncated());
                }
                let len = u16::from_be_bytes([b[pos + 2], b[pos + 3]]) as usize;
                let end = pos + 2 + len;
                if len < 2 || end > b.len() {
                    return Err(truncated());
                }
                segs.push(Segment { marker, start: pos, end });
                pos = end;
            }
        }
    }
}

/// The complete JPEG stream of a chunk: SOI, the tables' segments, the chunk's own header
/// segments, then its scan data. APPn segments (JFIF, Adobe) are dropped: the TIFF's photometric
/// tag, not the stream's markers, says what the components are, as libtiff has it.
pub(crate) fn join_tables(tables: Option<&[u8]>, data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(data.len() + tables.map_or(0, <[u8]>::len));
    out.extend_from_slice(&[0xFF, 0xD8]);
    let keep = |s: &Segment| !(0xE0..=0xEF).contains(&s.marker);
    if let Some(t) = tables {
        let (segs, end) = header_segments(t, "the JPEG tables (tag 347)")?;
        if t.get(end + 1) != Some(&0xD9) {
            return Err("the JPEG tables (tag 347) hold image data instead of ending after their tables".into());
        }
        for s in segs.iter().filter(|s| keep(s)) {
            if !matches!(s.marker, 0xDB | 0xC4 | 0xDD | 0xFE) {
                return Err(format!("the JPEG tables (tag 347) hold a marker 0xFF{:02X} that is not a table", s.marker));
            }
            out.extend_from_slice(&t[s.start..s.end]);
        }
    }
    let (segs, sos) = header_segments(data, "its JPEG data")?;
    for s in segs.iter().filter(|s| keep(s)) {
        out.extend_from_slice(&data[s.start..s.end]);
    }
    out.extend_from_slice(&data[sos..]);
    Ok(out)
}

/// What a JPEG chunk must decode to.
pub(crate) struct Expect {
    /// Width in pixels.
    pub(crate) width: usize,
    /// Fewest rows (a strip's rows left in the raster).
    pub(crate) rows_min: usize,
    /// Most rows (a full chunk).
    pub(crate) rows_max: usize,
    /// Components: 1 or 3.
    pub(crate) components: usize,
    /// Convert YCbCr to RGB.
    pub(crate) ycbcr: bool,
}

/// Decodes one JPEG chunk to `width × rows × components` bytes (rows between the expected bounds).
pub(crate) fn decode(tables: Option<&[u8]>, data: &[u8], want: &Expect) -> Result<Vec<u8>, String> {
    let stream = join_tables(tables, data)?;
    let mut pixels = match crate::jpegdec::decode_all(&stream, (want.width, want.rows_max)).map_err(|e| format!("JPEG: {e}"))? {
        Some(d) => {
            if d.width != want.width || d.height < want.rows_min || d.components != want.components {
                return Err(format!(
                    "its JPEG data is {}×{} pixels of {} components, the chunk {}×{} of {}",
                    d.width, d.height, d.components, want.width, want.rows_max, want.components
                ));
            }
            d.pixels
        }
        None => decode_zune(&stream, want)?,
    };
    if want.ycbcr {
        super::ycbcr::to_rgb(&mut pixels);
    }
    Ok(pixels)
}

/// Decodes a stream [`crate::jpegdec`] does not (progressive) with zune-jpeg, to its components.
fn decode_zune(stream: &[u8], want: &Expect) -> Result<Vec<u8>, String> {
    let opts = DecoderOptions::default().set_strict_mode(true).set_max_width(want.width).set_max_height(want.rows_max);
    let jpeg = |e: zune_jpeg::errors::DecodeErrors| format!("JPEG: {e}");
    let mut dec = JpegDecoder::new_with_options(ZCursor::new(stream), opts);
    dec.decode_headers().map_err(jpeg)?;
    let (w, h) = dec.dimensions().ok_or("JPEG: no frame header")?;
    if w != want.width || h < want.rows_min || h > want.rows_max {
        return Err(format!("its JPEG data is {w}×{h} pixels, the chunk {}×{}", want.width, want.rows_max));
    }
    let space = dec.input_colorspace().ok_or("JPEG: no colour space")?;
    let components = match space {
        ColorSpace::Luma => 1,
        ColorSpace::YCbCr | ColorSpace::RGB => 3,
        _ => return Err(format!("its JPEG data has {} components, {} expected", space.num_components(), want.components)),
    };
    if components != want.components {
        return Err(format!("its JPEG data has {components} components, {} expected", want.components));
    }
    // The stream's own components, upsampled but not converted: zune-jpeg copies when the output
    // colour space is the input's.
    let mut dec = JpegDecoder::new_with_options(ZCursor::new(stream), opts.jpeg_set_out_colorspace(space));
    let pixels = dec.decode().map_err(|e| format!("JPEG (truncated or corrupt data): {e}"))?;
    if pixels.len() != w * h * components {
        return Err(format!("its JPEG data decoded to {} bytes, {} expected", pixels.len(), w * h * components));
    }
    Ok(pixels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_joined_and_app_segments_dropped() {
        let tables = [0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x03, 0x07, 0xFF, 0xD9];
        let data = [0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x02, 0xFF, 0xC0, 0x00, 0x02, 0xFF, 0xDA, 0x01, 0xFF, 0xD9];
        let j = join_tables(Some(&tables), &data).unwrap();
        assert_eq!(j, vec![0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x03, 0x07, 0xFF, 0xC0, 0x00, 0x02, 0xFF, 0xDA, 0x01, 0xFF, 0xD9]);
    }

    #[test]
    fn truncated_tables_are_named() {
        let data = [0xFF, 0xD8, 0xFF, 0xDA, 0x00];
        for t in [&[0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x43, 0x01][..], &[0xFF][..], &[0xFF, 0xD8, 0xFF, 0xDB][..]] {
            let e = join_tables(Some(t), &data).unwrap_err();
            assert!(e.contains("JPEG tables (tag 347)"), "{e}");
        }
    }
}
