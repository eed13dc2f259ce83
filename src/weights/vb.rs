//! `Vb`: a prefix-scoped view of a weight store used by model constructors, whose paths mirror
//! the tensor names; it also bridges to Candle's `VarBuilder`.
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::store::WeightStore;
use super::trainable::Trainable;
use crate::error::Result;

/// A prefix-scoped handle on a weight store with the compute dtype and device.
#[derive(Clone)]
pub struct Vb {
    store: Arc<WeightStore>,
    prefix: String,
    dtype: DType,
    device: Device,
    trainable: Option<Arc<Trainable>>,
}

impl Vb {
    /// A root view over `store`, materialising tensors in `dtype` on `device`.
    pub fn new(store: Arc<WeightStore>, dtype: DType, device: Device) -> Self {
        Vb { store, prefix: String::new(), dtype, device, trainable: None }
    }

    /// The view one level down (`prefix.name`).
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Vb { prefix, ..self.clone() }
    }

    /// The full name of `name` under this prefix.
    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// The current prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The compute device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The underlying store.
    pub fn store(&self) -> &Arc<WeightStore> {
        &self.store
    }

    /// The same view loading the tensors `trainable` selects as f32 Vars (never quantized).
    pub fn with_trainable(&self, trainable: Arc<Trainable>) -> Self {
        Vb { trainable: Some(trainable), ..self.clone() }
    }

    /// Registers a just-loaded tensor as a Var when this view trains it.
    fn adopt(&self, name: &str, t: Tensor) -> Result<Tensor> {
        match &self.trainable {
            Some(tr) if tr.selects(name) => tr.adopt(name, t),
            _ => Ok(t),
        }
    }

    /// Whether the tensor `name` under this prefix loads as a trainable Var.
    pub(crate) fn is_trainable(&self, name: &str) -> bool {
        self.trainable.as_ref().is_some_and(|t| t.selects(&self.path(name)))
    }

    /// The same view with another compute dtype (e.g. f32 for numerically sensitive parts).
    pub(crate) fn with_dtype(&self, dtype: DType) -> Self {
        Vb { dtype, ..self.clone() }
    }

    /// Whether `name` exists under this prefix.
    pub fn contains(&self, name: &str) -> bool {
        self.store.contains(&self.path(name))
    }

    /// Loads `name` with the expected shape, in the compute dtype.
    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> Result<Tensor> {
        let shape: Shape = shape.into();
        let path = self.path(name);
        self.adopt(&path, self.store.tensor_shaped(&path, shape.dims(), self.dtype, &self.device)?)
    }

    /// Loads `name` as a quantized tensor when stored quantized.
    pub fn qtensor(&self, name: &str) -> Result<Option<QTensor>> {
        if self.is_trainable(name) {
            return Ok(None);
        }
        self.store.qtensor(&self.path(name), &self.device)
    }

    /// A Candle `VarBuilder` over the same store, prefix, dtype and device.
    pub fn candle(&self) -> VarBuilder<'static> {
        let backend: Box<dyn SimpleBackend> = Box::new(StoreBackend(self.store.clone()));
        let vb = VarBuilder::from_backend(backend, self.dtype, self.device.clone());
        if self.prefix.is_empty() {
            vb
        } else {
            vb.push_prefix(&self.prefix)
        }
    }
}

/// Adapts a `WeightStore` to Candle's `SimpleBackend`.
struct StoreBackend(Arc<WeightStore>);

impl SimpleBackend for StoreBackend {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.tensor_shaped(name, s.dims(), dtype, dev).map_err(candle_core::Error::wrap)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.tensor(name, dtype, dev).map_err(candle_core::Error::wrap)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains(name)
    }
}
