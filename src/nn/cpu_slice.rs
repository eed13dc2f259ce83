//! Direct access to a CPU tensor's elements, for the kernels that run outside Candle's ops.
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
