//! WebP-compressed TIFF chunks (compression 50001, as GDAL writes them: each chunk a whole WebP
//! file, lossy or lossless, RGB or RGBA), decoded by the pure-Rust `image-webp` after its declared
//! size is checked against the chunk's.
use std::io::Cursor;

/// Decodes one WebP chunk of `width` × `rows_min..=rows_max` pixels to `samples` (3 or 4) bytes
/// per pixel; a missing alpha is opaque, an alpha the TIFF does not declare is dropped.
pub(crate) fn decode(data: &[u8], width: usize, rows_min: usize, rows_max: usize, samples: usize) -> Result<Vec<u8>, String> {
    let webp = |e: image_webp::DecodingError| format!("WebP: {e}");
    let mut dec = image_webp::WebPDecoder::new(Cursor::new(data)).map_err(webp)?;
    let (w, h) = dec.dimensions();
    let (w, h) = (w as usize, h as usize);
    if w != width || h < rows_min || h > rows_max {
        return Err(format!("its WebP data is {w}×{h} pixels, the chunk {width}×{rows_max}"));
    }
    let have = if dec.has_alpha() { 4 } else { 3 };
    dec.set_memory_limit(w * h * 4 + (1 << 20));
    let mut buf = vec![0u8; w * h * have];
    dec.read_image(&mut buf).map_err(webp)?;
    if have == samples {
        return Ok(buf);
    }
    let mut out = Vec::with_capacity(w * h * samples);
    for p in buf.chunks_exact(have) {
        out.extend_from_slice(&p[..3]);
        if samples == 4 {
            out.push(255);
        }
    }
    Ok(out)
}
