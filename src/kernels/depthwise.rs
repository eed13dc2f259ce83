//! Depthwise 2-D convolution (`groups == in_channels`) as a real kernel.
//!
//! Candle 0.11.1 runs a grouped convolution as one single-group convolution per group followed by a
//! concatenation, which is very slow for depthwise convs (SegFormer's Mix-FFN, MobileNets). This module
//! provides a direct NCHW kernel for the CPU (parallel over (batch, channel) planes with rayon), with
//! backward passes for the input and the weight, so that it is differentiable. On other devices a
//! stride-1 conv is a sum over the kernel taps of shifted inputs times per-channel weights (Candle
//! ops); other strides fall back to Candle's grouped `conv2d`.
//!
//! Shapes: input `[B, C, H, W]`, weight `[C·m, 1, kh, kw]` (channel multiplier `m ≥ 1`; output
//! channel `o` reads input channel `o / m`, as PyTorch's `groups = C`), optional bias `[C·m]`,
//! output `[B, C·m, OH, OW]` with `OH = (H + 2p − d(kh − 1) − 1) / s + 1` (likewise `OW`).
//! f32 and f64 are computed natively; f16 and bf16 are computed in f32 and rounded once.
//!
//! [`depthwise_conv2d_nhwc`] is the channels-last variant (`[B, H, W, C]` in and out, i.e. the token
//! layout `[B, H·W, C]` of a vision transformer, so no transposes are needed around it) with the bias
//! and an optional exact GELU fused into the output pass; its backward recomputes the pre-activation.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Module, Shape, Tensor};
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

/// Depthwise conv: the direct kernel on the CPU, a sum over taps (stride 1) or Candle's grouped
/// `conv2d` on other devices. Differentiable with respect to `x`, `w` and `bias`.
pub fn depthwise_conv2d(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, cfg: DepthwiseConfig) -> candle_core::Result<Tensor> {
    let g = Geom::new(x.dims(), w.dims(), cfg)?;
    let y = if x.device().is_cpu() && kernel_supports(x.dtype()) && x.dtype() == w.dtype() {
        let x = x.contiguous()?;
        let w = w.contiguous()?;
        x.apply_op2(&w, DwFwd { g })?
    } else if let Some(y) = tap_sum(x, w, &g, Layout2d::Nchw)? {
        y
    } else {
        x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, g.c_in)?
    };
    add_bias(y, bias)
}

/// Where the channels of a [`tap_sum`] input are.
#[derive(Clone, Copy)]
enum Layout2d {
    /// `[B, C, H, W]`.
    Nchw,
    /// `[B, H, W, C]`.
    Nhwc,
}

/// A stride-1, multiplier-1 depthwise conv as `Σ_taps w[:, ky, kx] · x_padded[shifted]` in Candle
/// ops: about 2·kh·kw kernel launches on a GPU, where Candle's grouped conv launches one convolution
/// per channel (SegFormer-B0 on an H200: 190 ms against PyTorch's 18). Differentiable. `None` for
/// other strides and multipliers.
fn tap_sum(x: &Tensor, w: &Tensor, g: &Geom, layout: Layout2d) -> candle_core::Result<Option<Tensor>> {
    if g.s != 1 || g.mult != 1 {
        return Ok(None);
    }
    let (hd, wd, tap_shape) = match layout {
        Layout2d::Nchw => (2, 3, (1, g.c_in, 1, 1)),
        Layout2d::Nhwc => (1, 2, (1, 1, 1, g.c_in)),
    };
    let padded = x.pad_with_zeros(hd, g.p, g.p)?.pad_with_zeros(wd, g.p, g.p)?;
    let w = w.to_dtype(x.dtype())?;
    let mut sum: Option<Tensor> = None;
    for ky in 0..g.kh {
        for kx in 0..g.kw {
            let tap = w.narrow(2, ky, 1)?.narrow(3, kx, 1)?.reshape(tap_shape)?;
            let term = padded.narrow(hd, ky * g.d, g.oh)?.narrow(wd, kx * g.d, g.ow)?.broadcast_mul(&tap)?;
            sum = Some(match sum {
                Some(s) => (s + term)?,
                None => term,
            });
        }
    }
    Ok(sum)
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
trait Elem: Copy + Default + Send + Sync + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + std::ops::AddAssign {
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// Exact (erf) GELU, the same formula and `erf` as Candle's `gelu_erf`.
    fn gelu_erf(self) -> Self;
    /// [`Elem::gelu_erf`] over a row in place (f32: the vectorised kernel of `nn::fast_math`).
    fn gelu_erf_row(row: &mut [Self]) {
        row.iter_mut().for_each(|v| *v = v.gelu_erf());
    }
}
impl Elem for f32 {
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn gelu_erf(self) -> Self {
        (candle_core::cpu::erf::erf_f32(self * std::f32::consts::FRAC_1_SQRT_2) + 1.) * 0.5 * self
    }
    fn gelu_erf_row(row: &mut [Self]) {
        super::fast_math::gelu_erf_in_place(row)
    }
}
impl Elem for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn gelu_erf(self) -> Self {
        (candle_core::cpu::erf::erf_f64(self * std::f64::consts::FRAC_1_SQRT_2) + 1.) * 0.5 * self
    }
}

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

