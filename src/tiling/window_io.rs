//! Windowed raster input: a rectangle of a large (Geo)TIFF is read by decoding only the strips or
//! tiles it intersects, never the whole raster. Classic TIFF and BigTIFF, stripped or tiled, chunky
//! or planar, uncompressed / deflate / LZW / PackBits / JPEG as the `tiff` crate decodes them;
//! 8- or 16-bit unsigned samples, gray, gray+alpha, RGB, RGBA or ≥ 3 bands (the first three taken as
//! RGB). 16-bit samples are scaled to 8 bits by `round(v · 255 / 65535)`. A PNG or JPEG within the
//! image limits is decoded whole and served from memory.
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use image::RgbImage;
use tiff::decoder::{ChunkType, Decoder, DecodingResult, Limits};
use tiff::tags::Tag;
use tiff::ColorType;

use crate::error::{Error, Result};
use crate::imageio::{load_rgb, ImageLimits};

/// Largest raster side accepted for windowed reading (2^20 pixels).
pub(crate) const MAX_RASTER_SIDE: usize = 1 << 20;
/// Largest raster pixel count accepted for windowed reading (2^36).
pub(crate) const MAX_RASTER_PIXELS: u64 = 1 << 36;
/// Largest decoded strip or tile (bytes); bigger chunks cannot be read window by window.
pub(crate) const MAX_CHUNK_BYTES: u64 = 64 << 20;
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

/// Opens `path` for windowed reading: a TIFF through [`TiffRaster`], anything else decoded whole
/// (within `limits`) into a [`MemoryRaster`]. `nodata` is the source's GDAL_NODATA value.
pub fn open_raster(path: &Path, limits: &ImageLimits, nodata: Option<f64>) -> Result<Box<dyn RasterSource>> {
    if crate::geotiff::is_tiff(path)? {
        Ok(Box::new(TiffRaster::open(path, nodata)?))
    } else {
        Ok(Box::new(MemoryRaster { path: path.to_path_buf(), image: load_rgb(path, limits)? }))
    }
}

/// The `(width, height)` a TIFF declares for its first image.
pub(crate) fn tiff_dimensions(path: &Path) -> Result<(u32, u32)> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
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

fn check_rect((w, h): (usize, usize), r: Rect, path: &Path) -> Result<()> {
    let inside = r.w > 0 && r.h > 0 && r.x.checked_add(r.w).is_some_and(|e| e <= w) && r.y.checked_add(r.h).is_some_and(|e| e <= h);
    if !inside {
        return Err(Error::Input(format!("{}: window {r:?} is not inside the {w}×{h} raster", path.display())));
    }
    if (r.w as u64) * (r.h as u64) > MAX_WINDOW_PIXELS {
        return Err(Error::Input(format!("{}: window {}×{} is larger than {MAX_WINDOW_PIXELS} pixels", path.display(), r.w, r.h)));
    }
    Ok(())
}

/// How a pixel's samples map to RGB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bands {
    /// One colour sample (gray), optionally followed by alpha.
    Gray { alpha: bool },
    /// Three colour samples, optionally followed by alpha; further bands ignored.
    Rgb { alpha: bool },
}

impl Bands {
    fn colour(self) -> usize {
        match self {
            Bands::Gray { .. } => 1,
            Bands::Rgb { .. } => 3,
        }
    }

    fn alpha(self) -> Option<usize> {
        match self {
            Bands::Gray { alpha: true } => Some(1),
            Bands::Rgb { alpha: true } => Some(3),
            _ => None,
        }
    }
}

/// A TIFF or BigTIFF read window by window.
pub struct TiffRaster {
    path: PathBuf,
    dec: Decoder<BufReader<File>>,
    width: usize,
    height: usize,
    chunk_w: usize,
    chunk_h: usize,
    tiled: bool,
    planar: bool,
    samples: usize,
    bits: u8,
    bands: Bands,
    nodata: Option<u16>,
}

