//! Depthwise 2-D convolution (`groups == in_channels`) as a real kernel.
//!
//! Candle 0.11.1 runs a grouped convolution as one single-group convolution per group followed by a
//! concatenation, which is very slow for depthwise convs (SegFormer's Mix-FFN, MobileNets). This module
//! provides a direct NCHW kernel for the CPU (parallel over (batch, channel) planes with rayon), with
//! backward passes for the input and the weight, so that it is differentiable. On other devices it
//! falls back to Candle's grouped `conv2d`.
//!
//! Shapes: input `[B, C, H, W]`, weight `[C·m, 1, kh, kw]` (channel multiplier `m ≥ 1`; output
//! channel `o` reads input channel `o / m`, as PyTorch's `groups = C`), optional bias `[C·m]`,
//! output `[B, C·m, OH, OW]` with `OH = (H + 2p − d(kh − 1) − 1) / s + 1` (likewise `OW`).
//! f32 and f64 are computed natively; f16 and bf16 are computed in f32 and rounded once.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Module, Shape, Tensor};
use rayon::prelude::*;

use crate::error::Result;
use crate::weights::Vb;

/// Stride, padding (zero, symmetric) and dilation, the same along both spatial axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DepthwiseConfig {
    /// Stride (≥ 1).
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    /// Dilation (≥ 1).
    pub dilation: usize,
}

impl Default for DepthwiseConfig {
    fn default() -> Self {
        DepthwiseConfig { stride: 1, padding: 0, dilation: 1 }
    }
}

/// Which implementation a [`DepthwiseConv2d`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DepthwiseImpl {
    /// The direct kernel on the CPU, Candle's grouped conv elsewhere.
    #[default]
    Auto,
    /// Always Candle's grouped `conv2d` (the slow reference path).
    Grouped,
}

/// Depthwise conv: the direct kernel on the CPU, Candle's grouped `conv2d` on other devices.
/// Differentiable with respect to `x`, `w` and `bias`.
pub fn depthwise_conv2d(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, cfg: DepthwiseConfig) -> candle_core::Result<Tensor> {
    let g = Geom::new(x.dims(), w.dims(), cfg)?;
    let y = if x.device().is_cpu() && kernel_supports(x.dtype()) && x.dtype() == w.dtype() {
        let x = x.contiguous()?;
        let w = w.contiguous()?;
        x.apply_op2(&w, DwFwd { g })?
    } else {
        x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, g.c_in)?
    };
    add_bias(y, bias)
}

/// Depthwise conv through Candle's grouped `conv2d` (`groups = C`), on any device: the reference the
/// kernel is tested against, and the slow path it replaces.
pub fn depthwise_conv2d_grouped(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cfg: DepthwiseConfig,
) -> candle_core::Result<Tensor> {
    let g = Geom::new(x.dims(), w.dims(), cfg)?;
    let y = x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, g.c_in)?;
    add_bias(y, bias)
}

fn add_bias(y: Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match bias {
        None => Ok(y),
        Some(b) => {
            let c = y.dim(1)?;
            if b.dims() != [c] {
                candle_core::bail!("depthwise conv: bias has shape {:?}, expected [{c}]", b.dims());
            }
            y.broadcast_add(&b.reshape((1, c, 1, 1))?)
        }
    }
}

/// A depthwise conv layer (`weight [C·m, 1, kh, kw]`, optional `bias`).
#[derive(Debug, Clone)]
pub struct DepthwiseConv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    cfg: DepthwiseConfig,
    imp: DepthwiseImpl,
}

impl DepthwiseConv2d {
    /// From tensors in memory; `weight` must be `[C·m, 1, kh, kw]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>, cfg: DepthwiseConfig) -> Self {
        DepthwiseConv2d { weight, bias, cfg, imp: DepthwiseImpl::Auto }
    }

    /// Loads `weight [out_c, 1, k, k]` (and `bias [out_c]` when `bias`) under `vb`
    /// (PyTorch `nn.Conv2d(in_c, out_c, k, groups=in_c)` naming).
    pub fn load(vb: &Vb, out_c: usize, k: usize, cfg: DepthwiseConfig, bias: bool) -> Result<Self> {
        let weight = vb.get((out_c, 1, k, k), "weight")?;
        let bias = if bias { Some(vb.get(out_c, "bias")?) } else { None };
        Ok(Self::new(weight, bias, cfg))
    }

    /// Chooses the implementation (for benchmarks and cross-checks).
    pub fn set_impl(&mut self, imp: DepthwiseImpl) {
        self.imp = imp;
    }

    /// The weight `[C·m, 1, kh, kw]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for DepthwiseConv2d {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.imp {
            DepthwiseImpl::Auto => depthwise_conv2d(x, &self.weight, self.bias.as_ref(), self.cfg),
            DepthwiseImpl::Grouped => depthwise_conv2d_grouped(x, &self.weight, self.bias.as_ref(), self.cfg),
        }
    }
}

