//! The geometric product: a CPU kernel over the 256-term gather table (the fast path), plus the two
//! tensor-op forms lgatr has (dense GEMM against the 16×16×16 table, sparse gather) which also
//! serve as the fallback on other devices.
use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::algebra::{geometric_product_table, GP_INDEX, GP_SIGN};
use super::kernels::{par_rows, Field};
use crate::error::{Error, Result};
use crate::kernels::fast_math::madd;

/// `(R, 2·C·16 + P)` rows `[left (C, 16) | right (C, 16) | pass (P)]` →
/// `(R, C·16 + P)` rows `[left_c · right_c (C, 16) | pass (P)]`.
#[derive(Debug, Clone, Copy)]
struct GpKernel {
    channels: usize,
    pass: usize,
    bivector: bool,
}

/// Channels to a tile: one AVX-512 register of f32 per multivector component.
const TILE: usize = 16;

impl GpKernel {
    /// The kernel on `rows` rows of `src`, `row_products` computing each row's channel products.
    fn run<T: Field>(&self, src: &[T], rows: usize, row_products: impl Fn(&[T], &[T], &mut [T], bool) + Sync) -> Vec<T> {
        let (c, p, bivector) = (self.channels, self.pass, self.bivector);
        par_rows(src, rows, 2 * c * 16 + p, c * 16 + p, |row_in, row_out| {
            let (left, rest) = row_in.split_at(c * 16);
            let (right, pass) = rest.split_at(c * 16);
            let (gp, pass_out) = row_out.split_at_mut(c * 16);
            row_products(left, right, gp, bivector);
            pass_out.copy_from_slice(pass);
        })
    }
}

/// Channels `first..first + n` (`n ≤ TILE`) of the `(C, 16)` multivectors `mv` as
/// `tile[component][channel]`, zero past `n`.
#[inline(always)]
fn load_tile<T: Field>(mv: &[T], first: usize, n: usize) -> [[T; TILE]; 16] {
    let mut tile = [[T::default(); TILE]; 16];
    for q in 0..n {
        let at = (first + q) * 16;
        for (j, component) in tile.iter_mut().enumerate() {
            component[q] = mv[at + j];
        }
    }
    tile
}

/// One row's channel-wise geometric products `gp[c] = left[c] · right[c]`, a tile of channels at
/// a time, with `madd(a, b, c) = a · b + c`. The sign is a multiply, not a branch: with the branch
/// LLVM vectorised across the 16 gather terms (with gathers) instead of across the tile.
#[inline(always)]
fn gp_row<T: Field>(left: &[T], right: &[T], gp: &mut [T], bivector: bool, madd: impl Fn(T, T, T) -> T) {
    let c = gp.len() / 16;
    let mut ch = 0;
    while ch < c {
        let l = TILE.min(c - ch);
        let (xs, ys) = (load_tile(left, ch, l), load_tile(right, ch, l));
        let mut acc = [[T::default(); TILE]; 16];
        for (i, a) in acc.iter_mut().enumerate() {
            if !bivector && (5..11).contains(&i) {
                continue;
            }
            for j in 0..16 {
                let (x, y, sign) = (&xs[j], &ys[GP_INDEX[i][j]], T::from_f64(GP_SIGN[i][j]));
                for q in 0..TILE {
                    a[q] = madd(x[q] * sign, y[q], a[q]);
                }
            }
        }
        for q in 0..l {
            let at = (ch + q) * 16;
            for (i, a) in acc.iter().enumerate() {
                gp[at + i] = a[q];
            }
        }
        ch += l;
    }
}

crate::kernels::fast_math::simd_fn! {
    /// [`gp_row`] in f32 at the CPU's vector width, with fused multiply-adds where it has them
    /// (the baseline build ran at SSE width: ~7 % of an L-GATr forward, 3.5 % this way).
    fn gp_row_f32<FUSED>(left: &[f32], right: &[f32], gp: &mut [f32], bivector: bool) -> () {
        gp_row(left, right, gp, bivector, madd::<FUSED>)
    }
}

/// [`gp_row`] with a separate multiply and add (f64).
fn gp_row_unfused<T: Field>(left: &[T], right: &[T], gp: &mut [T], bivector: bool) {
    gp_row(left, right, gp, bivector, |a, b, c| a * b + c)
}

impl CustomOp1 for GpKernel {
    fn name(&self) -> &'static str {
        "lgatr-geometric-product"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (o1, o2) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("lgatr gp kernel: input must be contiguous".into()))?;
        let (rows, w) = layout.shape().dims2()?;
        if w != 2 * self.channels * 16 + self.pass {
            candle_core::bail!("lgatr gp kernel: width {w} != 2·{}·16 + {}", self.channels, self.pass);
        }
        let out_shape = Shape::from((rows, self.channels * 16 + self.pass));
        match storage {
            CpuStorage::F32(v) => Ok((CpuStorage::F32(self.run(&v[o1..o2], rows, gp_row_f32)), out_shape)),
            CpuStorage::F64(v) => Ok((CpuStorage::F64(self.run(&v[o1..o2], rows, gp_row_unfused)), out_shape)),
            other => candle_core::bail!("lgatr gp kernel: unsupported dtype {:?}", other.dtype()),
        }
    }
}

/// The dense table as a `(256, 16)` tensor `T[(j,k), i] = GP[i, j, k]`.
pub(crate) fn gp_table_tensor(device: &candle_core::Device, dtype: DType) -> Result<Tensor> {
    let gp = geometric_product_table();
    let mut t = vec![0.0f64; 256 * 16];
    for (i, gpi) in gp.iter().enumerate() {
        for j in 0..16 {
            for k in 0..16 {
                t[(j * 16 + k) * 16 + i] = gpi[j][k];
            }
        }
    }
    Ok(Tensor::from_vec(t, (256, 16), device)?.to_dtype(dtype)?)
}