impl TiffRaster {
    /// Opens the first image of a TIFF, checking its declared size, sample layout, chunk size and
    /// that every strip or tile lies inside the file. `nodata` (GDAL_NODATA) marks pixels whose
    /// colour samples all equal it (when it is an integer that the samples can hold).
    pub fn open(path: &Path, nodata: Option<f64>) -> Result<Self> {
        let bad = |m: String| Error::bad_file(path, m);
        let tiff = |e: tiff::TiffError| Error::bad_file(path, format!("TIFF: {e}"));
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut limits = Limits::default();
        limits.decoding_buffer_size = MAX_CHUNK_BYTES as usize;
        limits.intermediate_buffer_size = MAX_CHUNK_BYTES as usize;
        let mut dec = Decoder::new(BufReader::new(file)).map_err(tiff)?.with_limits(limits);
        let (w, h) = dec.dimensions().map_err(tiff)?;
        let (width, height) = (w as usize, h as usize);
        if width > MAX_RASTER_SIDE || height > MAX_RASTER_SIDE || (w as u64) * (h as u64) > MAX_RASTER_PIXELS {
            return Err(bad(format!(
                "declared raster size {w}×{h} is beyond what is read window by window ({MAX_RASTER_SIDE} px per side, {MAX_RASTER_PIXELS} pixels)"
            )));
        }
        let (bands, bits, samples) = match dec.colortype().map_err(tiff)? {
            ColorType::Gray(b) => (Bands::Gray { alpha: false }, b, 1),
            ColorType::GrayA(b) => (Bands::Gray { alpha: true }, b, 2),
            ColorType::RGB(b) => (Bands::Rgb { alpha: false }, b, 3),
            ColorType::RGBA(b) => (Bands::Rgb { alpha: true }, b, 4),
            ColorType::Multiband { bit_depth, num_samples } if num_samples >= 3 => (Bands::Rgb { alpha: false }, bit_depth, num_samples as usize),
            ColorType::Multiband { bit_depth, num_samples } => (Bands::Gray { alpha: false }, bit_depth, num_samples as usize),
            other => return Err(bad(format!("{other:?} rasters are not supported for tiled reading (gray, RGB, RGBA or multiband)"))),
        };
        if bits != 8 && bits != 16 {
            return Err(bad(format!("{bits}-bit samples are not supported for tiled reading (8 or 16 bits)")));
        }
        let sample_format = dec.find_tag_unsigned_vec::<u16>(Tag::SampleFormat).map_err(tiff)?.unwrap_or_default();
        if sample_format.iter().any(|&f| f != 1) {
            return Err(bad(format!("sample format {sample_format:?} is not supported for tiled reading (unsigned integers)")));
        }
        let planar = dec.find_tag_unsigned::<u16>(Tag::PlanarConfiguration).map_err(tiff)?.unwrap_or(1) == 2;
        let tiled = dec.get_chunk_type() == ChunkType::Tile;
        let (cw, ch) = dec.chunk_dimensions();
        let (chunk_w, chunk_h) = (cw as usize, (ch as usize).min(height.max(1)));
        if chunk_w == 0 || chunk_h == 0 {
            return Err(bad(format!("zero-sized {} {cw}×{ch}", if tiled { "tiles" } else { "strips" })));
        }
        let per_chunk = if planar { 1 } else { samples as u64 };
        let chunk_bytes = (chunk_w as u64).checked_mul(chunk_h as u64).and_then(|n| n.checked_mul(per_chunk * (bits as u64 / 8)));
        if chunk_bytes.is_none_or(|n| n > MAX_CHUNK_BYTES) {
            return Err(bad(format!(
                "its {} are {cw}×{ch} pixels, more than {} MiB decoded each; rewrite it tiled (e.g. `gdal_translate -co TILED=YES`)",
                if tiled { "tiles" } else { "strips" },
                MAX_CHUNK_BYTES >> 20
            )));
        }
        let (off_tag, len_tag) = if tiled { (Tag::TileOffsets, Tag::TileByteCounts) } else { (Tag::StripOffsets, Tag::StripByteCounts) };
        let offsets = dec.get_tag_u64_vec(off_tag).map_err(tiff)?;
        let lengths = dec.get_tag_u64_vec(len_tag).map_err(tiff)?;
        let across = if tiled { width.div_ceil(chunk_w) } else { 1 };
        let planes = if planar { samples } else { 1 };
        let expected = across.checked_mul(height.div_ceil(chunk_h)).and_then(|n| n.checked_mul(planes));
        if expected != Some(offsets.len()) || offsets.len() != lengths.len() {
            return Err(bad(format!(
                "{} offsets and {} byte counts for a {width}×{height} raster in {cw}×{ch} chunks (expected {})",
                offsets.len(),
                lengths.len(),
                expected.map(|n| n.to_string()).unwrap_or_else(|| "too many".into())
            )));
        }
        for (i, (&o, &n)) in offsets.iter().zip(&lengths).enumerate() {
            if o.checked_add(n).is_none_or(|end| end > file_len) {
                return Err(bad(format!(
                    "{} {i} (offset {o}, {n} bytes) lies past the end of the file ({file_len} bytes): the file is truncated or corrupt",
                    if tiled { "tile" } else { "strip" }
                )));
            }
        }
        // Uncompressed chunks must hold all their pixels.
        if dec.find_tag_unsigned::<u16>(Tag::Compression).map_err(tiff)?.unwrap_or(1) == 1 {
            let chunk_px = (chunk_w * chunk_h) as u64 * per_chunk * (bits as u64 / 8);
            let down = height.div_ceil(chunk_h);
            for (i, &n) in lengths.iter().enumerate() {
                let rows = if tiled { chunk_h } else { chunk_h.min(height - (i % down) * chunk_h) };
                let need = if tiled { chunk_px } else { (chunk_w * rows) as u64 * per_chunk * (bits as u64 / 8) };
                if n < need {
                    return Err(bad(format!(
                        "uncompressed {} {i} holds {n} bytes, {need} needed for its pixels: the file is truncated or corrupt",
                        if tiled { "tile" } else { "strip" }
                    )));
                }
            }
        }
        let max = if bits == 8 { 255.0 } else { 65535.0 };
        let nodata = nodata.filter(|v| v.fract() == 0.0 && (0.0..=max).contains(v)).map(|v| v as u16);
        Ok(TiffRaster { path: path.to_path_buf(), dec, width, height, chunk_w, chunk_h, tiled, planar, samples, bits, bands, nodata })
    }

