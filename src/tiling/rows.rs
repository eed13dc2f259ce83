//! A PNG or JPEG beyond the whole-image limits, read by rows and served window by window like a
//! striped TIFF: the decoder runs top to bottom and only the rows and columns of the window being
//! read are kept, so memory is bounded by the window, not the image. A window above the rows already
//! passed (the next column stripe) restarts the decoder from the top. Images whose rows cannot be
//! had one after another (interlaced PNG, progressive JPEG) are refused naming the limit.
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use image::RgbImage;

use super::window_io::{check_rect, RasterSource, Rect, Window};
use crate::error::{Error, Result};
use crate::imageio::ImageLimits;
use crate::tiffio::layout::{MAX_RASTER_PIXELS, MAX_RASTER_SIDE};

/// Largest PNG row buffer the decoder may allocate (bytes): a 2^20-px row of 16-bit RGBA is 8 MiB.
const PNG_ROW_LIMIT: usize = 64 << 20;

/// A decoder handing out an image's rows top to bottom.
pub(crate) trait RowDecoder {
    /// Writes the next row as 8-bit RGB into `out` (`width × 3` bytes); the error says what is wrong.
    fn next_row(&mut self, out: &mut [u8]) -> std::result::Result<(), String>;
}

/// Opens a decoder at the image's first row.
type Opener = fn(&Path) -> Result<Box<dyn RowDecoder>>;

/// The `(width, height)` a PNG or JPEG declares in its header (nothing decoded, no limits applied).
pub(crate) fn image_dimensions(path: &Path) -> Result<(u32, u32)> {
    crate::fsutil::check_input_file(path)?;
    let reader = image::ImageReader::open(path).map_err(|e| Error::io(path, e))?.with_guessed_format().map_err(|e| Error::io(path, e))?;
    if reader.format().is_none() {
        return Err(Error::bad_file(path, "not a recognised image format"));
    }
    reader.into_dimensions().map_err(|e| Error::bad_file(path, format!("cannot read image header: {e}")))
}

/// Opens a PNG or JPEG beyond `limits` for reading by rows; what cannot be read so is refused with
/// the limit it is beyond and the conversion to make.
pub(crate) fn open(path: &Path, limits: &ImageLimits) -> Result<Box<dyn RasterSource>> {
    let (w, h) = image_dimensions(path)?;
    let (width, height) = (w as usize, h as usize);
    if width > MAX_RASTER_SIDE || height > MAX_RASTER_SIDE || (w as u64) * (h as u64) > MAX_RASTER_PIXELS {
        return Err(Error::bad_file(path, format!("declared image size {w}×{h} is beyond what is read by rows ({MAX_RASTER_SIDE} px per side, {MAX_RASTER_PIXELS} pixels)")));
    }
    let beyond = format!(
        "is {w}×{h} px, beyond the whole-image limit ({} px per side, {} pixels)",
        limits.max_side, limits.max_pixels
    );
    let convert = "convert it to a tiled GeoTIFF (`gdal_translate -co TILED=YES -co COMPRESS=DEFLATE in out.tif`)";
    let opener: Opener = match sniff(path).or_else(|| image::ImageFormat::from_path(path).ok()) {
        Some(image::ImageFormat::Png) => {
            if png_interlaced(path)? {
                return Err(Error::bad_file(path, format!("{beyond}, and an interlaced PNG cannot be read by rows; {convert}")));
            }
            open_png
        }
        Some(image::ImageFormat::Jpeg) => {
            super::jpeg_rows::check(path, &beyond, convert)?;
            super::jpeg_rows::open
        }
        _ => return Err(Error::bad_file(path, format!("{beyond}; only PNG and JPEG are read by rows; {convert}"))),
    };
    Ok(Box::new(RowRaster { path: path.to_path_buf(), beyond, width, height, opener, dec: None, next: 0, band: Vec::new(), band_y: 0, band_x: (0, 0) }))
}

/// The format by the file's first bytes (the name's extension only where they say nothing).
fn sniff(path: &Path) -> Option<image::ImageFormat> {
    image::ImageReader::open(path).ok()?.with_guessed_format().ok()?.format()
}

/// A raster read by rows (see the module documentation).
struct RowRaster {
    path: PathBuf,
    /// "is W×H px, beyond the whole-image limit (…)", for errors.
    beyond: String,
    width: usize,
    height: usize,
    opener: Opener,
    dec: Option<Box<dyn RowDecoder>>,
    /// The row the decoder hands out next.
    next: usize,
    /// Rows `band_y..next` of columns `band_x`, RGB.
    band: Vec<u8>,
    band_y: usize,
    band_x: (usize, usize),
}

