//! Per-architecture quantization recipes: which tensors stay float and what to fall back to.
use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::weights::dtype::parse_ggml_name;

/// A parsed recipe (`quantize/<arch>.toml`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The architecture this recipe is written for (`model_type`).
    pub arch: String,
    /// Glob patterns of tensors that may be quantized (only rank-2 matrices ever are).
    #[serde(default = "default_quantize")]
    pub quantize: Vec<String>,
    /// Glob patterns of tensors kept in f32 whatever the target type.
    #[serde(default)]
    pub keep_f32: Vec<String>,
    /// Float type for tensors that are not quantized (`f16` or `f32`).
    #[serde(default = "default_float")]
    pub float: String,
    /// Glob patterns of tensors not written at all (parts of a checkpoint the model never reads).
    #[serde(default)]
    pub drop: Vec<String>,
    /// Replacement type when a matrix's inner dimension does not fit the target's block size
    /// (e.g. `q4k = "q8_0"`); tried repeatedly, ending at `float`.
    #[serde(default)]
    pub fallback: BTreeMap<String, String>,
}

fn default_quantize() -> Vec<String> {
    vec!["*.weight".into()]
}

fn default_float() -> String {
    "f16".into()
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            arch: String::new(),
            quantize: default_quantize(),
            keep_f32: vec!["*norm*".into(), "*.bias".into()],
            float: default_float(),
            drop: Vec::new(),
            fallback: [("q4k", "q8_0"), ("q5k", "q8_0"), ("q6k", "q8_0"), ("q2k", "q4_0"), ("q3k", "q4_0")]
                .into_iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }
}

/// Matches `name` against a glob with `*` wildcards (any run of characters, dots included).
pub(crate) fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

fn any_match(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| glob_match(p, name))
}

impl Recipe {
    /// The built-in recipe of `arch`'s family (`quantize/<family>.toml`), if edgerun knows `arch`.
    pub fn builtin(arch: &str) -> Result<Option<Self>> {
        let Some(text) = crate::models::family_of(arch).map(|f| f.recipe()) else { return Ok(None) };
        let mut r: Recipe = toml::from_str(text).map_err(|e| Error::Config(format!("built-in recipe for {arch}: {e}")))?;
        // one file may serve a family of architectures (DA3): it applies to the one it is registered for
        r.arch = arch.to_string();
        r.validate().map_err(Error::Config)?;
        Ok(Some(r))
    }

    /// Reads and validates a recipe file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::fsutil::read_input_text(path, crate::fsutil::MAX_TEXT_INPUT)?;
        let r: Recipe = toml::from_str(&text).map_err(|e| Error::bad_file(path, e.to_string()))?;
        r.validate().map_err(|m| Error::bad_file(path, m))?;
        Ok(r)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        self.float_type()?;
        for (k, v) in &self.fallback {
            parse_ggml_name(k).ok_or_else(|| format!("unknown type `{k}` in [fallback]"))?;
            parse_ggml_name(v).ok_or_else(|| format!("unknown type `{v}` in [fallback]"))?;
        }
        Ok(())
    }

    fn float_type(&self) -> std::result::Result<GgmlDType, String> {
        match self.float.as_str() {
            "f16" => Ok(GgmlDType::F16),
            "f32" => Ok(GgmlDType::F32),
            other => Err(format!("`float` must be f16 or f32, not `{other}`")),
        }
    }

    /// Whether a tensor named `name` is left out of the output.
    pub fn drops(&self, name: &str) -> bool {
        any_match(&self.drop, name)
    }

    /// Chooses the stored type of a tensor named `name` with `shape` when quantizing to `target`.
    pub fn choose(&self, name: &str, shape: &[usize], target: GgmlDType) -> GgmlDType {
        let float = self.float_type().unwrap_or(GgmlDType::F16);
        if any_match(&self.keep_f32, name) || shape.len() < 2 {
            return GgmlDType::F32;
        }
        if matches!(target, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            return target;
        }
        if shape.len() != 2 || !any_match(&self.quantize, name) {
            return float;
        }
        let inner = shape[1];
        let mut t = target;
        for _ in 0..8 {
            if inner.is_multiple_of(t.block_size()) {
                return t;
            }
            match self.fallback.get(crate::weights::dtype::ggml_name(t)).and_then(|n| parse_ggml_name(n)) {
                Some(next) => t = next,
                None => break,
            }
        }
        float
    }
}
