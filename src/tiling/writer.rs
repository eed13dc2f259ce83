//! Windowed GeoTIFF output: a single-band float32 or uint8 (or an RGB8) TIFF written block by block (TIFF tiles
//! of `block`×`block`, deflate), so that no more than the blocks being completed are held in memory.
//! The tile directory (TileOffsets / TileByteCounts, tags 322–325) is written by hand after the
//! data; the `tiff` crate's encoder only writes strips. BigTIFF when the uncompressed raster could
//! exceed 4 GiB. Georeferencing tags are copied verbatim from the source (see [`crate::geotiff`]);
//! GDAL_NODATA is replaced by the output's own no-data text. Written via [`AtomicFile`].
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use tiff::encoder::compression::{CompressionAlgorithm, Deflate, DeflateLevel};

use crate::error::{Error, Result};
use crate::fsutil::AtomicFile;
use crate::geotiff::{GeoReference, RawTag, GDAL_NODATA};

/// The sample type of an output raster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleKind {
    /// IEEE float32 (SampleFormat 3).
    F32,
    /// Unsigned 8-bit (SampleFormat 1).
    U8,
    /// Unsigned 8-bit RGB, chunky (test and benchmark inputs).
    Rgb8,
}

impl SampleKind {
    /// Bytes per pixel.
    pub fn bytes(self) -> usize {
        match self {
            SampleKind::F32 => 4,
            SampleKind::U8 => 1,
            SampleKind::Rgb8 => 3,
        }
    }
}

/// Output settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterOptions {
    /// TIFF tile side (a multiple of 16).
    pub block: usize,
    /// Deflate-compress the blocks.
    pub deflate: bool,
    /// Force (`Some(true)`) or forbid BigTIFF; `None`: BigTIFF when the uncompressed raster could exceed 4 GiB.
    pub bigtiff: Option<bool>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions { block: 256, deflate: true, bigtiff: None }
    }
}

/// A tiled TIFF being written block by block.
pub struct TiledTiffWriter {
    path: PathBuf,
    file: AtomicFile,
    width: usize,
    height: usize,
    kind: SampleKind,
    opts: WriterOptions,
    big: bool,
    tags: Vec<RawTag>,
    offsets: Vec<u64>,
    counts: Vec<u64>,
    pos: u64,
    scratch: Vec<u8>,
}

const TYPE_SHORT: u16 = 3;
const IMAGE_DESCRIPTION: u16 = 270;
const TYPE_LONG: u16 = 4;
const TYPE_LONG8: u16 = 16;

fn type_size(t: u16) -> Option<usize> {
    match t {
        1 | 2 | 6 | 7 => Some(1),
        3 | 8 => Some(2),
        4 | 9 | 11 | 13 => Some(4),
        5 | 10 | 12 | 16 | 17 | 18 => Some(8),
        _ => None,
    }
}

