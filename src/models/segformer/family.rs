//! SegFormer as a family: `model_type: "segformer"` checkpoints, the segmentation task, the
//! SegFormer image processor, its footprint (encoder stages, decode head), its recipe and its
//! four-stage training layout.
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::{Config, SegformerForSemanticSegmentation, SegformerProcessor};
use crate::error::Result;
use crate::models::family::{DepthOutputs, Family};
use crate::models::footprint::ModelEstimate;
use crate::models::processor::ImageProcessor;
use crate::models::training::{number_after, two_numbers_after, Slot, Trainee, TrainingLayout};
use crate::models::Model;
use crate::tasks::Task;
use crate::weights::Vb;

/// The SegFormer family.
pub struct SegformerFamily;

impl Family for SegformerFamily {
    type Config = Config;
    const NAME: &'static str = "SegFormer";
    const ARCHITECTURES: &'static [&'static str] = &["segformer"];
    const TASKS: &'static [Task] = &[Task::Segmentation];
    const RECIPE: &'static str = include_str!("../../../quantize/segformer.toml");
    // Four stages of patch embedding, blocks and norm.
    const TRAINING: Option<TrainingLayout> = Some(TrainingLayout {
        prefix: "segformer.",
        position: |n| {
            if let Some(s) = number_after(n, "segformer.encoder.patch_embeddings.") {
                Some((s, Slot::Embed))
            } else if let Some((s, j)) = two_numbers_after(n, "segformer.encoder.block.") {
                Some((s, Slot::Block(j)))
            } else {
                number_after(n, "segformer.encoder.layer_norm.").map(|s| (s, Slot::Norm))
            }
        },
    });

    fn implied_architecture(_: &Value) -> Option<&'static str> {
        None
    }

    fn parse_config(_: &str, config: &Value) -> Result<Config> {
        Config::from_json(config)
    }

    fn load(vb: &Vb, config: &Config) -> Result<Box<dyn Model>> {
        Ok(Box::new(SegformerForSemanticSegmentation::load(vb, config)?))
    }

    /// The encoder's worst block or the decode head (they do not overlap in time), plus the stage
    /// maps the head keeps.
    fn footprint(c: &Config) -> Option<ModelEstimate> {
        let hidden: Vec<u64> = c.hidden_sizes.iter().map(|&v| v as u64).collect();
        let heads: Vec<u64> = c.num_attention_heads.iter().map(|&v| v as u64).collect();
        let sr: Vec<u64> = c.sr_ratios.iter().map(|&v| v as u64).collect();
        let ratios: Vec<u64> = c.mlp_ratios.iter().map(|&v| v as u64).collect();
        let dec = c.decoder_hidden_size as u64;
        let labels = c.id2label.as_ref().map(|m| m.len() as u64).unwrap_or(150);
        Some(Arc::new(move |h, w, elem| {
            let mut peak = 0u64;
            let (mut sh, mut sw) = (h.div_ceil(4), w.div_ceil(4));
            for (i, &c) in hidden.iter().enumerate() {
                let n = sh * sw;
                let r = sr.get(i).copied().unwrap_or(1).max(1);
                let keys = (sh.div_ceil(r) * sw.div_ceil(r)).max(1);
                let attention = 4 * n * c + 2 * heads.get(i).copied().unwrap_or(1) * n * keys;
                let mlp = 3 * ratios.get(i).copied().unwrap_or(4) * c * n + 2 * n * c;
                peak = peak.max(attention.max(mlp));
                sh = sh.div_ceil(2);
                sw = sw.div_ceil(2);
            }
            let n0 = h.div_ceil(4) * w.div_ceil(4);
            // The concatenation of the four upsampled maps, the fused map and the logits (resized
            // to each image one image at a time, outside the batch).
            let decode = 4 * dec * n0 + dec * n0 + labels * n0;
            let kept: u64 = hidden.iter().enumerate().map(|(i, c)| c * n0 / (1 << (2 * i))).sum();
            (peak.max(decode) + kept) * elem
        }))
    }

    fn processor(_: &Config, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        Ok(Some(Arc::new(SegformerProcessor::from_model_path(model_path)?)))
    }

    fn depth_outputs(_: &Config) -> Option<DepthOutputs> {
        None
    }

    fn trainee(vb: &Vb, config: &Config) -> Result<Box<dyn Trainee>> {
        Ok(Box::new(SegformerForSemanticSegmentation::load(vb, config)?))
    }
}