/// Which of the three NCHW kernels an op runs; all take two same-dtype contiguous CPU tensors.
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

/// A CPU kernel over same-dtype contiguous operands.
trait Kernel {
    fn label(&self) -> &'static str;
    /// Expected element counts of the operands.
    fn operand_sizes(&self) -> Vec<usize>;
    fn out_shape(&self) -> Shape;
    fn run<T: Elem>(&self, ins: &[&[T]]) -> Vec<T>;
}

fn typed<'a, T: candle_core::WithDType>(ins: &[(&'a CpuStorage, &Layout)]) -> candle_core::Result<Vec<&'a [T]>> {
    ins.iter().enumerate().map(|(i, (s, l))| contiguous::<T>(s, l, &format!("operand {i}"))).collect()
}

fn run_native<T: Elem + candle_core::WithDType, K: Kernel>(k: &K, ins: &[(&CpuStorage, &Layout)]) -> candle_core::Result<Vec<T>> {
    Ok(k.run(&typed::<T>(ins)?))
}

fn run_via_f32<T: candle_core::WithDType, K: Kernel>(k: &K, ins: &[(&CpuStorage, &Layout)]) -> candle_core::Result<Vec<T>> {
    let conv: Vec<Vec<f32>> = typed::<T>(ins)?.iter().map(|v| v.iter().map(|x| x.to_f64() as f32).collect()).collect();
    let refs: Vec<&[f32]> = conv.iter().map(|v| v.as_slice()).collect();
    Ok(k.run(&refs).into_iter().map(|v| T::from_f64(v as f64)).collect())
}

fn cpu_dispatch<K: Kernel>(k: &K, ins: &[(&CpuStorage, &Layout)]) -> candle_core::Result<(CpuStorage, Shape)> {
    let want = k.operand_sizes();
    let got: Vec<usize> = ins.iter().map(|(_, l)| l.shape().elem_count()).collect();
    if want != got {
        candle_core::bail!("{}: operand sizes {got:?} do not match the geometry ({want:?})", k.label());
    }
    let dt = ins[0].0.dtype();
    if ins.iter().any(|(s, _)| s.dtype() != dt) {
        candle_core::bail!("{}: operands have different dtypes", k.label());
    }
    let st = match ins[0].0 {
        CpuStorage::F32(_) => CpuStorage::F32(run_native::<f32, K>(k, ins)?),
        CpuStorage::F64(_) => CpuStorage::F64(run_native::<f64, K>(k, ins)?),
        CpuStorage::F16(_) => CpuStorage::F16(run_via_f32::<half::f16, K>(k, ins)?),
        CpuStorage::BF16(_) => CpuStorage::BF16(run_via_f32::<half::bf16, K>(k, ins)?),
        _ => candle_core::bail!("{}: unsupported dtype {dt:?} (f32, f64, f16, bf16)", k.label()),
    };
    Ok((st, k.out_shape()))
}

struct NchwKernel {
    g: Geom,
    kind: Kind,
}

