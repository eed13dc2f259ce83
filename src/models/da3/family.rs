//! Depth Anything 3 as a family: the any-view, Mono and Metric checkpoints (hub configs that name a
//! `model_name` included), the depth task, the package's input processor and the ViT + DPT
//! footprint. DA3 does not fine-tune.
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::processor::Da3Processor;
use super::{architecture_for_model_name, Config, Da3, Da3Kind, ARCH_ANY_VIEW, ARCH_METRIC, ARCH_MONO, ARCH_NESTED};
use crate::error::{Error, Result};
use crate::models::family::{DepthOutputs, Family};
use crate::models::footprint::{ModelEstimate, VitDpt};
use crate::models::processor::ImageProcessor;
use crate::models::training::{Trainee, TrainingLayout};
use crate::models::Model;
use crate::tasks::Task;
use crate::weights::Vb;

/// The Depth Anything 3 family.
pub(crate) struct Da3Family;

impl Family for Da3Family {
    type Config = Config;
    const NAME: &'static str = "Depth Anything 3";
    const ARCHITECTURES: &'static [&'static str] = &[ARCH_ANY_VIEW, ARCH_MONO, ARCH_METRIC, ARCH_NESTED];
    const TASKS: &'static [Task] = &[Task::Depth];
    const RECIPE: &'static str = include_str!("../../../quantize/da3.toml");
    const TRAINING: Option<TrainingLayout> = None;

    fn implied_architecture(config: &Value) -> Option<&'static str> {
        config.get("model_name").and_then(|v| v.as_str()).and_then(architecture_for_model_name)
    }

    fn parse_config(_: &str, config: &Value) -> Result<Config> {
        Config::from_json(config)
    }

    fn load(vb: &Vb, config: &Config) -> Result<Box<dyn Model>> {
        Ok(Box::new(Da3::load(vb, config)?))
    }

    fn footprint(c: &Config) -> Option<ModelEstimate> {
        let (d, heads) = match c.net.name.as_str() {
            "vits" => (384, 6),
            "vitb" => (768, 12),
            "vitg" => (1536, 24),
            _ => (1024, 16),
        };
        let hidden = c.net.embed_dim.unwrap_or(d) as u64;
        let vit = VitDpt {
            patch: c.net.patch_size as u64,
            hidden,
            heads: c.net.num_heads.unwrap_or(heads) as u64,
            mlp: (hidden as f64 * c.net.mlp_ratio.unwrap_or(4.0)) as u64,
            extra_tokens: 2,
            kept_layers: c.net.out_layers.len() as u64,
            neck: c.head.out_channels.iter().map(|&n| n as u64).collect(),
            fusion: c.head.features as u64,
            head: 32,
            out_channels: c.head.output_dim as u64,
            head_maps: 4,
            post_maps: 0,
        };
        Some(Arc::new(move |h, w, elem| vit.bytes(h, w, elem)))
    }

    fn processor(_: &Config, _: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        Ok(Some(Arc::new(Da3Processor::default())))
    }

    fn depth_outputs(c: &Config) -> Option<DepthOutputs> {
        Some(match c.kind {
            Da3Kind::AnyView => DepthOutputs { depth: "depth", confidence: Some("depth_conf"), sky: None, metric: false, needs_focal: false },
            Da3Kind::Mono => DepthOutputs { depth: "depth", confidence: None, sky: Some("sky"), metric: false, needs_focal: false },
            Da3Kind::Metric => DepthOutputs { depth: "depth", confidence: None, sky: Some("sky"), metric: true, needs_focal: true },
        })
    }

    fn trainee(_: &Vb, _: &Config) -> Result<Box<dyn Trainee>> {
        Err(Error::Config("Depth Anything 3 checkpoints cannot be fine-tuned yet".into()))
    }
}
