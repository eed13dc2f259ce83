//! JPEG decoding in strict mode: `image` runs the same decoder (zune-jpeg) leniently, which fills
//! a truncated baseline or progressive scan with grey and reports success; here the decoder must
//! reach the end of every scan, so a truncated file is an error.
use image::{DynamicImage, ImageBuffer, RgbImage};
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use super::ImageLimits;

/// The output colour space `image` asks zune-jpeg for (its own mapping, kept identical).
fn supported(orig: ColorSpace) -> ColorSpace {
    match orig {
        ColorSpace::RGB | ColorSpace::RGBA | ColorSpace::Luma | ColorSpace::LumaA => orig,
        _ => ColorSpace::RGB,
    }
}

/// Decodes a JPEG as 8-bit RGB with the pixels `image` would give, failing on truncated or
/// corrupt entropy-coded data instead of filling it in.
pub(crate) fn decode_strict(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, String> {
    let base = DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(limits.max_side as usize)
        .set_max_height(limits.max_side as usize);
    let mut probe = JpegDecoder::new_with_options(ZCursor::new(bytes), base);
    probe.decode_headers().map_err(|e| format!("cannot decode image: {e}"))?;
    let orig = probe.input_colorspace().ok_or("cannot decode image: no colour space in the JPEG header")?;
    let (w, h) = probe.dimensions().ok_or("cannot decode image: no dimensions in the JPEG header")?;
    let out = supported(orig);
    let need = (w as u64) * (h as u64) * out.num_components() as u64;
    if need > limits.max_alloc {
        return Err(format!("cannot decode image: {need} bytes of pixels exceed the allocation limit {}", limits.max_alloc));
    }
    let mut dec = JpegDecoder::new_with_options(ZCursor::new(bytes), base.jpeg_set_out_colorspace(out));
    let pixels = dec.decode().map_err(|e| format!("cannot decode image (truncated or corrupt JPEG): {e}"))?;
    let (w, h) = (w as u32, h as u32);
    let bad = || "cannot decode image: decoded data does not match the header's size".to_string();
    let img = match out {
        ColorSpace::RGB => DynamicImage::ImageRgb8(ImageBuffer::from_raw(w, h, pixels).ok_or_else(bad)?),
        ColorSpace::RGBA => DynamicImage::ImageRgba8(ImageBuffer::from_raw(w, h, pixels).ok_or_else(bad)?),
        ColorSpace::Luma => DynamicImage::ImageLuma8(ImageBuffer::from_raw(w, h, pixels).ok_or_else(bad)?),
        ColorSpace::LumaA => DynamicImage::ImageLumaA8(ImageBuffer::from_raw(w, h, pixels).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    Ok(img.into_rgb8())
}
