//! Windowed raster input: a rectangle of a large raster is read without decoding the whole of it.
//! A (Geo)TIFF through [`crate::tiffio::TiffRaster`] (only the strips or tiles the window
//! intersects); a PNG or JPEG within the image limits decoded whole and served from memory
//! ([`MemoryRaster`]); one beyond them read by rows ([`super::rows`]).
use std::io::BufReader;
use std::path::{Path, PathBuf};

use image::RgbImage;
use tiff::decoder::Decoder;

use crate::error::{Error, Result};
use crate::imageio::decode::check_size;
use crate::imageio::{load_rgb, ImageLimits};
use crate::tiffio::TiffRaster;

/// Largest window a caller may request (pixels).
pub(crate) const MAX_WINDOW_PIXELS: u64 = 1 << 28;

/// A pixel rectangle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    /// Left column.
    pub x: usize,
    /// Top row.
    pub y: usize,
    /// Width.
    pub w: usize,
    /// Height.
    pub h: usize,
}

/// A window of a raster as 8-bit RGB, with the source's no-data pixels marked.
#[derive(Debug, Clone)]
pub struct Window {
    /// The pixels.
    pub rgb: RgbImage,
    /// Row-major: `true` where the source is no-data (every colour sample equal to GDAL_NODATA, or
    /// alpha 0); `None` when the source has neither.
    pub nodata: Option<Vec<bool>>,
}

/// A raster that can be read a window at a time.
pub trait RasterSource {
    /// `(width, height)` in pixels.
    fn dimensions(&self) -> (usize, usize);
    /// The pixels of `r` (which must lie inside the raster).
    fn read_window(&mut self, r: Rect) -> Result<Window>;
    /// The file the raster comes from (for messages).
    fn path(&self) -> &Path;
    /// Whether windows may mark no-data pixels (a GDAL_NODATA value or an alpha band).
    fn has_mask(&self) -> bool {
        false
    }
}

/// Opens `path` for windowed reading: a TIFF through [`TiffRaster`]; a PNG or JPEG within `limits`
/// decoded whole into a [`MemoryRaster`], one beyond them read by rows ([`super::rows`]). `nodata`
/// is the source's GDAL_NODATA value.
pub fn open_raster(path: &Path, limits: &ImageLimits, nodata: Option<f64>) -> Result<Box<dyn RasterSource>> {
    if crate::geotiff::is_tiff(path)? {
        return Ok(Box::new(TiffRaster::open(path, nodata)?));
    }
    let (w, h) = super::rows::image_dimensions(path)?;
    if check_size(w, h, limits).is_ok() {
        Ok(Box::new(MemoryRaster { path: path.to_path_buf(), image: load_rgb(path, limits)? }))
    } else {
        super::rows::open(path, limits)
    }
}

/// The `(width, height)` a TIFF declares for its first image.
pub(crate) fn tiff_dimensions(path: &Path) -> Result<(u32, u32)> {
    let file = crate::fsutil::open_input(path)?;
    let tiff = |e: tiff::TiffError| Error::bad_file(path, format!("TIFF: {e}"));
    Decoder::new(BufReader::new(file)).map_err(tiff)?.dimensions().map_err(tiff)
}

/// An image held in memory, served window by window.
pub struct MemoryRaster {
    /// Where it came from.
    pub path: PathBuf,
    /// The pixels.
    pub image: RgbImage,
}

impl RasterSource for MemoryRaster {
    fn dimensions(&self) -> (usize, usize) {
        (self.image.width() as usize, self.image.height() as usize)
    }

    fn read_window(&mut self, r: Rect) -> Result<Window> {
        check_rect(self.dimensions(), r, &self.path)?;
        let mut rgb = RgbImage::new(r.w as u32, r.h as u32);
        let src = self.image.as_raw();
        let sw = self.image.width() as usize * 3;
        for (row, dst) in rgb.chunks_mut(r.w * 3).enumerate() {
            let start = (r.y + row) * sw + r.x * 3;
            dst.copy_from_slice(&src[start..start + r.w * 3]);
        }
        Ok(Window { rgb, nodata: None })
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// Checks that `r` is a non-empty window inside a `w`×`h` raster, of at most [`MAX_WINDOW_PIXELS`].
pub(crate) fn check_rect((w, h): (usize, usize), r: Rect, path: &Path) -> Result<()> {
    let inside = r.w > 0 && r.h > 0 && r.x.checked_add(r.w).is_some_and(|e| e <= w) && r.y.checked_add(r.h).is_some_and(|e| e <= h);
    if !inside {
        return Err(Error::Input(format!("{}: window {r:?} is not inside the {w}×{h} raster", path.display())));
    }
    if (r.w as u64) * (r.h as u64) > MAX_WINDOW_PIXELS {
        return Err(Error::Input(format!("{}: window {}×{} is larger than {MAX_WINDOW_PIXELS} pixels", path.display(), r.w, r.h)));
    }
    Ok(())
}
