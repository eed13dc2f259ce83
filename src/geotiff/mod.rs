//! GeoTIFF georeferencing: read the georeferencing tags of a (Geo)TIFF and write a float32 GeoTIFF
//! that carries them bit-exactly, so an output raster of the same size overlays its source in a GIS.
//!
//! Copied tags (raw values, any TIFF type, byte order normalised): ModelPixelScale (33550),
//! ModelTiepoint (33922), ModelTransformation (34264), GeoKeyDirectory (34735), GeoDoubleParams
//! (34736), GeoAsciiParams (34737) and GDAL_NODATA (42113). The raster type (PixelIsArea / Point)
//! lives in the GeoKey directory and travels with it. Band-specific GDAL metadata (42112) is not
//! copied: the output has one band of a different meaning.
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom};
use std::path::Path;

use tiff::decoder::{Decoder, Limits};
use tiff::encoder::{colortype, Compression, DeflateLevel, TiffEncoder};
use tiff::tags::{ByteOrder, Tag, Type, ValueBuffer};

use crate::error::{Error, Result};
use crate::fsutil::AtomicFile;

/// ModelPixelScaleTag.
pub const MODEL_PIXEL_SCALE: u16 = 33550;
/// ModelTiepointTag.
pub const MODEL_TIEPOINT: u16 = 33922;
/// ModelTransformationTag.
pub(crate) const MODEL_TRANSFORMATION: u16 = 34264;
/// GeoKeyDirectoryTag.
pub const GEO_KEY_DIRECTORY: u16 = 34735;
/// GeoDoubleParamsTag.
pub(crate) const GEO_DOUBLE_PARAMS: u16 = 34736;
/// GeoAsciiParamsTag.
pub(crate) const GEO_ASCII_PARAMS: u16 = 34737;
/// GDAL_NODATA (ASCII).
pub const GDAL_NODATA: u16 = 42113;

/// The tags copied from a source to an output, in tag order.
pub(crate) const GEO_TAGS: [u16; 7] =
    [MODEL_PIXEL_SCALE, MODEL_TIEPOINT, MODEL_TRANSFORMATION, GEO_KEY_DIRECTORY, GEO_DOUBLE_PARAMS, GEO_ASCII_PARAMS, GDAL_NODATA];

/// Largest accepted tag value (bytes); GeoTIFF tags are tiny, a huge one means a broken file.
const MAX_TAG_BYTES: usize = 1 << 20;

/// One raw tag value: TIFF field type, count and the value bytes, little-endian per element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTag {
    /// Tag code.
    pub code: u16,
    /// TIFF field type (2 ASCII, 3 SHORT, 12 DOUBLE, …).
    pub field_type: u16,
    /// Number of values.
    pub count: u64,
    /// The value bytes, each element little-endian (ASCII as stored, NULs included).
    pub bytes: Vec<u8>,
}

impl RawTag {
    /// The values of a DOUBLE tag.
    pub fn f64s(&self) -> Option<Vec<f64>> {
        (self.field_type == Type::DOUBLE.to_u16())
            .then(|| self.bytes.chunks_exact(8).map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect())
    }

