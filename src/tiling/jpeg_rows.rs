//! A JPEG beyond the whole-image limits read by rows through [`crate::jpegdec`] (libjpeg's pixels,
//! YCbCr converted to RGB as libjpeg does, gray replicated); a progressive JPEG, whose rows are
//! final only after its last scan, is refused naming the limit it is beyond.
use std::io::BufReader;
use std::path::Path;

use super::rows::RowDecoder;
use crate::error::{Error, Result};
use crate::jpegdec::{Decoder, Opened};
use crate::tiffio::ycbcr;

/// Largest JPEG side (the format's own limit).
const MAX_SIDE: usize = u16::MAX as usize;

/// Checks that the JPEG at `path` can be read by rows; the refusal says `beyond` (which limit the
/// image is beyond) and `convert` (what to do).
pub(crate) fn check(path: &Path, beyond: &str, convert: &str) -> Result<()> {
    match open_decoder(path)? {
        Opened::Sequential(_) => Ok(()),
        Opened::Progressive => Err(Error::bad_file(
            path,
            format!("{beyond}, and a progressive JPEG cannot be read by rows (every scan is needed before any row is final); {convert}"),
        )),
        Opened::Unsupported(what) => Err(Error::bad_file(path, format!("{beyond}, and {what} cannot be read by rows; {convert}"))),
    }
}

fn open_decoder(path: &Path) -> Result<Opened> {
    let file = crate::fsutil::open_input(path)?;
    Decoder::open(Box::new(BufReader::new(file)), (MAX_SIDE, MAX_SIDE)).map_err(|m| Error::bad_file(path, format!("JPEG: {m}")))
}

/// Opens the JPEG at `path` at its first row.
pub(crate) fn open(path: &Path) -> Result<Box<dyn RowDecoder>> {
    let Opened::Sequential(dec) = open_decoder(path)? else { return Err(Error::bad_file(path, "JPEG: not a sequential JPEG")) };
    let (w, _) = dec.dimensions();
    let n = dec.components();
    let ycbcr = n == 3 && !dec.header().is_rgb();
    Ok(Box::new(JpegRows { dec, ycbcr, buf: vec![0; w * n] }))
}

/// Rows of a sequential JPEG.
struct JpegRows {
    dec: Box<Decoder>,
    ycbcr: bool,
    buf: Vec<u8>,
}

impl RowDecoder for JpegRows {
    fn next_row(&mut self, out: &mut [u8]) -> std::result::Result<(), String> {
        self.dec.next_row(&mut self.buf).map_err(|m| format!("JPEG: {m}"))?;
        if self.buf.len() == out.len() {
            out.copy_from_slice(&self.buf);
            if self.ycbcr {
                ycbcr::to_rgb(out);
            }
        } else {
            for (px, &g) in out.chunks_exact_mut(3).zip(&self.buf) {
                px.fill(g);
            }
        }
        Ok(())
    }
}
