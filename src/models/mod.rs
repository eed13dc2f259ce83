//! Model families and the registry: [`FAMILIES`] lists one [`Descriptor`] per family, each
//! implemented in the family's own folder ([`family::Family`]); [`Checkpoint`] opens a model,
//! recognises its family and parses its config once.
pub mod backbones;
pub mod chmv2;
pub mod da3;
pub mod depth_anything;
pub mod family;
pub mod fixed_size;
pub mod footprint;
pub mod lgatr;
pub mod processor;
pub mod sam3;
pub mod segformer;
pub mod training;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::tasks::Task;
use crate::weights::{Vb, WeightStore};
pub use family::{DepthOutputs, Descriptor, Family, GgufExtras};
use family::{AnyConfig, Registered};
use processor::ImageProcessor;
use training::Trainee;

/// Tensors by name, as read from or written to a safetensors file.
pub type NamedTensors = BTreeMap<String, Tensor>;

/// A loaded model whose raw forward pass maps named input tensors to named outputs,
/// using the reference implementation's tensor names.
pub trait Model: Send + Sync {
    /// The architecture name (`model_type` as the reference writes it).
    fn architecture(&self) -> &str;
    /// The input names this model expects.
    fn input_names(&self) -> Vec<&'static str>;
    /// Runs the forward pass on already-preprocessed tensors.
    fn forward_named(&self, inputs: &NamedTensors) -> Result<NamedTensors>;
    /// The forward pass handing its outputs to `sink`: by default all at the end; a model whose
    /// outputs are large per item (SAM 3's masks per prompt) writes each block as it is made.
    fn forward_into(&self, inputs: &NamedTensors, sink: &mut dyn crate::tensor_io::OutputSink) -> Result<()> {
        crate::tensor_io::write_all(sink, &self.forward_named(inputs)?)
    }
}

/// The input tensor `name`, or an error naming it.
pub fn required<'a>(inputs: &'a NamedTensors, name: &str) -> Result<&'a Tensor> {
    inputs.get(name).ok_or_else(|| Error::Input(format!("missing input `{name}`")))
}

/// Every model family edgerun knows, one entry each.
pub static FAMILIES: &[&dyn Descriptor] = &[
    &Registered::<depth_anything::DepthAnythingFamily>::new(),
    &Registered::<da3::Da3Family>::new(),
    &Registered::<segformer::SegformerFamily>::new(),
    &Registered::<chmv2::Chmv2Family>::new(),
    &Registered::<lgatr::LgatrFamily>::new(),
    &Registered::<sam3::Sam3Family>::new(),
];

/// Every architecture name the families recognise, sorted.
pub fn architectures() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = FAMILIES.iter().flat_map(|f| f.architectures().iter().copied()).collect();
    all.sort_unstable();
    all
}

/// The family that recognises `arch`.
pub(crate) fn family_of(arch: &str) -> Option<&'static dyn Descriptor> {
    FAMILIES.iter().copied().find(|f| f.architectures().contains(&arch))
}

/// The architecture of a checkpoint: the config's `model_type`, else the one a family recognises
/// from the rest of its config (Depth Anything 3 hub configs: `{"model_name": "da3-small"}`), else
/// GGUF `general.architecture`.
pub fn architecture(store: &WeightStore) -> Option<String> {
    if let Some(s) = store.config().get("model_type").and_then(|v| v.as_str()) {
        return Some(s.to_string());
    }
    if let Some(a) = FAMILIES.iter().find_map(|f| f.implied_architecture(store.config())) {
        return Some(a.to_string());
    }
    store.architecture()
}

/// A model opened from disk: its weights, its family and its config, parsed once.
pub struct Checkpoint {
    store: Arc<WeightStore>,
    path: PathBuf,
    arch: &'static str,
    family: &'static dyn Descriptor,
    config: AnyConfig,
}

