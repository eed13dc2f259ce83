//! Reading (Geo)TIFF pixels with edgerun's own chunk decoding, for the tiled and the untiled paths
//! alike: the image's layout and colour model ([`layout`]), the lossless codecs ([`codec`]: none,
//! PackBits, LZW, Deflate, ZSTD), JPEG with tables in YCbCr or RGB ([`jpeg`], [`ycbcr`]), WebP
//! ([`webp`]), the horizontal predictor ([`predictor`]), and the windowed reader ([`raster`]) that
//! skips overviews and reads an internal mask. Every size read from the file is bounded before it
//! sizes an allocation; what stays unsupported is refused in plain words ([`unsupported`]).
pub(crate) mod chunk;
pub(crate) mod codec;
pub(crate) mod jpeg;
pub(crate) mod layout;
pub(crate) mod predictor;
pub(crate) mod raster;
pub(crate) mod unsupported;
pub(crate) mod webp;
pub(crate) mod ycbcr;

use std::io::Cursor;
use std::path::Path;

use image::RgbImage;

use crate::imageio::decode::check_size;
use crate::imageio::ImageLimits;
use crate::tiling::RasterSource;
pub use raster::TiffRaster;

/// Decodes a whole TIFF held in memory as 8-bit RGB (the untiled path), its declared size and the
/// bytes of its pixels checked against `limits` before any pixel is decoded.
pub(crate) fn decode_whole(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, String> {
    let mut raster = TiffRaster::from_reader(Path::new(""), Cursor::new(bytes), bytes.len() as u64, None).map_err(|e| message(&e))?;
    let (w, h) = raster.dimensions();
    check_size(w as u32, h as u32, limits)?;
    let need = (w as u64) * (h as u64) * 3;
    if need > limits.max_alloc {
        return Err(format!("cannot decode image: {need} bytes of pixels exceed the allocation limit {}", limits.max_alloc));
    }
    raster.read_all().map_err(|e| message(&e))
}

/// An error's message without the (empty) path prefix of an in-memory file.
fn message(e: &crate::Error) -> String {
    e.to_string().trim_start_matches(": ").to_string()
}
