//! The tasks as [`TileModel`]s for large rasters, and their default tile sizes (the model's working
//! size, so that tiles are not resized): canopy height (metres, blended directly), depth (relative
//! depth aligned by scale and shift, metric blended directly) and segmentation (logits blended,
//! then argmax; open-vocabulary class scores blended, then the thresholded argmax).
use candle_core::{DType, Device};
use image::RgbImage;

use super::chm::ChmEstimator;
use super::depth::DepthEstimator;
use super::open_vocab::OpenVocabSegmenter;
use super::segment::Segmenter;
use crate::error::{Error, Result};
use crate::models::chmv2::processor::WORKING_SIZE as CHM_TILE;
use crate::models::processor::ImageProcessor;
use crate::tiling::{Combine, TileMap, TileModel};

/// CHMv2's default `(tile, overlap)`: the checkpoint's 416² working size, 64 px overlap.
pub const CHM_DEFAULT: (usize, usize) = (CHM_TILE, 64);
/// Depth overlap (wide, so that the scale fit of relative depth has many pairs).
pub(crate) const DEPTH_OVERLAP: usize = 96;
/// Segmentation overlap.
pub(crate) const SEG_OVERLAP: usize = 64;

/// Canopy height per tile.
pub struct ChmTiles<'a> {
    /// The model.
    pub est: &'a ChmEstimator,
}

impl TileModel for ChmTiles<'_> {
    fn channels(&self) -> usize {
        1
    }

    fn combine(&self) -> Combine {
        Combine::Direct
    }

    fn predict(&self, tiles: &[&RgbImage], labels: &[String]) -> Result<Vec<TileMap>> {
        self.est.predict(tiles, labels, tiles.len())?.into_iter().map(|m| TileMap::dense(m.height, m.width, m.values)).collect()
    }

    fn device(&self) -> Option<&Device> {
        Some(self.est.device())
    }
}

/// Depth per tile (DA3 sky masks and confidences are not tiled).
pub struct DepthTiles<'a> {
    /// The model.
    pub est: &'a DepthEstimator,
}

impl TileModel for DepthTiles<'_> {
    fn channels(&self) -> usize {
        1
    }

    fn combine(&self) -> Combine {
        if self.est.is_metric() {
            Combine::Direct
        } else {
            Combine::ScaleShift
        }
    }

    fn predict(&self, tiles: &[&RgbImage], _labels: &[String]) -> Result<Vec<TileMap>> {
        self.est.predict(tiles, tiles.len())?.into_iter().map(|m| TileMap::dense(m.height, m.width, m.values)).collect()
    }

    fn device(&self) -> Option<&Device> {
        Some(self.est.device())
    }
}

/// The default `(tile, overlap)` of a depth model: its network input size (518 for Depth Anything
/// V2, the `process_res` 504 for DA3), so that tiles are not resized.
pub fn depth_default(est: &DepthEstimator) -> (usize, usize) {
    let tile = est.processor().working_size();
    (tile, DEPTH_OVERLAP.min(tile / 4))
}

/// Segmentation logits per tile.
pub struct SegTiles<'a> {
    /// The model.
    pub seg: &'a Segmenter,
}

impl TileModel for SegTiles<'_> {
    fn channels(&self) -> usize {
        self.seg.labels().len()
    }

    fn combine(&self) -> Combine {
        Combine::Direct
    }

    fn predict(&self, tiles: &[&RgbImage], _labels: &[String]) -> Result<Vec<TileMap>> {
        let logits = self.seg.logits(tiles)?;
        tiles
            .iter()
            .zip(logits)
            .map(|(img, l)| {
                let (channels, lh, lw) = l.dims3()?;
                if lh == 0 || lw == 0 {
                    return Err(Error::Input("empty logits".into()));
                }
                let values = l.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
                Ok(TileMap::Logits { channels, lh, lw, values, height: img.height() as usize, width: img.width() as usize })
            })
            .collect()
    }

    fn device(&self) -> Option<&Device> {
        Some(self.seg.device())
    }
}

/// The default `(tile, overlap)` of a SegFormer: its network input size (512 without a
/// preprocessor config).
pub fn seg_default(seg: &Segmenter) -> (usize, usize) {
    let tile = seg.processor().working_size();
    // A small network input (`--size 64x64`) gets a proportionally small overlap.
    (tile, SEG_OVERLAP.min(tile / 4))
}

/// Open-vocabulary class scores per tile (blended across tiles, then thresholded).
pub struct OpenVocabTiles<'a> {
    /// The segmenter.
    pub seg: &'a OpenVocabSegmenter,
}

impl TileModel for OpenVocabTiles<'_> {
    fn channels(&self) -> usize {
        self.seg.classes().len()
    }

    fn combine(&self) -> Combine {
        Combine::Direct
    }

    fn predict(&self, tiles: &[&RgbImage], _labels: &[String]) -> Result<Vec<TileMap>> {
        tiles
            .iter()
            .map(|img| {
                let s = self.seg.scores(img)?;
                Ok(TileMap::Dense { channels: s.classes, height: s.height, width: s.width, values: s.values })
            })
            .collect()
    }

    fn device(&self) -> Option<&Device> {
        Some(self.seg.device())
    }
}

/// The default `(tile, overlap)` of an open-vocabulary segmenter: its view size.
pub fn open_vocab_default(seg: &OpenVocabSegmenter) -> (usize, usize) {
    let tile = seg.input_side();
    (tile, SEG_OVERLAP.min(tile / 4))
}