impl Checkpoint {
    /// Opens the model at `path` (a directory or a `.gguf`), recognises its family and parses its
    /// config; an unknown architecture or a bad config is an error naming the file.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_store(Arc::new(WeightStore::open(path)?), path)
    }

    /// As [`Checkpoint::open`], from a store already open (`path` is where it was opened from).
    pub(crate) fn from_store(store: Arc<WeightStore>, path: &Path) -> Result<Self> {
        let arch = architecture(&store).ok_or_else(|| {
            Error::bad_file(store.root(), "no architecture: config.json has no `model_type` (and no GGUF general.architecture)")
        })?;
        let family = family_of(&arch).ok_or_else(|| {
            crate::config_check::in_file(
                store.config_origin(),
                Error::Config(format!("unknown architecture `{arch}` (supported: {})", architectures().join(", "))),
            )
        })?;
        let arch = family.architectures().iter().copied().find(|a| *a == arch).unwrap_or(family.name());
        let config = family.parse_config(arch, store.config()).map_err(|e| crate::config_check::in_file(store.config_origin(), e))?;
        Ok(Checkpoint { store, path: path.to_path_buf(), arch, family, config })
    }

    /// The weights.
    pub fn store(&self) -> &Arc<WeightStore> {
        &self.store
    }

    /// Where it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its architecture name.
    pub fn architecture(&self) -> &'static str {
        self.arch
    }

    /// Its family.
    pub fn family(&self) -> &'static dyn Descriptor {
        self.family
    }

    /// Its typed config, when it is a `T` (the config type of the family that asks).
    pub fn config<T: 'static>(&self) -> Option<&T> {
        self.config.downcast_ref::<T>()
    }

    /// Whether its family serves `task`.
    pub fn serves(&self, task: Task) -> bool {
        self.family.tasks().contains(&task)
    }

    /// The raw model on `device`, computing in `dtype`.
    pub fn load(&self, device: &Device, dtype: DType) -> Result<Box<dyn Model>> {
        let vb = Vb::new(self.store.clone(), dtype, device.clone());
        self.built(|| self.family.load(&vb, &self.config))
    }

    /// Runs `build` (which reads tensors) and names the checkpoint in its errors: a Candle error
    /// there means the weights and the config disagree — bad input, not a compute failure.
    pub fn built<T>(&self, build: impl FnOnce() -> Result<T>) -> Result<T> {
        build().map_err(|e| match e {
            Error::Candle(c) => Error::bad_file(self.store.root(), format!("the weights do not match the config: {}", Error::candle_message(&c))),
            other => crate::config_check::in_file(self.store.config_origin(), other),
        })
    }

    /// Its per-item activation estimate for a model computing in `dtype` (`None` for a family
    /// whose items are not images).
    pub fn footprint(&self, dtype: DType) -> Option<footprint::Footprint> {
        Some(footprint::Footprint::new(self.family.footprint(&self.config)?, dtype))
    }

    /// Its image processor (`None` for a family whose inputs are not images).
    pub fn processor(&self) -> Result<Option<Arc<dyn ImageProcessor>>> {
        self.family.processor(&self.config, &self.path)
    }

    /// Its depth outputs, when it is a depth model.
    pub fn depth_outputs(&self) -> Option<DepthOutputs> {
        self.family.depth_outputs(&self.config)
    }

    /// What a GGUF copy of it carries besides its tensors ([`Family::gguf_extras`]).
    pub fn gguf_extras(&self, prompts: Option<&[String]>) -> Result<GgufExtras> {
        self.built(|| self.family.gguf_extras(&self.config, &self.store, &self.path, prompts))
    }

    /// The model as fine-tuning drives it, its trainable weights chosen in `vb`.
    pub fn trainee(&self, vb: &Vb) -> Result<Box<dyn Trainee>> {
        self.built(|| self.family.trainee(vb, &self.config))
    }
}

/// Loads the model stored in `store`, picking the family from its architecture name.
pub fn load(store: Arc<WeightStore>, device: &Device, dtype: DType) -> Result<Box<dyn Model>> {
    let root = store.root().to_path_buf();
    Checkpoint::from_store(store, &root)?.load(device, dtype)
}
