//! The f32 CPU products of the linear layers: `x · w + bias` for a weight held transposed in f32 or
//! f16, or narrower (Q8_0 rows) widened block by block, in output blocks that the threads take from
//! rayon's queue as they come free, the bias (and an exact GELU) added in one pass after.
use candle_core::{DType, Tensor};

/// The bias's elements when the product can add it in the GEMM: an f32 CPU bias that records no
/// gradient (`Some(None)`: no bias); `None` when it must be added by a Candle op.
pub(crate) fn frozen_bias(bias: Option<&Tensor>) -> candle_core::Result<Option<Option<Vec<f32>>>> {
    match bias {
        None => Ok(Some(None)),
        Some(b) if b.track_op() => Ok(None),
        Some(b) => Ok(crate::kernels::cpu_slice::with_contiguous(b, |b: &[f32]| b.to_vec())?.map(Some)),
    }
}

/// A `[rows, n]` product written by `fill(out)` (a GEMM that overwrites every element, handed
/// the buffer's uninitialised storage), then the bias added to every row in one parallel pass;
/// zeros plus the bias when `k` is 0 (the GEMM writes nothing then). A GEMM accumulating into
/// bias rows written beforehand read them back from memory inside its kernel: DA-V2-Small 518²,
/// every linear so, ran 6 % slower than this.
pub(crate) fn product_plus_bias(rows: usize, n: usize, k: usize, bias: Option<&[f32]>, post: Post, fill: impl FnOnce(*mut f32)) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out: Vec<f32> = if k == 0 {
        vec![0f32; rows * n]
    } else {
        let mut out = Vec::with_capacity(rows * n);
        fill(out.spare_capacity_mut().as_mut_ptr().cast());
        // SAFETY: `fill` wrote every one of the `rows · n` elements.
        unsafe { out.set_len(rows * n) };
        out
    };
    if bias.is_some() || post != Post::None {
        out.par_chunks_mut(n.max(1) * BIAS_ROWS_PER_TASK).for_each(|c| finish_rows(c, n, bias, post));
    }
    out
}

/// Rows per task of the bias pass.
pub(crate) const BIAS_ROWS_PER_TASK: usize = 16;

/// What follows a linear layer's product in the same pass as its bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Post {
    /// Nothing.
    None,
    /// Exact (erf) GELU.
    GeluErf,
}

/// Adds `bias` (`n` values) to every `n`-long row of `out` (nothing without one), then applies `post`.
pub(crate) fn finish_rows(out: &mut [f32], n: usize, bias: Option<&[f32]>, post: Post) {
    if let Some(b) = bias {
        out.chunks_exact_mut(n.max(1)).for_each(|row| row.iter_mut().zip(b).for_each(|(o, &v)| *o += v));
    }
    if post == Post::GeluErf {
        crate::kernels::fast_math::gelu_erf_in_place(out);
    }
}

/// How a block of a weight's values lies in memory.
#[derive(Clone, Copy)]
enum Layout {
    /// `[nb, k]` row-major: output column `j`'s weights contiguous.
    OutIn,
    /// `[k, ·]` rows `stride` apart, the block's `nb` columns first in each: input feature `p`'s
    /// weights contiguous.
    InOut { stride: usize },
}

/// `out[:, j0 .. j0 + nb] (+)= x [rows, k] · w` for `x` row-major with row stride `ldx`, a weight
/// block `w` of `nb` output columns laid out as `layout` says, and the row-major `[rows, n]` output
/// at `out` (read first when `accumulate`), on this thread.
///
/// # Safety
/// `out` addresses `rows × n` floats that no other task writes in columns `j0 .. j0 + nb`;
/// `xs` holds `rows` rows of `k` floats `ldx` apart and `ws` the block's `nb × k` values at its layout.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into_columns(out: *mut f32, n: usize, j0: usize, xs: &[f32], ldx: usize, rows: usize, k: usize, ws: &[f32], layout: Layout, nb: usize, accumulate: bool) {
    let (rhs_cs, rhs_rs) = match layout {
        Layout::OutIn => (k as isize, 1),
        Layout::InOut { stride } => (1, stride as isize),
    };
    gemm::gemm(
        rows, nb, k,
        out.add(j0), 1, n as isize, accumulate,
        xs.as_ptr(), 1, ldx as isize,
        ws.as_ptr(), rhs_cs, rhs_rs,
        1.0, 1.0, false, false, false, gemm::Parallelism::None,
    );
}