/// The geometry of one depthwise convolution.
#[derive(Debug, Clone, Copy)]
struct Geom {
    b: usize,
    c_in: usize,
    mult: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    s: usize,
    p: usize,
    d: usize,
}

impl Geom {
    fn new(x: &[usize], wt: &[usize], cfg: DepthwiseConfig) -> candle_core::Result<Self> {
        let &[b, c_in, h, w] = x else {
            candle_core::bail!("depthwise conv: input must be [B, C, H, W], got {x:?}");
        };
        let &[c_out, one, kh, kw] = wt else {
            candle_core::bail!("depthwise conv: weight must be [C*m, 1, kh, kw], got {wt:?}");
        };
        if one != 1 || c_in == 0 || c_out == 0 || c_out % c_in != 0 || kh == 0 || kw == 0 {
            candle_core::bail!("depthwise conv: weight {wt:?} does not fit input {x:?} (need [C*m, 1, kh, kw] with C = {c_in})");
        }
        if cfg.stride == 0 || cfg.dilation == 0 {
            candle_core::bail!("depthwise conv: stride and dilation must be ≥ 1 ({cfg:?})");
        }
        let span_h = cfg.dilation * (kh - 1) + 1;
        let span_w = cfg.dilation * (kw - 1) + 1;
        if h + 2 * cfg.padding < span_h || w + 2 * cfg.padding < span_w {
            candle_core::bail!(
                "depthwise conv: padded input {}x{} is smaller than the dilated kernel {span_h}x{span_w}",
                h + 2 * cfg.padding,
                w + 2 * cfg.padding
            );
        }
        let oh = (h + 2 * cfg.padding - span_h) / cfg.stride + 1;
        let ow = (w + 2 * cfg.padding - span_w) / cfg.stride + 1;
        Ok(Geom { b, c_in, mult: c_out / c_in, h, w, kh, kw, oh, ow, s: cfg.stride, p: cfg.padding, d: cfg.dilation })
    }

    fn c_out(&self) -> usize {
        self.c_in * self.mult
    }

    /// Input row of output row `oy` under kernel row `ki`, if inside the image.
    #[inline]
    fn in_row(&self, oy: usize, ki: usize) -> Option<usize> {
        let iy = (oy * self.s + ki * self.d) as isize - self.p as isize;
        (iy >= 0 && (iy as usize) < self.h).then_some(iy as usize)
    }

    /// For kernel column `kj`: the input-column offset `off` (`ix = ox·s + off`) and the output
    /// columns `lo..hi` whose `ix` lies inside the image.
    fn col_ranges(&self) -> Vec<(isize, usize, usize)> {
        (0..self.kw)
            .map(|kj| {
                let off = (kj * self.d) as isize - self.p as isize;
                let s = self.s as isize;
                let lo = if off >= 0 { 0 } else { ((-off + s - 1) / s) as usize };
                let last = self.w as isize - 1 - off; // need ox·s ≤ last
                let hi = if last < 0 { 0 } else { ((last / s) as usize + 1).min(self.ow) };
                (off, lo.min(hi), hi)
            })
            .collect()
    }
}

/// Element types the kernels run on natively.
trait Elem: Copy + Default + Send + Sync + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + std::ops::AddAssign {}
impl Elem for f32 {}
impl Elem for f64 {}

fn fwd_kernel<T: Elem>(g: &Geom, x: &[T], wt: &[T]) -> Vec<T> {
    let (ip, op, kk) = (g.h * g.w, g.oh * g.ow, g.kh * g.kw);
    let cols = g.col_ranges();
    let mut out = vec![T::default(); g.b * g.c_out() * op];
    if op == 0 {
        return out;
    }
    out.par_chunks_mut(op).enumerate().for_each(|(plane, o)| {
        let (bi, oc) = (plane / g.c_out(), plane % g.c_out());
        let ic = oc / g.mult;
        let xin = &x[(bi * g.c_in + ic) * ip..][..ip];
        let wk = &wt[oc * kk..][..kk];
        for oy in 0..g.oh {
            let orow = &mut o[oy * g.ow..][..g.ow];
            for ki in 0..g.kh {
                let Some(iy) = g.in_row(oy, ki) else { continue };
                let irow = &xin[iy * g.w..][..g.w];
                for (kj, &(off, lo, hi)) in cols.iter().enumerate() {
                    let wv = wk[ki * g.kw + kj];
                    if lo >= hi {
                        continue;
                    }
                    let start = (lo as isize * g.s as isize + off) as usize;
                    if g.s == 1 {
                        for (ov, &iv) in orow[lo..hi].iter_mut().zip(&irow[start..start + (hi - lo)]) {
                            *ov += wv * iv;
                        }
                    } else {
                        for (ov, &iv) in orow[lo..hi].iter_mut().zip(irow[start..].iter().step_by(g.s)) {
                            *ov += wv * iv;
                        }
                    }
                }
            }
        }
    });
    out
}

