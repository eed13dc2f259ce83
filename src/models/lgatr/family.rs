//! L-GATr as a family: `model_type: "lgatr" | "lgatr_slim"` state dicts, the event task (packed
//! events of different lengths), its recipe, and how a file's stored types decide how the folded
//! maps are held. Its items are events, not images: no image processor, no per-image footprint,
//! and it does not fine-tune.
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use serde_json::Value;

use super::{load, Config, MapStorage};
use crate::error::{Error, Result};
use crate::models::family::{DepthOutputs, Family};
use crate::models::footprint::ModelEstimate;
use crate::models::processor::ImageProcessor;
use crate::models::training::{Trainee, TrainingLayout};
use crate::models::Model;
use crate::tasks::Task;
use crate::weights::{StoredDType, Vb, WeightStore};

/// The L-GATr family.
pub(crate) struct LgatrFamily;

/// How L-GATr holds its folded maps for the matrices in `store`: rounded to Q8_0 for a file with
/// Q8_0 matrices, in f16 for one whose matrices are all f16 (norm scales aside, which `edgerun
/// quantize` keeps in f32), else as computed.
fn map_storage(store: &WeightStore) -> MapStorage {
    if store.entries().values().any(|e| e.dtype == StoredDType::Ggml(GgmlDType::Q8_0)) {
        return MapStorage::Int8;
    }
    let mut matrices = store.entries().values().filter(|e| e.shape.len() >= 2 && !e.name.contains("norm")).peekable();
    if matrices.peek().is_some() && matrices.all(|e| e.dtype.plain() == Some(candle_core::DType::F16)) {
        MapStorage::Half
    } else {
        MapStorage::Plain
    }
}

impl Family for LgatrFamily {
    type Config = Config;
    const NAME: &'static str = "L-GATr";
    const ARCHITECTURES: &'static [&'static str] = &["lgatr", "lgatr_slim"];
    const TASKS: &'static [Task] = &[Task::Events];
    const RECIPE: &'static str = include_str!("../../../quantize/lgatr.toml");
    const TRAINING: Option<TrainingLayout> = None;

    fn implied_architecture(_: &Value) -> Option<&'static str> {
        None
    }

    fn parse_config(_: &str, config: &Value) -> Result<Config> {
        Config::from_json(config)
    }

    fn load(vb: &Vb, config: &Config) -> Result<Box<dyn Model>> {
        load(vb.candle(), config, map_storage(vb.store()))
    }

    fn footprint(_: &Config) -> Option<ModelEstimate> {
        None
    }

    fn processor(_: &Config, _: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        Ok(None)
    }

    fn depth_outputs(_: &Config) -> Option<DepthOutputs> {
        None
    }

    fn trainee(_: &Vb, _: &Config) -> Result<Box<dyn Trainee>> {
        Err(Error::Config("L-GATr models cannot be fine-tuned yet".into()))
    }
}
