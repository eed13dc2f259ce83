//! A Q8_0 weight held as its GGUF blocks and widened to f32 a block of rows at a time, for CPUs
//! without an int8 dot-product instruction (AVX2 without VNNI, NEON without the int8 GEMM): there
//! an int8 product runs no faster than an f32 FMA, so the f32 GEMM does the arithmetic and the
//! weight keeps Q8_0's memory (8.5 bits per value). Also the GGUF Q8_0 block layout both CPU paths read.

/// Values per Q8_0 block.
pub(crate) const BLOCK: usize = 32;
/// Bytes of one Q8_0 block in a GGUF tensor: an f16 scale and 32 signed bytes.
pub(crate) const BLOCK_BYTES: usize = 2 + BLOCK;

/// The blocks per row of an `[n, k]` Q8_0 matrix stored in `len` bytes; `None` when `k` is not a
/// whole number of blocks, the matrix is empty or the length disagrees.
pub(crate) fn blocks_per_row(len: usize, n: usize, k: usize) -> Option<usize> {
    if k == 0 || n == 0 || !k.is_multiple_of(BLOCK) {
        return None;
    }
    let kb = k / BLOCK;
    (len == n.checked_mul(kb)?.checked_mul(BLOCK_BYTES)?).then_some(kb)
}

/// The scale of one Q8_0 block (its first two bytes, f16 little-endian).
#[inline(always)]
pub(crate) fn block_scale(block: &[u8]) -> f32 {
    half::f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// A Q8_0 matrix `[n, k]`, row-major blocks as GGUF stores them.
pub(crate) struct Q8Rows {
    n: usize,
    k: usize,
    blocks: Vec<u8>,
}

impl std::fmt::Debug for Q8Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q8Rows {{ n: {}, k: {} }}", self.n, self.k)
    }
}

impl Q8Rows {
    /// Copies the Q8_0 blocks of an `[n, k]` matrix; `None` when `k` is not a whole number of
    /// blocks or `data` has another length.
    pub(crate) fn from_q8_0(data: &[u8], n: usize, k: usize) -> Option<Self> {
        blocks_per_row(data.len(), n, k)?;
        Some(Q8Rows { n, k, blocks: data.to_vec() })
    }

    /// Output features (rows).
    pub(crate) fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns).
    pub(crate) fn k(&self) -> usize {
        self.k
    }

    /// Writes rows `first ..` of the matrix in f32 into `dst` (a whole number of rows, inside the
    /// matrix).
    pub(crate) fn widen_rows(&self, first: usize, dst: &mut [f32]) {
        let row_bytes = self.k / BLOCK * BLOCK_BYTES;
        let src = &self.blocks[first * row_bytes..][..dst.len() / BLOCK * BLOCK_BYTES];
        widen(src, dst);
    }
}

super::fast_math::simd_fn! {
    /// `dst[32·b + i] = scale_b · q_b[i]` for the Q8_0 blocks `src`.
    fn widen(src: &[u8], dst: &mut [f32]) -> () {
        for (block, out) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
            let scale = block_scale(block);
            for (o, &q) in out.iter_mut().zip(&block[2..]) {
                *o = scale * (q as i8) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widens_the_rows_asked_for() {
        let (n, k) = (3, 64);
        let mut data = Vec::new();
        for r in 0..n {
            for b in 0..k / BLOCK {
                data.extend_from_slice(&half::f16::from_f32(0.5 * (r * 2 + b + 1) as f32).to_le_bytes());
                data.extend((0..BLOCK).map(|i| (i as i8 - 16 + r as i8) as u8));
            }
        }
        let q = Q8Rows::from_q8_0(&data, n, k).unwrap();
        let mut dst = vec![0f32; 2 * k];
        q.widen_rows(1, &mut dst);
        for (j, row) in dst.chunks(k).enumerate() {
            let r = j + 1;
            for (c, &v) in row.iter().enumerate() {
                let want = 0.5 * (r * 2 + c / BLOCK + 1) as f32 * ((c % BLOCK) as f32 - 16.0 + r as f32);
                assert_eq!(v, want, "row {r} column {c}");
            }
        }
        assert!(Q8Rows::from_q8_0(&data[1..], n, k).is_none(), "length");
        assert!(Q8Rows::from_q8_0(&data, n, 48).is_none(), "partial block");
    }
}
