//! Int8 GEMM for Q8_0 weights on x86-64 CPUs with AVX-512 VNNI or AVX-VNNI: `y = x Wᵀ (+ b)` where
//! `x`'s rows are quantized on the fly in blocks of 32 (one f32 scale per block, as Q8_0) and each block's
//! 32 products are summed in int32 by `vpdpbusd`, 16 (AVX-512) or 8 output columns at a time, then
//! scaled into f32.
//! The weights are repacked once at load into 32-column panels.
use rayon::prelude::*;

pub(crate) use super::q8_rows::BLOCK;
use super::q8_rows::{block_scale, blocks_per_row, BLOCK_BYTES};

/// Output columns per weight panel (two 16-lane registers).
const PANEL: usize = 32;
/// Activation rows per register tile (AVX-512).
const TILE_ROWS: usize = 4;
/// Activation rows per register tile (AVX-VNNI: 16 registers of 256 bits).
const TILE_ROWS_256: usize = 3;
/// Activation rows per parallel task (its quantized rows and one weight panel stay in L2).
const TASK_ROWS: usize = 64;

/// One 32-value block of a 32-column weight panel.
#[repr(C, align(64))]
#[derive(Clone)]
struct PanelBlock {
    /// `[k group (8)][column (32)][4 bytes]`: the 4 consecutive weights of one column a `vpdpbusd`
    /// lane multiplies.
    qs: [i8; BLOCK * PANEL],
    /// Each column's block scale.
    scale: [f32; PANEL],
    /// `−128 · Σ w` per column: cancels the +128 offset that makes the activations unsigned.
    offset: [i32; PANEL],
}

/// A Q8_0 weight `[n, k]` repacked for [`PackedQ8::matmul`].
pub struct PackedQ8 {
    n: usize,
    k: usize,
    /// `[panel][block]`.
    blocks: Vec<PanelBlock>,
}

impl std::fmt::Debug for PackedQ8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedQ8 {{ n: {}, k: {} }}", self.n, self.k)
    }
}

/// The int8 kernels, by instruction set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 VNNI: 4 rows × 32 columns per register tile.
    Avx512Vnni,
    /// AVX-VNNI (the 256-bit VEX form: Alder Lake and later laptops without AVX-512): 3 rows × 16
    /// columns per register tile.
    AvxVnni,
}