/// `∂L/∂x` from `∂L/∂y` (`gy [B, C·m, OH, OW]`).
fn bwd_input_kernel<T: Elem>(g: &Geom, gy: &[T], wt: &[T]) -> Vec<T> {
    let (ip, op, kk) = (g.h * g.w, g.oh * g.ow, g.kh * g.kw);
    let cols = g.col_ranges();
    let mut gx = vec![T::default(); g.b * g.c_in * ip];
    if ip == 0 {
        return gx;
    }
    gx.par_chunks_mut(ip).enumerate().for_each(|(plane, gxp)| {
        let (bi, ic) = (plane / g.c_in, plane % g.c_in);
        for mi in 0..g.mult {
            let oc = ic * g.mult + mi;
            let gyp = &gy[(bi * g.c_out() + oc) * op..][..op];
            let wk = &wt[oc * kk..][..kk];
            for oy in 0..g.oh {
                let grow = &gyp[oy * g.ow..][..g.ow];
                for ki in 0..g.kh {
                    let Some(iy) = g.in_row(oy, ki) else { continue };
                    let xrow = &mut gxp[iy * g.w..][..g.w];
                    for (kj, &(off, lo, hi)) in cols.iter().enumerate() {
                        let wv = wk[ki * g.kw + kj];
                        if lo >= hi {
                            continue;
                        }
                        let start = (lo as isize * g.s as isize + off) as usize;
                        if g.s == 1 {
                            for (xv, &gv) in xrow[start..start + (hi - lo)].iter_mut().zip(&grow[lo..hi]) {
                                *xv += wv * gv;
                            }
                        } else {
                            for (xv, &gv) in xrow[start..].iter_mut().step_by(g.s).zip(&grow[lo..hi]) {
                                *xv += wv * gv;
                            }
                        }
                    }
                }
            }
        }
    });
    gx
}

/// `∂L/∂w` (`[C·m, 1, kh, kw]`) from the input `x` and `∂L/∂y`.
fn bwd_weight_kernel<T: Elem>(g: &Geom, x: &[T], gy: &[T]) -> Vec<T> {
    let (ip, op, kk) = (g.h * g.w, g.oh * g.ow, g.kh * g.kw);
    let cols = g.col_ranges();
    let mut gw = vec![T::default(); g.c_out() * kk];
    gw.par_chunks_mut(kk).enumerate().for_each(|(oc, gwk)| {
        let ic = oc / g.mult;
        for bi in 0..g.b {
            let xin = &x[(bi * g.c_in + ic) * ip..][..ip];
            let gyp = &gy[(bi * g.c_out() + oc) * op..][..op];
            for oy in 0..g.oh {
                let grow = &gyp[oy * g.ow..][..g.ow];
                for ki in 0..g.kh {
                    let Some(iy) = g.in_row(oy, ki) else { continue };
                    let irow = &xin[iy * g.w..][..g.w];
                    for (kj, &(off, lo, hi)) in cols.iter().enumerate() {
                        if lo >= hi {
                            continue;
                        }
                        let start = (lo as isize * g.s as isize + off) as usize;
                        let mut acc = T::default();
                        if g.s == 1 {
                            for (&gv, &iv) in grow[lo..hi].iter().zip(&irow[start..start + (hi - lo)]) {
                                acc += gv * iv;
                            }
                        } else {
                            for (&gv, &iv) in grow[lo..hi].iter().zip(irow[start..].iter().step_by(g.s)) {
                                acc += gv * iv;
                            }
                        }
                        gwk[ki * g.kw + kj] += acc;
                    }
                }
            }
        }
    });
    gw
}

/// Which of the three kernels an op runs; all take two same-dtype contiguous CPU tensors.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// (x, w) → y
    Fwd,
    /// (gy, w) → gx
    BwdInput,
    /// (x, gy) → gw
    BwdWeight,
}

