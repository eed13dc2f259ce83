//! Text prompts: reading a prompt list, and the prompt features that `edgerun quantize --prompts`
//! computes once and stores in a GGUF in place of the text encoder (so a device with a fixed class
//! list carries and runs only the image side).
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::config::Config;
use super::text::TextEncoder;
use super::tokenizer::{BpeVocabulary, ClipTokenizer};
use super::{detector_root, PromptFeatures};
use crate::error::{Error, Result};
use crate::models::GgufExtras;
use crate::weights::{MetaValue, Vb, WeightStore};

/// The most prompts one list may hold.
pub const MAX_PROMPTS: usize = 4096;
/// The stored features `[P, L, D]`.
pub(crate) const FEATURES: &str = "edgerun.prompt_features";
/// The stored masks `[P, L]`.
pub(crate) const MASK: &str = "edgerun.prompt_mask";
/// The stored prompts' texts (metadata, an array of strings in row order).
pub(crate) const NAMES: &str = "edgerun.prompts";

/// Parses a prompt list: one prompt per line, or several separated by commas (the synonyms of a
/// class file); blank lines are skipped, repeats kept once, each prompt trimmed.
pub fn parse_prompts(text: &str) -> std::result::Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        for p in line.split(',') {
            let p = p.trim();
            if p.is_empty() {
                return Err(format!("line {}: an empty prompt", i + 1));
            }
            if !out.iter().any(|q| q == p) {
                out.push(p.to_string());
            }
        }
        if out.len() > MAX_PROMPTS {
            return Err(format!("more than {MAX_PROMPTS} prompts"));
        }
    }
    if out.is_empty() {
        return Err("no prompts".into());
    }
    Ok(out)
}

/// Reads a prompt list ([`parse_prompts`]) from a UTF-8 file; errors name it.
pub fn read_prompt_file(path: &Path) -> Result<Vec<String>> {
    let text = crate::fsutil::read_input_text(path, crate::fsutil::MAX_TEXT_INPUT)?;
    parse_prompts(&text).map_err(|m| Error::bad_file(path, m))
}

/// The prompts whose features `store` holds (none for a file without them), in row order.
pub fn stored_prompt_names(store: &WeightStore) -> Result<Vec<String>> {
    if !store.contains(FEATURES) {
        return Ok(Vec::new());
    }
    let bad = |m: String| Error::bad_file(store.root(), m);
    let names: Vec<String> = match store.metadata().get(NAMES) {
        Some(MetaValue::Array(a)) => a.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad(format!("`{NAMES}` holds a non-string")))).collect::<Result<_>>()?,
        _ => return Err(bad(format!("`{FEATURES}` without the prompts' names (`{NAMES}`)"))),
    };
    if names.is_empty() || names.len() > MAX_PROMPTS {
        return Err(bad(format!("{} stored prompts; 1 to {MAX_PROMPTS} are read", names.len())));
    }
    Ok(names)
}

/// Prompt features read back from a GGUF.
pub(crate) struct StoredPrompts {
    pub(crate) names: Vec<String>,
    pub(crate) features: PromptFeatures,
}

impl StoredPrompts {
    /// The stored prompts of `store`, checked against the model (`context` tokens of width `width`).
    pub(crate) fn load(vb: &Vb, context: usize, width: usize) -> Result<Option<Self>> {
        let store = vb.store();
        if !store.contains(FEATURES) {
            return Ok(None);
        }
        let bad = |m: String| Error::bad_file(store.root(), m);
        let names = stored_prompt_names(store)?;
        let p = names.len();
        let features = vb.get((p, context, width), FEATURES)?;
        let mask = vb.get((p, context), MASK)?.to_dtype(DType::F32)?;
        let rows = mask.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        if let Some(i) = rows.iter().position(|r| r.iter().any(|&m| m != 0.0 && m != 1.0) || r.first() != Some(&1.0)) {
            return Err(bad(format!("`{MASK}` row {i} is not a mask of 0s and 1s starting with a token")));
        }
        Ok(Some(StoredPrompts { names, features: PromptFeatures { features, mask } }))
    }

    /// The row of `prompt`, if stored.
    pub(crate) fn row(&self, prompt: &str) -> Option<usize> {
        self.names.iter().position(|n| n == prompt)
    }
}

/// The tokenizer of a checkpoint: its GGUF copy, else the files beside it.
pub(crate) fn tokenizer(store: &WeightStore, model_path: &Path, config: &Config) -> Result<Option<ClipTokenizer>> {
    let stored = BpeVocabulary::from_metadata(store.metadata()).map_err(|m| Error::bad_file(store.root(), m))?;
    let vocab = match stored {
        Some(v) => Some(v),
        None => BpeVocabulary::beside(model_path)?,
    };
    let t = &config.text_config;
    vocab.map(|v| ClipTokenizer::new(&v, t.max_position_embeddings, t.vocab_size)).transpose()
}

/// SAM 3's GGUF extras: its tokenizer; or, with `prompts`, their features (from the text encoder in
/// f32 on the CPU) with the prompts' texts, and the text encoder left out.
pub(crate) fn gguf_extras(config: &Config, store: &Arc<WeightStore>, model_path: &Path, prompts: Option<&[String]>) -> Result<GgufExtras> {
    let tok = tokenizer(store, model_path, config)?;
    let Some(prompts) = prompts else {
        let metadata = match BpeVocabulary::from_metadata(store.metadata()).map_err(|m| Error::bad_file(store.root(), m))? {
            Some(v) => v.metadata(),
            None => BpeVocabulary::beside(model_path)?.map(|v| v.metadata()).unwrap_or_default(),
        };
        return Ok(GgufExtras { metadata, ..Default::default() });
    };
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(Error::Input(format!("{} prompts; 1 to {MAX_PROMPTS} can be stored", prompts.len())));
    }
    let tok = tok.ok_or_else(|| Error::bad_file(model_path, "no tokenizer (tokenizer.json, or vocab.json and merges.txt, beside the model) to tokenize the prompts"))?;
    let vb = detector_root(&Vb::new(store.clone(), DType::F32, Device::Cpu));
    if !vb.contains("text_encoder.text_model.embeddings.token_embedding.weight") {
        return Err(Error::bad_file(model_path, "no text encoder to compute the prompts' features with"));
    }
    let text = TextEncoder::load(&vb, &config.text_config, config.width())?;
    let (ids, mask) = tok.encode(prompts)?;
    let shape = (prompts.len(), tok.context());
    let mask = Tensor::from_vec(mask, shape, &Device::Cpu)?;
    let features = text.forward(&Tensor::from_vec(ids, shape, &Device::Cpu)?, &mask)?;
    let prefix = if vb.prefix().is_empty() { String::new() } else { format!("{}.", vb.prefix()) };
    Ok(GgufExtras {
        metadata: vec![(NAMES.into(), MetaValue::Array(prompts.iter().map(|p| MetaValue::String(p.clone())).collect()))],
        tensors: vec![(FEATURES.into(), features), (MASK.into(), mask)],
        drop: vec![format!("{prefix}text_encoder.*"), format!("{prefix}text_projection.*")],
    })
}
