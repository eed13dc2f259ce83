//! Reading inputs on the decode pool: the file's bytes once, the header checked against the limits
//! (before any pixel is decoded), then the decode; and reading existing depth maps for edges-only runs.
use std::path::Path;

use image::RgbImage;

use crate::imageio::decode::{decode_bytes, header_size};
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
    let bytes = crate::fsutil::read_input(path, limits.max_alloc).map_err(|e| format!("cannot read file: {e}"))?;
    let (w, h) = header_size(&bytes, limits)?;
    Ok(Encoded { bytes, width: w, height: h })
}

/// Decodes a checked input as 8-bit RGB under the decoder limits (a truncated file is an error).
pub fn decode(enc: &Encoded, limits: &ImageLimits) -> Result<RgbImage, String> {
    let img = decode_bytes(&enc.bytes, limits)?;
    if (img.width(), img.height()) != (enc.width, enc.height) {
        return Err(format!("decoded size {}×{} differs from the header's {}×{}", img.width(), img.height(), enc.width, enc.height));
    }
    Ok(img)
}

/// A depth map read back from a stage output.
pub(crate) fn read_depth(path: &Path) -> Result<(usize, usize, Vec<f32>), String> {
    read_npy_2d(path).map(|((h, w), v)| (h, w, v)).map_err(|e| format!("cannot read the depth map: {e}"))
}