impl Kernel {
    /// The kernel this CPU runs best, if any (`EDGERUN_NO_INT8=1`: none).
    pub fn detect() -> Option<Kernel> {
        #[cfg(target_arch = "x86_64")]
        {
            static KERNEL: std::sync::OnceLock<Option<Kernel>> = std::sync::OnceLock::new();
            *KERNEL.get_or_init(|| {
                if std::env::var_os("EDGERUN_NO_INT8").is_some() {
                    None
                } else if Kernel::Avx512Vnni.runs_here() {
                    Some(Kernel::Avx512Vnni)
                } else if Kernel::AvxVnni.runs_here() {
                    Some(Kernel::AvxVnni)
                } else {
                    None
                }
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    }

    /// Whether this CPU has the kernel's instructions.
    pub fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Kernel::Avx512Vnni => {
                    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
                }
                Kernel::AvxVnni => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("avxvnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }
}

/// Whether this CPU runs an int8 kernel (AVX-512 VNNI or AVX-VNNI).
pub fn available() -> bool {
    Kernel::detect().is_some()
}

/// Values of one GGUF Q4_K block.
const Q4K_VALUES: usize = 256;
/// Bytes of one GGUF Q4_K block: f16 `d` and `dmin`, 12 bytes of 6-bit sub-block scales and
/// minimums, 128 bytes of 4-bit values.
const Q4K_BYTES: usize = 144;

/// One Q4_K block (`src`, 144 bytes) as the eight Q8_0 blocks (`dst`, 8 × 34 bytes) that Candle's
/// f32 → Q8_0 rounding makes of its dequantized values: each sub-block of 32 holds at most 16 levels
/// `d·sc·q − dmin·m`, so those are rounded once each (the same f32 operations as Candle's `to_float`
/// and `from_float`, without their `roundf` call per value).
fn q4k_to_q8_0(src: &[u8], dst: &mut [u8]) {
    let d = half::f16::from_le_bytes([src[0], src[1]]).to_f32();
    let dmin = half::f16::from_le_bytes([src[2], src[3]]).to_f32();
    let scales = &src[4..16];
    let qs = &src[16..Q4K_BYTES];
    for (sub, block) in dst.chunks_exact_mut(BLOCK_BYTES).take(Q4K_VALUES / BLOCK).enumerate() {
        // Candle's get_scale_min_k4: six bits each of scale and minimum per sub-block.
        let (sc, m) = match sub {
            0..4 => (scales[sub] & 63, scales[sub + 4] & 63),
            _ => ((scales[sub + 4] & 0xF) | ((scales[sub - 4] >> 6) << 4), (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4)),
        };
        let (scale, min) = (d * sc as f32, dmin * m as f32);
        // Sub-blocks 2j and 2j + 1 are the low and high nibbles of the same 32 bytes.
        let bytes = &qs[sub / 2 * BLOCK..][..BLOCK];
        let shift = 4 * (sub % 2);
        let level = |q: u8| scale * q as f32 - min;
        let (mut used, mut amax) = (0u16, 0f32);
        for &b in bytes {
            used |= 1 << ((b >> shift) & 0xF);
        }
        for q in 0..16u8 {
            if used & (1 << q) != 0 {
                amax = amax.max(level(q).abs());
            }
        }
        let step = amax / 127.0;
        let inv = if step != 0.0 { 1.0 / step } else { 0.0 };
        let rounded: [u8; 16] = std::array::from_fn(|q| round_to_i8(level(q as u8) * inv) as u8);
        block[..2].copy_from_slice(&half::f16::from_f32(step).to_le_bytes());
        for (o, &b) in block[2..].iter_mut().zip(bytes) {
            *o = rounded[((b >> shift) & 0xF) as usize];
        }
    }
}

/// `v.round() as i8` (halves away from zero, saturating, NaN to 0) without a call to libm's `roundf`,
/// which x86-64's baseline has no instruction for: `v − trunc(v)` is exact once `v` is clamped.
#[inline(always)]
fn round_to_i8(v: f32) -> i8 {
    let v = v.clamp(-128.0, 127.0);
    let t = v as i32;
    let frac = v - t as f32;
    (t + (frac >= 0.5) as i32 - (frac <= -0.5) as i32) as i8
}

impl PackedQ8 {
    /// Repacks the raw GGUF Q8_0 data of an `[n, k]` matrix; `None` when `k` is not a multiple of
    /// 32 or the data does not have the size of `n · k/32` blocks.
    pub fn from_q8_0(data: &[u8], n: usize, k: usize) -> Option<Self> {
        let kb = blocks_per_row(data.len(), n, k)?;
        let panels = n.div_ceil(PANEL);
        let empty = PanelBlock { qs: [0; BLOCK * PANEL], scale: [0.0; PANEL], offset: [0; PANEL] };
        let mut blocks = vec![empty; panels * kb];
        blocks.par_chunks_mut(kb).enumerate().for_each(|(p, panel)| {
            for (b, blk) in panel.iter_mut().enumerate() {
                for col in 0..PANEL.min(n - p * PANEL) {
                    let src = &data[((p * PANEL + col) * kb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                    blk.scale[col] = block_scale(src);
                    let mut sum = 0i32;
                    for (i, &q) in src[2..].iter().enumerate() {
                        let q = q as i8;
                        blk.qs[(i / 4) * PANEL * 4 + col * 4 + i % 4] = q;
                        sum += q as i32;
                    }
                    blk.offset[col] = -128 * sum;
                }
            }
        });
        Some(PackedQ8 { n, k, blocks })
    }

    /// The raw GGUF Q4_K data of an `[n, k]` matrix rounded to Q8_0 and repacked, rows in parallel:
    /// the same blocks as dequantizing it and rounding the values as Candle rounds f32 to Q8_0
    /// ([`q4k_to_q8_0`]). `None` when `k` is not a multiple of 256 or the data does not have the size
    /// of `n · k/256` blocks.
    pub(crate) fn from_q4k(data: &[u8], n: usize, k: usize) -> Option<Self> {
        if k == 0 || n == 0 || !k.is_multiple_of(Q4K_VALUES) || data.len() != n.checked_mul(k / Q4K_VALUES)?.checked_mul(Q4K_BYTES)? {
            return None;
        }
        let (row_q4k, row_q8) = (k / Q4K_VALUES * Q4K_BYTES, k / BLOCK * BLOCK_BYTES);
        let mut q8 = vec![0u8; n * row_q8];
        q8.par_chunks_mut(row_q8).zip(data.par_chunks(row_q4k)).for_each(|(dst, src)| {
            for (q4k, q8) in src.chunks_exact(Q4K_BYTES).zip(dst.chunks_exact_mut(Q4K_VALUES / BLOCK * BLOCK_BYTES)) {
                q4k_to_q8_0(q4k, q8);
            }
        });
        Self::from_q8_0(&q8, n, k)
    }

    /// An f32 `[n, k]` matrix rounded to Q8_0 (Candle's rounding, as `edgerun quantize` writes it)
    /// and repacked; `None` where `k` is not a whole number of blocks.
    pub fn from_f32(weight: &candle_core::Tensor) -> candle_core::Result<Option<Self>> {
        use candle_core::quantized::{GgmlDType, QTensor};
        let (n, k) = weight.dims2()?;
        if k == 0 || !k.is_multiple_of(BLOCK) {
            return Ok(None);
        }
        let q = QTensor::quantize(&weight.to_dtype(candle_core::DType::F32)?, GgmlDType::Q8_0)?;
        Ok(Self::from_q8_0(&q.data()?, n, k))
    }

    /// The matrices stacked along the outputs (`[Σn, k]`: one product where there were several);
    /// `None` without parts, when their `k` differ, or when a part but the last has a partial panel.
    pub fn concat(parts: &[&PackedQ8]) -> Option<Self> {
        let (first, rest) = parts.split_first()?;
        if rest.iter().any(|p| p.k != first.k) || parts[..parts.len() - 1].iter().any(|p| p.n % PANEL != 0) {
            return None;
        }
        // Sized once: collected from the chain, the vector grew by doubling (ViT-H's joined q/k/v took
        // 160 MiB of capacity for 113 MiB of blocks).
        let mut blocks = Vec::with_capacity(parts.iter().map(|p| p.blocks.len()).sum());
        for p in parts {
            blocks.extend(p.blocks.iter().cloned());
        }
        Some(PackedQ8 { n: parts.iter().map(|p| p.n).sum(), k: first.k, blocks })
    }

    /// Output features.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    /// `x [m, k] → x Wᵀ + bias`, `[m, n]` row-major, with [`Kernel::detect`]'s kernel; an error where
    /// there is none or the lengths do not fit.
    pub fn matmul(&self, x: &[f32], m: usize, bias: Option<&[f32]>) -> candle_core::Result<Vec<f32>> {
        match Kernel::detect() {
            Some(kernel) => self.matmul_with(kernel, x, m, bias),
            None => candle_core::bail!("the int8 GEMM needs a CPU with AVX-512 VNNI or AVX-VNNI"),
        }
    }

    /// [`Self::matmul`] with a given kernel (an error where this CPU lacks it).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], m: usize, bias: Option<&[f32]>) -> candle_core::Result<Vec<f32>> {
        if !kernel.runs_here() {
            candle_core::bail!("this CPU cannot run the {kernel:?} int8 kernel");
        }
        if Some(x.len()) != m.checked_mul(self.k) || bias.is_some_and(|b| b.len() != self.n) {
            candle_core::bail!("int8 GEMM: input of {} values for {m} rows of {}, bias of {:?} for {} outputs", x.len(), self.k, bias.map(<[f32]>::len), self.n);
        }
        // Uninitialised: the tiles write every element (zeroing it first cost a memory pass).
        let mut out: Vec<f32> = Vec::with_capacity(m * self.n);
        self.product_into(kernel, x, m, bias, &mut out.spare_capacity_mut()[..m * self.n]);
        // SAFETY: `product_into` wrote all m × n elements.
        unsafe { out.set_len(m * self.n) };
        Ok(out)
    }

    /// [`Self::matmul`] into `out` (`m × n`, row-major, written whole); an error where this CPU has
    /// no int8 kernel or the lengths do not fit.
    pub(crate) fn matmul_into(&self, x: &[f32], m: usize, bias: Option<&[f32]>, out: &mut [std::mem::MaybeUninit<f32>]) -> candle_core::Result<()> {
        let Some(kernel) = Kernel::detect() else { candle_core::bail!("the int8 GEMM needs a CPU with AVX-512 VNNI or AVX-VNNI") };
        if Some(x.len()) != m.checked_mul(self.k) || bias.is_some_and(|b| b.len() != self.n) || Some(out.len()) != m.checked_mul(self.n) {
            candle_core::bail!("int8 GEMM: input of {} values for {m} rows of {}, bias of {:?}, output of {} for {} outputs", x.len(), self.k, bias.map(<[f32]>::len), out.len(), self.n);
        }
        self.product_into(kernel, x, m, bias, out);
        Ok(())
    }

    /// `x Wᵀ + bias` for activations already rounded by [`quantize_rows`] (or row by row by
    /// [`quantize_row_into`]): the bytes `qa` `[m, k]` and the block scales `da` `[m, k/32]`.
    pub(crate) fn matmul_quantized(&self, qa: &[u8], da: &[f32], m: usize, bias: Option<&[f32]>) -> candle_core::Result<Vec<f32>> {
        let Some(kernel) = Kernel::detect() else { candle_core::bail!("the int8 GEMM needs a CPU with AVX-512 VNNI or AVX-VNNI") };
        if Some(qa.len()) != m.checked_mul(self.k) || Some(da.len()) != m.checked_mul(self.k / BLOCK) || bias.is_some_and(|b| b.len() != self.n) {
            candle_core::bail!("int8 GEMM: {} bytes and {} scales for {m} rows of {}, bias of {:?} for {} outputs", qa.len(), da.len(), self.k, bias.map(<[f32]>::len), self.n);
        }
        let mut out: Vec<f32> = Vec::with_capacity(m * self.n);
        self.quantized_product_into(kernel, qa, da, m, bias, &mut out.spare_capacity_mut()[..m * self.n]);
        // SAFETY: the product wrote all m × n elements.
        unsafe { out.set_len(m * self.n) };
        Ok(out)
    }

    /// Writes every element of `out` (`m × n`) with `kernel`, which runs here; the lengths are checked.
    fn product_into(&self, kernel: Kernel, x: &[f32], m: usize, bias: Option<&[f32]>, out: &mut [std::mem::MaybeUninit<f32>]) {
        let (qa, da) = quantize_rows(x, m, self.k);
        self.quantized_product_into(kernel, &qa, &da, m, bias, out);
    }

    /// [`Self::product_into`] for rounded activations (`qa` `[m, k]`, `da` `[m, k/32]`).
    fn quantized_product_into(&self, kernel: Kernel, qa: &[u8], da: &[f32], m: usize, bias: Option<&[f32]>, out: &mut [std::mem::MaybeUninit<f32>]) {
        let kb = self.k / BLOCK;
        let panels = self.n.div_ceil(PANEL);
        let chunks = m.div_ceil(TASK_ROWS);
        let dst = super::cpu_slice::SharedOut(out.as_mut_ptr().cast::<f32>());
        (0..chunks * panels).into_par_iter().for_each(|unit| {
            let (chunk, p) = (unit / panels, unit % panels);
            let panel = &self.blocks[p * kb..][..kb];
            let cols = PANEL.min(self.n - p * PANEL);
            let bias = bias.map(|b| &b[p * PANEL..][..cols]);
            let rows = (chunk * TASK_ROWS)..m.min((chunk + 1) * TASK_ROWS);
            let step = if kernel == Kernel::Avx512Vnni { TILE_ROWS } else { TILE_ROWS_256 };
            let mut r = rows.start;
            while r < rows.end {
                let tile = step.min(rows.end - r);
                let tile_out = Tile { out: dst.at(r * self.n + p * PANEL), ldo: self.n, cols, bias };
                // SAFETY: the CPU runs `kernel` (checked above); the activations of rows r..r+tile
                // and their scales are in bounds (`quantize_rows` made m × k and m × kb), and the
                // tile writes rows r.. of columns p·32..p·32+cols, which no other unit writes.
                unsafe {
                    let (a, d) = (&qa[r * self.k..], &da[r * kb..]);
                    match (kernel, tile) {
                        (Kernel::Avx512Vnni, 4) => vnni::tile::<4>(panel, a, d, self.k, tile_out),
                        (Kernel::Avx512Vnni, 3) => vnni::tile::<3>(panel, a, d, self.k, tile_out),
                        (Kernel::Avx512Vnni, 2) => vnni::tile::<2>(panel, a, d, self.k, tile_out),
                        (Kernel::Avx512Vnni, _) => vnni::tile::<1>(panel, a, d, self.k, tile_out),
                        (Kernel::AvxVnni, 3) => vnni::tile256::<3>(panel, a, d, self.k, tile_out),
                        (Kernel::AvxVnni, 2) => vnni::tile256::<2>(panel, a, d, self.k, tile_out),
                        (Kernel::AvxVnni, _) => vnni::tile256::<1>(panel, a, d, self.k, tile_out),
                    }
                }
                r += tile;
            }
        });
        // The units cover every row chunk × panel, and each tile stored all `cols` columns of its
        // rows, so all m × n elements are written.
    }
}

/// Where one register tile writes: row-major output at `out` (row stride `ldo`), `cols` ≤ 32
/// valid columns, each plus `bias`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Tile<'a> {
    out: *mut f32,
    ldo: usize,
    cols: usize,
    bias: Option<&'a [f32]>,
}

/// Quantizes each row of `x [m, k]` in blocks of 32 to `round(x / d) + 128` (unsigned bytes) with
/// `d = max|x| / 127` per block; returns the bytes `[m, k]` and the scales `[m, k/32]`. A block
/// holding a non-finite value gets a NaN scale, so the product is not finite either.
pub(crate) fn quantize_rows(x: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let kb = k / BLOCK;
    let mut q = vec![0u8; m * k];
    let mut d = vec![0f32; m * kb];
    q.par_chunks_mut(k).zip(d.par_chunks_mut(kb)).zip(x.par_chunks(k)).for_each(|((q, d), x)| quantize_row_into(x, q, d));
    (q, d)
}

/// [`quantize_rows`]' rounding of the values `x` (whole blocks of 32) into the bytes `q` (as long)
/// and one scale per block in `d`.
pub(crate) fn quantize_row_into(x: &[f32], q: &mut [u8], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was detected.
        return unsafe { quantize_avx512::quantize_row(x, q, d) };
    }
    quantize_row(x, q, d)
}

/// Adding it to a float of magnitude ≤ 2²² rounds that float to an integer (half to even) in the
/// low mantissa bits: 1.5 · 2²³.
const ROUND: f32 = 12_582_912.0;

#[cfg(target_arch = "x86_64")]
mod quantize_avx512 {
    use super::{BLOCK, ROUND};
    use std::arch::x86_64::*;

    /// [`super::quantize_row`] in AVX-512 intrinsics, value for value: LLVM left the portable
    /// loop's maxima and non-finite sums scalar (4.7 % of a DA3-Small Q8_0 forward).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn quantize_row(x: &[f32], q: &mut [u8], d: &mut [f32]) {
        let (lo, hi, round, zero) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0), _mm512_set1_ps(ROUND), _mm512_setzero_ps());
        let flip = _mm_set1_epi8(i8::MIN);
        for ((q, d), x) in q.chunks_exact_mut(BLOCK).zip(d.iter_mut()).zip(x.chunks_exact(BLOCK)) {
            let v = [_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))];
            // `max(a, b)` is `a > b ? a : b`: a NaN lane stays 0 (as the portable select).
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[1]), _mm512_max_ps(_mm512_abs_ps(v[0]), zero)));
            let poison = _mm512_add_ps(_mm512_mul_ps(v[0], zero), _mm512_mul_ps(v[1], zero));
            let finite = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(poison, poison) == u16::MAX;
            let inv = _mm512_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            for (half, v) in v.into_iter().enumerate() {
                let y = _mm512_add_ps(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(v, inv))), round);
                // The low byte of y's bits is the integer's; xor 0x80 adds the 128 offset.
                let bytes = _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_castps_si512(y)), flip);
                _mm_storeu_si128(q.as_mut_ptr().add(16 * half).cast(), bytes);
            }
            *d = if finite { amax / 127.0 } else { f32::NAN };
        }
    }
}

