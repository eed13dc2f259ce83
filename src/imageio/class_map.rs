//! Class-id masks: 8-bit PNGs whose pixel values (grey levels or palette indices) are class ids.
use std::io::Cursor;
use std::path::Path;

use super::decode::{check_size, ImageLimits};
use crate::error::{Error, Result};

/// Reads an 8-bit grayscale or palette PNG as raw class ids (a palette is not applied) →
/// ((height, width), ids). The declared size is checked against `limits` before anything is allocated.
pub(crate) fn read_class_png(path: &Path, limits: &ImageLimits) -> Result<((usize, usize), Vec<u8>)> {
    let bad = |m: String| Error::bad_file(path, m);
    let bytes = crate::fsutil::read_input(path, limits.max_alloc)?;
    let mut decoder = png::Decoder::new_with_limits(Cursor::new(&bytes[..]), png::Limits { bytes: limits.max_alloc as usize });
    decoder.set_transformations(png::Transformations::IDENTITY);
    let mut reader = decoder.read_info().map_err(|e| bad(format!("not a readable PNG class map: {e}")))?;
    let info = reader.info();
    let (w, h, color, depth) = (info.width, info.height, info.color_type, info.bit_depth);
    check_size(w, h, limits).map_err(bad)?;
    if depth != png::BitDepth::Eight || !matches!(color, png::ColorType::Grayscale | png::ColorType::Indexed) {
        return Err(bad(format!("a class map must be an 8-bit grayscale or palette PNG (class id = pixel value); this one is {color:?} with {depth:?} bits")));
    }
    let size = reader.output_buffer_size().ok_or_else(|| bad("image too large".into()))?;
    let mut buf = vec![0u8; size];
    let frame = reader.next_frame(&mut buf).map_err(|e| bad(format!("cannot decode the class map: {e}")))?;
    let (w, h) = (w as usize, h as usize);
    let mut ids = Vec::with_capacity(w * h);
    for row in buf.chunks(frame.line_size).take(h) {
        ids.extend_from_slice(row.get(..w).ok_or_else(|| bad("short row in the class map".into()))?);
    }
    if ids.len() != w * h {
        return Err(bad(format!("the class map holds {} of its {} pixels", ids.len(), w * h)));
    }
    Ok(((h, w), ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_png(path: &Path, color: png::ColorType, w: u32, h: u32, data: &[u8]) {
        let f = std::fs::File::create(path).unwrap();
        let mut enc = png::Encoder::new(f, w, h);
        enc.set_color(color);
        enc.set_depth(png::BitDepth::Eight);
        if color == png::ColorType::Indexed {
            enc.set_palette(vec![0u8; 3 * 256]);
        }
        enc.write_header().unwrap().write_image_data(data).unwrap();
    }

    #[test]
    fn grey_and_palette_values_are_the_class_ids() {
        let dir = std::env::temp_dir().join(format!("edgerun-classmap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ids = [0u8, 1, 2, 255, 7, 3];
        for (name, color) in [("grey.png", png::ColorType::Grayscale), ("palette.png", png::ColorType::Indexed)] {
            let p = dir.join(name);
            write_png(&p, color, 3, 2, &ids);
            assert_eq!(read_class_png(&p, &ImageLimits::default()).unwrap(), ((2, 3), ids.to_vec()), "{name}");
        }
        let rgb = dir.join("rgb.png");
        write_png(&rgb, png::ColorType::Rgb, 1, 1, &[1, 2, 3]);
        let e = read_class_png(&rgb, &ImageLimits::default()).unwrap_err().to_string();
        assert!(e.contains("rgb.png") && e.contains("8-bit grayscale or palette"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