impl Kernel for NchwKernel {
    fn label(&self) -> &'static str {
        match self.kind {
            Kind::Fwd => "depthwise-conv2d",
            Kind::BwdInput => "depthwise-conv2d-bwd-input",
            Kind::BwdWeight => "depthwise-conv2d-bwd-weight",
        }
    }

    fn operand_sizes(&self) -> Vec<usize> {
        let g = &self.g;
        let (x, y, w) = (g.b * g.c_in * g.h * g.w, g.b * g.c_out() * g.oh * g.ow, g.c_out() * g.kh * g.kw);
        match self.kind {
            Kind::Fwd => vec![x, w],
            Kind::BwdInput => vec![y, w],
            Kind::BwdWeight => vec![x, y],
        }
    }

    fn out_shape(&self) -> Shape {
        let g = &self.g;
        match self.kind {
            Kind::Fwd => (g.b, g.c_out(), g.oh, g.ow).into(),
            Kind::BwdInput => (g.b, g.c_in, g.h, g.w).into(),
            Kind::BwdWeight => (g.c_out(), 1, g.kh, g.kw).into(),
        }
    }

    fn run<T: Elem>(&self, ins: &[&[T]]) -> Vec<T> {
        match self.kind {
            Kind::Fwd => fwd_kernel(&self.g, ins[0], ins[1]),
            Kind::BwdInput => bwd_input_kernel(&self.g, ins[0], ins[1]),
            Kind::BwdWeight => bwd_weight_kernel(&self.g, ins[0], ins[1]),
        }
    }
}

fn cpu_run(kind: Kind, g: &Geom, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
    cpu_dispatch(&NchwKernel { g: *g, kind }, &[(s1, l1), (s2, l2)])
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
pub(crate) fn kernel_supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// Activation fused into [`depthwise_conv2d_nhwc`]'s output pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DwActivation {
    /// Conv + bias only.
    #[default]
    None,
    /// Exact GELU `x·Φ(x)` (erf), the same as Candle's `gelu_erf` and PyTorch's `nn.GELU()`.
    GeluErf,
}

/// Channels-last depthwise conv: `x [B, H, W, C]` → `act(conv(x) + bias) [B, OH, OW, C·m]`, weight
/// `[C·m, 1, kh, kw]` (PyTorch layout). The direct kernel on the CPU, Candle's grouped conv (with
/// permutes) elsewhere. Differentiable with respect to `x`, `w` and `bias`.
pub fn depthwise_conv2d_nhwc(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    act: DwActivation,
    cfg: DepthwiseConfig,
) -> candle_core::Result<Tensor> {
    let &[b, h, wd, c] = x.dims() else {
        candle_core::bail!("depthwise conv (NHWC): input must be [B, H, W, C], got {:?}", x.dims());
    };
    let g = Geom::new(&[b, c, h, wd], w.dims(), cfg)?;
    if let Some(bias) = bias {
        if bias.dims() != [g.c_out()] {
            candle_core::bail!("depthwise conv: bias has shape {:?}, expected [{}]", bias.dims(), g.c_out());
        }
    }
    let same_dtype = x.dtype() == w.dtype() && bias.is_none_or(|b| b.dtype() == x.dtype());
    if x.device().is_cpu() && kernel_supports(x.dtype()) && same_dtype {
        let bias = match bias {
            Some(b) => b.contiguous()?,
            None => Tensor::zeros(g.c_out(), x.dtype(), x.device())?,
        };
        x.contiguous()?.apply_op3(&w.contiguous()?, &bias, DwNhwc { g, act })
    } else if let Some(y) = tap_sum(x, w, &g, Layout2d::Nhwc)? {
        let y = match bias {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
            None => y,
        };
        match act {
            DwActivation::None => Ok(y),
            DwActivation::GeluErf => y.gelu_erf(),
        }
    } else {
        let y = depthwise_conv2d_grouped(&x.permute((0, 3, 1, 2))?, w, bias, cfg)?;
        let y = match act {
            DwActivation::None => y,
            DwActivation::GeluErf => y.gelu_erf()?,
        };
        y.permute((0, 2, 3, 1))?.contiguous()
    }
}

/// `wt[tap · Co + oc] = w[oc · kk + tap]`: taps-major weights, so the channel loop is contiguous.
fn taps_major<T: Elem>(g: &Geom, w: &[T]) -> Vec<T> {
    let (kk, co) = (g.kh * g.kw, g.c_out());
    let mut t = vec![T::default(); kk * co];
    for oc in 0..co {
        for tap in 0..kk {
            t[tap * co + oc] = w[oc * kk + tap];
        }
    }
    t
}

/// `out[b, oy, ox, oc] = act(bias[oc] + Σ_taps w[oc, tap] · x[b, iy, ix, oc / m])`.
fn nhwc_fwd<T: Elem>(g: &Geom, x: &[T], w: &[T], bias: &[T], act: DwActivation) -> Vec<T> {
    let wt = taps_major(g, w);
    let cols = g.col_ranges();
    let row_len = g.ow * g.c_out();
    let mut out = vec![T::default(); g.b * g.oh * row_len];
    if row_len == 0 {
        return out;
    }
    out.par_chunks_mut(row_len).enumerate().for_each(|(r, orow)| nhwc_fwd_row(g, x, &wt, &cols, bias, act, r, orow));
    out
}