/// `x [rows, k] · w + bias` for row-major f32 `x` and a transposed f32 weight `w [k, n]`: blocks of
/// the output, one single-threaded GEMM each, taken by the threads as they come free (see
/// [`OutputBlocks`]). Then the bias.
pub(crate) fn xw_plus_bias(xs: &[f32], rows: usize, k: usize, ws: &[f32], n: usize, bias: Option<&[f32]>, post: Post) -> Vec<f32> {
    // SAFETY: `out` is rows × n with this call its only writer, `xs` rows × k, `ws` k × n.
    product_plus_bias(rows, n, k, bias, post, |out| unsafe { blocked_xw_into(out, xs, k, rows, k, ws, n, false) })
}

/// `out (+)= x [rows, k] · w` for `x` row-major with row stride `ldx`, a row-major `w [k, n]` and
/// the row-major `[rows, n]` output, in [`OutputBlocks`] taken by the threads as they come free.
///
/// # Safety
/// `out` addresses `rows × n` floats that nothing else touches meanwhile; `xs` holds `rows` rows of
/// `k` floats `ldx` apart and `ws` `k × n` values.
#[allow(clippy::too_many_arguments)]
unsafe fn blocked_xw_into(out: *mut f32, xs: &[f32], ldx: usize, rows: usize, k: usize, ws: &[f32], n: usize, accumulate: bool) {
    use rayon::prelude::*;
    let blocks = OutputBlocks::new(rows, k, n, rayon::current_num_threads());
    let dst = crate::kernels::cpu_slice::SharedOut(out);
    (0..blocks.count()).into_par_iter().for_each(|b| {
        let ((i0, mr), (j0, nc)) = blocks.block(b);
        // SAFETY: this task alone writes rows i0 .. i0 + mr, columns j0 .. j0 + nc of the rows × n
        // output; `xs[i0 · ldx..]` holds those mr rows of k floats and `ws[j0..]` the block's nc
        // columns of the k × n weight, rows n apart.
        unsafe { gemm_into_columns(dst.at(i0 * n), n, j0, &xs[i0 * ldx..], ldx, mr, k, &ws[j0..], Layout::InOut { stride: n }, nc, accumulate) };
    });
}

/// Blocks per thread of an f32 linear's output: enough that a thread slowed by another tenant of
/// the host leaves the other little to wait for.
const BLOCKS_PER_THREAD: usize = 8;
/// The depth from which a product takes the [`DEEP`] block shape ([`BlockShape::for_depth`]).
const DEEP_FROM: usize = 768;

/// The smallest output block an f32 linear is cut into. Each block packs its rows of `x` again
/// once per column block and its columns of the weight once per row block; the `gemm` crate's
/// microkernel is 64 columns wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockShape {
    /// Fewest columns in a block.
    min_cols: usize,
    /// Columns are cut in multiples of this.
    col_step: usize,
    /// Fewest rows in a block.
    min_rows: usize,
}

/// Products 768 features deep and more (CHMv2's, DA-V2-S's MLP down projection): 96-column blocks
/// kept the packed weight blocks small; 192 columns and shorter rows ran CHMv2 1.11× slower.
const DEEP: BlockShape = BlockShape { min_cols: 96, col_step: 16, min_rows: 256 };
/// Shallower products (the ViT-S linears, L-GATr's maps, SegFormer's): 96-column blocks ran their
/// GEMMs ~8 % slower than whole (a 32-column tail kernel, `x` packed per block), so columns come
/// whole kernel widths at a time, at least three, and rows are cut shorter instead.
const SHALLOW: BlockShape = BlockShape { min_cols: 192, col_step: 64, min_rows: 128 };

