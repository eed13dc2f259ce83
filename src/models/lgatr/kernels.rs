//! Row-wise CPU kernels (f32 / f64) for the per-item ops of the fused layout
//! `[mv (C, 16) | s (S)]`: the equivariant layer norm and the scalar-gated nonlinearity.
//! Each replaces a dozen small tensor ops and copies; the tensor-op versions remain as the
//! fallback for other devices and dtypes (and as the reference the tests compare against).
use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::algebra::{metric_grades, GRADE_INDEX, GRADE_SLICES};
use super::config::Nonlinearity;
use crate::kernels::fast_math::{madd, sigmoid};

/// Minimum number of elements per thread before a kernel splits work.
const PAR_GRAIN: usize = 1 << 15;

pub(crate) trait Field:
    Copy
    + Default
    + Send
    + Sync
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn abs(self) -> Self;
    /// `f(self)` in the type's own precision, as [`Nonlinearity::apply`].
    fn nonlinearity(self, f: Nonlinearity) -> Self;
    /// [`Field::nonlinearity`] on every element of `data`.
    fn nonlinearity_in_place(data: &mut [Self], f: Nonlinearity) {
        data.iter_mut().for_each(|x| *x = x.nonlinearity(f));
    }
}

macro_rules! field {
    ($t:ty, $k:expr $(, $in_place:path)?) => {
        impl Field for $t {
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn nonlinearity(self, f: Nonlinearity) -> Self {
                let x = self;
                match f {
                    Nonlinearity::Gelu => 0.5 * x * (1.0 + ($k * x * (1.0 + 0.044715 * x * x)).tanh()),
                    Nonlinearity::Relu => x.max(0.0),
                    Nonlinearity::Sigmoid => 1.0 / (1.0 + (-x).exp()),
                    Nonlinearity::Tanh => x.tanh(),
                    Nonlinearity::Silu => x / (1.0 + (-x).exp()),
                }
            }
            $(
                fn nonlinearity_in_place(data: &mut [Self], f: Nonlinearity) {
                    $in_place(data, f)
                }
            )?
        }
    };
}
field!(f32, GELU_TANH_K, nonlinearity_f32_in_place);
field!(f64, std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2);

/// `√(2/π)`, the tanh GELU's inner scale.
const GELU_TANH_K: f32 = std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2;

crate::kernels::fast_math::simd_fn! {
    /// `f` on every f32 in `data`, vectorised: the tanh GELU, sigmoid and SiLU through
    /// `0.5 · (1 + tanh u) = σ(2u)` and the overflow-free [`sigmoid`] (libm's scalar `tanhf`
    /// took ~6 % of an L-GATr forward).
    fn nonlinearity_f32_in_place<FUSED>(data: &mut [f32], f: Nonlinearity) -> () {
        match f {
            Nonlinearity::Gelu => data.iter_mut().for_each(|x| {
                let v = *x;
                let u = GELU_TANH_K * v * madd::<FUSED>(0.044_715 * v, v, 1.0);
                *x = v * sigmoid::<FUSED>(2.0 * u);
            }),
            Nonlinearity::Sigmoid => data.iter_mut().for_each(|x| *x = sigmoid::<FUSED>(*x)),
            Nonlinearity::Silu => data.iter_mut().for_each(|x| *x *= sigmoid::<FUSED>(*x)),
            Nonlinearity::Relu | Nonlinearity::Tanh => data.iter_mut().for_each(|x| *x = x.nonlinearity(f)),
        }
    }
}

/// Whether the row kernels can run on `t` (CPU, f32 / f64).
pub(crate) fn kernel_ok(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// Runs `f(row_in, row_out)` over `rows` rows, split into one block per rayon thread. (Blocks on
/// threads spawned per call cost a thread creation each: ~1,150 per L-GATr top-tagging forward,
/// 2.3 % of its time in the kernel's `clone3` alone.)
pub(crate) fn par_rows<T: Field>(
    src: &[T],
    rows: usize,
    w_in: usize,
    w_out: usize,
    f: impl Fn(&[T], &mut [T]) + Sync,
) -> Vec<T> {
    let mut dst = vec![T::default(); rows * w_out];
    let work = |s: &[T], d: &mut [T]| {
        for (ri, ro) in s.chunks_exact(w_in).zip(d.chunks_exact_mut(w_out)) {
            f(ri, ro);
        }
    };
    let threads = rayon::current_num_threads().max(1);
    let per = rows.div_ceil(threads).max(PAR_GRAIN.div_ceil(w_in.max(1)));
    if threads == 1 || rows <= per || w_in == 0 || w_out == 0 {
        work(src, &mut dst);
    } else {
        use rayon::prelude::*;
        src.par_chunks(per * w_in).zip(dst.par_chunks_mut(per * w_out)).for_each(|(s, d)| work(s, d));
    }
    dst
}

fn contiguous_rows<'a, T>(v: &'a [T], layout: &Layout) -> candle_core::Result<(&'a [T], usize, usize)> {
    let (o1, o2) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("lgatr kernel: input must be contiguous".into()))?;
    let (rows, w) = layout.shape().dims2()?;
    Ok((&v[o1..o2], rows, w))
}

