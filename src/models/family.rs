//! What a model family is: the [`Family`] each family implements in its own folder (the
//! architecture names it recognises, its typed config, how it loads, its activation footprint, its
//! quantize recipe, its image processor, the tasks it serves and how it trains), and the erased
//! [`Descriptor`] the registry lists.
use std::any::Any;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::footprint::ModelEstimate;
use super::processor::ImageProcessor;
use super::training::{Trainee, TrainingLayout};
use super::Model;
use crate::error::{Error, Result};
use crate::tasks::Task;
use crate::weights::{MetaValue, Vb, WeightStore};

/// The outputs of a depth model, by the names its forward pass gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DepthOutputs {
    /// The depth map (`[B, H, W]`).
    pub depth: &'static str,
    /// A per-pixel confidence, where the model has one.
    pub confidence: Option<&'static str>,
    /// A sky score, where the model has one (sky pixels then get the far depth).
    pub sky: Option<&'static str>,
    /// Whether the depth is metric (metres) rather than relative.
    pub metric: bool,
    /// Whether metric depth needs the images' focal length (`focal · output / 300`).
    pub needs_focal: bool,
}

/// What a GGUF copy of a checkpoint carries besides the checkpoint's tensors (`edgerun quantize`).
#[derive(Debug, Default)]
pub struct GgufExtras {
    /// Metadata entries.
    pub metadata: Vec<(String, MetaValue)>,
    /// Tensors computed from the checkpoint (stored in f32).
    pub tensors: Vec<(String, candle_core::Tensor)>,
    /// Glob patterns of checkpoint tensors left out.
    pub drop: Vec<String>,
}

/// Everything a model family knows about itself. Each family implements it once, in its folder
/// under `src/models/`, and is listed in the registry ([`super::FAMILIES`]); nothing outside the
/// folder matches its architecture names.
pub trait Family: Sync + 'static {
    /// The typed config, parsed once from `config.json` or a GGUF's `edgerun.config`.
    type Config: Send + Sync + 'static;
    /// The family's name in messages.
    const NAME: &'static str;
    /// The architecture names (`model_type`) it recognises.
    const ARCHITECTURES: &'static [&'static str];
    /// The tasks it serves.
    const TASKS: &'static [Task];
    /// Its `edgerun quantize` recipe (TOML, `quantize/<family>.toml`).
    const RECIPE: &'static str;
    /// How fine-tuning walks its backbone; `None` where the family does not fine-tune.
    const TRAINING: Option<TrainingLayout>;

    /// An architecture that a config without a `model_type` implies (DA3 hub configs name a
    /// `model_name`); `None` for families whose configs always carry one.
    fn implied_architecture(config: &Value) -> Option<&'static str>;
    /// Parses and checks the config of a checkpoint of architecture `arch`.
    fn parse_config(arch: &str, config: &Value) -> Result<Self::Config>;
    /// Builds the model for its raw forward pass ([`Model`]).
    fn load(vb: &Vb, config: &Self::Config) -> Result<Box<dyn Model>>;
    /// Its model's activation bytes per item, by network input size (for `--batch auto`); `None`
    /// for a family whose items are not images.
    fn footprint(config: &Self::Config) -> Option<ModelEstimate>;
    /// Its image processor (reading `preprocessor_config.json` beside `model_path` when there is
    /// one); `None` for a family whose inputs are not images.
    fn processor(config: &Self::Config, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>>;
    /// Its depth outputs, where it serves [`Task::Depth`].
    fn depth_outputs(config: &Self::Config) -> Option<DepthOutputs>;
    /// The model as fine-tuning drives it (the trainable weights already chosen in `vb`); an
    /// error for a family without [`Family::TRAINING`].
    fn trainee(vb: &Vb, config: &Self::Config) -> Result<Box<dyn Trainee>>;

    /// What a GGUF copy of the checkpoint in `store` (opened from `model_path`) carries besides its
    /// tensors; with `prompts`, those text prompts' features computed once in place of what computes
    /// them. Default: nothing, and prompts are an error.
    fn gguf_extras(_config: &Self::Config, _store: &Arc<WeightStore>, _model_path: &Path, prompts: Option<&[String]>) -> Result<GgufExtras> {
        match prompts {
            None => Ok(GgufExtras::default()),
            Some(_) => Err(Error::Config(format!("{} models take no text prompts", Self::NAME))),
        }
    }
}

