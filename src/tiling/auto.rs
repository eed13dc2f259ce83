//! When an input is tiled: `--tile 0` never, `--tile N` always, and by default a GeoTIFF with a
//! side over [`AUTO_SIDE`] pixels or any image beyond the image limits (which could not be decoded
//! whole: a TIFF is read window by window, a PNG or JPEG by rows), with the model's default tile
//! and overlap.
use std::path::Path;

use super::plan::{check_tile, MAX_TILE, MIN_TILE};
use crate::error::Result;
use crate::geotiff::{is_tiff, GeoReference};
use crate::imageio::decode::check_size;
use crate::imageio::ImageLimits;

/// Side (pixels) above which a georeferenced TIFF is tiled when `--tile` is not given.
pub(crate) const AUTO_SIDE: u32 = 4096;

/// `--tile` / `--overlap` as given on the command line (or in a config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileRequest {
    /// Tile side: `Some(0)` off, `Some(n)` always, `None` automatic.
    pub tile: Option<usize>,
    /// Overlap; `None`: the model's default (at most half the tile).
    pub overlap: Option<usize>,
}

impl TileRequest {
    /// Checks the values given against the model's default `(tile, overlap)`: a tile of 0 turns
    /// tiling off; without a tile only a given overlap is checked (against the default tile).
    pub fn validate(&self, default: (usize, usize)) -> Result<()> {
        match (self.tile, self.overlap) {
            (Some(0), _) | (None, None) => Ok(()),
            (Some(t), o) => check_tile(t, o.unwrap_or(default.1.min(t / 2))),
            (None, Some(o)) => check_tile(default_tile(default), o),
        }
    }
}

/// `Some((tile, overlap))` when `path` is to be tiled under `req`, with `default` the model's
/// `(tile, overlap)`; reads at most the TIFF header.
pub fn decide(path: &Path, req: TileRequest, default: (usize, usize), limits: &ImageLimits) -> Result<Option<(usize, usize)>> {
    if !wants_tiles(path, req, limits)? {
        return Ok(None);
    }
    let tile = req.tile.unwrap_or_else(|| default_tile(default));
    let overlap = req.overlap.unwrap_or(default.1.min(tile / 2));
    check_tile(tile, overlap)?;
    Ok(Some((tile, overlap)))
}

/// Whether `path` is to be tiled under `req` (whatever the model): `--tile 0` never, `--tile N`
/// always, automatically a large GeoTIFF or an image beyond `limits`; reads at most the header.
pub fn wants_tiles(path: &Path, req: TileRequest, limits: &ImageLimits) -> Result<bool> {
    match req.tile {
        Some(t) => Ok(t > 0),
        None => {
            if !is_tiff(path)? {
                let (w, h) = super::rows::image_dimensions(path)?;
                return Ok(check_size(w, h, limits).is_err());
            }
            let (w, h, referenced) = match GeoReference::read(path)? {
                Some(g) => (g.width, g.height, true),
                None => {
                    let (w, h) = super::window_io::tiff_dimensions(path)?;
                    (w, h, false)
                }
            };
            Ok((referenced && w.max(h) > AUTO_SIDE) || check_size(w, h, limits).is_err())
        }
    }
}

/// The model's default tile, within the accepted range.
fn default_tile(default: (usize, usize)) -> usize {
    default.0.clamp(MIN_TILE, MAX_TILE)
}