impl RasterSource for RowRaster {
    fn dimensions(&self) -> (usize, usize) {
        (self.width, self.height)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn read_window(&mut self, r: Rect) -> Result<Window> {
        check_rect((self.width, self.height), r, &self.path)?;
        let cols = (r.x, r.x + r.w);
        if self.dec.is_none() || r.y < self.band_y || cols != self.band_x {
            self.dec = Some((self.opener)(&self.path)?);
            self.next = 0;
            self.band.clear();
            self.band_y = 0;
            self.band_x = cols;
        }
        // Drop the kept rows above the window.
        let drop = (r.y.min(self.next) - self.band_y) * r.w * 3;
        self.band.drain(..drop);
        self.band_y = r.y.min(self.next);
        let mut row = vec![0u8; self.width * 3];
        let Some(dec) = self.dec.as_mut() else { return Err(Error::bad_file(&self.path, "row decoder not open")) };
        while self.next < r.y + r.h {
            dec.next_row(&mut row).map_err(|m| Error::bad_file(&self.path, format!("{}, read by rows: {m}", self.beyond)))?;
            if self.next >= r.y {
                self.band.extend_from_slice(&row[r.x * 3..(r.x + r.w) * 3]);
            } else {
                self.band_y = self.next + 1;
            }
            self.next += 1;
        }
        let start = (r.y - self.band_y) * r.w * 3;
        let rgb = RgbImage::from_raw(r.w as u32, r.h as u32, self.band[start..start + r.w * r.h * 3].to_vec())
            .ok_or_else(|| Error::bad_file(&self.path, "window buffer of the wrong size"))?;
        Ok(Window { rgb, nodata: None })
    }
}

/// Whether a PNG is interlaced (Adam7), from its header.
fn png_interlaced(path: &Path) -> Result<bool> {
    let file = crate::fsutil::open_input(path)?;
    let dec = png::Decoder::new_with_limits(BufReader::new(file), png::Limits { bytes: PNG_ROW_LIMIT });
    let reader = dec.read_info().map_err(|e| Error::bad_file(path, format!("PNG: {e}")))?;
    Ok(reader.info().interlaced)
}

/// A PNG's rows: palettes and low bit depths expanded, alpha dropped, 16-bit samples scaled to 8
/// bits as `round(v · 255 / 65535)` — the pixels the whole-image decode gives.
struct PngRows {
    reader: png::Reader<BufReader<File>>,
}

fn open_png(path: &Path) -> Result<Box<dyn RowDecoder>> {
    let file = crate::fsutil::open_input(path)?;
    let mut dec = png::Decoder::new_with_limits(BufReader::new(file), png::Limits { bytes: PNG_ROW_LIMIT });
    dec.set_transformations(png::Transformations::EXPAND);
    let reader = dec.read_info().map_err(|e| Error::bad_file(path, format!("PNG: {e}")))?;
    Ok(Box::new(PngRows { reader }))
}

impl RowDecoder for PngRows {
    fn next_row(&mut self, out: &mut [u8]) -> std::result::Result<(), String> {
        let (colour, depth) = self.reader.output_color_type();
        let channels = colour.samples();
        let wide = depth == png::BitDepth::Sixteen;
        let row = self.reader.next_row().map_err(|e| format!("PNG (truncated or corrupt): {e}"))?;
        let Some(row) = row else { return Err("PNG: the image data ends before its last row".into()) };
        let data = row.data();
        let bytes = if wide { 2 } else { 1 };
        if data.len() < out.len() / 3 * channels * bytes {
            return Err("PNG: a row is shorter than the image width".into());
        }
        let sample = |i: usize| -> u8 {
            if wide {
                let v = u16::from_be_bytes([data[2 * i], data[2 * i + 1]]) as u32;
                ((v * 255 + 32767) / 65535) as u8
            } else {
                data[i]
            }
        };
        for (x, px) in out.chunks_exact_mut(3).enumerate() {
            let base = x * channels;
            if channels >= 3 {
                px.copy_from_slice(&[sample(base), sample(base + 1), sample(base + 2)]);
            } else {
                px.fill(sample(base));
            }
        }
        Ok(())
    }
}
