//! Direct access to a CPU tensor's elements, and a shared output pointer, for the kernels that run
//! outside Candle's ops.
use candle_core::{Result, Storage, Tensor, WithDType};

/// Runs `f` on the elements of `t` (made contiguous first) when it lives on the CPU with element
/// type `T`; `Ok(None)` for other devices and dtypes.
pub fn with_contiguous<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<Option<R>> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
    let Ok(data) = cpu.as_slice::<T>() else { return Ok(None) };
    Ok(Some(f(&data[layout.start_offset()..][..t.elem_count()])))
}

/// A pointer into an output buffer that parallel tasks write at disjoint elements (each task's
/// rows or stripe); the owner keeps the buffer alive until they are done.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: the callers (the stripe and direct convs, the int8 GEMM, the f16 linear's column blocks)
// give every task its own elements, and the buffer outlives the tasks.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    /// The pointer `offset` elements in.
    pub(crate) fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}
