//! 2-D convolution with a faster CPU path: stride-1 convs in f32 run as an image-to-columns GEMM in
//! row stripes (each stripe's columns stay in cache; the GEMM's output rows are the NCHW output rows),
//! about twice Candle's conv2d at the DPT heads' shapes. Recording (training) inputs take the
//! differentiable path of [`crate::nn::grad`], other devices and dtypes Candle's conv.
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Conv2dConfig;
use rayon::prelude::*;

/// Floats of one stripe's columns (8 MiB): big enough for an efficient GEMM, small enough for L3.
const STRIPE_FLOATS: usize = 2 << 20;

/// A conv layer: weight `[O, C/groups, kh, kw]`, optional bias `[O]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    inner: candle_nn::Conv2d,
}

impl Conv2d {
    /// Builds from a weight, an optional bias and the conv settings.
    pub fn new(weight: Tensor, bias: Option<Tensor>, cfg: Conv2dConfig) -> Self {
        Conv2d { inner: candle_nn::Conv2d::new(weight, bias, cfg) }
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.inner.bias()
    }

    /// Padding, stride, dilation, groups.
    pub fn config(&self) -> &Conv2dConfig {
        self.inner.config()
    }

    /// Candle's conv (the reference the fast path is tested against).
    pub fn forward_candle(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)
    }

    fn fast_path_applies(&self, x: &Tensor) -> bool {
        let c = self.config();
        x.device().is_cpu()
            && x.dtype() == DType::F32
            && self.weight().dtype() == DType::F32
            && c.stride == 1
            && c.dilation == 1
            && c.groups == 1
            && x.rank() == 4
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let recording = super::grad::records(x) || super::grad::records(self.weight()) || self.bias().is_some_and(super::grad::records);
        if recording {
            super::grad::conv2d(self, x)
        } else if self.fast_path_applies(x) {
            im2col_conv(x, self.weight(), self.bias(), self.config().padding)
        } else {
            self.inner.forward(x)
        }
    }
}

/// Stride-1 conv of `x` `[B, C, H, W]` with `w` `[O, C, kh, kw]` and zero padding `pad`, by stripes of
/// output rows: columns `[C·kh·kw (+1), rows·OW]` built in parallel, one GEMM per stripe (the bias
/// rides along as a weight column against a row of ones, saving a pass over the output).
fn im2col_conv(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, pad: usize) -> Result<Tensor> {
    let (b, c, h, wd) = x.dims4()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if wc != c {
        candle_core::bail!("conv2d: input has {c} channels, the weight expects {wc}");
    }
    let (oh, ow) = ((h + 2 * pad).checked_sub(kh).map(|v| v + 1), (wd + 2 * pad).checked_sub(kw).map(|v| v + 1));
    let (Some(oh), Some(ow)) = (oh, ow) else {
        candle_core::bail!("conv2d: a {kh}×{kw} kernel does not fit a {h}×{wd} input padded by {pad}");
    };
    let taps = c * kh * kw;
    let (w2, k) = match bias {
        Some(b) => (Tensor::cat(&[&w.reshape((o, taps))?, &b.reshape((o, 1))?], 1)?, taps + 1),
        None => (w.reshape((o, taps))?.contiguous()?, taps),
    };
    let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let rows_per_stripe = (STRIPE_FLOATS / (k * ow).max(1)).clamp(1, oh);
    let mut items = Vec::with_capacity(b);
    for bi in 0..b {
        let img = &xs[bi * c * h * wd..][..c * h * wd];
        let mut stripes = Vec::with_capacity(oh.div_ceil(rows_per_stripe));
        for y0 in (0..oh).step_by(rows_per_stripe) {
            let rows = rows_per_stripe.min(oh - y0);
            let n = rows * ow;
            let mut cols = vec![0f32; k * n];
            cols.par_chunks_mut(n).enumerate().for_each(|(r, col)| {
                if r == taps {
                    col.fill(1.0); // the bias row
                    return;
                }
                let (ci, ky, kx) = (r / (kh * kw), (r / kw) % kh, r % kw);
                let plane = &img[ci * h * wd..][..h * wd];
                for dy in 0..rows {
                    let iy = (y0 + dy + ky) as isize - pad as isize;
                    let line = &mut col[dy * ow..][..ow];
                    if iy < 0 || iy >= h as isize {
                        continue; // stays zero
                    }
                    let src = &plane[iy as usize * wd..][..wd];
                    // Output x reads input x + kx − pad; columns outside the input stay zero.
                    let lo = pad.saturating_sub(kx).min(ow);
                    let hi = (wd + pad).saturating_sub(kx).min(ow);
                    if lo < hi {
                        let s0 = lo + kx - pad;
                        line[lo..hi].copy_from_slice(&src[s0..s0 + (hi - lo)]);
                    }
                }
            });
            let cols = Tensor::from_vec(cols, (k, n), x.device())?;
            stripes.push(w2.matmul(&cols)?.reshape((o, rows, ow))?);
        }
        items.push(Tensor::cat(&stripes, 1)?);
    }
    Tensor::stack(&items, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_fast_path_equals_candles_conv() {
        let dev = Device::Cpu;
        for (c, o, k, pad, h, w) in [(3, 5, 3, 1, 7, 9), (4, 6, 1, 0, 5, 3), (2, 3, 3, 0, 6, 5), (3, 4, 5, 2, 4, 11), (2, 2, 3, 1, 1, 1), (8, 16, 3, 1, 40, 33)] {
            let x = Tensor::randn(0f32, 1.0, (2, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (o, c, k, k), &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            let conv = Conv2d::new(wt, Some(b), Conv2dConfig { padding: pad, ..Default::default() });
            assert!(conv.fast_path_applies(&x));
            let (fast, want) = (conv.forward(&x).unwrap(), conv.forward_candle(&x).unwrap());
            assert_eq!(fast.dims(), want.dims());
            let err = (fast - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
            assert!(err <= 1e-5 * scale, "c{c} o{o} k{k} p{pad} {h}×{w}: {err}");
        }
    }

    #[test]
    fn a_kernel_larger_than_the_padded_input_is_an_error() {
        let dev = Device::Cpu;
        let conv = Conv2d::new(Tensor::zeros((1, 1, 5, 5), DType::F32, &dev).unwrap(), None, Conv2dConfig::default());
        assert!(conv.forward(&Tensor::zeros((1, 1, 3, 3), DType::F32, &dev).unwrap()).is_err());
    }
}
