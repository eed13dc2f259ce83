//! Decoding images into RGB tensors, refusing oversized or malformed files.
use std::io::Cursor;
use std::path::Path;

use candle_core::{Device, Tensor};
use image::{ImageFormat, ImageReader, RgbImage};

use crate::error::{Error, Result};

mod jpeg;

/// Limits applied before and during decoding.
#[derive(Debug, Clone, Copy)]
pub struct ImageLimits {
    /// Largest accepted width or height in pixels.
    pub max_side: u32,
    /// Largest accepted pixel count.
    pub max_pixels: u64,
    /// Largest decoder allocation in bytes.
    pub max_alloc: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits { max_side: 20_000, max_pixels: 120_000_000, max_alloc: 1 << 30 }
    }
}

/// Decodes `path` as 8-bit RGB, checking its declared size against `limits` before decoding.
/// A truncated or corrupt file is an error, never a partially grey image.
pub fn load_rgb(path: &Path, limits: &ImageLimits) -> Result<RgbImage> {
    let bad = |m: String| Error::bad_file(path, m);
    let bytes = crate::fsutil::read_input(path, limits.max_alloc)?;
    if bytes.is_empty() {
        return Err(bad("file is empty".into()));
    }
    let (w, h) = header_size(&bytes, limits).map_err(bad)?;
    let img = decode_bytes(&bytes, limits).map_err(bad)?;
    if img.dimensions() != (w, h) {
        return Err(bad(format!("decoded size {}×{} differs from the header's {w}×{h}", img.width(), img.height())));
    }
    Ok(img)
}

/// The size an image file declares in its header, checked against `limits` (nothing is decoded).
pub(crate) fn header_size(bytes: &[u8], limits: &ImageLimits) -> std::result::Result<(u32, u32), String> {
    if bytes.is_empty() {
        return Err("file is empty".into());
    }
    if is_tiff_bytes(bytes) {
        let (w, h) = tiff_size(Cursor::new(bytes))?;
        check_size(w, h, limits)?;
        return Ok((w, h));
    }
    let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| format!("cannot read file: {e}"))?;
    if reader.format().is_none() {
        return Err("not a recognised image format".into());
    }
    let (w, h) = reader.into_dimensions().map_err(|e| format!("cannot read image header: {e}"))?;
    check_size(w, h, limits)?;
    Ok((w, h))
}

/// The size `path` declares in its header, read from the file without decoding it (or reading it all).
pub(crate) fn file_header_size(path: &Path, limits: &ImageLimits) -> Result<(u32, u32)> {
    let bad = |m: String| Error::bad_file(path, m);
    crate::fsutil::check_input_file(path)?;
    if crate::geotiff::is_tiff(path)? {
        let file = crate::fsutil::open_input(path)?;
        let (w, h) = tiff_size(std::io::BufReader::new(file)).map_err(bad)?;
        check_size(w, h, limits).map_err(bad)?;
        return Ok((w, h));
    }
    let reader = ImageReader::open(path).map_err(|e| Error::io(path, e))?.with_guessed_format().map_err(|e| Error::io(path, e))?;
    if reader.format().is_none() {
        return Err(bad("not a recognised image format".into()));
    }
    let (w, h) = reader.into_dimensions().map_err(|e| bad(format!("cannot read image header: {e}")))?;
    check_size(w, h, limits).map_err(bad)?;
    Ok((w, h))
}

/// Whether `bytes` start with a TIFF or BigTIFF header.
fn is_tiff_bytes(bytes: &[u8]) -> bool {
    matches!(bytes.get(..4), Some(b"II*\0" | b"MM\0*" | b"II+\0" | b"MM\0+"))
}

/// The size a TIFF declares for its first image.
fn tiff_size(reader: impl std::io::Read + std::io::Seek) -> std::result::Result<(u32, u32), String> {
    let tiff = |e: tiff::TiffError| format!("cannot read image header: TIFF: {e}");
    tiff::decoder::Decoder::new(reader).map_err(tiff)?.dimensions().map_err(tiff)
}

/// Decodes image bytes as 8-bit RGB under the decoder limits; JPEGs in strict mode, so that a
/// truncated file (baseline or progressive) is an error rather than a grey-filled image; TIFFs
/// with edgerun's own TIFF reader ([`crate::tiffio`]), as the tiled path reads them.
pub(crate) fn decode_bytes(bytes: &[u8], limits: &ImageLimits) -> std::result::Result<RgbImage, String> {
    if is_tiff_bytes(bytes) {
        return crate::tiffio::decode_whole(bytes, limits);
    }
    let mut reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| format!("cannot read file: {e}"))?;
    if reader.format() == Some(ImageFormat::Jpeg) {
        return jpeg::decode_strict(bytes, limits);
    }
    let mut l = image::Limits::default();
    l.max_image_width = Some(limits.max_side);
    l.max_image_height = Some(limits.max_side);
    l.max_alloc = Some(limits.max_alloc);
    reader.limits(l);
    let img = reader.decode().map_err(|e| format!("cannot decode image: {e}"))?;
    Ok(img.into_rgb8())
}

/// Checks a declared image size against `limits` (zero sizes and oversized images are refused).
pub(crate) fn check_size(w: u32, h: u32, limits: &ImageLimits) -> std::result::Result<(), String> {
    if w == 0 || h == 0 {
        return Err(format!("image has zero size {w}×{h}"));
    }
    if w > limits.max_side || h > limits.max_side || (w as u64) * (h as u64) > limits.max_pixels {
        return Err(format!(
            "image is {w}×{h}, larger than the limit ({} px per side, {} pixels)",
            limits.max_side, limits.max_pixels
        ));
    }
    Ok(())
}

/// An RGB image as an f32 tensor `[3, H, W]` with values in [0, 1].
pub fn rgb_to_tensor(img: &RgbImage, device: &Device) -> Result<Tensor> {
    let (w, h) = img.dimensions();
    let data: Vec<f32> = img.as_raw().iter().map(|&v| v as f32 / 255.0).collect();
    let t = Tensor::from_vec(data, (h as usize, w as usize, 3), device)?;
    Ok(t.permute((2, 0, 1))?.contiguous()?)
}
