//! A TIFF or BigTIFF read window by window: the full-resolution image (a Cloud-Optimized GeoTIFF's
//! overviews are skipped) and its internal transparency mask, if any; only the strips or tiles a
//! window intersects are read, in whatever order they lie in the file.
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use image::RgbImage;
use tiff::decoder::{Decoder, Limits};

use super::chunk::{self, Chunk};
use super::layout::{subfile_type, Colour, Layout, MAX_CHUNK_BYTES, SUBFILE_MASK, SUBFILE_REDUCED};
use crate::error::{Error, Result};
use crate::tiling::window_io::{check_rect, RasterSource, Rect, Window};

/// Images (IFDs) looked through for the full-resolution image and its mask.
const MAX_IFDS: usize = 64;

/// A TIFF or BigTIFF read window by window (see the module documentation of [`crate::tiling`]).
pub struct TiffRaster<R: Read + Seek = BufReader<File>> {
    path: PathBuf,
    dec: Decoder<R>,
    main: Layout,
    mask: Option<Layout>,
    nodata: Option<u16>,
}

impl TiffRaster<BufReader<File>> {
    /// Opens a TIFF file (read-only; a FIFO or device is refused) and checks its layout. `nodata`
    /// (GDAL_NODATA) marks pixels whose colour samples all equal it (when it is an integer the
    /// samples can hold).
    pub fn open(path: &Path, nodata: Option<f64>) -> Result<Self> {
        let meta = crate::fsutil::check_input_file(path)?;
        let file = crate::fsutil::open_input(path)?;
        Self::from_reader(path, BufReader::new(file), meta.len(), nodata)
    }
}

impl<R: Read + Seek> TiffRaster<R> {
    /// Reads the layout of the TIFF in `reader` (`len` bytes long; `path` names it in errors).
    pub(crate) fn from_reader(path: &Path, reader: R, len: u64, nodata: Option<f64>) -> Result<Self> {
        let bad = |m: String| Error::bad_file(path, m);
        let tiff = |e: tiff::TiffError| Error::bad_file(path, format!("TIFF: {e}"));
        let mut limits = Limits::default();
        limits.decoding_buffer_size = MAX_CHUNK_BYTES as usize;
        limits.intermediate_buffer_size = MAX_CHUNK_BYTES as usize;
        let mut dec = Decoder::new(reader).map_err(tiff)?.with_limits(limits);
        let (mut main, mut mask) = (None, None);
        for _ in 0..MAX_IFDS {
            let sub = subfile_type(&mut dec).map_err(bad)?;
            if sub & SUBFILE_REDUCED == 0 {
                if sub & SUBFILE_MASK == 0 && main.is_none() {
                    main = Some(Layout::read(&mut dec, len, false).map_err(bad)?);
                } else if sub & SUBFILE_MASK != 0 && mask.is_none() {
                    mask = Some(Layout::read(&mut dec, len, true).map_err(|m| bad(format!("its transparency mask: {m}")))?);
                }
            }
            if (main.is_some() && mask.is_some()) || !dec.more_images() {
                break;
            }
            // An image after the main one that the tiff crate cannot parse is not needed.
            if let Err(e) = dec.next_image() {
                if main.is_some() {
                    break;
                }
                return Err(tiff(e));
            }
        }
        let main = main.ok_or_else(|| bad("has no full-resolution image (only overviews or masks)".into()))?;
        let mask = mask.filter(|m| (m.width, m.height) == (main.width, main.height));
        let max = if main.bits == 8 { 255.0 } else { 65535.0 };
        let nodata = nodata.filter(|v| v.fract() == 0.0 && (0.0..=max).contains(v)).map(|v| v as u16);
        Ok(TiffRaster { path: path.to_path_buf(), dec, main, mask, nodata })
    }

    /// The main image's layout (`mask` false) or the mask's.
    fn layout(&self, mask: bool) -> Result<&Layout> {
        if mask {
            self.mask.as_ref().ok_or_else(|| Error::bad_file(&self.path, "has no transparency mask"))
        } else {
            Ok(&self.main)
        }
    }

    /// Reads and decodes chunk `index` of the main image (`mask` false) or of the mask.
    fn chunk(&mut self, mask: bool, index: usize) -> Result<Chunk> {
        let layout = self.layout(mask)?;
        let (offset, len) = (layout.offsets[index], layout.lengths[index]);
        let kind = if layout.tiled { "tile" } else { "strip" };
        let what = if mask { format!("mask {kind} {index}") } else { format!("{kind} {index}") };
        let path = self.path.clone();
        let io = |e: std::io::Error| Error::bad_file(&path, format!("{what}: {e}"));
        // `len` was bounded when the layout was read (inside the file, at most MAX_STORED_BYTES).
        let mut raw = vec![0u8; len as usize];
        let r = self.dec.inner();
        r.seek(SeekFrom::Start(offset)).map_err(io)?;
        r.read_exact(&mut raw).map_err(io)?;
        let layout = self.layout(mask)?;
        chunk::decode(layout, index, &raw).map_err(|m| Error::bad_file(&self.path, format!("{what} ({} compression): {m}", layout.compression.name())))
    }