/// A parsed config of some family, as the registry holds it.
pub(crate) type AnyConfig = Box<dyn Any + Send + Sync>;

/// A [`Family`] with its config type erased, as the registry lists it.
pub trait Descriptor: Sync {
    /// See [`Family::NAME`].
    fn name(&self) -> &'static str;
    /// See [`Family::ARCHITECTURES`].
    fn architectures(&self) -> &'static [&'static str];
    /// See [`Family::TASKS`].
    fn tasks(&self) -> &'static [Task];
    /// See [`Family::RECIPE`].
    fn recipe(&self) -> &'static str;
    /// See [`Family::TRAINING`].
    fn training(&self) -> Option<TrainingLayout>;
    /// See [`Family::implied_architecture`].
    fn implied_architecture(&self, config: &Value) -> Option<&'static str>;
    /// See [`Family::parse_config`].
    fn parse_config(&self, arch: &str, config: &Value) -> Result<AnyConfig>;
    /// See [`Family::load`].
    fn load(&self, vb: &Vb, config: &AnyConfig) -> Result<Box<dyn Model>>;
    /// See [`Family::footprint`].
    fn footprint(&self, config: &AnyConfig) -> Option<ModelEstimate>;
    /// See [`Family::processor`].
    fn processor(&self, config: &AnyConfig, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>>;
    /// See [`Family::depth_outputs`].
    fn depth_outputs(&self, config: &AnyConfig) -> Option<DepthOutputs>;
    /// See [`Family::trainee`].
    fn trainee(&self, vb: &Vb, config: &AnyConfig) -> Result<Box<dyn Trainee>>;
    /// See [`Family::gguf_extras`].
    fn gguf_extras(&self, config: &AnyConfig, store: &Arc<WeightStore>, model_path: &Path, prompts: Option<&[String]>) -> Result<GgufExtras>;
}

/// The registry's entry for family `F`.
pub(crate) struct Registered<F: Family>(PhantomData<F>);

impl<F: Family> Registered<F> {
    /// The entry.
    pub(crate) const fn new() -> Self {
        Registered(PhantomData)
    }

    fn typed(config: &AnyConfig) -> Result<&F::Config> {
        config.downcast_ref::<F::Config>().ok_or_else(|| Error::Config(format!("a config of another family was handed to {}", F::NAME)))
    }
}

impl<F: Family> Default for Registered<F> {
    fn default() -> Self {
        Self::new()
    }
}

impl<F: Family> Descriptor for Registered<F> {
    fn name(&self) -> &'static str {
        F::NAME
    }

    fn architectures(&self) -> &'static [&'static str] {
        F::ARCHITECTURES
    }

    fn tasks(&self) -> &'static [Task] {
        F::TASKS
    }

    fn recipe(&self) -> &'static str {
        F::RECIPE
    }

    fn training(&self) -> Option<TrainingLayout> {
        F::TRAINING
    }

    fn implied_architecture(&self, config: &Value) -> Option<&'static str> {
        F::implied_architecture(config)
    }

    fn parse_config(&self, arch: &str, config: &Value) -> Result<AnyConfig> {
        Ok(Box::new(F::parse_config(arch, config)?))
    }

    fn load(&self, vb: &Vb, config: &AnyConfig) -> Result<Box<dyn Model>> {
        F::load(vb, Self::typed(config)?)
    }

    fn footprint(&self, config: &AnyConfig) -> Option<ModelEstimate> {
        F::footprint(Self::typed(config).ok()?)
    }

    fn processor(&self, config: &AnyConfig, model_path: &Path) -> Result<Option<Arc<dyn ImageProcessor>>> {
        F::processor(Self::typed(config)?, model_path)
    }

    fn depth_outputs(&self, config: &AnyConfig) -> Option<DepthOutputs> {
        F::depth_outputs(Self::typed(config).ok()?)
    }

    fn trainee(&self, vb: &Vb, config: &AnyConfig) -> Result<Box<dyn Trainee>> {
        F::trainee(vb, Self::typed(config)?)
    }

    fn gguf_extras(&self, config: &AnyConfig, store: &Arc<WeightStore>, model_path: &Path, prompts: Option<&[String]>) -> Result<GgufExtras> {
        F::gguf_extras(Self::typed(config)?, store, model_path, prompts)
    }
}
