//! `edgerun quantize`: stream a checkpoint into a GGUF file, tensor by tensor, following a recipe.
pub mod gguf_writer;
pub mod recipe;

use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::fsutil::{register_input, AtomicFile};
use crate::weights::dtype::ggml_name;
use crate::weights::gguf;
use crate::weights::{MetaValue, WeightStore, CONFIG_METADATA_KEY};
pub use recipe::Recipe;

/// What happened to one tensor.
#[derive(Debug, Clone)]
pub struct TensorReport {
    /// Tensor name.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Stored type in the output.
    pub dtype: GgmlDType,
    /// Bytes in the input.
    pub bytes_in: usize,
    /// Bytes in the output.
    pub bytes_out: usize,
    /// ‖x − dequant(quant(x))‖ / ‖x‖ (0 for exact copies).
    pub rel_error: f64,
}

/// Totals of a quantize run.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Tensors written.
    pub tensors: usize,
    /// Input tensor bytes.
    pub bytes_in: usize,
    /// Output file size in bytes.
    pub bytes_out: u64,
    /// Largest per-tensor relative error.
    pub max_rel_error: f64,
}

fn rel_error(x: &Tensor, y: &Tensor) -> Result<f64> {
    let num = (x - y)?.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let den = x.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok(if den > 0.0 { (num / den).sqrt() } else { num.sqrt() })
}

fn encode(x: &Tensor, dtype: GgmlDType) -> Result<(Vec<u8>, Tensor)> {
    let flat = x.flatten_all()?;
    Ok(match dtype {
        GgmlDType::F32 => {
            let v = flat.to_vec1::<f32>()?;
            (v.iter().flat_map(|f| f.to_le_bytes()).collect(), x.clone())
        }
        GgmlDType::F16 => {
            let h = flat.to_dtype(DType::F16)?;
            let v = h.to_vec1::<half::f16>()?;
            (v.iter().flat_map(|f| f.to_le_bytes()).collect(), h.to_dtype(DType::F32)?.reshape(x.shape())?)
        }
        _ => {
            let q = QTensor::quantize(x, dtype)?;
            let back = q.dequantize(&Device::Cpu)?;
            (q.data()?.into_owned(), back)
        }
    })
}

/// Quantizes the model at `input` (directory, safetensors or GGUF) into `output` (GGUF), atomically.
/// Calls `report` once per tensor as it is written.
pub fn quantize(input: &Path, output: &Path, target: GgmlDType, recipe: &Recipe, report: impl FnMut(&TensorReport)) -> Result<Summary> {
    quantize_with(input, output, target, recipe, None, report)
}

/// As [`quantize`], with what the model's family adds to a GGUF copy ([`crate::models::GgufExtras`]:
/// SAM 3's tokenizer, or with `prompts` those prompts' features in place of its text encoder).
pub fn quantize_with(
    input: &Path,
    output: &Path,
    target: GgmlDType,
    recipe: &Recipe,
    prompts: Option<&[String]>,
    mut report: impl FnMut(&TensorReport),
) -> Result<Summary> {
    let store = std::sync::Arc::new(WeightStore::open(input)?);
    // The output may name an input through another path (`q/../q/x.gguf`): the writer refuses that.
    for f in store.files() {
        register_input(f);
    }
    let arch = crate::models::architecture(&store).unwrap_or_default();
    if !recipe.arch.is_empty() && !arch.is_empty() && recipe.arch != arch {
        return Err(Error::Config(format!("recipe is for `{}` but the model is `{arch}`", recipe.arch)));
    }
    let checkpoint = crate::models::family_of(&arch).map(|_| crate::models::Checkpoint::from_store(store.clone(), input));
    let extras = match (checkpoint, prompts) {
        (Some(ckpt), Some(_)) => ckpt?.gguf_extras(prompts)?,
        (None, Some(_)) => return Err(Error::Config(format!("`{arch}` models take no text prompts"))),
        (Some(Ok(ckpt)), None) => ckpt.gguf_extras(None)?,
        // A config that does not parse is copied as it is: loading the copy names it (as its metadata).
        (Some(Err(_)) | None, None) => crate::models::GgufExtras::default(),
    };
    let dropped = |name: &str| recipe.drops(name) || extras.drop.iter().any(|p| recipe::glob_match(p, name));
    let mut plan: Vec<(String, Vec<usize>, GgmlDType)> = store
        .entries()
        .values()
        .filter(|e| !dropped(&e.name))
        .map(|e| {
            // GGUF has no rank-0 tensors: scalars are stored as [1] (the loader accepts either).
            let shape = if e.shape.is_empty() { vec![1] } else { e.shape.clone() };
            (e.name.clone(), shape, recipe.choose(&e.name, &e.shape, target))
        })
        .collect();
    for (name, t) in &extras.tensors {
        if store.contains(name) {
            return Err(Error::Config(format!("the checkpoint already has a tensor `{name}`")));
        }
        plan.push((name.clone(), t.dims().to_vec(), GgmlDType::F32));
    }
    let planned = gguf_writer::plan(plan).ok_or_else(|| Error::Config("a tensor does not fit its planned type".into()))?;
    let mut metadata = vec![
        ("general.architecture".to_string(), MetaValue::String(arch.clone())),
        ("general.alignment".to_string(), MetaValue::U32(gguf::DEFAULT_ALIGNMENT as u32)),
        (CONFIG_METADATA_KEY.to_string(), MetaValue::String(store.config().to_string())),
        ("edgerun.quantize.type".to_string(), MetaValue::String(ggml_name(target).to_string())),
        ("edgerun.version".to_string(), MetaValue::String(env!("CARGO_PKG_VERSION").to_string())),
    ];
    if let Some(MetaValue::String(n)) = store.metadata().get("general.name") {
        metadata.push(("general.name".to_string(), MetaValue::String(n.clone())));
    }
    metadata.extend(extras.metadata.iter().cloned());
    let mut file = AtomicFile::create(output)?;
    let io = |e: std::io::Error| Error::io(output, e);
    let mut summary = Summary::default();
    {
        let mut w = gguf_writer::GgufWriter::new(BufWriter::new(file.file().map_err(io)?), &metadata, planned).map_err(io)?;
        while let Some(t) = w.next_tensor().cloned() {
            let (x, bytes_in) = match extras.tensors.iter().find(|(n, _)| *n == t.name) {
                Some((_, x)) => (x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?, 0),
                None => (store.tensor(&t.name, DType::F32, &Device::Cpu)?, store.entries()[&t.name].len),
            };
            let (bytes, back) = encode(&x, t.dtype).map_err(|e| match store.entries().get(&t.name) {
                Some(entry) => Error::bad_tensor(store.file_of(entry), &t.name, format!("cannot encode as {}: {e}", ggml_name(t.dtype))),
                None => Error::Config(format!("`{}`: cannot encode as {}: {e}", t.name, ggml_name(t.dtype))),
            })?;
            let r = TensorReport {
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype,
                bytes_in,
                bytes_out: bytes.len(),
                rel_error: rel_error(&x, &back)?,
            };
            w.write_tensor(&bytes).map_err(io)?;
            summary.tensors += 1;
            summary.bytes_in += r.bytes_in;
            summary.max_rel_error = summary.max_rel_error.max(r.rel_error);
            report(&r);
        }
        w.finish().map_err(io)?;
    }
    summary.bytes_out = file.file().and_then(|f| f.metadata()).map_err(io)?.len();
    file.commit()?;
    Ok(summary)
}

