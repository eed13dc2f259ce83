//! SAM 3 as a family: `model_type: "sam3"` checkpoints and the hub's `sam3_video` one (its detector),
//! its recipe, its image processor (a fixed resize to `image_size`, mean and std 0.5) and the memory
//! an image with a batch of prompts takes. It does not fine-tune.
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::{Config, Sam3, PROMPT_BATCH};
use crate::error::{Error, Result};
use crate::imageio::resample::{Filter, Rounding};
use crate::models::family::{DepthOutputs, Family, GgufExtras};
use crate::models::fixed_size::FixedSizeProcessor;
use crate::models::footprint::ModelEstimate;
use crate::models::processor::ImageProcessor;
use crate::models::training::{Trainee, TrainingLayout};
use crate::models::Model;
use crate::tasks::Task;
use crate::weights::{Vb, WeightStore};

/// The SAM 3 family.
pub struct Sam3Family;

/// SAM 3's processor defaults (the original `Sam3Processor`: torchvision's antialiased bilinear
/// resize of the uint8 image to `side`², 1/255, mean and std 0.5).
pub(crate) fn processor_defaults(side: usize) -> FixedSizeProcessor {
    FixedSizeProcessor { size: Some((side, side)), filter: Filter::Bilinear, rounding: Rounding::Torch, rescale: Some(1.0 / 255.0), normalize: Some(([0.5; 3], [0.5; 3])) }
}

impl Family for Sam3Family {
    type Config = Config;
    const NAME: &'static str = "SAM 3";
    const ARCHITECTURES: &'static [&'static str] = &["sam3", "sam3_video"];
    const TASKS: &'static [Task] = &[Task::Segmentation];
    const RECIPE: &'static str = include_str!("../../../quantize/sam3.toml");
    const TRAINING: Option<TrainingLayout> = None;

    fn implied_architecture(_: &Value) -> Option<&'static str> {
        None
    }

    fn parse_config(arch: &str, config: &Value) -> Result<Config> {
        Config::from_json(arch, config)
    }

    fn load(vb: &Vb, config: &Config) -> Result<Box<dyn Model>> {
        Ok(Box::new(Sam3::load(vb, config)?))
    }

    /// The ViT's widest moment (its tokens, a LayerNorm's output, q/k/v and the MLP's hidden
    /// layer, or the neck's ×4 level being built) with the FPN levels kept, then a batch of
    /// prompts through the DETR encoder (tokens, MLP hidden layer) and decoder (the box bias over
    /// the image tokens), and one prompt's pixel decoder and masks at the ×4 level.
    fn footprint(c: &Config) -> Option<ModelEstimate> {
        let v = c.vit();
        let (patch, width, mlp) = (v.patch_size as u64, v.hidden_size as u64, v.intermediate_size as u64);
        let d = c.width() as u64;
        let (ffn, queries, heads) = (c.detr_encoder_config.intermediate_size as u64, c.detr_decoder_config.num_queries as u64 + 1, c.detr_decoder_config.num_attention_heads as u64);
        let batch = PROMPT_BATCH as u64;
        Some(Arc::new(move |h, w, elem| {
            let n = (h / patch) * (w / patch);
            let vit = n * (6 * width + 2 * mlp);
            let neck = 16 * n * (width / 4 + 2 * d);
            let levels = 21 * n * d;
            let encoder = batch * n * (6 * d + 2 * ffn);
            let decoder = batch * n * (4 * d + 2 * heads * queries);
            let masks = 16 * n * (5 * d + 2 * queries);
            (vit.max(neck) + levels + encoder.max(decoder) + masks) * elem
        }))
    }

    fn processor(c: &Config, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        Ok(Some(Arc::new(FixedSizeProcessor::from_model_path_or(model_path, processor_defaults(c.vit().image_size))?)))
    }

    fn depth_outputs(_: &Config) -> Option<DepthOutputs> {
        None
    }

    fn trainee(_: &Vb, _: &Config) -> Result<Box<dyn Trainee>> {
        Err(Error::Config("SAM 3 models cannot be fine-tuned".into()))
    }

    fn gguf_extras(c: &Config, store: &Arc<WeightStore>, model_path: &Path, prompts: Option<&[String]>) -> Result<GgufExtras> {
        super::prompts::gguf_extras(c, store, model_path, prompts)
    }
}
