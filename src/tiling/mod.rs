//! Tiled inference of rasters larger than a model's working size (orthomosaics of 10k² pixels and
//! more): read window by window, run as overlapping tiles in batches, blend with smooth weights,
//! write a tiled (Big)GeoTIFF block by block. Memory is bounded by the tile batch (planned and
//! backed off by [`crate::runner::ItemRunner`]) and a column stripe of at most
//! [`TilingOptions::max_stripe`] pixels, not by the raster. See `docs/tiling.md`.
pub mod align;
pub mod auto;
pub(crate) mod blend;
pub mod map;
pub mod plan;
pub(crate) mod jpeg_rows;
pub(crate) mod rows;
pub mod run;
pub(crate) mod window_io;
pub mod writer;

use image::RgbImage;

pub use auto::{decide, wants_tiles, TileRequest};
pub use blend::Output;
pub use map::TileMap;
pub use plan::TilePlan;
pub use run::{run_tiled, tile_file, TiledStats};
pub use crate::tiffio::TiffRaster;
pub use window_io::{open_raster, MemoryRaster, RasterSource, Rect, Window};
pub use writer::{SampleKind, TiledTiffWriter, WriterOptions};

use crate::error::Result;

/// How tiles' outputs are combined where they overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// Weighted mean of the values as predicted (metric outputs: canopy height, metric depth; logits).
    Direct,
    /// Relative depth: each tile is first brought to its already-processed neighbours' scale by a
    /// least-squares scale and shift fitted on the overlaps ([`align`]).
    ScaleShift,
}

/// A model run on tiles.
pub trait TileModel {
    /// Planes per tile map (1, or the class count for logits).
    fn channels(&self) -> usize;
    /// How overlapping tiles combine.
    fn combine(&self) -> Combine;
    /// One map per tile crop, at the crop's resolution; `labels` name the tiles in errors.
    fn predict(&self, tiles: &[&RgbImage], labels: &[String]) -> Result<Vec<TileMap>>;
    /// The device the model runs on (synchronised after it runs out of memory), if it has one.
    fn device(&self) -> Option<&candle_core::Device> {
        None
    }
}

/// Tiling settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TilingOptions {
    /// Tile side in pixels.
    pub tile: usize,
    /// Minimum overlap between neighbouring tiles in pixels (at most half the tile).
    pub overlap: usize,
    /// Widest column stripe processed at once (pixels; rounded to whole output blocks).
    pub max_stripe: usize,
    /// Output format.
    pub writer: WriterOptions,
}

impl TilingOptions {
    /// `tile` / `overlap` with the default stripe (4096 px) and writer settings.
    pub fn new(tile: usize, overlap: usize) -> Self {
        TilingOptions { tile, overlap, max_stripe: DEFAULT_MAX_STRIPE, writer: WriterOptions::default() }
    }
}

/// Default widest column stripe (pixels).
pub(crate) const DEFAULT_MAX_STRIPE: usize = 4096;
