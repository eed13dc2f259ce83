//! The memory-mapped weight store.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;

use super::dtype::StoredDType;
use super::entry::TensorEntry;
use super::gguf::{self, MetaValue};
use super::limits::Limits;
use super::remap::{Alias, Remap};
use super::safetensors;
use crate::error::{Error, Result};

/// The GGUF metadata key that carries the model's `config.json`, so a `.gguf` alone is a model.
pub const CONFIG_METADATA_KEY: &str = "edgerun.config";

/// Which on-disk layout a store was opened from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One or more safetensors files (sharded via `model.safetensors.index.json`).
    Safetensors,
    /// A single GGUF file.
    Gguf,
}

struct Mapped {
    path: PathBuf,
    map: Mmap,
}

/// Validated, memory-mapped access to a model's tensors, config and metadata.
pub struct WeightStore {
    root: PathBuf,
    format: Format,
    files: Vec<Mapped>,
    tensors: BTreeMap<String, TensorEntry>,
    metadata: BTreeMap<String, MetaValue>,
    config: serde_json::Value,
    config_origin: String,
    remaps: Vec<Remap>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightStore({}, {:?}, {} tensors)", self.root.display(), self.format, self.tensors.len())
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    crate::fsutil::check_input_file(path)?;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len == 0 {
        return Err(Error::bad_file(path, "file is empty"));
    }
    // SAFETY: the mapping is read-only; edgerun never writes to files it has mapped. Another process
    // truncating the file underneath is outside what any mmap-based loader can guard against.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

fn read_config(path: &Path) -> Result<serde_json::Value> {
    let text = crate::fsutil::read_input(path, crate::fsutil::MAX_TEXT_INPUT)?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| Error::bad_file(path, format!("invalid JSON: {e}")))?;
    if !v.is_object() {
        return Err(Error::bad_file(path, "config must be a JSON object"));
    }
    Ok(v)
}