/// Output row `r` (image `r / oh`, row `r % oh`) of [`nhwc_fwd`] into `orow` (`ow × Co`), with
/// the taps-major weight `wt` and the column ranges `cols`.
#[allow(clippy::too_many_arguments)]
fn nhwc_fwd_row<T: Elem>(g: &Geom, x: &[T], wt: &[T], cols: &[(isize, usize, usize)], bias: &[T], act: DwActivation, r: usize, orow: &mut [T]) {
    let (ci, co, m) = (g.c_in, g.c_out(), g.mult);
    let (bi, oy) = (r / g.oh, r % g.oh);
    for px in orow.chunks_exact_mut(co) {
        px.copy_from_slice(bias);
    }
    for ki in 0..g.kh {
        let Some(iy) = g.in_row(oy, ki) else { continue };
        let irow = &x[(bi * g.h + iy) * g.w * ci..][..g.w * ci];
        for (kj, &(off, lo, hi)) in cols.iter().enumerate() {
            let wv = &wt[(ki * g.kw + kj) * co..][..co];
            for ox in lo..hi {
                let ix = (ox as isize * g.s as isize + off) as usize;
                let ipx = &irow[ix * ci..][..ci];
                let opx = &mut orow[ox * co..][..co];
                if m == 1 {
                    for ((o, &wc), &xv) in opx.iter_mut().zip(wv).zip(ipx) {
                        *o += wc * xv;
                    }
                } else {
                    for (oc, (o, &wc)) in opx.iter_mut().zip(wv).enumerate() {
                        *o += wc * ipx[oc / m];
                    }
                }
            }
        }
    }
    if act == DwActivation::GeluErf {
        T::gelu_erf_row(orow);
    }
}

thread_local! {
    /// Each worker's output row of [`depthwise_nhwc_q8`].
    static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`depthwise_conv2d_nhwc`] of f32 CPU tensors (`x` `[B, H, W, C]`, no gradient recorded), each
/// output pixel's `Co` values rounded to 8 bits in Q8_0 blocks as it is computed
/// ([`super::int8_gemm::quantize_rows`]' rounding) for an int8 product that follows: the bytes
/// `[B·OH·OW, Co]` and the block scales `[B·OH·OW, Co/32]`, the f32 map never written out.
/// `Ok(None)` where it does not run: other dtypes or devices, a gradient to record, or `Co` not
/// whole blocks.
pub(crate) fn depthwise_nhwc_q8(x: &Tensor, w: &Tensor, bias: &Tensor, act: DwActivation, cfg: DepthwiseConfig) -> candle_core::Result<Option<(Vec<u8>, Vec<f32>)>> {
    use super::int8_gemm::{quantize_row_into, BLOCK};
    let runs = [x, w, bias].iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op());
    let &[b, h, wd, c] = x.dims() else {
        candle_core::bail!("depthwise conv (NHWC): input must be [B, H, W, C], got {:?}", x.dims());
    };
    let g = Geom::new(&[b, c, h, wd], w.dims(), cfg)?;
    let co = g.c_out();
    if !runs || co % BLOCK != 0 {
        return Ok(None);
    }
    if bias.dims() != [co] {
        candle_core::bail!("depthwise conv: bias has shape {:?}, expected [{co}]", bias.dims());
    }
    let (x, w, bias) = (x.contiguous()?, w.contiguous()?.flatten_all()?.to_vec1::<f32>()?, bias.to_vec1::<f32>()?);
    let wt = taps_major(&g, &w);
    let cols = g.col_ranges();
    let (row_len, pixels) = (g.ow * co, g.b * g.oh * g.ow);
    let mut q = vec![0u8; pixels * co];
    let mut d = vec![0f32; pixels * (co / BLOCK)];
    if row_len == 0 {
        return Ok(Some((q, d)));
    }
    let done = super::cpu_slice::with_contiguous(&x, |xs: &[f32]| {
        q.par_chunks_mut(row_len).zip(d.par_chunks_mut(g.ow * (co / BLOCK))).enumerate().for_each(|(r, (q, d))| {
            super::cpu_slice::with_scratch(&ROW, |row| {
                row.resize(row_len, 0.0);
                nhwc_fwd_row(&g, xs, &wt, &cols, &bias, act, r, row);
                quantize_row_into(row, q, d);
            })
        })
    })?;
    Ok(done.map(|()| (q, d)))
}

