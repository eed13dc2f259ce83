//! Model families and the registry that picks one from a checkpoint's architecture name.
pub mod chmv2;
pub mod da3;
pub mod depth_anything;
pub mod segformer;

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::error::Result;

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
}

/// The input tensor `name`, or an error naming it.
pub fn required<'a>(inputs: &'a NamedTensors, name: &str) -> Result<&'a Tensor> {
    inputs.get(name).ok_or_else(|| crate::error::Error::Input(format!("missing input `{name}`")))
}

/// The architectures `load` knows, as `model_type` strings.
pub const ARCHITECTURES: &[&str] = &["chmv2", "da3", "da3_metric", "da3_mono", "depth_anything", "lgatr", "lgatr_slim", "segformer", ];

/// Loads the model stored in `store`, picking the family from its architecture name.
pub fn load(store: std::sync::Arc<crate::weights::WeightStore>, device: &candle_core::Device, dtype: candle_core::DType) -> Result<Box<dyn Model>> {
    use crate::error::Error;
    let arch = store.architecture().ok_or_else(|| {
        Error::bad_file(store.root(), "no architecture: config.json has no `model_type` (and no GGUF general.architecture)")
    })?;
    let vb = crate::weights::Vb::new(store.clone(), dtype, device.clone());
    let config = store.config().clone();
    let build = || -> Result<Box<dyn Model>> {
        Ok(match arch.as_str() {
            "lgatr" | "lgatr_slim" => lgatr::load(vb.candle(), &config)?,
            "chmv2" => Box::new(chmv2::Chmv2::load(&vb, &config)?),
            "da3" | "da3_mono" | "da3_metric" | "da3_nested" => Box::new(da3::Da3::load(&vb, &config)?),
            "depth_anything" => Box::new(depth_anything::DepthAnything::load(&vb, &config)?),
            "segformer" => Box::new(segformer::SegformerForSemanticSegmentation::load(&vb, &config)?),
            other => return Err(Error::Config(format!("unknown architecture `{other}` (supported: {})", ARCHITECTURES.join(", ")))),
        })
    };
    build().map_err(|e| crate::config_check::in_file(store.config_origin(), e))
}
pub mod lgatr;
