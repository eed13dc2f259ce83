//! GGML blocks served straight from a weight file's read-only mapping (CPU, unix): a quantized
//! weight then costs no private copy, and once Candle has repacked it for its tiled kernels the
//! mapped pages can be released (`WeightStore::release_pages`), so the weight is held once.
use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, GgmlType, QuantizedType};
use candle_core::CpuStorage;
use half::f16;
use memmap2::Mmap;

/// `count` blocks of type `T` at byte `start` of `map`.
pub(crate) struct MappedBlocks<T> {
    map: Arc<Mmap>,
    start: usize,
    count: usize,
    _blocks: PhantomData<T>,
}

impl<T: GgmlType + Send + Sync> MappedBlocks<T> {
    /// The `len` bytes at `start` of `map` as blocks, or None when they are not a whole number of
    /// aligned blocks inside the map, or `T` is not laid out as GGUF stores it.
    pub(crate) fn new(map: Arc<Mmap>, start: usize, len: usize) -> Option<Self> {
        let size = std::mem::size_of::<T>();
        let fits = size == T::DTYPE.type_size()
            && len.is_multiple_of(size)
            && start.checked_add(len).is_some_and(|end| end <= map.len())
            && (map.as_ptr() as usize + start).is_multiple_of(std::mem::align_of::<T>());
        fits.then(|| MappedBlocks { map, start, count: len / size, _blocks: PhantomData })
    }

    fn blocks(&self) -> &[T] {
        // SAFETY: `new` checked that the range lies inside the map and is aligned for `T`; Candle's
        // blocks are `repr(C)` structs of f16 and integer fields whose size is the GGML block size
        // (checked in `new`), so any bytes are valid blocks. The map is read-only, kept alive by the
        // `Arc`, and never written (see `WeightStore::release_pages` for why releasing its pages
        // does not change what these bytes read).
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.start).cast::<T>(), self.count) }
    }
}

impl<T: GgmlType + Send + Sync> QuantizedType for MappedBlocks<T> {
    fn dtype(&self) -> GgmlDType {
        T::DTYPE
    }

    fn matmul_t(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> candle_core::Result<()> {
        candle_core::quantized::k_quants::matmul(mkn, lhs, self.blocks(), dst)
    }

    fn matmul_t_f16(&self, mkn: (usize, usize, usize), lhs: &[f16], dst: &mut [f16]) -> candle_core::Result<()> {
        candle_core::quantized::k_quants::matmul_f16(mkn, lhs, self.blocks(), dst)
    }

    fn embedding(&self, ids: &[u32], rows: usize, hidden: usize) -> candle_core::Result<CpuStorage> {
        if !hidden.is_multiple_of(T::BLCK_SIZE) || self.count != rows * (hidden / T::BLCK_SIZE) {
            candle_core::bail!("quantized embedding of {rows}×{hidden} does not match {} blocks", self.count)
        }
        let row_blocks = hidden / T::BLCK_SIZE;
        let mut out = vec![0f32; ids.len() * hidden];
        for (dst, &row) in out.chunks_exact_mut(hidden.max(1)).zip(ids) {
            let row = row as usize;
            if row >= rows {
                candle_core::bail!("embedding id {row} is out of range for {rows} rows")
            }
            T::to_float(&self.blocks()[row * row_blocks..(row + 1) * row_blocks], dst);
        }
        Ok(CpuStorage::F32(out))
    }

    fn dequantize(&self, elem_count: usize) -> candle_core::Result<CpuStorage> {
        if elem_count != self.count * T::BLCK_SIZE {
            candle_core::bail!("cannot dequantize {} blocks into {elem_count} values", self.count)
        }
        let mut ys = vec![0f32; elem_count];
        T::to_float(self.blocks(), &mut ys);
        Ok(CpuStorage::F32(ys))
    }

    fn storage_size_in_bytes(&self) -> usize {
        self.count * std::mem::size_of::<T>()
    }

    fn as_ptr(&self) -> *const u8 {
        self.blocks().as_ptr().cast()
    }

    fn block_size(&self) -> usize {
        T::BLCK_SIZE
    }

    fn from_float(&mut self, _: &[f32]) {
        // Candle only quantizes into storage it has just allocated (`QTensor::quantize`); a mapped
        // weight file is never a quantization target.
        panic!("mapped GGUF weights are read-only and cannot be quantized into");
    }

    fn from_float_imatrix(&mut self, _: &[f32], _: &[f32], _: usize) {
        panic!("mapped GGUF weights are read-only and cannot be quantized into");
    }

    fn size(&self) -> usize {
        self.storage_size_in_bytes()
    }
}
