//! Reading inputs on the decode pool: the file's bytes once, the header checked against the limits
//! (before any pixel is decoded), then the decode; and reading existing depth maps for edges-only runs.
use std::io::Cursor;
use std::path::Path;

use image::{ImageReader, RgbImage};

use crate::imageio::npy::read_npy_2d;
use crate::imageio::ImageLimits;

/// An input read from disk whose header passed the limits.
pub struct Encoded {
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
}

/// Reads `path` and checks its header; the error is the reason recorded in the journal.
pub fn read_checked(path: &Path, limits: &ImageLimits) -> Result<Encoded, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read file: {e}"))?;
    if bytes.is_empty() {
        return Err("file is empty".into());
    }
    let reader = ImageReader::new(Cursor::new(&bytes[..])).with_guessed_format().map_err(|e| format!("cannot read file: {e}"))?;
    if reader.format().is_none() {
        return Err("not a recognised image format".into());
    }
    let (w, h) = reader.into_dimensions().map_err(|e| format!("cannot read image header: {e}"))?;
    crate::imageio::decode::check_size(w, h, limits)?;
    Ok(Encoded { bytes, width: w, height: h })
}

/// Decodes a checked input as 8-bit RGB under the decoder limits.
pub fn decode(enc: &Encoded, limits: &ImageLimits) -> Result<RgbImage, String> {
    let mut reader = ImageReader::new(Cursor::new(&enc.bytes[..])).with_guessed_format().map_err(|e| format!("cannot read file: {e}"))?;
    let mut l = image::Limits::default();
    l.max_image_width = Some(limits.max_side);
    l.max_image_height = Some(limits.max_side);
    l.max_alloc = Some(limits.max_alloc);
    reader.limits(l);
    let img = reader.decode().map_err(|e| format!("cannot decode image: {e}"))?;
    let img = img.into_rgb8();
    if (img.width(), img.height()) != (enc.width, enc.height) {
        return Err(format!("decoded size {}×{} differs from the header's {}×{}", img.width(), img.height(), enc.width, enc.height));
    }
    Ok(img)
}

/// A depth map read back from a stage output.
pub fn read_depth(path: &Path) -> Result<(usize, usize, Vec<f32>), String> {
    read_npy_2d(path).map(|((h, w), v)| (h, w, v)).map_err(|e| format!("cannot read the depth map: {e}"))
}
