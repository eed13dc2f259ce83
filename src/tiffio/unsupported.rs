//! What stays unsupported, named in plain words with the GDAL command that converts the file into
//! one that is read (never a decoder's internal name for it).

/// The conversion to suggest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hint {
    /// Re-encode as a deflate-compressed tiled GeoTIFF.
    Deflate,
    /// Rescale the samples to 8-bit unsigned.
    ToByte,
    /// Expand a palette to RGB.
    Palette,
    /// Convert the colour model to RGB.
    Rgb,
    /// CMYK: GDAL keeps the bands as they are, so the conversion is made where the file came from.
    Cmyk,
}

/// The re-encoding every hint ends with.
pub(crate) const DEFLATE: &str = "gdal_translate -co TILED=YES -co COMPRESS=DEFLATE in.tif out.tif";

/// "`what`: not supported; convert …", with the command for `hint`.
pub(crate) fn refuse(what: &str, hint: Hint) -> String {
    let how = match hint {
        Hint::Deflate => format!("convert it with `{DEFLATE}`"),
        Hint::ToByte => {
            "convert it to 8-bit RGB with `gdal_translate -ot Byte -scale MIN MAX 0 255 -co TILED=YES -co COMPRESS=DEFLATE in.tif out.tif` (MIN and MAX from `gdalinfo -stats`)".into()
        }
        Hint::Palette => "expand it to RGB with `gdal_translate -expand rgb -co TILED=YES -co COMPRESS=DEFLATE in.tif out.tif`".into(),
        Hint::Rgb => format!("convert it to RGB with `{DEFLATE} -co PHOTOMETRIC=RGB`"),
        Hint::Cmyk => format!("export it as RGB from the software that made it (GDAL keeps CMYK bands as they are), then `{DEFLATE}`"),
    };
    format!("{what}: not supported by edgerun; {how}")
}
