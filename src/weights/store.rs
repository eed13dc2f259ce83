//! The memory-mapped weight store.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
#[cfg(unix)]
use candle_core::quantized::{GgmlType, QStorage};
#[cfg(unix)]
use candle_core::WithDType;
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
    /// Parsed for the header; on unix dense tensors are read from `file` instead (see `Mapped::read`),
    /// and quantized CPU weights are served from it (see `WeightStore::qtensor`).
    map: Arc<Mmap>,
    #[cfg(unix)]
    file: File,
}

impl Mapped {
    /// Drops this process's resident pages of the whole map (see `WeightStore::release_pages`).
    fn release(&self) {
        #[cfg(unix)]
        // SAFETY: `map` is a read-only shared file mapping (`Mmap::map`: PROT_READ, MAP_SHARED), so
        // it holds no private or modified pages: MADV_DONTNEED only removes this process's page-table
        // entries, and a later access faults the same file page back in from the page cache. Any
        // borrow of the bytes (a mapped quantized weight) therefore still reads the file's contents.
        let _ = unsafe { self.map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
    }

    /// Reads `piece` into a new `Vec<T>` of `piece.len / size_of::<T>()` elements (rounded up) with
    /// `pread`, so the bytes are held once (in the vector) and the file's page cache is never mapped
    /// into this process.
    ///
    /// # Safety
    /// `T` must be plain data: no padding bytes, and every bit pattern a valid `T` (number types,
    /// and GGML blocks made of f16 and integer fields).
    #[cfg(unix)]
    unsafe fn read<T: Clone>(&self, piece: &Piece, zero: T) -> std::io::Result<Vec<T>> {
        use std::os::unix::fs::FileExt;
        let size = std::mem::size_of::<T>().max(1);
        let n = piece.len.div_ceil(size);
        let mut v = vec![zero; n];
        // SAFETY: `v` holds `n * size >= piece.len` initialised bytes without padding; every bit
        // pattern is a valid `T` (the caller's promise), so overwriting them as bytes leaves valid `T`s.
        let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), n * size) };
        self.file.read_exact_at(&mut bytes[..piece.len], piece.start as u64)?;
        Ok(v)
    }

    /// Reads a plain-typed `piece` (see `read`).
    #[cfg(unix)]
    fn read_plain<T: WithDType>(&self, piece: &Piece) -> std::io::Result<Vec<T>> {
        // SAFETY: every `WithDType` this store reads (`u8`, `u32`, `i16`, `i32`, `i64`, `f16`,
        // `bf16`, `f32`, `f64`) is a number type: no padding, every bit pattern valid.
        unsafe { self.read(piece, T::zero()) }
    }

    /// The storage of a CPU `QTensor` holding `piece` as GGML blocks of type `T`: with `mapped`,
    /// the blocks in the map itself; otherwise read straight into the vector the tensor keeps.
    /// None when `T` is not laid out as GGUF stores it.
    #[cfg(unix)]
    fn blocks<T: GgmlType + Send + Sync + 'static>(&self, piece: &Piece, mapped: bool) -> std::io::Result<Option<QStorage>> {
        if mapped {
            let blocks = super::mapped::MappedBlocks::<T>::new(self.map.clone(), piece.start, piece.len);
            return Ok(blocks.map(|b| QStorage::Cpu(Box::new(b))));
        }
        if std::mem::size_of::<T>() != T::DTYPE.type_size() || !piece.len.is_multiple_of(T::DTYPE.type_size()) {
            return Ok(None);
        }
        // SAFETY: Candle's blocks are `repr(C)` structs of f16 and integer fields whose size equals
        // the GGML block size (checked above), so they have no padding and any bytes are valid.
        let blocks = unsafe { self.read(piece, T::zeros())? };
        Ok(Some(QStorage::Cpu(Box::new(blocks))))
    }
}

