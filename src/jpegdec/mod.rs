//! A small sequential-JPEG decoder that gives libjpeg's pixels (islow IDCT, fancy upsampling;
//! colour conversion in [`crate::tiffio::ycbcr`]) one row at a time. It serves JPEG-compressed TIFF
//! tiles, so that they equal what GDAL and tifffile/imagecodecs decode, and JPEG files beyond the
//! whole-image limits, read by rows in bounded memory. Progressive and other kinds are left to
//! zune-jpeg (tiles) or refused (rows).
pub(crate) mod bits;
pub(crate) mod decoder;
pub(crate) mod header;
pub(crate) mod huffman;
pub(crate) mod idct;
pub(crate) mod upsample;

pub(crate) use decoder::{Decoder, Opened};

/// Decodes a whole in-memory sequential JPEG of at most `max` pixels per side to its components
/// (`width × height × components` bytes, not colour-converted); `None` when it is not one this
/// decoder reads (progressive, unusual subsampling).
pub(crate) fn decode_all(bytes: &[u8], max: (usize, usize)) -> Result<Option<Decoded>, String> {
    let mut dec = match Decoder::open(Box::new(std::io::Cursor::new(bytes.to_vec())), max)? {
        Opened::Sequential(d) => d,
        Opened::Progressive | Opened::Unsupported(_) => return Ok(None),
    };
    let ((w, h), n) = (dec.dimensions(), dec.components());
    let mut pixels = vec![0u8; w * h * n];
    for row in pixels.chunks_exact_mut(w * n) {
        dec.next_row(row)?;
    }
    Ok(Some(Decoded { width: w, height: h, components: n, pixels }))
}

/// A decoded JPEG.
pub(crate) struct Decoded {
    /// Width.
    pub(crate) width: usize,
    /// Height.
    pub(crate) height: usize,
    /// Components per pixel.
    pub(crate) components: usize,
    /// The samples.
    pub(crate) pixels: Vec<u8>,
}