/// `gx[b, iy, ix, c] = Σ_{mi, taps hitting (iy, ix)} w[c·m + mi, tap] · gz[b, oy, ox, c·m + mi]` (gather form).
fn nhwc_bwd_input<T: Elem>(g: &Geom, gz: &[T], w: &[T]) -> Vec<T> {
    let (ci, co, m) = (g.c_in, g.c_out(), g.mult);
    let wt = taps_major(g, w);
    let row_len = g.w * ci;
    let mut gx = vec![T::default(); g.b * g.h * row_len];
    if row_len == 0 {
        return gx;
    }
    // Output index hit by input index `i` under kernel offset `k·d`, if any.
    let src = |i: usize, k: usize, n_out: usize| -> Option<usize> {
        let t = (i + g.p) as isize - (k * g.d) as isize;
        (t >= 0 && (t as usize).is_multiple_of(g.s) && (t as usize / g.s) < n_out).then(|| t as usize / g.s)
    };
    gx.par_chunks_mut(row_len).enumerate().for_each(|(r, xrow)| {
        let (bi, iy) = (r / g.h, r % g.h);
        for ki in 0..g.kh {
            let Some(oy) = src(iy, ki, g.oh) else { continue };
            let grow = &gz[(bi * g.oh + oy) * g.ow * co..][..g.ow * co];
            for kj in 0..g.kw {
                let wv = &wt[(ki * g.kw + kj) * co..][..co];
                for ix in 0..g.w {
                    let Some(ox) = src(ix, kj, g.ow) else { continue };
                    let gpx = &grow[ox * co..][..co];
                    let xpx = &mut xrow[ix * ci..][..ci];
                    if m == 1 {
                        for ((xv, &wc), &gv) in xpx.iter_mut().zip(wv).zip(gpx) {
                            *xv += wc * gv;
                        }
                    } else {
                        for (oc, (&wc, &gv)) in wv.iter().zip(gpx).enumerate() {
                            xpx[oc / m] += wc * gv;
                        }
                    }
                }
            }
        }
    });
    gx
}

/// `[gw taps-major (kk·Co) ‖ gbias (Co)]` from `x` and `gz`; per-row partial sums, accumulated in f64.
fn nhwc_bwd_weight<T: Elem>(g: &Geom, x: &[T], gz: &[T]) -> Vec<T> {
    let (ci, co, m) = (g.c_in, g.c_out(), g.mult);
    let kk = g.kh * g.kw;
    let cols = g.col_ranges();
    let acc = (0..g.b * g.oh)
        .into_par_iter()
        .fold(
            || vec![0f64; (kk + 1) * co],
            |mut acc, r| {
                let (bi, oy) = (r / g.oh, r % g.oh);
                let grow = &gz[(bi * g.oh + oy) * g.ow * co..][..g.ow * co];
                let mut part = vec![T::default(); (kk + 1) * co];
                for gpx in grow.chunks_exact(co) {
                    for (p, &gv) in part[kk * co..].iter_mut().zip(gpx) {
                        *p += gv;
                    }
                }
                for ki in 0..g.kh {
                    let Some(iy) = g.in_row(oy, ki) else { continue };
                    let irow = &x[(bi * g.h + iy) * g.w * ci..][..g.w * ci];
                    for (kj, &(off, lo, hi)) in cols.iter().enumerate() {
                        let pw = &mut part[(ki * g.kw + kj) * co..][..co];
                        for ox in lo..hi {
                            let ix = (ox as isize * g.s as isize + off) as usize;
                            let ipx = &irow[ix * ci..][..ci];
                            let gpx = &grow[ox * co..][..co];
                            if m == 1 {
                                for ((p, &gv), &xv) in pw.iter_mut().zip(gpx).zip(ipx) {
                                    *p += gv * xv;
                                }
                            } else {
                                for (oc, (p, &gv)) in pw.iter_mut().zip(gpx).enumerate() {
                                    *p += gv * ipx[oc / m];
                                }
                            }
                        }
                    }
                }
                for (a, p) in acc.iter_mut().zip(part) {
                    *a += p.to_f64();
                }
                acc
            },
        )
        .reduce(
            || vec![0f64; (kk + 1) * co],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y;
                }
                a
            },
        );
    acc.into_iter().map(T::from_f64).collect()
}

