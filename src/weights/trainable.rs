//! Loading chosen tensors as trainable `Var`s: the model structs hold the Vars' tensors, so an
//! optimiser's in-place update reaches the very weights the forward pass reads (no second model).
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};

/// Which tensor names load as `Var`s (f32; f64 stays f64 for gradient checks), and the Vars loaded so far (in load order).
pub struct Trainable {
    select: Box<dyn Fn(&str) -> bool + Send + Sync>,
    vars: Mutex<Vec<(String, Var)>>,
}

impl Trainable {
    /// A selection by full tensor name.
    pub fn new(select: impl Fn(&str) -> bool + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Trainable { select: Box::new(select), vars: Mutex::new(Vec::new()) })
    }

    /// Whether `name` is trainable.
    pub fn selects(&self, name: &str) -> bool {
        (self.select)(name)
    }

    /// Turns the loaded `tensor` named `name` into a Var (once per name) and returns its tensor.
    pub(crate) fn adopt(&self, name: &str, tensor: Tensor) -> Result<Tensor> {
        let mut vars = self.vars.lock().map_err(|_| Error::Config("trainable parameter registry poisoned".into()))?;
        if let Some((_, v)) = vars.iter().find(|(n, _)| n == name) {
            return Ok(v.as_tensor().clone());
        }
        let dtype = if tensor.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let var = Var::from_tensor(&tensor.to_dtype(dtype)?)?;
        let t = var.as_tensor().clone();
        vars.push((name.to_string(), var));
        Ok(t)
    }

    /// The Vars loaded so far, sorted by name.
    pub fn vars(&self) -> Vec<(String, Var)> {
        let mut v = self.vars.lock().map(|v| v.clone()).unwrap_or_default();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}