impl WeightStore {
    /// Opens a model directory, a `.safetensors` file or a `.gguf` file with default limits.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with_limits(path, &Limits::default())
    }

    /// Opens with explicit header limits.
    pub fn open_with_limits(path: impl AsRef<Path>, limits: &Limits) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Self::open_dir(path, limits);
        }
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
            let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
            if n < 4 {
                magic = [0; 4];
            }
        }
        if &magic == gguf::MAGIC || path.extension().is_some_and(|e| e == "gguf") {
            Self::open_gguf(path, limits)
        } else {
            let config_path = path.with_file_name("config.json");
            let config = if config_path.exists() { read_config(&config_path)? } else { serde_json::json!({}) };
            Self::open_safetensors(path, vec![path.to_path_buf()], config, &config_path, limits)
        }
    }

    fn open_dir(dir: &Path, limits: &Limits) -> Result<Self> {
        let config_path = dir.join("config.json");
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        if index.exists() || single.exists() {
            let config = if config_path.exists() {
                read_config(&config_path)?
            } else {
                return Err(Error::bad_file(dir, "model directory has no config.json"));
            };
            if index.exists() {
                let (shards, weight_map) = shard_files(dir, &index)?;
                let store = Self::open_safetensors(dir, shards, config, &config_path, limits)?;
                for (tensor, file) in weight_map {
                    let entry = store.tensors.get(&tensor).ok_or_else(|| Error::bad_tensor(&index, &tensor, format!("listed in weight_map but not found in {file}")))?;
                    if store.files[entry.file].path.file_name().is_none_or(|n| n != file.as_str()) {
                        return Err(Error::bad_tensor(&index, &tensor, format!("weight_map says {file}, but it is stored in {}", store.files[entry.file].path.display())));
                    }
                }
                return Ok(store);
            }
            return Self::open_safetensors(dir, vec![single], config, &config_path, limits);
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        match ggufs.as_slice() {
            [one] => Self::open_gguf(one, limits),
            [] => Err(Error::bad_file(dir, "no model.safetensors, model.safetensors.index.json or .gguf file in this directory")),
            _ => Err(Error::bad_file(dir, "several .gguf files in this directory; name one")),
        }
    }

    fn open_safetensors(root: &Path, paths: Vec<PathBuf>, config: serde_json::Value, config_path: &Path, limits: &Limits) -> Result<Self> {
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (i, p) in paths.into_iter().enumerate() {
            let map = map_file(&p)?;
            let header = safetensors::parse(&map, i, limits).map_err(|m| Error::bad_file(&p, m))?;
            for (k, v) in header.metadata {
                metadata.insert(k, MetaValue::String(v));
            }
            for t in header.tensors {
                if tensors.contains_key(&t.name) {
                    return Err(Error::bad_tensor(&p, &t.name, "appears in more than one shard"));
                }
                tensors.insert(t.name.clone(), t);
            }
            files.push(Mapped { path: p, map });
        }
        let config_origin = config_path.display().to_string();
        Ok(WeightStore { root: root.to_path_buf(), format: Format::Safetensors, files, tensors, metadata, config, config_origin, remaps: vec![] })
    }

    fn open_gguf(path: &Path, limits: &Limits) -> Result<Self> {
        let map = map_file(path)?;
        let header = gguf::parse(&map, 0, limits).map_err(|m| Error::bad_file(path, m))?;
        let config = match header.metadata.get(CONFIG_METADATA_KEY) {
            Some(MetaValue::String(s)) => {
                let v: serde_json::Value = serde_json::from_str(s)
                    .map_err(|e| Error::bad_file(path, format!("metadata `{CONFIG_METADATA_KEY}` is not valid JSON: {e}")))?;
                if !v.is_object() {
                    return Err(Error::bad_file(path, format!("metadata `{CONFIG_METADATA_KEY}` must be a JSON object")));
                }
                v
            }
            Some(_) => return Err(Error::bad_file(path, format!("metadata `{CONFIG_METADATA_KEY}` must be a string"))),
            None => serde_json::json!({}),
        };
        let tensors = header.tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
        Ok(WeightStore {
            root: path.to_path_buf(),
            format: Format::Gguf,
            files: vec![Mapped { path: path.to_path_buf(), map }],
            tensors,
            metadata: header.metadata,
            config,
            config_origin: format!("{} (metadata {CONFIG_METADATA_KEY})", path.display()),
            remaps: vec![],
        })
    }

    /// Adds a name-remapping rule, tried in order when a requested name is not stored as is.
    pub fn with_remap(mut self, remap: Remap) -> Self {
        self.remaps.push(remap);
        self
    }

    /// The directory or file the store was opened from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The on-disk format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The paths of the mapped files (shards).
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// The model config (`config.json`, or the GGUF `edgerun.config` metadata; `{}` when absent).
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Where the config came from, for error messages: `…/config.json` or `….gguf (metadata edgerun.config)`.
    pub fn config_origin(&self) -> &str {
        &self.config_origin
    }

    /// The architecture the files declare: the config's `model_type`, else GGUF
    /// `general.architecture`. `models::architecture` also recognises configs that name a model
    /// without declaring a type.
    pub fn architecture(&self) -> Option<String> {
        if let Some(s) = self.config.get("model_type").and_then(|v| v.as_str()) {
            return Some(s.to_string());
        }
        self.metadata.get("general.architecture").and_then(|v| v.as_str()).map(str::to_string)
    }

    /// File-level metadata (GGUF key/values, or safetensors `__metadata__` strings).
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// Every stored tensor, by name.
    pub fn entries(&self) -> &BTreeMap<String, TensorEntry> {
        &self.tensors
    }

    /// Whether `name` can be loaded (directly or through a remap).
    pub fn contains(&self, name: &str) -> bool {
        self.resolve(name).is_some()
    }

    fn resolve(&self, name: &str) -> Option<(&TensorEntry, Option<(usize, usize)>)> {
        if let Some(e) = self.tensors.get(name) {
            return Some((e, None));
        }
        self.remaps.iter().find_map(|r| {
            let Alias { name, chunk } = r(name)?;
            self.tensors.get(&name).map(|e| (e, chunk))
        })
    }

    /// The path of the file that holds `entry`.
    pub fn file_of(&self, entry: &TensorEntry) -> &Path {
        &self.files[entry.file].path
    }

    /// The raw stored bytes of `entry`.
    pub fn bytes(&self, entry: &TensorEntry) -> &[u8] {
        &self.files[entry.file].map[entry.start..entry.start + entry.len]
    }

    fn err(&self, name: &str, msg: impl Into<String>) -> Error {
        Error::bad_tensor(&self.root, name, msg)
    }

    /// The stored dtype and shape of `name` (after remapping and chunking).
    pub fn info(&self, name: &str) -> Option<(StoredDType, Vec<usize>)> {
        let (e, chunk) = self.resolve(name)?;
        let mut shape = e.shape.clone();
        if let (Some((_, n)), Some(d0)) = (chunk, shape.first_mut()) {
            *d0 /= n;
        }
        Some((e.dtype, shape))
    }

    /// Loads `name` as a dense tensor in `dtype` on `device`, dequantizing if it is stored quantized.
    pub fn tensor(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let (entry, chunk) = self.resolve(name).ok_or_else(|| self.err(name, "not found"))?;
        let path = self.file_of(entry);
        let t = match entry.dtype.plain() {
            Some(stored) => Tensor::from_raw_buffer(self.bytes(entry), stored, &entry.shape, device)
                .map_err(|e| Error::bad_tensor(path, &entry.name, e.to_string()))?,
            None => self.qtensor_of(entry, &Device::Cpu)?.dequantize(device)?,
        };
        let t = match chunk {
            None => t,
            Some((i, n)) => {
                let d0 = entry.shape.first().copied().unwrap_or(1);
                if n == 0 || i >= n || d0 % n != 0 {
                    return Err(Error::bad_tensor(path, &entry.name, format!("cannot split dimension {d0} into {n} parts")));
                }
                t.narrow(0, i * d0 / n, d0 / n)?
            }
        };
        Ok(if t.dtype() == dtype { t } else { t.to_dtype(dtype)? })
    }

    /// Loads `name` checking its shape.
    pub fn tensor_shaped(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let t = self.tensor(name, dtype, device)?;
        if shape.is_empty() && t.dims() == [1] {
            return Ok(t.reshape(())?);
        }
        if t.dims() != shape {
            return Err(self.err(name, format!("expected shape {shape:?}, found {:?}", t.dims())));
        }
        Ok(t)
    }

    /// Loads `name` as a block-quantized tensor when it is stored quantized (None for plain types).
    pub fn qtensor(&self, name: &str, device: &Device) -> Result<Option<QTensor>> {
        let (entry, chunk) = self.resolve(name).ok_or_else(|| self.err(name, "not found"))?;
        if !entry.dtype.is_quantized() || chunk.is_some() {
            return Ok(None);
        }
        self.qtensor_of(entry, device).map(Some)
    }

    fn qtensor_of(&self, entry: &TensorEntry, device: &Device) -> Result<QTensor> {
        let StoredDType::Ggml(g) = entry.dtype else {
            return Err(Error::bad_tensor(self.file_of(entry), &entry.name, "not a GGML tensor"));
        };
        if matches!(g, GgmlDType::Q8_1 | GgmlDType::Q8K) {
            return Err(Error::bad_tensor(self.file_of(entry), &entry.name, format!("{} cannot be loaded for compute", entry.dtype.name())));
        }
        qtensor_from_ggml(g, self.bytes(entry), entry.shape.clone(), device)
            .map_err(|e| Error::bad_tensor(self.file_of(entry), &entry.name, e.to_string()))
    }

    /// Total stored bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.len).sum()
    }
}

/// The shard files of a sharded checkpoint and its (tensor → shard file) map.
fn shard_files(dir: &Path, index: &Path) -> Result<(Vec<PathBuf>, Vec<(String, String)>)> {
    let v = read_config(index)?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::bad_file(index, "no `weight_map` object"))?;
    let mut names: Vec<String> = Vec::new();
    let mut weight_map = Vec::with_capacity(map.len());
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| Error::bad_file(index, format!("shard of `{tensor}` is not a string")))?;
        let ok = !file.is_empty() && !file.contains(['/', '\\']) && file != "." && file != "..";
        if !ok {
            return Err(Error::bad_file(index, format!("shard name `{file}` must be a plain file name")));
        }
        if !names.iter().any(|n| n == file) {
            names.push(file.to_string());
        }
        weight_map.push((tensor.clone(), file.to_string()));
    }
    if names.is_empty() {
        return Err(Error::bad_file(index, "`weight_map` is empty"));
    }
    names.sort();
    Ok((names.into_iter().map(|n| dir.join(n)).collect(), weight_map))
}