    /// Chunk index and data rectangle of the chunk at chunk-grid position `(cx, cy)` in `plane`.
    fn chunk(&self, cx: usize, cy: usize, plane: usize) -> (u32, Rect) {
        let across = if self.tiled { self.width.div_ceil(self.chunk_w) } else { 1 };
        let down = self.height.div_ceil(self.chunk_h);
        let index = plane * across * down + cy * across + cx;
        let (x, y) = (cx * self.chunk_w, cy * self.chunk_h);
        let r = Rect { x, y, w: self.chunk_w.min(self.width - x), h: self.chunk_h.min(self.height - y) };
        (index as u32, r)
    }

    /// Decodes one chunk as samples widened to u16 (`8-bit` values stay 0..=255).
    fn decode(&mut self, index: u32, r: Rect, per_pixel: usize) -> Result<Vec<u16>> {
        let path = self.path.clone();
        let data = self.dec.read_chunk(index).map_err(|e| Error::bad_file(&path, format!("TIFF chunk {index}: {e}")))?;
        let v: Vec<u16> = match data {
            DecodingResult::U8(v) => v.into_iter().map(u16::from).collect(),
            DecodingResult::U16(v) => v,
            _ => return Err(Error::bad_file(&path, format!("TIFF chunk {index}: unexpected sample type"))),
        };
        let want = r.w * r.h * per_pixel;
        // A tile's data may include its padding (w × h of the full tile) when the decoder keeps it.
        if v.len() != want {
            return Err(Error::bad_file(&path, format!("TIFF chunk {index}: {} samples decoded, {want} expected", v.len())));
        }
        Ok(v)
    }
}

impl RasterSource for TiffRaster {
    fn dimensions(&self) -> (usize, usize) {
        (self.width, self.height)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn has_mask(&self) -> bool {
        self.nodata.is_some() || self.bands.alpha().is_some()
    }

    fn read_window(&mut self, r: Rect) -> Result<Window> {
        check_rect((self.width, self.height), r, &self.path)?;
        let mut rgb = RgbImage::new(r.w as u32, r.h as u32);
        let mut nodata = (self.nodata.is_some() || self.bands.alpha().is_some()).then(|| vec![false; r.w * r.h]);
        let (cx0, cx1) = if self.tiled { (r.x / self.chunk_w, (r.x + r.w - 1) / self.chunk_w) } else { (0, 0) };
        let (cy0, cy1) = (r.y / self.chunk_h, (r.y + r.h - 1) / self.chunk_h);
        let colour = self.bands.colour();
        let used: Vec<usize> = (0..colour).chain(self.bands.alpha()).collect();
        let to8 = |v: u16, bits: u8| if bits == 8 { v as u8 } else { ((v as u32 * 255 + 32767) / 65535) as u8 };
        for cy in cy0..=cy1 {
            for cx in cx0..=cx1 {
                // Planar: one decoded buffer per used band; chunky: one buffer holding every band.
                let (_, cr) = self.chunk(cx, cy, 0);
                let bufs: Vec<Vec<u16>> = if self.planar {
                    let mut v = Vec::with_capacity(used.len());
                    for &b in &used {
                        let (idx, br) = self.chunk(cx, cy, b);
                        v.push(self.decode(idx, br, 1)?);
                    }
                    v
                } else {
                    let (idx, br) = self.chunk(cx, cy, 0);
                    vec![self.decode(idx, br, self.samples)?]
                };
                let (planar, samples) = (self.planar, self.samples);
                let sample = |p: usize, k: usize| -> u16 { if planar { bufs[k][p] } else { bufs[0][p * samples + used[k]] } };
                let (x0, x1) = (r.x.max(cr.x), (r.x + r.w).min(cr.x + cr.w));
                let (y0, y1) = (r.y.max(cr.y), (r.y + r.h).min(cr.y + cr.h));
                for y in y0..y1 {
                    for x in x0..x1 {
                        let p = (y - cr.y) * cr.w + (x - cr.x);
                        let c: [u16; 3] = if colour == 3 { [sample(p, 0), sample(p, 1), sample(p, 2)] } else { [sample(p, 0); 3] };
                        let o = (y - r.y) * r.w + (x - r.x);
                        rgb.as_mut()[o * 3..o * 3 + 3].copy_from_slice(&[to8(c[0], self.bits), to8(c[1], self.bits), to8(c[2], self.bits)]);
                        if let Some(mask) = nodata.as_mut() {
                            let by_value = self.nodata.is_some_and(|nd| c.iter().all(|&s| s == nd));
                            let by_alpha = self.bands.alpha().is_some() && sample(p, colour) == 0;
                            mask[o] = by_value || by_alpha;
                        }
                    }
                }
            }
        }
        Ok(Window { rgb, nodata })
    }
}
