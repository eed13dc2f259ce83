//! Direct access to a CPU tensor's elements, and a shared output pointer, for the kernels that run
//! outside Candle's ops.
use candle_core::{Result, Storage, Tensor, WithDType};

/// Runs `f` on the elements of `t` (made contiguous first) when it lives on the CPU with element
/// type `T`; `Ok(None)` for other devices and dtypes.
pub(crate) fn with_contiguous<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<Option<R>> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
    let Ok(data) = cpu.as_slice::<T>() else { return Ok(None) };
    Ok(Some(f(&data[layout.start_offset()..][..t.elem_count()])))
}

/// The f32 elements of a contiguous CPU storage laid out by `l` (a custom op's operand).
pub(crate) fn contiguous_f32<'a>(s: &'a candle_core::CpuStorage, l: &candle_core::Layout) -> Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("a custom op's operand is not contiguous") };
    Ok(&s.as_slice::<f32>()?[start..end])
}

/// `f` on the f32 elements of one CPU tensor (made contiguous first, borrowed); an error for other
/// devices and dtypes.
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    with_contiguous(t, f)?.ok_or_else(|| candle_core::Error::Msg(format!("expected an f32 CPU tensor, got {:?} on {:?}", t.dtype(), t.device())))?
}

/// `f` on the f32 elements of two CPU tensors (each made contiguous first, borrowed, not copied); an
/// error for other devices and dtypes.
pub(crate) fn with_f32_pair<R>(a: &Tensor, b: &Tensor, f: impl FnOnce(&[f32], &[f32]) -> Result<R>) -> Result<R> {
    let not_cpu = || candle_core::Error::Msg(format!("expected f32 CPU tensors, got {:?} on {:?} and {:?} on {:?}", a.dtype(), a.device(), b.dtype(), b.device()));
    let inner = with_contiguous(a, |sa: &[f32]| with_contiguous(b, |sb: &[f32]| f(sa, sb)))?.ok_or_else(not_cpu)?;
    inner?.ok_or_else(not_cpu)?
}

/// A per-thread scratch buffer, reused across tasks and calls (see [`with_scratch`]).
pub(crate) type Scratch<T> = std::thread::LocalKey<std::cell::RefCell<Vec<T>>>;

/// Runs `f` on this thread's buffer in `key`, or on a fresh one when the thread already holds it:
/// a rayon worker waiting inside a parallel call (a threaded GEMM, a nested `par_iter`) runs other
/// tasks meanwhile, and one of those can reach the same kernel again.
pub(crate) fn with_scratch<T, R>(key: &'static Scratch<T>, f: impl FnOnce(&mut Vec<T>) -> R) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffer) => f(&mut buffer),
        Err(_) => f(&mut Vec::new()),
    })
}

/// A pointer into an output buffer that parallel tasks write at disjoint elements (each task's
/// rows or stripe); the owner keeps the buffer alive until they are done.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: the callers (the stripe and direct convs, the int8 GEMM, the f16 linear's column blocks)
// give every task its own elements, and the buffer outlives the tasks.
unsafe impl Send for SharedOut {}
// SAFETY: as for `Send`: no two tasks touch the same elements.
unsafe impl Sync for SharedOut {}
impl SharedOut {
    /// The pointer `offset` elements in.
    pub(crate) fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` matrix, in parallel 32 × 32 tiles
/// (element by element, Candle's strided copy takes ~4× as long on a ViT-L weight).
pub(crate) fn transposed<T: Copy + Default + Send + Sync>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    use rayon::prelude::*;
    const TILE: usize = 32;
    assert!(src.len() >= rows * cols, "transposed: {} elements for a {rows} × {cols} matrix", src.len());
    let mut out = vec![T::default(); rows * cols];
    if rows == 0 || cols == 0 {
        return out;
    }
    // Each task writes TILE output rows (source columns c0 .. c0 + TILE), tile by tile.
    out.par_chunks_mut(TILE * rows).enumerate().for_each(|(block, dst)| {
        let c0 = block * TILE;
        let width = dst.len() / rows;
        for r0 in (0..rows).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                let line = &src[r * cols + c0..][..width];
                for (c, &v) in line.iter().enumerate() {
                    dst[c * rows + r] = v;
                }
            }
        }
    });
    out
}

/// `x [B, R, C]` → `[B, C, R]`, contiguous: per batch item the tiled parallel [`transposed`] for
/// f32 on the CPU outside autograd (Candle's strided copy runs on one thread: 4 % of a
/// SegFormer-B0 forward), Candle's ops otherwise.
pub(crate) fn transpose_last_two(x: &Tensor) -> Result<Tensor> {
    let (b, r, c) = x.dims3()?;
    if x.dtype() == candle_core::DType::F32 && !x.track_op() && r * c > 0 {
        let flipped = with_contiguous(x, |s: &[f32]| match b {
            1 => transposed(s, r, c),
            _ => s.chunks_exact(r * c).flat_map(|m| transposed(m, r, c)).collect(),
        })?;
        if let Some(v) = flipped {
            return Tensor::from_vec(v, (b, c, r), x.device());
        }
    }
    x.transpose(1, 2)?.contiguous()
}

#[cfg(test)]
mod tests {
    /// The batched transpose is Candle's, for one and several batch items and a narrowed view.
    #[test]
    fn batched_transpose_is_candles() {
        use candle_core::{Device, Tensor};
        let x = Tensor::arange(0f32, 2.0 * 37.0 * 5.0, &Device::Cpu).unwrap().reshape((2, 37, 5)).unwrap();
        for t in [x.clone(), x.narrow(0, 1, 1).unwrap(), x.narrow(1, 3, 30).unwrap()] {
            let want = t.transpose(1, 2).unwrap().contiguous().unwrap();
            let got = super::transpose_last_two(&t).unwrap();
            assert_eq!(got.dims(), want.dims());
            assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
    }

    /// Every element lands at its transposed place, for shapes off the tile size.
    #[test]
    fn transposes_at_odd_shapes() {
        for (rows, cols) in [(1, 1), (3, 70), (33, 31), (64, 65), (0, 5)] {
            let src: Vec<u32> = (0..rows * cols).map(|i| i as u32).collect();
            let t = super::transposed(&src, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(t[c * rows + r], src[r * cols + c], "{rows} × {cols} at ({r}, {c})");
                }
            }
        }
    }
}