/// Dense form: `outer(x, y) (R, 256) @ GP (256, 16)` on `(R, 16)` rows.
pub(crate) fn gp_dense_rows(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let (r, _) = x.dims2()?;
    let table = gp_table_tensor(x.device(), x.dtype())?;
    let outer = x.unsqueeze(2)?.broadcast_mul(&y.unsqueeze(1)?)?.reshape((r, 256))?;
    Ok(outer.matmul(&table)?)
}

/// Gather form (lgatr's `sparse_gp`): `Σ_j sign[i,j] · x[j] · y[idx[i,j]]` on `(R, 16)` rows.
pub(crate) fn gp_gather_rows(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let (r, _) = x.dims2()?;
    let dev = x.device();
    let idx: Vec<u32> = GP_INDEX.iter().flatten().map(|&k| k as u32).collect();
    let idx = Tensor::from_vec(idx, 256, dev)?;
    let signs: Vec<f64> = GP_SIGN.iter().flatten().copied().collect();
    let signs = Tensor::from_vec(signs, (16, 16), dev)?.to_dtype(x.dtype())?;
    let yg = y.contiguous()?.index_select(&idx, 1)?.reshape((r, 16, 16))?;
    let prod = yg.broadcast_mul(&signs)?.broadcast_mul(&x.unsqueeze(1)?)?;
    Ok(prod.sum(2)?)
}

fn use_kernel(t: &Tensor) -> bool {
    super::kernels::kernel_ok(t)
}

/// The geometric product channel by channel on fused rows: `(R, 2·C·16 + P)` =
/// `[left | right | pass]` → `(R, C·16 + P)` = `[left · right | pass]`; with `bivector = false`
/// the grade-2 part of the product is zeroed (lgatr's `PrimitivesConfig.bivector`).
pub fn gp_fused(lr: &Tensor, channels: usize, pass: usize, bivector: bool) -> Result<Tensor> {
    let (r, w) = lr.dims2()?;
    if w != 2 * channels * 16 + pass {
        return Err(Error::Input(format!("gp_fused: width {w} != 2·{channels}·16 + {pass}")));
    }
    if use_kernel(lr) {
        let lr = lr.contiguous()?;
        return Ok(lr.apply_op1_no_bwd(&GpKernel { channels, pass, bivector })?);
    }
    let cw = channels * 16;
    let left = lr.narrow(1, 0, cw)?.contiguous()?.reshape((r * channels, 16))?;
    let right = lr.narrow(1, cw, cw)?.contiguous()?.reshape((r * channels, 16))?;
    let mut g = gp_dense_rows(&left, &right)?;
    if !bivector {
        let mask: Vec<f64> = (0..16).map(|i| if (5..11).contains(&i) { 0.0 } else { 1.0 }).collect();
        let mask = Tensor::from_vec(mask, 16, lr.device())?.to_dtype(lr.dtype())?;
        g = g.broadcast_mul(&mask)?;
    }
    let g = g.reshape((r, cw))?;
    if pass == 0 {
        Ok(g)
    } else {
        Ok(Tensor::cat(&[&g, &lr.narrow(1, 2 * cw, pass)?], 1)?)
    }
}

/// Which implementation [`geometric_product_with`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpImpl {
    /// The CPU kernel (falls back to `Dense` elsewhere).
    Kernel,
    /// Outer product and a `(256, 16)` GEMM.
    Dense,
    /// `index_select` gather and a sum.
    Gather,
}

/// `geometric_product(x, y)` of lgatr on `(..., 16)` tensors (broadcast against each other).
pub fn geometric_product(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    geometric_product_with(x, y, GpImpl::Kernel)
}

/// [`geometric_product`] with an explicit implementation.
pub fn geometric_product_with(x: &Tensor, y: &Tensor, imp: GpImpl) -> Result<Tensor> {
    if x.dims().last() != Some(&16) || y.dims().last() != Some(&16) {
        return Err(Error::Input(format!(
            "geometric_product expects (..., 16), got {:?} and {:?}",
            x.dims(),
            y.dims()
        )));
    }
    let shape = x.shape().broadcast_shape_binary_op(y.shape(), "geometric_product")?;
    let x = x.broadcast_as(&shape)?.contiguous()?;
    let y = y.broadcast_as(&shape)?.contiguous()?;
    let r = shape.elem_count() / 16;
    let (x2, y2) = (x.reshape((r, 16))?, y.reshape((r, 16))?);
    let out = match imp {
        GpImpl::Kernel if use_kernel(&x2) => {
            // rows of TILE products, so that the kernel's SIMD tile is full
            let pad = r.next_multiple_of(TILE) - r;
            let (xp, yp) = (x2.pad_with_zeros(0, 0, pad)?, y2.pad_with_zeros(0, 0, pad)?);
            let rows = (r + pad) / TILE;
            let lr = Tensor::cat(&[&xp.reshape((rows, TILE * 16))?, &yp.reshape((rows, TILE * 16))?], 1)?;
            gp_fused(&lr, TILE, 0, true)?.reshape((r + pad, 16))?.narrow(0, 0, r)?
        }
        GpImpl::Kernel | GpImpl::Dense => gp_dense_rows(&x2, &y2)?,
        GpImpl::Gather => gp_gather_rows(&x2, &y2)?,
    };
    Ok(out.reshape(shape)?)
}