impl TiledTiffWriter {
    /// Starts `path` (atomically) for a `width`×`height` raster of `kind` samples carrying `geo`'s
    /// georeferencing, with `nodata` as its GDAL_NODATA text (none: no GDAL_NODATA tag).
    pub fn create(path: &Path, width: usize, height: usize, kind: SampleKind, geo: Option<&GeoReference>, nodata: Option<&str>, opts: WriterOptions) -> Result<Self> {
        if width == 0 || height == 0 || width > u32::MAX as usize || height > u32::MAX as usize {
            return Err(Error::Input(format!("cannot write a {width}×{height} raster")));
        }
        if opts.block == 0 || !opts.block.is_multiple_of(16) || opts.block > 4096 {
            return Err(Error::Input(format!("TIFF tile side {} is not a multiple of 16 up to 4096", opts.block)));
        }
        if let Some(g) = geo {
            if (g.width as usize, g.height as usize) != (width, height) {
                return Err(Error::Input(format!(
                    "output raster {width}×{height} differs from the georeferenced source {}×{}; the tags would not fit",
                    g.width, g.height
                )));
            }
        }
        let mut tags: Vec<RawTag> = geo.map(|g| g.tags.iter().filter(|t| t.code != GDAL_NODATA).cloned().collect()).unwrap_or_default();
        if let Some(text) = nodata {
            let mut bytes = text.as_bytes().to_vec();
            bytes.push(0);
            tags.push(RawTag { code: GDAL_NODATA, field_type: 2, count: bytes.len() as u64, bytes });
        }
        for t in &tags {
            let size = type_size(t.field_type).ok_or_else(|| Error::Input(format!("tag {} has unknown TIFF type {}", t.code, t.field_type)))?;
            if (t.count as u128) * (size as u128) != t.bytes.len() as u128 {
                return Err(Error::Input(format!("tag {}: {} bytes for {} values of type {}", t.code, t.bytes.len(), t.count, t.field_type)));
            }
        }
        tags.sort_by_key(|t| t.code);
        let blocks = width.div_ceil(opts.block) * height.div_ceil(opts.block);
        let block_bytes = (opts.block * opts.block * kind.bytes()) as u64;
        // Deflate never grows a block by more than a few bytes per 16 KiB; 1 % + 1 KiB per block is ample.
        let bound = (blocks as u64).saturating_mul(block_bytes + block_bytes / 100 + 1024).saturating_add(1 << 20);
        let needs_64 = tags.iter().any(|t| t.field_type >= 16);
        let big = opts.bigtiff.unwrap_or(bound >= u32::MAX as u64 || needs_64);
        if !big && needs_64 {
            return Err(Error::Input("a 64-bit georeferencing tag needs a BigTIFF output".into()));
        }
        let mut file = AtomicFile::create(path)?;
        let header: Vec<u8> = if big {
            [b"II".as_slice(), &43u16.to_le_bytes(), &8u16.to_le_bytes(), &0u16.to_le_bytes(), &0u64.to_le_bytes()].concat()
        } else {
            [b"II".as_slice(), &42u16.to_le_bytes(), &0u32.to_le_bytes()].concat()
        };
        file.write_all(&header).map_err(|e| Error::io(path, e))?;
        Ok(TiledTiffWriter {
            path: path.to_path_buf(),
            file,
            width,
            height,
            kind,
            opts,
            big,
            tags,
            offsets: vec![0; blocks],
            counts: vec![0; blocks],
            pos: header.len() as u64,
            scratch: Vec::new(),
        })
    }

    /// Sets the ImageDescription (tag 270) text.
    pub(crate) fn set_description(&mut self, text: &str) {
        let mut bytes: Vec<u8> = text.bytes().filter(|&b| b != 0).collect();
        bytes.push(0);
        self.tags.retain(|t| t.code != IMAGE_DESCRIPTION);
        self.tags.push(RawTag { code: IMAGE_DESCRIPTION, field_type: 2, count: bytes.len() as u64, bytes });
    }

    /// Whether the file is a BigTIFF.
    pub fn is_bigtiff(&self) -> bool {
        self.big
    }

    /// The block (TIFF tile) side.
    pub fn block(&self) -> usize {
        self.opts.block
    }

    /// Writes block `(bx, by)`: `block`×`block` pixels, row-major, samples little-endian (pixels
    /// beyond the raster edge are padding).
    pub fn write_block(&mut self, bx: usize, by: usize, data: &[u8]) -> Result<()> {
        let b = self.opts.block;
        let across = self.width.div_ceil(b);
        if bx >= across || by >= self.height.div_ceil(b) || data.len() != b * b * self.kind.bytes() {
            return Err(Error::Input(format!("block ({bx}, {by}) of {} bytes does not fit the {b}-pixel tiling", data.len())));
        }
        let i = by * across + bx;
        if self.counts[i] != 0 {
            return Err(Error::Input(format!("block ({bx}, {by}) written twice")));
        }
        let io = |e| Error::io(&self.path, e);
        let n = if self.opts.deflate {
            self.scratch.clear();
            Deflate::with_level(DeflateLevel::Balanced).write_to(&mut self.scratch, data).map_err(io)?;
            self.file.write_all(&self.scratch).map_err(io)?;
            self.scratch.len() as u64
        } else {
            self.file.write_all(data).map_err(io)?;
            data.len() as u64
        };
        if !self.big && self.pos + n > u32::MAX as u64 {
            return Err(Error::Input(format!("{}: the output passed 4 GiB in a classic TIFF", self.path.display())));
        }
        self.offsets[i] = self.pos;
        self.counts[i] = n;
        self.pos += n;
        Ok(())
    }