    /// Reads the whole raster (for the untiled path; the caller checks its size first).
    pub(crate) fn read_all(&mut self) -> Result<RgbImage> {
        Ok(self.read_window(Rect { x: 0, y: 0, w: self.main.width, h: self.main.height })?.rgb)
    }

    /// Marks the pixels of `r` that the internal mask hides.
    fn apply_mask(&mut self, r: Rect, nodata: &mut [bool]) -> Result<()> {
        let Some(m) = self.mask.as_ref() else { return Ok(()) };
        let (cw, ch, across) = (m.chunk_w, m.chunk_h, m.across());
        let (cx0, cx1) = if m.tiled { (r.x / cw, (r.x + r.w - 1) / cw) } else { (0, 0) };
        for cy in r.y / ch..=(r.y + r.h - 1) / ch {
            for cx in cx0..=cx1 {
                let c = self.chunk(true, cy * across + cx)?;
                let (x0, y0) = (cx * cw, cy * ch);
                for y in r.y.max(y0)..(r.y + r.h).min(y0 + ch) {
                    for x in r.x.max(x0)..(r.x + r.w).min(x0 + cw) {
                        if c.samples[(y - y0) * c.stride + (x - x0)] == 0 {
                            nodata[(y - r.y) * r.w + (x - r.x)] = true;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl<R: Read + Seek> RasterSource for TiffRaster<R> {
    fn dimensions(&self) -> (usize, usize) {
        (self.main.width, self.main.height)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn has_mask(&self) -> bool {
        self.nodata.is_some() || self.main.alpha.is_some() || self.mask.is_some()
    }

    fn read_window(&mut self, r: Rect) -> Result<Window> {
        check_rect(self.dimensions(), r, &self.path)?;
        let mut rgb = RgbImage::new(r.w as u32, r.h as u32);
        let mut nodata = self.has_mask().then(|| vec![false; r.w * r.h]);
        let l = &self.main;
        let (cw, ch, across, down, spp, planar, bits, alpha) = (l.chunk_w, l.chunk_h, l.across(), l.down(), l.chunk_samples(), l.planar, l.bits, l.alpha);
        let colour = l.colour.samples();
        let inverted = matches!(l.colour, Colour::Gray { inverted: true });
        let used: Vec<usize> = (0..colour).chain(alpha).collect();
        let max = if bits == 8 { 255u32 } else { 65535 };
        let to8 = |v: u16| if bits == 8 { v as u8 } else { ((v as u32 * 255 + 32767) / 65535) as u8 };
        let (cx0, cx1) = if l.tiled { (r.x / cw, (r.x + r.w - 1) / cw) } else { (0, 0) };
        for cy in r.y / ch..=(r.y + r.h - 1) / ch {
            for cx in cx0..=cx1 {
                // Planar: one chunk per used band; chunky: one chunk holding every band.
                let bufs: Vec<Chunk> = if planar {
                    used.iter().map(|&b| self.chunk(false, (b * down + cy) * across + cx)).collect::<Result<_>>()?
                } else {
                    vec![self.chunk(false, cy * across + cx)?]
                };
                let sample = |p: usize, k: usize| -> u16 { if planar { bufs[k].samples[p] } else { bufs[0].samples[p * spp + used[k]] } };
                let (x0, y0) = (cx * cw, cy * ch);
                for y in r.y.max(y0)..(r.y + r.h).min(y0 + ch) {
                    for x in r.x.max(x0)..(r.x + r.w).min(x0 + cw) {
                        let p = (y - y0) * cw + (x - x0);
                        let c: [u16; 3] = if colour == 3 { [sample(p, 0), sample(p, 1), sample(p, 2)] } else { [sample(p, 0); 3] };
                        let o = (y - r.y) * r.w + (x - r.x);
                        let shown = |v: u16| to8(if inverted { (max - v as u32) as u16 } else { v });
                        rgb.as_mut()[o * 3..o * 3 + 3].copy_from_slice(&[shown(c[0]), shown(c[1]), shown(c[2])]);
                        if let Some(mask) = nodata.as_mut() {
                            let by_value = self.nodata.is_some_and(|nd| c.iter().all(|&s| s == nd));
                            let by_alpha = alpha.is_some() && sample(p, colour) == 0;
                            mask[o] = by_value || by_alpha;
                        }
                    }
                }
            }
        }
        if let Some(mask) = nodata.as_mut() {
            self.apply_mask(r, mask)?;
        }
        Ok(Window { rgb, nodata })
    }
}
