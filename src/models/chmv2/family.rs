//! CHMv2 as a family: `model_type: "chmv2"` checkpoints, the canopy-height task, the CHMv2 image
//! processor, the ViT + DPT footprint with its bins, its recipe and its training layout.
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::processor::Chmv2Processor;
use super::{Chmv2, Config};
use crate::error::Result;
use crate::models::family::{DepthOutputs, Family};
use crate::models::footprint::{ModelEstimate, VitDpt};
use crate::models::processor::ImageProcessor;
use crate::models::training::{vit_position, Trainee, TrainingLayout};
use crate::models::Model;
use crate::tasks::Task;
use crate::weights::Vb;

/// The CHMv2 family.
pub struct Chmv2Family;

impl Family for Chmv2Family {
    type Config = Config;
    const NAME: &'static str = "CHMv2";
    const ARCHITECTURES: &'static [&'static str] = &["chmv2"];
    const TASKS: &'static [Task] = &[Task::CanopyHeight];
    const RECIPE: &'static str = include_str!("../../../quantize/chmv2.toml");
    const TRAINING: Option<TrainingLayout> =
        Some(TrainingLayout { prefix: "backbone.", position: |n| vit_position(n, "backbone.embeddings.", "backbone.layer.", "backbone.norm.") });

    fn implied_architecture(_: &Value) -> Option<&'static str> {
        None
    }

    fn parse_config(_: &str, config: &Value) -> Result<Config> {
        Config::from_json(config)
    }

    fn load(vb: &Vb, config: &Config) -> Result<Box<dyn Model>> {
        Ok(Box::new(Chmv2::load(vb, config)?))
    }

    fn footprint(c: &Config) -> Option<ModelEstimate> {
        let b = &c.backbone_config;
        let vit = VitDpt {
            patch: c.patch_size as u64,
            hidden: b.hidden_size as u64,
            heads: b.num_attention_heads as u64,
            mlp: b.intermediate_size as u64,
            extra_tokens: 1 + b.num_register_tokens as u64,
            kept_layers: b.feature_indices().map(|v| v.len() as u64).unwrap_or(4),
            neck: c.post_process_channels.clone().unwrap_or_else(|| vec![128, 256, 512, 1024]).into_iter().map(|n| n as u64).collect(),
            fusion: c.fusion_hidden_size as u64,
            head: c.head_hidden_size as u64,
            out_channels: c.number_output_channels as u64,
            // The bins become heights through a softmax and a weighted sum: two more such maps.
            head_maps: 4,
            post_maps: 2,
        };
        Some(Arc::new(move |h, w, elem| vit.bytes(h, w, elem)))
    }

    fn processor(_: &Config, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        Ok(Some(Arc::new(Chmv2Processor::for_model(model_path)?)))
    }

    fn depth_outputs(_: &Config) -> Option<DepthOutputs> {
        None
    }

    fn trainee(vb: &Vb, config: &Config) -> Result<Box<dyn Trainee>> {
        Ok(Box::new(Chmv2::load(vb, config)?))
    }
}