    /// The values of a SHORT tag.
    pub(crate) fn u16s(&self) -> Option<Vec<u16>> {
        (self.field_type == Type::SHORT.to_u16()).then(|| self.bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
    }

    /// The text of an ASCII tag up to its first NUL.
    pub fn text(&self) -> Option<String> {
        (self.field_type == Type::ASCII.to_u16()).then(|| {
            let end = self.bytes.iter().position(|&b| b == 0).unwrap_or(self.bytes.len());
            String::from_utf8_lossy(&self.bytes[..end]).into_owned()
        })
    }
}

/// The georeferencing of a GeoTIFF raster.
#[derive(Debug, Clone, PartialEq)]
pub struct GeoReference {
    /// Raster width of the source.
    pub width: u32,
    /// Raster height of the source.
    pub height: u32,
    /// Bits per sample of the source (first sample).
    pub bits_per_sample: u16,
    /// The copied tags, in tag order.
    pub tags: Vec<RawTag>,
}

fn tiff_err(path: &Path, e: tiff::TiffError) -> Error {
    Error::bad_file(path, format!("TIFF: {e}"))
}

/// Whether the file starts with a TIFF or BigTIFF header.
pub(crate) fn is_tiff(path: &Path) -> Result<bool> {
    let mut f = crate::fsutil::open_input(path)?;
    let mut magic = [0u8; 4];
    match f.read_exact(&mut magic) {
        Ok(()) => Ok(matches!(&magic, b"II*\0" | b"MM\0*" | b"II+\0" | b"MM\0+")),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Swaps each element of `bytes` between little-endian and the native byte order (identity on
/// little-endian hosts); `ty` fixes the element width (RATIONALs swap as two 4-byte halves).
fn swap_native(ty: Type, bytes: &mut [u8]) {
    if cfg!(target_endian = "little") {
        return;
    }
    let unit = match ty {
        Type::SHORT | Type::SSHORT => 2,
        Type::LONG | Type::SLONG | Type::FLOAT | Type::IFD | Type::RATIONAL | Type::SRATIONAL => 4,
        Type::DOUBLE | Type::LONG8 | Type::SLONG8 | Type::IFD8 => 8,
        _ => 1,
    };
    if unit > 1 {
        for c in bytes.chunks_exact_mut(unit) {
            c.reverse();
        }
    }
}

impl GeoReference {
    /// Reads the georeferencing of the first image of the TIFF at `path`; `None` when the file is not
    /// a TIFF or has none of the model tie point / pixel scale / transformation / GeoKey tags.
    pub fn read(path: &Path) -> Result<Option<Self>> {
        if !is_tiff(path)? {
            return Ok(None);
        }
        let mut f = crate::fsutil::open_input(path)?;
        f.seek(SeekFrom::Start(0)).map_err(|e| Error::io(path, e))?;
        let mut limits = Limits::default();
        limits.ifd_value_size = MAX_TAG_BYTES;
        let mut dec = Decoder::new(BufReader::new(f)).map_err(|e| tiff_err(path, e))?.with_limits(limits);
        let (width, height) = dec.dimensions().map_err(|e| tiff_err(path, e))?;
        let bits_per_sample = dec
            .find_tag_unsigned_vec::<u16>(Tag::BitsPerSample)
            .map_err(|e| tiff_err(path, e))?
            .and_then(|v| v.first().copied())
            .unwrap_or(1);
        let mut tags = Vec::new();
        for code in GEO_TAGS {
            let tag = Tag::from_u16_exhaustive(code);
            let mut buf = ValueBuffer::empty(Type::BYTE);
            let found = dec.image_ifd().find_tag_buf(tag, &mut buf).map_err(|e| tiff_err(path, e))?;
            if found.is_none() {
                continue;
            }
            if buf.as_bytes().len() > MAX_TAG_BYTES {
                return Err(Error::bad_file(path, format!("tag {code} is implausibly large ({} bytes)", buf.as_bytes().len())));
            }
            buf.set_byte_order(ByteOrder::LittleEndian);
            tags.push(RawTag { code, field_type: buf.data_type().to_u16(), count: buf.count(), bytes: buf.as_bytes().to_vec() });
        }
        let geo = GeoReference { width, height, bits_per_sample, tags };
        let referenced = [MODEL_PIXEL_SCALE, MODEL_TIEPOINT, MODEL_TRANSFORMATION, GEO_KEY_DIRECTORY].iter().any(|c| geo.tag(*c).is_some());
        Ok(referenced.then_some(geo))
    }

    /// The tag with `code`, if present.
    pub fn tag(&self, code: u16) -> Option<&RawTag> {
        self.tags.iter().find(|t| t.code == code)
    }

    /// ModelPixelScale `(sx, sy, sz)`.
    pub fn pixel_scale(&self) -> Option<Vec<f64>> {
        self.tag(MODEL_PIXEL_SCALE).and_then(RawTag::f64s)
    }

    /// ModelTiepoint `(i, j, k, x, y, z)*`.
    pub fn tiepoints(&self) -> Option<Vec<f64>> {
        self.tag(MODEL_TIEPOINT).and_then(RawTag::f64s)
    }

    /// ModelTransformation (4×4 row-major).
    pub fn transformation(&self) -> Option<Vec<f64>> {
        self.tag(MODEL_TRANSFORMATION).and_then(RawTag::f64s)
    }

    /// The GeoKey directory as SHORTs.
    pub fn geo_keys(&self) -> Option<Vec<u16>> {
        self.tag(GEO_KEY_DIRECTORY).and_then(RawTag::u16s)
    }

    /// The GDAL_NODATA text.
    pub fn nodata_text(&self) -> Option<String> {
        self.tag(GDAL_NODATA).and_then(RawTag::text)
    }

    /// GDAL_NODATA as a finite number, if it parses as one.
    pub fn nodata(&self) -> Option<f64> {
        self.nodata_text().and_then(|t| t.trim().parse::<f64>().ok()).filter(|v| v.is_finite())
    }
}

/// Writes a single-band float32 GeoTIFF (deflate, strips) of `width`×`height` row-major `values`,
/// carrying `geo`'s tags verbatim; atomic.
pub fn write_f32(path: &Path, width: u32, height: u32, values: &[f32], geo: Option<&GeoReference>) -> Result<()> {
    let n = (width as usize).checked_mul(height as usize).ok_or_else(|| Error::Input("raster size overflows".into()))?;
    if n == 0 || values.len() != n {
        return Err(Error::Input(format!("{} values for a {width}×{height} raster", values.len())));
    }
    if let Some(g) = geo {
        if (g.width, g.height) != (width, height) {
            return Err(Error::Input(format!(
                "output raster {width}×{height} differs from the georeferenced source {}×{}; the tags would not fit",
                g.width, g.height
            )));
        }
    }
    let bad = |e: tiff::TiffError| Error::bad_file(path, format!("writing TIFF: {e}"));
    let mut file = AtomicFile::create(path)?;
    {
        let mut enc = TiffEncoder::new(BufWriter::new(file.file().map_err(|e| Error::io(path, e))?)).map_err(bad)?.with_compression(Compression::Deflate(DeflateLevel::Balanced));
        let mut img = enc.new_image::<colortype::Gray32Float>(width, height).map_err(bad)?;
        if let Some(g) = geo {
            let de = img.encoder();
            let mut dir = tiff::Directory::empty();
            for t in &g.tags {
                let ty = Type::from_u16(t.field_type)
                    .ok_or_else(|| Error::Input(format!("tag {} has unknown TIFF type {}", t.code, t.field_type)))?;
                let mut bytes = t.bytes.clone();
                swap_native(ty, &mut bytes);
                let entry = de.write_entry_bytes(ty, &bytes).map_err(bad)?;
                dir.extend([(Tag::from_u16_exhaustive(t.code), entry)]);
            }
            de.extend_from(&dir);
        }
        img.write_data(values).map_err(bad)?;
    }
    file.commit()
}

/// Reads a single-band float32 TIFF (as [`write_f32`] writes) into `(width, height, values)`.
pub fn read_f32(path: &Path) -> Result<(u32, u32, Vec<f32>)> {
    let f = crate::fsutil::open_input(path)?;
    let mut dec = Decoder::new(BufReader::new(f)).map_err(|e| tiff_err(path, e))?;
    let (w, h) = dec.dimensions().map_err(|e| tiff_err(path, e))?;
    match dec.read_image().map_err(|e| tiff_err(path, e))? {
        tiff::decoder::DecodingResult::F32(v) => Ok((w, h, v)),
        _ => Err(Error::bad_file(path, "not a float32 raster")),
    }
}
