//! Writing 8-bit PNGs (grayscale class ids, RGB visualisations) with text metadata, atomically.
use std::path::Path;

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;

fn encode(path: &Path, w: u32, h: u32, color: png::ColorType, data: &[u8], text: &[(&str, &str)]) -> Result<()> {
    let mut buf = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut buf, w, h);
        enc.set_color(color);
        enc.set_depth(png::BitDepth::Eight);
        for (k, v) in text {
            enc.add_itxt_chunk(k.to_string(), v.to_string()).map_err(|e| Error::bad_file(path, e.to_string()))?;
        }
        let mut wr = enc.write_header().map_err(|e| Error::bad_file(path, e.to_string()))?;
        wr.write_image_data(data).map_err(|e| Error::bad_file(path, e.to_string()))?;
    }
    write_atomic(path, &buf)
}

/// Writes a `w`×`h` 8-bit grayscale PNG (e.g. class ids) with iTXt metadata.
pub fn write_png_gray8(path: &Path, w: u32, h: u32, data: &[u8], text: &[(&str, &str)]) -> Result<()> {
    encode(path, w, h, png::ColorType::Grayscale, data, text)
}

/// Writes a `w`×`h` 8-bit RGB PNG.
pub fn write_png_rgb8(path: &Path, w: u32, h: u32, data: &[u8]) -> Result<()> {
    encode(path, w, h, png::ColorType::Rgb, data, &[])
}