impl BlockShape {
    /// The shape for a product `k` features deep: [`DEEP`] from [`DEEP_FROM`], else [`SHALLOW`].
    fn for_depth(k: usize) -> BlockShape {
        if k >= DEEP_FROM { DEEP } else { SHALLOW }
    }
}

/// How an f32 linear's `[rows, n]` output is cut into blocks. The `gemm` crate's own threading
/// splits each depth step's work evenly between the threads and waits for both: on a shared
/// 2-vCPU host one thread often ran ~15 % of the time alone. Blocks taken from rayon's queue
/// balance instead: interleaved A/B on that host, CHMv2 f32 0.81–0.95× and DA-V2-Small 0.92×
/// the time of the crate's split (the deep products); the shallow ones too, L-GATr 0.93× and
/// DA-V2-Small 0.91–0.96×. Outputs bit-identical.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OutputBlocks {
    rows: usize,
    n: usize,
    block_rows: usize,
    block_cols: usize,
    col_blocks: usize,
}

impl OutputBlocks {
    /// Columns first (see [`BlockShape`] for the depth `k`), then rows until there are
    /// [`BLOCKS_PER_THREAD`] per thread or the minimums stop it; one block on one thread.
    fn new(rows: usize, k: usize, n: usize, threads: usize) -> Self {
        let shape = BlockShape::for_depth(k);
        // One thread: one block, `x` packed once.
        let target = if threads > 1 { BLOCKS_PER_THREAD * threads } else { 1 };
        let block_cols = n.div_ceil(target).next_multiple_of(shape.col_step).max(shape.min_cols).min(n).max(1);
        let col_blocks = n.div_ceil(block_cols);
        let row_blocks = target.div_ceil(col_blocks.max(1)).min(rows / shape.min_rows).max(1);
        let block_rows = rows.div_ceil(row_blocks).max(1);
        OutputBlocks { rows, n, block_rows, block_cols, col_blocks }
    }

    /// How many blocks there are (none for an empty output).
    fn count(&self) -> usize {
        self.rows.div_ceil(self.block_rows) * self.col_blocks
    }

    /// Block `b`'s (first row, rows) and (first column, columns).
    fn block(&self, b: usize) -> ((usize, usize), (usize, usize)) {
        let (i0, j0) = ((b / self.col_blocks) * self.block_rows, (b % self.col_blocks) * self.block_cols);
        ((i0, self.block_rows.min(self.rows - i0)), (j0, self.block_cols.min(self.n - j0)))
    }
}

/// Floats of one widened block of an f16 or Q8_0 weight (1 MiB: it stays in L2 while its GEMM reads it).
const WIDE_BLOCK_FLOATS: usize = 1 << 18;

