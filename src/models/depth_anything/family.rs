//! Depth Anything V1/V2 as a family: `model_type: "depth_anything"` checkpoints, the depth task,
//! the DPT image processor, the ViT + DPT footprint, its recipe and its training layout.
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::processor::DptProcessor;
use super::{Config, DepthAnything, DepthKind};
use crate::error::Result;
use crate::models::family::{DepthOutputs, Family};
use crate::models::footprint::{ModelEstimate, VitDpt};
use crate::models::processor::ImageProcessor;
use crate::models::training::{vit_position, Trainee, TrainingLayout};
use crate::models::Model;
use crate::tasks::Task;
use crate::weights::Vb;

/// The Depth Anything V1/V2 family.
pub struct DepthAnythingFamily;

impl Family for DepthAnythingFamily {
    type Config = Config;
    const NAME: &'static str = "Depth Anything V1/V2";
    const ARCHITECTURES: &'static [&'static str] = &["depth_anything"];
    const TASKS: &'static [Task] = &[Task::Depth];
    const RECIPE: &'static str = include_str!("../../../quantize/depth_anything.toml");
    const TRAINING: Option<TrainingLayout> = Some(TrainingLayout {
        prefix: "backbone.",
        position: |n| vit_position(n, "backbone.embeddings.", "backbone.encoder.layer.", "backbone.layernorm."),
    });

    fn implied_architecture(_: &Value) -> Option<&'static str> {
        None
    }

    fn parse_config(_: &str, config: &Value) -> Result<Config> {
        Config::from_json(config)
    }

    fn load(vb: &Vb, config: &Config) -> Result<Box<dyn Model>> {
        Ok(Box::new(DepthAnything::load(vb, config)?))
    }

    fn footprint(c: &Config) -> Option<ModelEstimate> {
        let b = &c.backbone_config;
        let vit = VitDpt {
            patch: b.patch_size as u64,
            hidden: b.hidden_size as u64,
            heads: b.num_attention_heads as u64,
            mlp: (b.hidden_size as f64 * b.mlp_ratio) as u64,
            extra_tokens: 1,
            kept_layers: 4,
            neck: c.neck_hidden_sizes.iter().map(|&n| n as u64).collect(),
            fusion: c.fusion_hidden_size as u64,
            head: c.head_hidden_size as u64,
            out_channels: 1,
            head_maps: 2,
            post_maps: 0,
        };
        Some(Arc::new(move |h, w, elem| vit.bytes(h, w, elem)))
    }

    fn processor(_: &Config, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        Ok(Some(Arc::new(DptProcessor::for_model(model_path)?)))
    }

    fn depth_outputs(c: &Config) -> Option<DepthOutputs> {
        let metric = c.kind().ok()? == DepthKind::Metric;
        Some(DepthOutputs { depth: "predicted_depth", confidence: None, sky: None, metric, needs_focal: false })
    }

    fn trainee(vb: &Vb, config: &Config) -> Result<Box<dyn Trainee>> {
        Ok(Box::new(DepthAnything::load(vb, config)?))
    }
}