#[derive(Debug, Clone, Copy)]
enum NhwcKind {
    /// (x, w, bias) → act(conv + bias)
    Fwd(DwActivation),
    /// (gz, w) → gx
    BwdInput,
    /// (x, gz) → [gw taps-major ‖ gbias]
    BwdWeight,
}

struct NhwcKernel {
    g: Geom,
    kind: NhwcKind,
}

impl Kernel for NhwcKernel {
    fn label(&self) -> &'static str {
        match self.kind {
            NhwcKind::Fwd(_) => "depthwise-conv2d-nhwc",
            NhwcKind::BwdInput => "depthwise-conv2d-nhwc-bwd-input",
            NhwcKind::BwdWeight => "depthwise-conv2d-nhwc-bwd-weight",
        }
    }

    fn operand_sizes(&self) -> Vec<usize> {
        let g = &self.g;
        let (x, y, w) = (g.b * g.c_in * g.h * g.w, g.b * g.c_out() * g.oh * g.ow, g.c_out() * g.kh * g.kw);
        match self.kind {
            NhwcKind::Fwd(_) => vec![x, w, g.c_out()],
            NhwcKind::BwdInput => vec![y, w],
            NhwcKind::BwdWeight => vec![x, y],
        }
    }

    fn out_shape(&self) -> Shape {
        let g = &self.g;
        match self.kind {
            NhwcKind::Fwd(_) => (g.b, g.oh, g.ow, g.c_out()).into(),
            NhwcKind::BwdInput => (g.b, g.h, g.w, g.c_in).into(),
            NhwcKind::BwdWeight => ((g.kh * g.kw + 1) * g.c_out(),).into(),
        }
    }

    fn run<T: Elem>(&self, ins: &[&[T]]) -> Vec<T> {
        match self.kind {
            NhwcKind::Fwd(act) => nhwc_fwd(&self.g, ins[0], ins[1], ins[2], act),
            NhwcKind::BwdInput => nhwc_bwd_input(&self.g, ins[0], ins[1]),
            NhwcKind::BwdWeight => nhwc_bwd_weight(&self.g, ins[0], ins[1]),
        }
    }
}

/// The differentiable channels-last op `(x, w, bias) → act(conv(x, w) + bias)`.
struct DwNhwc {
    g: Geom,
    act: DwActivation,
}

/// A channels-last backward op (no gradient of its own).
struct DwNhwcBwd {
    g: Geom,
    kind: NhwcKind,
}

/// `d gelu_erf(z) / dz = Φ(z) + z·φ(z)`.
fn gelu_erf_grad(z: &Tensor) -> candle_core::Result<Tensor> {
    let cdf = ((z * std::f64::consts::FRAC_1_SQRT_2)?.erf()? + 1.0)? * 0.5;
    let pdf = ((z.sqr()? * -0.5)?.exp()? * (0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2))?;
    cdf? + (z * pdf)?
}