/// `EquiLayerNorm` on rows `(R, 16C + S)`, with optional gains (`16C + S` values).
#[derive(Debug, Clone)]
pub(crate) struct EquiNormKernel {
    pub c: usize,
    pub s: usize,
    pub mv_eps: f64,
    pub s_eps: f64,
    pub gains: Option<Vec<f64>>,
}

impl EquiNormKernel {
    fn run<T: Field>(&self, src: &[T], rows: usize) -> Vec<T> {
        let (c, s) = (self.c, self.s);
        let w = 16 * c + s;
        let mg = metric_grades();
        let factor: Vec<f64> = (0..16).map(|i| mg[i][GRADE_INDEX[i]]).collect();
        let gains: Option<Vec<T>> = self.gains.as_ref().map(|g| g.iter().map(|&v| T::from_f64(v)).collect());
        let factor: Vec<T> = factor.iter().map(|&v| T::from_f64(v)).collect();
        let inv_c = 1.0 / c.max(1) as f64;
        par_rows(src, rows, w, w, |x, y| {
            if c > 0 {
                let mut total = T::default();
                for m in x[..16 * c].chunks_exact(16) {
                    for &(a, b) in GRADE_SLICES.iter() {
                        let mut g = T::default();
                        for i in a..b {
                            g = g + factor[i] * m[i] * m[i];
                        }
                        total = total + g.abs();
                    }
                }
                let inv = T::from_f64(1.0 / (total.to_f64() * inv_c).max(self.mv_eps).sqrt());
                match &gains {
                    Some(g) => {
                        for i in 0..16 * c {
                            y[i] = x[i] * inv * g[i];
                        }
                    }
                    None => {
                        for i in 0..16 * c {
                            y[i] = x[i] * inv;
                        }
                    }
                }
            }
            if s > 0 {
                let sc = &x[16 * c..];
                let mut sum = T::default();
                for &v in sc {
                    sum = sum + v;
                }
                let mean = T::from_f64(sum.to_f64() / s as f64);
                let mut var = T::default();
                for &v in sc {
                    var = var + (v - mean) * (v - mean);
                }
                let inv = T::from_f64(1.0 / (var.to_f64() / s as f64 + self.s_eps).sqrt());
                let out = &mut y[16 * c..];
                match &gains {
                    Some(g) => {
                        for k in 0..s {
                            out[k] = (sc[k] - mean) * inv * g[16 * c + k];
                        }
                    }
                    None => {
                        for k in 0..s {
                            out[k] = (sc[k] - mean) * inv;
                        }
                    }
                }
            }
        })
    }
}

impl CustomOp1 for EquiNormKernel {
    fn name(&self) -> &'static str {
        "lgatr-equi-layer-norm"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = layout.shape().clone();
        match storage {
            CpuStorage::F32(v) => {
                let (v, rows, w) = contiguous_rows(v, layout)?;
                check_width(w, 16 * self.c + self.s)?;
                Ok((CpuStorage::F32(self.run(v, rows)), shape))
            }
            CpuStorage::F64(v) => {
                let (v, rows, w) = contiguous_rows(v, layout)?;
                check_width(w, 16 * self.c + self.s)?;
                Ok((CpuStorage::F64(self.run(v, rows)), shape))
            }
            other => candle_core::bail!("lgatr norm kernel: unsupported dtype {:?}", other.dtype()),
        }
    }
}

fn check_width(w: usize, want: usize) -> candle_core::Result<()> {
    if w != want {
        candle_core::bail!("lgatr kernel: row width {w}, expected {want}");
    }
    Ok(())
}

/// `ScalarGatedNonlinearity` on rows `(R, 16C + S)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GateKernel {
    pub c: usize,
    pub s: usize,
    pub f: Nonlinearity,
}

impl GateKernel {
    fn run<T: Field>(&self, src: &[T], rows: usize) -> Vec<T> {
        let (c, s, f) = (self.c, self.s, self.f);
        let w = 16 * c + s;
        par_rows(src, rows, w, w, |x, y| {
            let mut gates = [T::default(); 16];
            for first in (0..c).step_by(16) {
                let n = (c - first).min(16);
                for (j, g) in gates[..n].iter_mut().enumerate() {
                    *g = x[16 * (first + j)];
                }
                T::nonlinearity_in_place(&mut gates[..n], f);
                for (j, &g) in gates[..n].iter().enumerate() {
                    let ch = 16 * (first + j);
                    for i in ch..ch + 16 {
                        y[i] = x[i] * g;
                    }
                }
            }
            y[16 * c..].copy_from_slice(&x[16 * c..]);
            T::nonlinearity_in_place(&mut y[16 * c..], f);
        })
    }
}

impl CustomOp1 for GateKernel {
    fn name(&self) -> &'static str {
        "lgatr-gated-nonlinearity"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = layout.shape().clone();
        match storage {
            CpuStorage::F32(v) => {
                let (v, rows, w) = contiguous_rows(v, layout)?;
                check_width(w, 16 * self.c + self.s)?;
                Ok((CpuStorage::F32(self.run(v, rows)), shape))
            }
            CpuStorage::F64(v) => {
                let (v, rows, w) = contiguous_rows(v, layout)?;
                check_width(w, 16 * self.c + self.s)?;
                Ok((CpuStorage::F64(self.run(v, rows)), shape))
            }
            other => candle_core::bail!("lgatr gate kernel: unsupported dtype {:?}", other.dtype()),
        }
    }
}
