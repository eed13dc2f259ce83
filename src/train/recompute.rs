//! Activation checkpointing for the backbone blocks: the forward pass keeps only each trained block's
//! input (optionally offloaded: to host memory from a GPU, to a spill file on a CPU), the head's
//! backward gives the gradient at the block outputs, and each block is recomputed, newest first, to
//! carry the gradient back one block at a time. Gradients equal a plain backward up to the order of
//! floating-point sums; peak memory holds one block's graph instead of all of them.
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};

use super::grads::Grads;
use crate::error::{Error, Result};
use crate::models::training::BlockWalk;

/// Where the kept block inputs wait for the backward pass.
pub enum KeptInputs {
    /// On the compute device.
    Device(HashMap<usize, Tensor>),
    /// In host memory (from a GPU).
    Host(HashMap<usize, Tensor>, Device),
    /// In a spill file (CPU): f32 bytes at known offsets.
    Spill(SpillFile),
}

/// A scratch file holding tensors by slot, written and read with plain file I/O so the kept inputs
/// live in the page cache, not in the process's memory.
pub struct SpillFile {
    path: PathBuf,
    file: File,
    slots: HashMap<usize, (u64, Vec<usize>)>,
    end: u64,
}

impl SpillFile {
    /// Creates (truncates) the spill file `path` inside the output directory `root` (never through a
    /// link, never over a FIFO, device or input: [`crate::fsutil::open_in_place`]).
    pub fn create(root: &Path, path: &Path) -> Result<Self> {
        let file = crate::fsutil::open_in_place(root, path, crate::fsutil::InPlace::Rewrite)?;
        Ok(SpillFile { path: path.to_path_buf(), file, slots: HashMap::new(), end: 0 })
    }

    fn put(&mut self, slot: usize, t: &Tensor) -> Result<()> {
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let offset = self.end;
        self.file.seek(SeekFrom::Start(offset)).and_then(|_| self.file.write_all(&bytes)).map_err(|e| Error::io(&self.path, e))?;
        self.end += bytes.len() as u64;
        self.slots.insert(slot, (offset, t.dims().to_vec()));
        Ok(())
    }

    fn take(&mut self, slot: usize, device: &Device) -> Result<Tensor> {
        let (offset, dims) = self.slots.remove(&slot).ok_or_else(|| Error::Input(format!("no kept input for block {slot}")))?;
        let n: usize = dims.iter().product();
        let mut bytes = vec![0u8; n * 4];
        self.file.seek(SeekFrom::Start(offset)).and_then(|_| self.file.read_exact(&mut bytes)).map_err(|e| Error::io(&self.path, e))?;
        let values: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(Tensor::from_vec(values, dims, device)?)
    }

    /// Forgets every slot and rewinds (the file keeps its size for the next step).
    fn reset(&mut self) {
        self.slots.clear();
        self.end = 0;
    }
}

impl KeptInputs {
    fn put(&mut self, i: usize, t: &Tensor) -> Result<()> {
        match self {
            KeptInputs::Device(m) => {
                m.insert(i, t.clone());
            }
            KeptInputs::Host(m, _) => {
                m.insert(i, t.to_device(&Device::Cpu)?);
            }
            KeptInputs::Spill(f) => f.put(i, t)?,
        }
        Ok(())
    }

    fn take(&mut self, i: usize, device: &Device) -> Result<Tensor> {
        let missing = || Error::Input(format!("no kept input for block {i}"));
        Ok(match self {
            KeptInputs::Device(m) => m.remove(&i).ok_or_else(missing)?,
            KeptInputs::Host(m, dev) => m.remove(&i).ok_or_else(missing)?.to_device(dev)?,
            KeptInputs::Spill(f) => f.take(i, device)?,
        })
    }

    fn reset(&mut self) {
        match self {
            KeptInputs::Device(m) | KeptInputs::Host(m, _) => m.clear(),
            KeptInputs::Spill(f) => f.reset(),
        }
    }
}

/// One micro-batch through `model` with checkpointed blocks from `first_trained` on: returns the loss
/// value (of `loss`, which should already be divided by the micro-batches of the step) and adds every
/// trained parameter's gradient to `grads`.
pub fn checkpointed_step(
    model: &dyn BlockWalk,
    pixels: &Tensor,
    first_trained: usize,
    kept: &mut KeptInputs,
    grads: &mut Grads,
    loss: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<f64> {
    let indices = model.taps();
    let last = indices.iter().copied().max().unwrap_or(0);
    let device = pixels.device().clone();
    kept.reset();
    // Forward: nothing of the blocks' graphs is kept, only the trained blocks' inputs and the taps.
    let (x0, ph, pw) = model.embed(pixels)?;
    let grid = (ph, pw);
    let mut x = x0.detach();
    let mut taps: HashMap<usize, Tensor> = HashMap::new();
    if indices.contains(&0) {
        taps.insert(0, x.clone());
    }
    for i in 0..last {
        if i >= first_trained {
            kept.put(i, &x)?;
        }
        x = model.block(i, &x, grid)?.detach();
        if indices.contains(&(i + 1)) {
            taps.insert(i + 1, x.clone());
        }
    }
    drop(x);
    // Head: the taps become leaves whose gradients start the walk back through the blocks.
    let leaves: HashMap<usize, Var> = taps.iter().map(|(&i, t)| Ok((i, Var::from_tensor(t)?))).collect::<Result<_>>()?;
    drop(taps);
    let tapped = indices
        .iter()
        .map(|i| leaves.get(i).map(|v| v.as_tensor().clone()).ok_or_else(|| Error::Input(format!("hidden state {i} not computed"))))
        .collect::<Result<Vec<_>>>()?;
    let value = loss(&model.head(&tapped, grid)?)?;
    drop(tapped);
    let scalar = value.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    if !scalar.is_finite() {
        return Ok(scalar);
    }
    let store = value.backward()?;
    grads.add_available(&store)?;
    let mut upstream: HashMap<usize, Tensor> = leaves.iter().filter_map(|(&i, v)| store.get(v.as_tensor()).map(|g| (i, g.detach()))).collect();
    drop(store);
    // Backward, one recomputed block at a time.
    for i in (first_trained..last).rev() {
        let Some(g) = upstream.remove(&(i + 1)) else { continue };
        let input = Var::from_tensor(&kept.take(i, &device)?)?;
        let y = model.block(i, input.as_tensor(), grid)?;
        let store = (y * g)?.sum_all()?.backward()?;
        grads.add_available(&store)?;
        if let Some(gx) = store.get(input.as_tensor()) {
            let gx = gx.detach();
            let merged = match upstream.remove(&i) {
                Some(t) => (t + gx)?,
                None => gx,
            };
            upstream.insert(i, merged);
        }
    }
    if first_trained == 0 {
        // Embeddings trained too (`all`): recompute them and finish the walk.
        if let Some(g) = upstream.remove(&0) {
            let (x0, _, _) = model.embed(pixels)?;
            grads.add_available(&(x0 * g)?.sum_all()?.backward()?)?;
        }
    }
    grads.finish_pass()?;
    Ok(scalar)
}