/// The bytes of a tensor (or of one dim-0 chunk of it) and the shape they hold.
struct Piece {
    start: usize,
    len: usize,
    shape: Vec<usize>,
    /// `(offset, len)` along dim 0 still to take after loading, when the chunk is no whole run of
    /// quantization blocks.
    narrow: Option<(usize, usize)>,
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

fn map_file(path: &Path) -> Result<Mapped> {
    let file = crate::fsutil::open_input(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len == 0 {
        return Err(Error::bad_file(path, "file is empty"));
    }
    // SAFETY: the mapping is read-only; edgerun never writes to files it has mapped. Another process
    // truncating the file underneath is outside what any mmap-based loader can guard against.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    Ok(Mapped {
        path: path.to_path_buf(),
        map: Arc::new(map),
        #[cfg(unix)]
        file,
    })
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
    pub(crate) fn open_with_limits(path: impl AsRef<Path>, limits: &Limits) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Self::open_dir(path, limits);
        }
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let mut f = crate::fsutil::open_input(path)?;
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
            let mapped = map_file(&p)?;
            let header = safetensors::parse(&mapped.map, i, limits).map_err(|m| Error::bad_file(&p, m))?;
            for (k, v) in header.metadata {
                metadata.insert(k, MetaValue::String(v));
            }
            for t in header.tensors {
                if tensors.contains_key(&t.name) {
                    return Err(Error::bad_tensor(&p, &t.name, "appears in more than one shard"));
                }
                tensors.insert(t.name.clone(), t);
            }
            mapped.release();
            files.push(mapped);
        }
        let config_origin = config_path.display().to_string();
        Ok(WeightStore { root: root.to_path_buf(), format: Format::Safetensors, files, tensors, metadata, config, config_origin, remaps: vec![] })
    }

    fn open_gguf(path: &Path, limits: &Limits) -> Result<Self> {
        let mapped = map_file(path)?;
        let header = gguf::parse(&mapped.map, 0, limits).map_err(|m| Error::bad_file(path, m))?;
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
        mapped.release();
        Ok(WeightStore {
            root: path.to_path_buf(),
            format: Format::Gguf,
            files: vec![mapped],
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
    pub(crate) fn config_origin(&self) -> &str {
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

    /// The raw stored bytes of `entry`, through the map: touching them maps their pages into this
    /// process until the store is dropped (`tensor` and `qtensor` read without mapping on unix).
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

    /// The bytes and shape of `entry`, or of part `i` of `n` equal parts along dimension 0.
    fn piece(&self, entry: &TensorEntry, chunk: Option<(usize, usize)>) -> Result<Piece> {
        let Some((i, n)) = chunk else {
            return Ok(Piece { start: entry.start, len: entry.len, shape: entry.shape.clone(), narrow: None });
        };
        let d0 = entry.shape.first().copied().unwrap_or(1);
        if n == 0 || i >= n || d0 % n != 0 {
            return Err(Error::bad_tensor(self.file_of(entry), &entry.name, format!("cannot split dimension {d0} into {n} parts")));
        }
        // Rows are stored one after another, so a dim-0 part is one contiguous byte range, unless a
        // block-quantized part would split a block: then the whole tensor is read and narrowed.
        let Some(len) = entry.dtype.bytes_for(entry.numel() / n).filter(|&l| l * n == entry.len) else {
            let narrow = Some((i * d0 / n, d0 / n));
            return Ok(Piece { start: entry.start, len: entry.len, shape: entry.shape.clone(), narrow });
        };
        let mut shape = entry.shape.clone();
        if let Some(s0) = shape.first_mut() {
            *s0 = d0 / n;
        }
        Ok(Piece { start: entry.start + i * len, len, shape, narrow: None })
    }

    /// Materialises `piece` of `entry` as a tensor of its stored plain type, reading it straight into
    /// the tensor's buffer (on unix; elsewhere copied out of the map).
    fn plain_piece(&self, entry: &TensorEntry, piece: &Piece, stored: DType, device: &Device) -> Result<Tensor> {
        let file = &self.files[entry.file];
        let bad = |e: String| Error::bad_tensor(&file.path, &entry.name, e);
        #[cfg(unix)]
        {
            let io = |e: std::io::Error| bad(format!("cannot read its {} bytes at offset {}: {e}", piece.len, piece.start));
            let shape = piece.shape.as_slice();
            let t = match stored {
                DType::U8 => Tensor::from_vec(file.read_plain::<u8>(piece).map_err(io)?, shape, device),
                DType::U32 => Tensor::from_vec(file.read_plain::<u32>(piece).map_err(io)?, shape, device),
                DType::I16 => Tensor::from_vec(file.read_plain::<i16>(piece).map_err(io)?, shape, device),
                DType::I32 => Tensor::from_vec(file.read_plain::<i32>(piece).map_err(io)?, shape, device),
                DType::I64 => Tensor::from_vec(file.read_plain::<i64>(piece).map_err(io)?, shape, device),
                DType::F16 => Tensor::from_vec(file.read_plain::<half::f16>(piece).map_err(io)?, shape, device),
                DType::BF16 => Tensor::from_vec(file.read_plain::<half::bf16>(piece).map_err(io)?, shape, device),
                DType::F32 => Tensor::from_vec(file.read_plain::<f32>(piece).map_err(io)?, shape, device),
                DType::F64 => Tensor::from_vec(file.read_plain::<f64>(piece).map_err(io)?, shape, device),
                other => return Err(bad(format!("stored dtype {other:?} cannot be loaded"))),
            };
            t.map_err(|e| bad(e.to_string()))
        }
        #[cfg(not(unix))]
        Tensor::from_raw_buffer(&file.map[piece.start..piece.start + piece.len], stored, &piece.shape, device)
            .map_err(|e| bad(e.to_string()))
    }

    /// Materialises `piece` of a GGML-typed `entry` as a `QTensor`, which owns its blocks.
    /// With `mapped`, the blocks of a CPU tensor stay in the file's mapping (see `qtensor`);
    /// otherwise they are read into memory the `QTensor` owns.
    fn quantized_piece(&self, entry: &TensorEntry, piece: &Piece, device: &Device, mapped: bool) -> Result<QTensor> {
        let file = &self.files[entry.file];
        let bad = |e: String| Error::bad_tensor(&file.path, &entry.name, e);
        let StoredDType::Ggml(g) = entry.dtype else {
            return Err(bad("not a GGML tensor".into()));
        };
        if matches!(g, GgmlDType::Q8_1 | GgmlDType::Q8K) {
            return Err(bad(format!("{} cannot be loaded for compute", entry.dtype.name())));
        }
        #[cfg(unix)]
        {
            let io = |e: std::io::Error| bad(format!("cannot read its {} bytes at offset {}: {e}", piece.len, piece.start));
            if device.is_cpu() {
                use candle_core::quantized::k_quants::*;
                let storage = match g {
                    GgmlDType::Q4_0 => file.blocks::<BlockQ4_0>(piece, mapped),
                    GgmlDType::Q4_1 => file.blocks::<BlockQ4_1>(piece, mapped),
                    GgmlDType::Q5_0 => file.blocks::<BlockQ5_0>(piece, mapped),
                    GgmlDType::Q5_1 => file.blocks::<BlockQ5_1>(piece, mapped),
                    GgmlDType::Q8_0 => file.blocks::<BlockQ8_0>(piece, mapped),
                    GgmlDType::Q2K => file.blocks::<BlockQ2K>(piece, mapped),
                    GgmlDType::Q3K => file.blocks::<BlockQ3K>(piece, mapped),
                    GgmlDType::Q4K => file.blocks::<BlockQ4K>(piece, mapped),
                    GgmlDType::Q5K => file.blocks::<BlockQ5K>(piece, mapped),
                    GgmlDType::Q6K => file.blocks::<BlockQ6K>(piece, mapped),
                    _ => Ok(None),
                }
                .map_err(io)?;
                if let Some(storage) = storage {
                    return QTensor::new(storage, piece.shape.as_slice()).map_err(|e| bad(e.to_string()));
                }
            }
            // Elsewhere Candle copies (or uploads) the blocks itself: read them into a 4-byte-aligned
            // buffer (blocks hold f16/f32 fields) that lives only until then.
            // SAFETY: u32 is a number type.
            let words = unsafe { file.read(piece, 0u32) }.map_err(io)?;
            // SAFETY: `words` holds at least `piece.len` initialised bytes; u8 has no alignment or validity needs.
            let bytes = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), piece.len) };
            qtensor_from_ggml(g, bytes, piece.shape.clone(), device).map_err(|e| bad(e.to_string()))
        }
        #[cfg(not(unix))]
        {
            let _ = mapped;
            let bytes = &file.map[piece.start..piece.start + piece.len];
            qtensor_from_ggml(g, bytes, piece.shape.clone(), device).map_err(|e| bad(e.to_string()))
        }
    }

    /// Loads `name` as a dense tensor in `dtype` on `device`, dequantizing if it is stored quantized.
    /// Only the requested chunk is read, and it is held once (see `plain_piece`).
    pub fn tensor(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let (entry, chunk) = self.resolve(name).ok_or_else(|| self.err(name, "not found"))?;
        let piece = self.piece(entry, chunk)?;
        if piece.shape.contains(&0) {
            return Ok(crate::device::empty_tensor(&piece.shape, dtype, device)?);
        }
        let t = match entry.dtype.plain() {
            Some(stored) => self.plain_piece(entry, &piece, stored, device)?,
            None => self.quantized_piece(entry, &piece, &Device::Cpu, false)?.dequantize(device)?,
        };
        // A narrowed view would keep the whole tensor's storage alive: copy the part out.
        let t = match piece.narrow {
            Some((offset, len)) => t.narrow(0, offset, len)?.force_contiguous()?,
            None => t,
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
    /// On the CPU (unix) the blocks are not copied: the tensor reads them from the file's mapping,
    /// which it keeps alive. Once Candle has repacked them for its tiled kernels, or the weight has
    /// been used, `release_pages` takes their pages out of this process's resident memory again.
    /// Elsewhere Candle owns a copy (or the device holds the upload).
    pub fn qtensor(&self, name: &str, device: &Device) -> Result<Option<QTensor>> {
        let (entry, chunk) = self.resolve(name).ok_or_else(|| self.err(name, "not found"))?;
        if !entry.dtype.is_quantized() || chunk.is_some() {
            return Ok(None);
        }
        let piece = self.piece(entry, None)?;
        self.quantized_piece(entry, &piece, device, true).map(Some)
    }

    /// The stored element type of `name` (a plain dtype or a GGML block type), if it exists.
    pub(crate) fn stored_dtype(&self, name: &str) -> Option<StoredDType> {
        self.resolve(name).map(|(entry, _)| entry.dtype)
    }

    /// Takes every page of the weight files out of this process's resident memory. Nothing is
    /// lost: the files are mapped read-only and shared, so a mapped quantized weight that is read
    /// again faults its pages back in from the page cache. Call it after using mapped weights whose
    /// bytes are not needed again (Candle's repacked kernels keep their own copy). A no-op off unix.
    pub fn release_pages(&self) {
        for f in &self.files {
            f.release();
        }
    }

    /// Total stored bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.len).sum()
    }
}

/// The shard files of a sharded checkpoint and its (tensor, shard file) pairs.
type Shards = (Vec<PathBuf>, Vec<(String, String)>);

/// The shard files of a sharded checkpoint and its (tensor → shard file) map.
fn shard_files(dir: &Path, index: &Path) -> Result<Shards> {
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