impl CustomOp3 for DwNhwc {
    fn name(&self) -> &'static str {
        "depthwise-conv2d-nhwc"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_dispatch(&NhwcKernel { g: self.g, kind: NhwcKind::Fwd(self.act) }, &[(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = self.g;
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let gz = match self.act {
            DwActivation::None => gy.contiguous()?,
            DwActivation::GeluErf => {
                // Recompute the pre-activation rather than keeping it alive through the forward pass.
                let z = x.apply_op3_no_bwd(&w, &bias.contiguous()?, &DwNhwc { g, act: DwActivation::None })?;
                (gy * gelu_erf_grad(&z)?)?.contiguous()?
            }
        };
        let gx = gz.apply_op2_no_bwd(&w, &DwNhwcBwd { g, kind: NhwcKind::BwdInput })?;
        let gwb = x.apply_op2_no_bwd(&gz, &DwNhwcBwd { g, kind: NhwcKind::BwdWeight })?;
        let (kk, co) = (g.kh * g.kw, g.c_out());
        let gw = gwb.narrow(0, 0, kk * co)?.reshape((kk, co))?.t()?.contiguous()?.reshape((co, 1, g.kh, g.kw))?;
        let gb = gwb.narrow(0, kk * co, co)?;
        Ok((Some(gx), Some(gw), Some(gb)))
    }
}

impl CustomOp2 for DwNhwcBwd {
    fn name(&self) -> &'static str {
        match self.kind {
            NhwcKind::Fwd(_) => "depthwise-conv2d-nhwc",
            NhwcKind::BwdInput => "depthwise-conv2d-nhwc-bwd-input",
            NhwcKind::BwdWeight => "depthwise-conv2d-nhwc-bwd-weight",
        }
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_dispatch(&NhwcKernel { g: self.g, kind: self.kind }, &[(s1, l1), (s2, l2)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The quantizing conv gives exactly the bytes and scales of the f32 conv's output rounded
    /// afterwards, with and without GELU, stride or padding; it declines widths that are not
    /// whole Q8_0 blocks.
    #[test]
    fn quantized_output_equals_the_f32_output_rounded() {
        let dev = Device::Cpu;
        for (b, h, w, c, stride, act) in [(2, 9, 7, 64, 1, DwActivation::GeluErf), (1, 10, 13, 32, 2, DwActivation::None)] {
            let x = crate::kernels::test_values::spread((b, h, w, c), 1, &dev);
            let wt = crate::kernels::test_values::spread((c, 1, 3, 3), 2, &dev);
            let bias = crate::kernels::test_values::spread(c, 3, &dev);
            let cfg = DepthwiseConfig { stride, padding: 1, dilation: 1 };
            let y = depthwise_conv2d_nhwc(&x, &wt, Some(&bias), act, cfg).unwrap();
            let (_, oh, ow, _) = y.dims4().unwrap();
            let want = crate::kernels::int8_gemm::quantize_rows(&y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b * oh * ow, c);
            let got = depthwise_nhwc_q8(&x, &wt, &bias, act, cfg).unwrap().expect("f32 CPU, whole blocks");
            assert_eq!(got, want, "{b}×{h}×{w}×{c} stride {stride} {act:?}");
        }
        let narrow = Tensor::zeros((1, 4, 4, 48), DType::F32, &dev).unwrap();
        let (wt, bias) = (Tensor::zeros((48, 1, 3, 3), DType::F32, &dev).unwrap(), Tensor::zeros(48, DType::F32, &dev).unwrap());
        assert!(depthwise_nhwc_q8(&narrow, &wt, &bias, DwActivation::None, DepthwiseConfig { stride: 1, padding: 1, dilation: 1 }).unwrap().is_none());
    }

    /// The GPU path (taps of shifted inputs) equals Candle's grouped conv, in both layouts, with
    /// padding and dilation; strides and channel multipliers are declined.
    #[test]
    fn tap_sum_matches_the_grouped_conv() {
        let dev = Device::Cpu;
        for (k, p, d) in [(3, 1, 1), (3, 2, 2), (5, 0, 1), (1, 0, 1)] {
            let x = Tensor::randn(0f32, 1.0, (2, 6, 9, 11), &dev).unwrap();
            let w = Tensor::randn(0f32, 1.0, (6, 1, k, k), &dev).unwrap();
            let cfg = DepthwiseConfig { stride: 1, padding: p, dilation: d };
            let g = Geom::new(x.dims(), w.dims(), cfg).unwrap();
            let want = depthwise_conv2d_grouped(&x, &w, None, cfg).unwrap();
            let nchw = tap_sum(&x, &w, &g, Layout2d::Nchw).unwrap().unwrap();
            let nhwc = tap_sum(&x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap(), &w, &g, Layout2d::Nhwc).unwrap().unwrap();
            for got in [nchw, nhwc.permute((0, 3, 1, 2)).unwrap()] {
                let err = (got - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(err < 1e-5, "k={k} p={p} d={d}: {err}");
            }
        }
        let x = Tensor::zeros((1, 4, 8, 8), DType::F32, &dev).unwrap();
        let strided = DepthwiseConfig { stride: 2, padding: 1, dilation: 1 };
        let w = Tensor::zeros((4, 1, 3, 3), DType::F32, &dev).unwrap();
        assert!(tap_sum(&x, &w, &Geom::new(x.dims(), w.dims(), strided).unwrap(), Layout2d::Nchw).unwrap().is_none());
        let w2 = Tensor::zeros((8, 1, 3, 3), DType::F32, &dev).unwrap();
        let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
        assert!(tap_sum(&x, &w2, &Geom::new(x.dims(), w2.dims(), cfg).unwrap(), Layout2d::Nchw).unwrap().is_none());
    }
}
