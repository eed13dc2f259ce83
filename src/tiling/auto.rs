//! When an input is tiled: `--tile 0` never, `--tile N` always, and by default a GeoTIFF with a
//! side over [`AUTO_SIDE`] pixels or a TIFF beyond the image limits (which could not be decoded
//! whole), with the model's default tile and overlap.
use std::path::Path;

use super::plan::check_tile;
use crate::error::Result;
use crate::geotiff::{is_tiff, GeoReference};
use crate::imageio::decode::check_size;
use crate::imageio::ImageLimits;

/// Side (pixels) above which a georeferenced TIFF is tiled when `--tile` is not given.
pub const AUTO_SIDE: u32 = 4096;

/// `--tile` / `--overlap` as given on the command line (or in a config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileRequest {
    /// Tile side: `Some(0)` off, `Some(n)` always, `None` automatic.
    pub tile: Option<usize>,
    /// Overlap; `None`: the model's default (at most half the tile).
    pub overlap: Option<usize>,
}

impl TileRequest {
    /// Checks the values given (a tile of 0 turns tiling off, so only the overlap is checked then).
    pub fn validate(&self, default: (usize, usize)) -> Result<()> {
        match self.tile {
            Some(0) => Ok(()),
            Some(t) => check_tile(t, self.overlap.unwrap_or(default.1.min(t / 2))),
            None => check_tile(default.0, self.overlap.unwrap_or(default.1)),
        }
    }
}

/// `Some((tile, overlap))` when `path` is to be tiled under `req`, with `default` the model's
/// `(tile, overlap)`; reads at most the TIFF header.
pub fn decide(path: &Path, req: TileRequest, default: (usize, usize), limits: &ImageLimits) -> Result<Option<(usize, usize)>> {
    let tile = match req.tile {
        Some(0) => return Ok(None),
        Some(t) => t,
        None => {
            if !is_tiff(path)? {
                return Ok(None);
            }
            let (w, h, referenced) = match GeoReference::read(path)? {
                Some(g) => (g.width, g.height, true),
                None => {
                    let (w, h) = super::window_io::tiff_dimensions(path)?;
                    (w, h, false)
                }
            };
            if !((referenced && w.max(h) > AUTO_SIDE) || check_size(w, h, limits).is_err()) {
                return Ok(None);
            }
            default.0
        }
    };
    let overlap = req.overlap.unwrap_or(default.1.min(tile / 2));
    check_tile(tile, overlap)?;
    Ok(Some((tile, overlap)))
}
