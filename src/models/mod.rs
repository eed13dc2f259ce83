//! Model families and the registry that picks one from a checkpoint's architecture name.
pub mod backbones;
pub mod chmv2;
pub mod da3;
pub mod depth_anything;
pub mod footprint;
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

/// The architecture of a checkpoint: the config's `model_type`, else the one a known `model_name`
/// implies (Depth Anything 3 hub configs: `{"model_name": "da3-small"}`), else GGUF
/// `general.architecture`. The registry, not the weight store, knows the model families.
pub fn architecture(store: &crate::weights::WeightStore) -> Option<String> {
    let config = store.config();
    if let Some(s) = config.get("model_type").and_then(|v| v.as_str()) {
        return Some(s.to_string());
    }
    if let Some(a) = config.get("model_name").and_then(|v| v.as_str()).and_then(da3::architecture_for_model_name) {
        return Some(a.to_string());
    }
    store.architecture()
}

/// Whether any matrix in `store` is stored as Q8_0 (a file `edgerun quantize` wrote with that type).
fn holds_q8_0(store: &crate::weights::WeightStore) -> bool {
    use crate::weights::StoredDType;
    store.entries().values().any(|e| e.dtype == StoredDType::Ggml(candle_core::quantized::GgmlDType::Q8_0))
}

/// How L-GATr holds its folded maps for the matrices in `store`: rounded to Q8_0 for a file with
/// Q8_0 matrices, in f16 for one whose matrices are all f16 (norm scales aside, which `edgerun
/// quantize` keeps in f32), else as computed.
fn lgatr_maps(store: &crate::weights::WeightStore) -> lgatr::MapStorage {
    if holds_q8_0(store) {
        return lgatr::MapStorage::Int8;
    }
    let mut matrices = store.entries().values().filter(|e| e.shape.len() >= 2 && !e.name.contains("norm")).peekable();
    if matrices.peek().is_some() && matrices.all(|e| e.dtype.plain() == Some(candle_core::DType::F16)) {
        lgatr::MapStorage::Half
    } else {
        lgatr::MapStorage::Plain
    }
}

/// Loads the model stored in `store`, picking the family from its architecture name.
pub fn load(store: std::sync::Arc<crate::weights::WeightStore>, device: &candle_core::Device, dtype: candle_core::DType) -> Result<Box<dyn Model>> {
    use crate::error::Error;
    let arch = architecture(&store).ok_or_else(|| {
        Error::bad_file(store.root(), "no architecture: config.json has no `model_type` (and no GGUF general.architecture)")
    })?;
    let vb = crate::weights::Vb::new(store.clone(), dtype, device.clone());
    let config = store.config().clone();
    let build = || -> Result<Box<dyn Model>> {
        Ok(match arch.as_str() {
            "lgatr" | "lgatr_slim" => lgatr::load(vb.candle(), &config, lgatr_maps(&store))?,
            "chmv2" => Box::new(chmv2::Chmv2::load(&vb, &config)?),
            "da3" | "da3_mono" | "da3_metric" | "da3_nested" => Box::new(da3::Da3::load(&vb, &config)?),
            "depth_anything" => Box::new(depth_anything::DepthAnything::load(&vb, &config)?),
            "segformer" => Box::new(segformer::SegformerForSemanticSegmentation::load(&vb, &config)?),
            other => return Err(Error::Config(format!("unknown architecture `{other}` (supported: {})", ARCHITECTURES.join(", ")))),
        })
    };
    // Building a model only reads tensors: a Candle error here (a shape the config did not lead to
    // expect) means the weights and the config disagree — bad input, not a compute failure.
    build().map_err(|e| match e {
        Error::Candle(c) => Error::bad_file(store.root(), format!("the weights do not match the config: {}", Error::candle_message(&c))),
        other => crate::config_check::in_file(store.config_origin(), other),
    })
}
pub mod lgatr;