fn contiguous<'a, T: candle_core::WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("depthwise conv: {what} is not contiguous"),
    }
}

fn run_kind<T: Elem + candle_core::WithDType>(
    kind: Kind,
    g: &Geom,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<Vec<T>> {
    let a = contiguous::<T>(s1, l1, "first operand")?;
    let b = contiguous::<T>(s2, l2, "second operand")?;
    Ok(match kind {
        Kind::Fwd => fwd_kernel(g, a, b),
        Kind::BwdInput => bwd_input_kernel(g, a, b),
        Kind::BwdWeight => bwd_weight_kernel(g, a, b),
    })
}

fn run_half<T: candle_core::WithDType>(
    kind: Kind,
    g: &Geom,
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<Vec<T>> {
    let a: Vec<f32> = contiguous::<T>(s1, l1, "first operand")?.iter().map(|v| v.to_f64() as f32).collect();
    let b: Vec<f32> = contiguous::<T>(s2, l2, "second operand")?.iter().map(|v| v.to_f64() as f32).collect();
    let r = match kind {
        Kind::Fwd => fwd_kernel(g, &a, &b),
        Kind::BwdInput => bwd_input_kernel(g, &a, &b),
        Kind::BwdWeight => bwd_weight_kernel(g, &a, &b),
    };
    Ok(r.into_iter().map(|v| T::from_f64(v as f64)).collect())
}

fn cpu_run(kind: Kind, g: &Geom, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
    let (e1, e2) = match kind {
        Kind::Fwd => (g.b * g.c_in * g.h * g.w, g.c_out() * g.kh * g.kw),
        Kind::BwdInput => (g.b * g.c_out() * g.oh * g.ow, g.c_out() * g.kh * g.kw),
        Kind::BwdWeight => (g.b * g.c_in * g.h * g.w, g.b * g.c_out() * g.oh * g.ow),
    };
    if l1.shape().elem_count() != e1 || l2.shape().elem_count() != e2 {
        candle_core::bail!("depthwise conv ({kind:?}): operand sizes {:?}, {:?} do not match {g:?}", l1.dims(), l2.dims());
    }
    let shape: Shape = match kind {
        Kind::Fwd => (g.b, g.c_out(), g.oh, g.ow).into(),
        Kind::BwdInput => (g.b, g.c_in, g.h, g.w).into(),
        Kind::BwdWeight => (g.c_out(), 1, g.kh, g.kw).into(),
    };
    let st = match (s1, s2) {
        (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(run_kind::<f32>(kind, g, s1, l1, s2, l2)?),
        (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(run_kind::<f64>(kind, g, s1, l1, s2, l2)?),
        (CpuStorage::F16(_), CpuStorage::F16(_)) => CpuStorage::F16(run_half::<half::f16>(kind, g, s1, l1, s2, l2)?),
        (CpuStorage::BF16(_), CpuStorage::BF16(_)) => CpuStorage::BF16(run_half::<half::bf16>(kind, g, s1, l1, s2, l2)?),
        _ => candle_core::bail!(
            "depthwise conv: unsupported or mismatched dtypes {:?} / {:?} (f32, f64, f16, bf16)",
            s1.dtype(),
            s2.dtype()
        ),
    };
    Ok((st, shape))
}

/// The differentiable forward op `(x, w) → y`.
struct DwFwd {
    g: Geom,
}

/// A backward op (no gradient of its own).
struct DwBwd {
    g: Geom,
    kind: Kind,
}

impl CustomOp2 for DwFwd {
    fn name(&self) -> &'static str {
        "depthwise-conv2d"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_run(Kind::Fwd, &self.g, s1, l1, s2, l2)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, gy: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let gy = gy.contiguous()?;
        let gx = gy.apply_op2_no_bwd(&w.contiguous()?, &DwBwd { g: self.g, kind: Kind::BwdInput })?;
        let gw = x.contiguous()?.apply_op2_no_bwd(&gy, &DwBwd { g: self.g, kind: Kind::BwdWeight })?;
        Ok((Some(gx), Some(gw)))
    }
}

impl CustomOp2 for DwBwd {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Fwd => "depthwise-conv2d",
            Kind::BwdInput => "depthwise-conv2d-bwd-input",
            Kind::BwdWeight => "depthwise-conv2d-bwd-weight",
        }
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_run(self.kind, &self.g, s1, l1, s2, l2)
    }
}

/// Whether the direct kernel handles `dtype` (the others go through Candle's grouped conv).
pub fn kernel_supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}