super::fast_math::simd_fn! {
    /// One row of [`quantize_rows`].
    fn quantize_row(x: &[f32], q: &mut [u8], d: &mut [f32]) -> () {
        for ((q, d), x) in q.chunks_exact_mut(BLOCK).zip(d.iter_mut()).zip(x.chunks_exact(BLOCK)) {
            *d = quantize_block(x, q);
        }
    }
}

/// Lanes of [`quantize_block`]'s maxima and sums (one 512-bit vector; a block is two).
const LANES: usize = 16;
const _: () = assert!(BLOCK.is_multiple_of(LANES), "a Q8_0 block is whole lanes");

/// One block of [`quantize_rows`]; returns its scale. Branch-free so that it vectorises.
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [u8]) -> f32 {
    // Lane-wise maxima and sums, combined at the end: one running sum over the block was a chain
    // of 32 dependent adds that no compiler may reorder (a third of the int8 GEMM's time).
    let (mut amax, mut poison) = ([0f32; LANES], [0f32; LANES]);
    for chunk in x.chunks_exact(LANES) {
        for ((m, s), &v) in amax.iter_mut().zip(&mut poison).zip(chunk) {
            *m = m.max(v.abs());
            // 0 · v is NaN exactly when v is not finite.
            *s += v * 0.0;
        }
    }
    let amax = amax.iter().fold(0f32, |m, &v| m.max(v));
    let poison = poison.iter().sum::<f32>();
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        // The integer sits in the low mantissa bits of `y` (a NaN gives some byte; the block's
        // scale is NaN then).
        let y = (v * inv).clamp(-127.0, 127.0) + ROUND;
        let r = (y.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
        *q = (r + 128) as u8;
    }
    amax / 127.0 + poison
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{PanelBlock, Tile, BLOCK, PANEL};
    use std::arch::x86_64::*;

    /// `R` activation rows (bytes `a`, row stride `k`; scales `d`, row stride k/32) times one
    /// 32-column panel, into `t`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VNNI; `a` holds `R` rows of `k` bytes and `d` `R` rows of k/32
    /// scales; `t.out` addresses `R` rows (stride `t.ldo`) of at least `t.cols` writable floats.
    ///
    /// # Safety
    /// None: it is never called.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile<const R: usize>(panel: &[PanelBlock], a: &[u8], d: &[f32], k: usize, t: Tile) {
        let kb = k / BLOCK;
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for (b, blk) in panel.iter().enumerate().take(kb) {
            let off0 = _mm512_loadu_si512(blk.offset.as_ptr().cast());
            let off1 = _mm512_loadu_si512(blk.offset.as_ptr().add(16).cast());
            let mut sums = [[off0, off1]; R];
            for g in 0..BLOCK / 4 {
                let w0 = _mm512_load_si512(blk.qs.as_ptr().add(g * PANEL * 4).cast());
                let w1 = _mm512_load_si512(blk.qs.as_ptr().add(g * PANEL * 4 + 64).cast());
                for (r, s) in sums.iter_mut().enumerate() {
                    let four = std::ptr::read_unaligned(a.as_ptr().add(r * k + b * BLOCK + g * 4).cast::<i32>());
                    let x = _mm512_set1_epi32(four);
                    s[0] = _mm512_dpbusd_epi32(s[0], x, w0);
                    s[1] = _mm512_dpbusd_epi32(s[1], x, w1);
                }
            }
            let s0 = _mm512_loadu_ps(blk.scale.as_ptr());
            let s1 = _mm512_loadu_ps(blk.scale.as_ptr().add(16));
            for (r, (acc, s)) in acc.iter_mut().zip(&sums).enumerate() {
                let da = _mm512_set1_ps(*d.get_unchecked(r * kb + b));
                acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(s0, da), acc[0]);
                acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_mul_ps(s1, da), acc[1]);
            }
        }
        for (half, start) in [0usize, 16].into_iter().enumerate() {
            let valid = t.cols.saturating_sub(start).min(16);
            if valid == 0 {
                continue;
            }
            let mask: __mmask16 = if valid == 16 { 0xffff } else { (1u16 << valid) - 1 };
            let bias = match t.bias {
                Some(b) => _mm512_maskz_loadu_ps(mask, b.as_ptr().add(start)),
                None => _mm512_setzero_ps(),
            };
            for (r, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(t.out.add(r * t.ldo + start), mask, _mm512_add_ps(acc[half], bias));
            }
        }
    }

    /// [`tile`] with AVX-VNNI's 256-bit registers: each 16-column half of the panel in turn
    /// (2 × 8 lanes; 3 rows use 6 int32 and 6 f32 of the 16 registers).
    ///
    /// # Safety
    /// As [`tile`], with AVX2, FMA and AVX-VNNI instead of AVX-512.
    ///
    /// # Safety
    /// None: it is never called.
    #[target_feature(enable = "avx2,fma,avxvnni")]
    pub(super) unsafe fn tile256<const R: usize>(panel: &[PanelBlock], a: &[u8], d: &[f32], k: usize, t: Tile) {
        let kb = k / BLOCK;
        for half in 0..2 {
            let start = half * 16;
            if t.cols <= start {
                break;
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for (b, blk) in panel.iter().enumerate().take(kb) {
                let off0 = _mm256_loadu_si256(blk.offset.as_ptr().add(start).cast());
                let off1 = _mm256_loadu_si256(blk.offset.as_ptr().add(start + 8).cast());
                let mut sums = [[off0, off1]; R];
                for g in 0..BLOCK / 4 {
                    let w0 = _mm256_loadu_si256(blk.qs.as_ptr().add(g * PANEL * 4 + start * 4).cast());
                    let w1 = _mm256_loadu_si256(blk.qs.as_ptr().add(g * PANEL * 4 + start * 4 + 32).cast());
                    for (r, s) in sums.iter_mut().enumerate() {
                        let four = std::ptr::read_unaligned(a.as_ptr().add(r * k + b * BLOCK + g * 4).cast::<i32>());
                        let x = _mm256_set1_epi32(four);
                        s[0] = _mm256_dpbusd_avx_epi32(s[0], x, w0);
                        s[1] = _mm256_dpbusd_avx_epi32(s[1], x, w1);
                    }
                }
                let s0 = _mm256_loadu_ps(blk.scale.as_ptr().add(start));
                let s1 = _mm256_loadu_ps(blk.scale.as_ptr().add(start + 8));
                for (r, (acc, s)) in acc.iter_mut().zip(&sums).enumerate() {
                    let da = _mm256_set1_ps(*d.get_unchecked(r * kb + b));
                    acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(s0, da), acc[0]);
                    acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(s1, da), acc[1]);
                }
            }
            for (part, col0) in [start, start + 8].into_iter().enumerate() {
                let valid = t.cols.saturating_sub(col0).min(8);
                for (r, acc) in acc.iter().enumerate() {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[part]);
                    let dst = t.out.add(r * t.ldo + col0);
                    for (i, v) in lanes.iter().enumerate().take(valid) {
                        *dst.add(i) = v + t.bias.map_or(0.0, |b| b[col0 + i]);
                    }
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod vnni {
    use super::{PanelBlock, Tile};
    /// Never called: [`super::available`] is false off x86-64.
    ///
    /// # Safety
    /// None: it is never called.
    pub(super) unsafe fn tile<const R: usize>(_: &[PanelBlock], _: &[u8], _: &[f32], _: usize, _: Tile) {
        unreachable!("the int8 GEMM runs on x86-64 only")
    }
    /// Never called: [`super::available`] is false off x86-64.
    ///
    /// # Safety
    /// None: it is never called.
    pub(super) unsafe fn tile256<const R: usize>(_: &[PanelBlock], _: &[u8], _: &[f32], _: usize, _: Tile) {
        unreachable!("the int8 GEMM runs on x86-64 only")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_0 bytes of an `[n, k]` matrix with deterministic values (scale, then 32 bytes per block).
    fn q8_0_matrix(n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut dense = vec![0f32; n * k];
        for row in 0..n {
            for b in 0..k / BLOCK {
                let scale = half::f16::from_f32(0.01 + 0.001 * ((row * 7 + b * 3) % 11) as f32);
                bytes.extend_from_slice(&scale.to_le_bytes());
                for i in 0..BLOCK {
                    let q = (((row * 31 + b * 17 + i * 13) % 255) as i32 - 127) as i8;
                    bytes.push(q as u8);
                    dense[row * k + b * BLOCK + i] = scale.to_f32() * q as f32;
                }
            }
        }
        (bytes, dense)
    }

    /// The product the kernel must reproduce: quantized activations times the Q8_0 weight, in f64.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, bias: Option<&[f32]>) -> Vec<f32> {
        let (qa, da) = quantize_rows(x, m, k);
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f64;
                for p in 0..k {
                    let a = (qa[i * k + p] as i32 - 128) as f64 * da[i * (k / BLOCK) + p / BLOCK] as f64;
                    acc += a * w[j * k + p] as f64;
                }
                out[i * n + j] = acc as f32 + bias.map_or(0.0, |b| b[j]);
            }
        }
        out
    }

    fn input(m: usize, k: usize) -> Vec<f32> {
        (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect()
    }

    /// The inline rounding is `f32::round` cast to i8 everywhere it can differ: halves, the values
    /// next to them, saturation, infinities and NaN.
    #[test]
    fn round_to_i8_is_round_then_cast() {
        let mut values = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e9, -1e9, 127.5, -128.5, 126.5, -127.5, 0.0, -0.0];
        for i in -130i32..=130 {
            for v in [i as f32 + 0.5, i as f32 - 0.5, i as f32] {
                values.extend([v, f32::from_bits(v.to_bits() + 1), f32::from_bits(v.to_bits().wrapping_sub(1))]);
            }
        }
        for v in values {
            assert_eq!(round_to_i8(v), v.round() as i8, "{v:e}");
        }
    }

    /// A Q4_K matrix is held as its dequantized values rounded to Q8_0 (the same blocks, scales and
    /// offsets as through f32), and its product tracks the Q4_K values' within the 8-bit rounding;
    /// data of another size is refused.
    #[test]
    fn q4k_rows_round_to_q8_0_as_their_dequantized_values() {
        use candle_core::quantized::{GgmlDType, QTensor};
        let cpu = candle_core::Device::Cpu;
        let (n, k) = (37, 512);
        // A row of zeros: blocks whose step is 0.
        let zeros = candle_core::Tensor::zeros((1, k), candle_core::DType::F32, &cpu).unwrap();
        let w = candle_core::Tensor::cat(&[&zeros, &crate::kernels::test_values::spread((n - 1, k), 5, &cpu)], 0).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        let data = q.data().unwrap();
        let direct = PackedQ8::from_q4k(&data, n, k).unwrap();
        let dequantized = q.dequantize(&cpu).unwrap();
        let via_f32 = PackedQ8::from_f32(&dequantized).unwrap().unwrap();
        assert_eq!((direct.n, direct.k, direct.blocks.len()), (via_f32.n, via_f32.k, via_f32.blocks.len()));
        // Candle rounds to Q8_0 with NEON code on aarch64 (where no int8 kernel takes Q4_K), elsewhere
        // with the scalar code that `q4k_to_q8_0` follows.
        if cfg!(not(all(target_arch = "aarch64", target_feature = "neon"))) {
            for (a, b) in direct.blocks.iter().zip(&via_f32.blocks) {
                assert!(a.qs == b.qs && a.scale == b.scale && a.offset == b.offset);
            }
        }
        assert!(PackedQ8::from_q4k(&data[..data.len() - 144], n, k).is_none());
        assert!(PackedQ8::from_q4k(&data, n, k - 32).is_none());
        if !available() {
            return;
        }
        let m = 9;
        let x = input(m, k);
        let values = dequantized.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = reference(&x, &values, m, n, k, None);
        let got = direct.matmul(&x, m, None).unwrap();
        let max = want.iter().fold(1f32, |a, v| a.max(v.abs()));
        let err = got.iter().zip(&want).fold(0f32, |a, (g, r)| a.max((g - r).abs()));
        assert!(err < 0.02 * max, "max error {err} against {max}");
    }

    #[test]
    fn matches_the_quantized_product_at_odd_shapes() {
        if !available() {
            return;
        }
        // Partial panels and halves (n = 40, 16, 7), partial row tiles (m = 1, 3, 70), a multi-chunk m;
        // every kernel this CPU has.
        for &(m, n, k) in &[(1, 16, 32), (3, 40, 64), (70, 7, 96), (130, 64, 384)] {
            let (bytes, w) = q8_0_matrix(n, k);
            let packed = PackedQ8::from_q8_0(&bytes, n, k).expect("valid Q8_0");
            let x = input(m, k);
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.5 - 3.0).collect();
            for kernel in [Kernel::Avx512Vnni, Kernel::AvxVnni].into_iter().filter(|k| k.runs_here()) {
                for b in [None, Some(bias.as_slice())] {
                    let got = packed.matmul_with(kernel, &x, m, b).unwrap();
                    let want = reference(&x, &w, m, n, k, b);
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{kernel:?} m={m} n={n} k={k}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn close_to_the_f32_product() {
        if !available() {
            return;
        }
        let (m, n, k) = (20, 48, 256);
        let (bytes, w) = q8_0_matrix(n, k);
        let packed = PackedQ8::from_q8_0(&bytes, n, k).expect("valid Q8_0");
        let x = input(m, k);
        let got = packed.matmul(&x, m, None).unwrap();
        let mut max_err = 0f32;
        let mut max_ref = 0f32;
        for i in 0..m {
            for j in 0..n {
                let exact: f32 = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
                max_err = max_err.max((got[i * n + j] - exact).abs());
                max_ref = max_ref.max(exact.abs());
            }
        }
        // 8-bit activations: about 0.4 % of a block's largest value per product.
        assert!(max_err <= 0.01 * max_ref, "error {max_err} against {max_ref}");
    }

    #[test]
    fn non_finite_inputs_stay_non_finite() {
        if !available() {
            return;
        }
        let (bytes, _) = q8_0_matrix(16, 32);
        let packed = PackedQ8::from_q8_0(&bytes, 16, 32).expect("valid Q8_0");
        let mut x = input(2, 32);
        x[5] = f32::NAN;
        x[40] = f32::INFINITY;
        let got = packed.matmul(&x, 2, None).unwrap();
        assert!(packed.matmul(&x, 3, None).is_err());
        assert!(got.iter().all(|v| !v.is_finite()), "{got:?}");
    }

    #[test]
    fn avx512_row_quantization_matches_the_portable_one() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let k = 32 * 9;
            let mut x: Vec<f32> = (0..k).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 10f32.powi((i / 32) as i32 - 4)).collect();
            x[32..64].fill(0.0); // an all-zero block
            x[64..96].fill(-0.0);
            x[100] = f32::NAN;
            x[140] = f32::NEG_INFINITY;
            x[200] = 127.5; // ties round to even
            x[201] = -0.5;
            let (mut q0, mut d0) = (vec![0u8; k], vec![0f32; k / 32]);
            let (mut q1, mut d1) = (vec![0u8; k], vec![0f32; k / 32]);
            quantize_row(&x, &mut q0, &mut d0);
            // SAFETY: AVX-512F was detected.
            unsafe { quantize_avx512::quantize_row(&x, &mut q1, &mut d1) };
            for b in 0..k / 32 {
                assert_eq!(d0[b].is_nan(), d1[b].is_nan(), "block {b}");
                if d0[b].is_finite() {
                    assert_eq!(d0[b].to_bits(), d1[b].to_bits(), "block {b} scale");
                    assert_eq!(q0[b * 32..][..32], q1[b * 32..][..32], "block {b} bytes");
                }
            }
            assert!(d1[3].is_nan() && d1[4].is_nan() && d1[6].is_finite());
        }
    }

    #[test]
    fn concatenated_matrices_multiply_as_their_parts() {
        if !available() {
            return;
        }
        let (m, k) = (5, 64);
        let parts: Vec<PackedQ8> = [32, 64, 7].iter().map(|&n| PackedQ8::from_q8_0(&q8_0_matrix(n, k).0, n, k).expect("valid Q8_0")).collect();
        let joined = PackedQ8::concat(&parts.iter().collect::<Vec<_>>()).expect("whole panels");
        assert_eq!((joined.n(), joined.k()), (103, k));
        let x = input(m, k);
        let got = joined.matmul(&x, m, None).unwrap();
        let mut col = 0;
        for p in &parts {
            let want = p.matmul(&x, m, None).unwrap();
            for i in 0..m {
                assert_eq!(got[i * 103 + col..][..p.n()], want[i * p.n()..][..p.n()]);
            }
            col += p.n();
        }
        let partial = PackedQ8::from_q8_0(&q8_0_matrix(7, k).0, 7, k).expect("valid Q8_0");
        assert!(PackedQ8::concat(&[&partial, &parts[0]]).is_none());
        assert!(PackedQ8::concat(&[&parts[0], &PackedQ8::from_q8_0(&q8_0_matrix(32, 32).0, 32, 32).expect("valid")]).is_none());
        assert!(PackedQ8::concat(&[]).is_none());
    }

    #[test]
    fn refuses_bad_sizes() {
        let (bytes, _) = q8_0_matrix(4, 64);
        assert!(PackedQ8::from_q8_0(&bytes, 4, 64).is_some());
        assert!(PackedQ8::from_q8_0(&bytes[1..], 4, 64).is_none());
        assert!(PackedQ8::from_q8_0(&bytes, 4, 48).is_none());
        assert!(PackedQ8::from_q8_0(&bytes, 8, 64).is_none());
        assert!(PackedQ8::from_q8_0(&bytes, usize::MAX, 64).is_none());
        if !available() {
            return;
        }
        // Pre-rounded activations multiply as the f32 ones do; lengths that disagree are errors.
        let w = PackedQ8::from_q8_0(&bytes, 4, 64).unwrap();
        let x: Vec<f32> = (0..3 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let (q, d) = quantize_rows(&x, 3, 64);
        assert_eq!(w.matmul_quantized(&q, &d, 3, None).unwrap(), w.matmul(&x, 3, None).unwrap());
        assert!(w.matmul_quantized(&q[1..], &d, 3, None).is_err());
        assert!(w.matmul_quantized(&q, &d[1..], 3, None).is_err());
        assert!(w.matmul_quantized(&q, &d, 3, Some(&[0.0; 3])).is_err());
        let mut out = vec![std::mem::MaybeUninit::new(0f32); 11];
        assert!(w.matmul_into(&x, 3, None, &mut out).is_err());
    }
}