/// `x [rows, k] · wᵀ + bias` for a weight `w [n, k]` held narrower than f32 (Q8_0 rows):
/// `widen(j0, dst)` writes weight rows `j0 ..` into `dst` in f32. Blocks of weight rows are widened
/// into a per-thread buffer that stays in cache, and each block's GEMM writes its columns of the
/// output, the blocks in parallel. (Widening the whole matrix first wrote and re-read an f32 copy
/// through memory on every product: CHMv2 f16 was 6 % slower than f32.)
pub(crate) fn widened_xwt_plus_bias(xs: &[f32], rows: usize, k: usize, n: usize, bias: Option<&[f32]>, post: Post, widen: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    thread_local! {
        static WIDENED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let threads = rayon::current_num_threads();
    // At least four blocks per thread (balance), at most one L2-sized block each.
    let block = (WIDE_BLOCK_FLOATS / k.max(1)).min(n.div_ceil(4 * threads)).max(16).min(n.max(1));
    product_plus_bias(rows, n, k, bias, post, |out| {
        let dst = crate::kernels::cpu_slice::SharedOut(out);
        (0..n.div_ceil(block)).into_par_iter().for_each(|bi| {
            let (j0, nb) = (bi * block, block.min(n - bi * block));
            let product = |wide: &mut Vec<f32>| {
                // Grown once per thread, never zeroed again: `widen` writes every value.
                if wide.len() < nb * k {
                    wide.resize(nb * k, 0.0);
                }
                let wide = &mut wide[..nb * k];
                widen(j0, wide);
                // SAFETY: this task alone writes columns j0 .. j0 + nb of the rows × n output;
                // `xs` is rows × k, `wide` the block's nb × k values.
                unsafe { gemm_into_columns(dst.at(0), n, j0, xs, k, rows, k, wide, Layout::OutIn, nb, false) };
            };
            crate::kernels::cpu_slice::with_scratch(&WIDENED, product);
        });
    })
}

/// Floats of one widened slab of a transposed f16 weight (8 MiB: it stays in L3 while the GEMM
/// reads it, and a slab is at least [`MIN_SLAB_ROWS`] deep). CHMv2 f16 on an Intel Xeon (2 MiB L2):
/// 8 MiB 3.4 % faster than 4 MiB, 16 MiB 2.7 %, 1–2 MiB 1.4 % slower.
const WIDE_SLAB_FLOATS: usize = 1 << 21;
/// The fewest input features per slab: fewer make the output's passes the larger traffic.
const MIN_SLAB_ROWS: usize = 128;

/// `x [rows, k] · w + bias` for a transposed f16 weight `w [k, n]`: slabs of input features (all
/// `n` columns, contiguous in `w`) are widened to f32 in turn (`half`'s vectorised F16C / NEON
/// conversion, in parallel) and each slab's blocked GEMM ([`blocked_xw_into`], as f32's) adds
/// `x[:, slab] · slab` into the output. (Blocks of output columns widened one by one made every
/// block's GEMM pack all of `x` again: CHMv2's 4096-wide MLP, 64-column blocks, 11 MB of `x` each.)
pub(crate) fn half_xw_plus_bias(xs: &[f32], rows: usize, k: usize, ws: &[half::f16], n: usize, bias: Option<&[f32]>, post: Post) -> Vec<f32> {
    if crate::kernels::half_amx::runs_for(rows, k, n) {
        // SAFETY: the tiles run here; `out` is rows × n with this call its only writer, `xs` is
        // rows × k and `ws` k × n.
        return product_plus_bias(rows, n, k, bias, post, |out| unsafe { crate::kernels::half_amx::xw_into(out, xs, rows, k, ws, n) });
    }
    let depth = (WIDE_SLAB_FLOATS / n.max(1)).max(MIN_SLAB_ROWS);
    half_slabs_xw_plus_bias(xs, rows, k, ws, n, bias, post, depth)
}

/// [`half_xw_plus_bias`] with slabs of `depth` input features.
#[allow(clippy::too_many_arguments)]
fn half_slabs_xw_plus_bias(xs: &[f32], rows: usize, k: usize, ws: &[half::f16], n: usize, bias: Option<&[f32]>, post: Post, depth: usize) -> Vec<f32> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    thread_local! {
        static SLAB: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if n == 0 {
        return Vec::new();
    }
    let depth = depth.clamp(1, k.max(1));
    product_plus_bias(rows, n, k, bias, post, |out| {
        let multiply = |slab: &mut Vec<f32>| {
            for p0 in (0..k).step_by(depth) {
                let kb = depth.min(k - p0);
                // Grown once per thread, never zeroed again: the conversion writes every value.
                if slab.len() < kb * n {
                    slab.resize(kb * n, 0.0);
                }
                let slab = &mut slab[..kb * n];
                slab.par_chunks_mut(n).zip(ws[p0 * n..][..kb * n].par_chunks(n)).for_each(|(dst, src)| src.convert_to_f32_slice(dst));
                // SAFETY: `out` is rows × n and this is its only writer (the first slab overwrites
                // it, the others add); `xs[p0..]` holds the slab's columns of x, rows of kb floats
                // k apart; `slab` is kb × n.
                unsafe { blocked_xw_into(out, &xs[p0..], k, rows, kb, slab, n, p0 > 0) };
            }
        };
        crate::kernels::cpu_slice::with_scratch(&SLAB, multiply);
    })
}

/// `x [rows, k] · w + bias` computed in f32 on the CPU outside Candle's ops, for a weight held
/// transposed, `[k, n]`, in f32 or f16 (widened per product). `None` when `x`, `w` or the bias is
/// not on the CPU, has another dtype or records a gradient: then Candle's ops run.
pub(crate) fn cpu_f32_product(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, post: Post) -> candle_core::Result<Option<Tensor>> {
    if x.dtype() != DType::F32 || !x.device().is_cpu() || x.track_op() || w.track_op() {
        return Ok(None);
    }
    let Some(bias) = frozen_bias(bias)? else { return Ok(None) };
    let (rows, in_dim) = x.dims2()?;
    let (k, n) = w.dims2()?;
    if in_dim != k {
        candle_core::bail!("linear: input has {in_dim} features, the weight expects {k}");
    }
    let out = match w.dtype() {
        DType::F32 => crate::kernels::cpu_slice::with_contiguous(w, |ws: &[f32]| {
            crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| xw_plus_bias(xs, rows, k, ws, n, bias.as_deref(), post))
        })?,
        DType::F16 => crate::kernels::cpu_slice::with_contiguous(w, |ws: &[half::f16]| {
            crate::kernels::cpu_slice::with_contiguous(x, |xs: &[f32]| half_xw_plus_bias(xs, rows, k, ws, n, bias.as_deref(), post))
        })?,
        _ => return Ok(None),
    };
    match out.transpose()?.flatten() {
        Some(y) => Ok(Some(Tensor::from_vec(y, (rows, n), x.device())?)),
        None => Ok(None),
    }
}