    /// Writes the directory and commits the file; fails if a block is missing.
    pub fn finish(mut self) -> Result<()> {
        if let Some(i) = self.counts.iter().position(|&c| c == 0) {
            return Err(Error::Input(format!("{}: block {i} was never written", self.path.display())));
        }
        let b = self.opts.block as u64;
        let short = |code: u16, v: u16| RawTag { code, field_type: TYPE_SHORT, count: 1, bytes: v.to_le_bytes().to_vec() };
        let long = |code: u16, v: u64| RawTag { code, field_type: TYPE_LONG, count: 1, bytes: (v as u32).to_le_bytes().to_vec() };
        let array = |code: u16, v: &[u64], big: bool| {
            let bytes = if big { v.iter().flat_map(|x| x.to_le_bytes()).collect() } else { v.iter().flat_map(|x| (*x as u32).to_le_bytes()).collect() };
            RawTag { code, field_type: if big { TYPE_LONG8 } else { TYPE_LONG }, count: v.len() as u64, bytes }
        };
        let shorts = |code: u16, v: &[u16]| RawTag { code, field_type: TYPE_SHORT, count: v.len() as u64, bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let (bits, format, photometric): (&[u16], &[u16], u16) = match self.kind {
            SampleKind::F32 => (&[32], &[3], 1),
            SampleKind::U8 => (&[8], &[1], 1),
            SampleKind::Rgb8 => (&[8, 8, 8], &[1, 1, 1], 2),
        };
        let mut entries = vec![
            long(256, self.width as u64),
            long(257, self.height as u64),
            shorts(258, bits),
            short(259, if self.opts.deflate { 8 } else { 1 }),
            short(262, photometric),
            short(277, bits.len() as u16),
            short(284, 1),
            long(322, b),
            long(323, b),
            array(324, &self.offsets, self.big),
            array(325, &self.counts, self.big),
            shorts(339, format),
        ];
        entries.append(&mut self.tags);
        entries.sort_by_key(|t| t.code);
        let (inline, entry_len, head_len) = if self.big { (8usize, 20usize, 8usize) } else { (4, 12, 2) };
        let ifd_at = self.pos.div_ceil(8) * 8;
        let ifd_len = (head_len + entries.len() * entry_len + inline) as u64;
        let mut out: Vec<u8> = vec![0; (ifd_at - self.pos) as usize];
        let mut extra: Vec<u8> = Vec::new();
        let extra_at = ifd_at + ifd_len;
        let mut ifd: Vec<u8> = Vec::with_capacity(ifd_len as usize);
        if self.big {
            ifd.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        } else {
            ifd.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        }
        for t in &entries {
            ifd.extend_from_slice(&t.code.to_le_bytes());
            ifd.extend_from_slice(&t.field_type.to_le_bytes());
            if self.big {
                ifd.extend_from_slice(&t.count.to_le_bytes());
            } else {
                ifd.extend_from_slice(&(t.count as u32).to_le_bytes());
            }
            if t.bytes.len() <= inline {
                let mut v = t.bytes.clone();
                v.resize(inline, 0);
                ifd.extend_from_slice(&v);
            } else {
                let at = extra_at + extra.len() as u64;
                if self.big {
                    ifd.extend_from_slice(&at.to_le_bytes());
                } else {
                    ifd.extend_from_slice(&(at as u32).to_le_bytes());
                }
                extra.extend_from_slice(&t.bytes);
                extra.resize(extra.len().div_ceil(8) * 8, 0);
            }
        }
        ifd.extend_from_slice(&vec![0u8; inline]);
        if !self.big && extra_at + extra.len() as u64 > u32::MAX as u64 {
            return Err(Error::Input(format!("{}: the output passed 4 GiB in a classic TIFF", self.path.display())));
        }
        out.extend_from_slice(&ifd);
        out.extend_from_slice(&extra);
        let path = self.path.clone();
        let io = |e| Error::io(&path, e);
        self.file.write_all(&out).map_err(io)?;
        let f = self.file.file().map_err(io)?;
        if self.big {
            f.seek(SeekFrom::Start(8)).map_err(io)?;
            f.write_all(&ifd_at.to_le_bytes()).map_err(io)?;
        } else {
            f.seek(SeekFrom::Start(4)).map_err(io)?;
            f.write_all(&(ifd_at as u32).to_le_bytes()).map_err(io)?;
        }
        self.file.commit()
    }
}