/// `x [rows, k] · w + bias` for a weight held transposed (`[k, n]`, f32 or f16) by the CPU GEMM
/// with the bias added in one parallel pass; `None` where Candle's ops must run (not an f32 CPU
/// input, or a gradient to record).
pub fn cpu_xw_plus_bias(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Option<Tensor>> {
    cpu_f32_product(x, w, bias, Post::None)
}

/// The `gemm` crate's parallelism over every thread of the rayon pool (none with one thread).
pub(crate) fn pool_parallelism() -> gemm::Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    }
}

/// `dst[n × m] (+)= beta · a · b` for row-major `a` (`n × k`, transposed: stored `k × n`) and `b`
/// (`k × m`, transposed: stored `m × k`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(dst: &mut [f32], (n, m, k): (usize, usize, usize), a: &[f32], a_t: bool, b: &[f32], b_t: bool, beta: f32, add: bool, par: gemm::Parallelism) {
    let (a_cs, a_rs) = if a_t { (n as isize, 1) } else { (1, k as isize) };
    let (b_cs, b_rs) = if b_t { (k as isize, 1) } else { (1, m as isize) };
    assert!(dst.len() >= n * m && a.len() >= n * k && b.len() >= k * m, "product: operands shorter than their shapes");
    // SAFETY: the strides address `n × k`, `k × m` and `n × m` elements within the three slices,
    // whose lengths are checked above.
    unsafe {
        gemm::gemm(n, m, k, dst.as_mut_ptr(), 1, m as isize, add, a.as_ptr(), a_cs, a_rs, b.as_ptr(), b_cs, b_rs, if add { 1.0 } else { 0.0 }, beta, false, false, false, par);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f16 product over slabs of input features equals the f32 product of the widened weight,
    /// bias included, whatever the slab depth (one, several, a partial last one).
    #[test]
    fn f16_slabs_multiply_as_the_widened_weight() {
        let (rows, k, n) = (9, 70, 13);
        let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let w: Vec<half::f16> = (0..k * n).map(|i| half::f16::from_f32(((i * 53) % 97) as f32 / 48.0 - 1.0)).collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 / 7.0).collect();
        for depth in [1, 16, 64, 70, 500] {
            let got = half_slabs_xw_plus_bias(&x, rows, k, &w, n, Some(&bias), Post::None, depth);
            for r in 0..rows {
                for j in 0..n {
                    let want = bias[j] as f64 + (0..k).map(|p| x[r * k + p] as f64 * w[p * n + j].to_f64()).sum::<f64>();
                    assert!((got[r * n + j] as f64 - want).abs() < 1e-4, "depth {depth} at ({r}, {j})");
                }
            }
        }
    }

    /// The f32 product overwrites its uninitialised output and then adds the bias: with and
    /// without a bias, and with no input features (the bias alone, or zeros).
    #[test]
    fn f32_products_add_the_bias_after_the_gemm() {
        for (rows, k, n) in [(37, 19, 23), (3, 0, 5), (0, 4, 6), (600, 21, 400), (300, 800, 200)] {
            let x: Vec<f32> = (0..rows * k).map(|i| ((i * 31) % 89) as f32 / 44.0 - 1.0).collect();
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 17) % 83) as f32 / 41.0 - 1.0).collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 / 3.0 - 1.0).collect();
            for b in [Some(&bias[..]), None] {
                let got = xw_plus_bias(&x, rows, k, &w, n, b, Post::None);
                assert_eq!(got.len(), rows * n);
                for r in 0..rows {
                    for j in 0..n {
                        let want = b.map_or(0.0, |b| b[j] as f64) + (0..k).map(|p| x[r * k + p] as f64 * w[p * n + j] as f64).sum::<f64>();
                        assert!((got[r * n + j] as f64 - want).abs() < 1e-4, "{rows}×{k}×{n} bias {} at ({r}, {j})", b.is_some());
                    }
                }
            }
        }
    }

    /// The output blocks of an f32 linear cover every element once, at least the minimum size
    /// where the output allows it, several per thread where it is large enough.
    #[test]
    fn output_blocks_tile_the_output_once() {
        for (rows, k, n, threads) in [(0, 64, 5, 2), (5, 64, 0, 2), (1, 1, 1, 2), (681, 1024, 4096, 2), (681, 4096, 1024, 2), (1370, 384, 384, 2), (1370, 384, 1152, 2), (6400, 288, 288, 2), (600, 768, 400, 3), (100, 64, 37, 1), (16384, 32, 32, 2)] {
            let blocks = OutputBlocks::new(rows, k, n, threads);
            let shape = BlockShape::for_depth(k);
            let mut seen = vec![0u8; rows * n];
            for b in 0..blocks.count() {
                let ((i0, mr), (j0, nc)) = blocks.block(b);
                assert!(mr > 0 && nc > 0, "{rows} × {n}: empty block {b}");
                for i in i0..i0 + mr {
                    seen[i * n + j0..][..nc].iter_mut().for_each(|s| *s += 1);
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "{rows} × {n} on {threads} threads: not covered exactly once");
            if rows * n > 0 {
                assert!(blocks.block_cols >= shape.min_cols.min(n) && blocks.block_rows >= shape.min_rows.min(rows), "{blocks:?}");
                assert!(blocks.block_cols == n || blocks.block_cols.is_multiple_of(shape.col_step), "{blocks:?}");
            }
        }
        assert!(OutputBlocks::new(681, 1024, 4096, 2).count() >= 2 * BLOCKS_PER_THREAD);
        assert!(OutputBlocks::new(1370, 384, 384, 2).count() >= 2 * BLOCKS_PER_THREAD);
        assert!(OutputBlocks::new(1370, 384, 1152, 2).count() >= 2 * BLOCKS_PER_THREAD);
        assert_eq!(OutputBlocks::new(1370, 384, 384, 1).count(), 1);
    }
}
