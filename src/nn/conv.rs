//! 2-D convolution with a faster CPU path: stride-1 convs in f32 run as an image-to-columns GEMM in
//! row stripes (each stripe's columns stay in cache; the GEMM's output rows are the NCHW output rows),
//! about twice Candle's conv2d at the DPT heads' shapes. Recording (training) inputs take the
//! differentiable path of [`crate::nn::grad`], other devices and dtypes Candle's conv.
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Conv2dConfig;
use rayon::prelude::*;

/// Floats of one stripe's input and output (512 KiB): they stay in L2 across the kernel taps.
const STRIPE_WORKING_SET: usize = 128 << 10;

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
            shifted_gemm_conv(x, self.weight(), self.bias(), self.config().padding)
        } else {
            self.inner.forward(x)
        }
    }
}

/// Stride-1 conv of `x` `[B, C, H, W]` with `w` `[O, C, kh, kw]` and zero padding `pad`, as a sum
/// of one GEMM per kernel tap over shifted views of the padded input (no image-to-columns buffer).
/// With the padded image flattened to rows of width `Wp`, output position `q = y·Wp + x` reads
/// input `q + ky·Wp + kx` for tap `(ky, kx)`: each tap is `W[:, :, ky, kx] · X[:, q + offset]`. The
/// output is computed on the padded width (the last `kw − 1` columns of each row are discarded)
/// in stripes of positions whose input and output stay in cache across the taps.
fn shifted_gemm_conv(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, pad: usize) -> Result<Tensor> {
    let (b, c, h, wd) = x.dims4()?;
    let (o, wc, kh, kw) = w.dims4()?;
    if wc != c {
        candle_core::bail!("conv2d: input has {c} channels, the weight expects {wc}");
    }
    let (hp, wp) = (h + 2 * pad, wd + 2 * pad);
    let (Some(oh), Some(ow)) = (hp.checked_sub(kh).map(|v| v + 1), wp.checked_sub(kw).map(|v| v + 1)) else {
        candle_core::bail!("conv2d: a {kh}×{kw} kernel does not fit a {h}×{wd} input padded by {pad}");
    };
    let plane = hp * wp + kw - 1; // slack: the last row's discarded columns read past the image
    let wide = oh * wp; // output positions on the padded width
    let stripe = (STRIPE_WORKING_SET / (c + o).max(1)).max(256).next_multiple_of(16).min(wide.max(1));
    let stripes = wide.div_ceil(stripe);
    let threads = rayon::current_num_threads();
    let ws = w.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let bs = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b * o * oh * ow];
    let mut padded = vec![0f32; c * plane];
    let mut buf = vec![0f32; stripes * o * stripe];
    for (img, dst) in xs.chunks_exact(c * h * wd).zip(out.chunks_exact_mut(o * oh * ow)) {
        padded.par_chunks_mut(plane).zip(img.par_chunks(h * wd)).for_each(|(p, src)| {
            for (y, row) in src.chunks_exact(wd).enumerate() {
                p[(y + pad) * wp + pad..][..wd].copy_from_slice(row);
            }
        });
        let run = |si: usize, st: &mut [f32], par: gemm::Parallelism| {
            let s0 = si * stripe;
            let n = stripe.min(wide - s0);
            for (oi, row) in st.chunks_exact_mut(stripe).enumerate() {
                row[..n].fill(bs.as_ref().map_or(0.0, |b| b[oi]));
            }
            for ky in 0..kh {
                for kx in 0..kw {
                    // SAFETY: dst is `o × n` with row stride `stripe` inside `st`; lhs addresses
                    // w[:, :, ky, kx] inside `ws`; rhs reads positions s0 + ky·wp + kx .. + n of
                    // each of the c padded planes, which ends within `plane` (see its slack).
                    unsafe {
                        gemm::gemm(
                            o, n, c,
                            st.as_mut_ptr(), 1, stripe as isize, true,
                            ws[ky * kw + kx..].as_ptr(), (kh * kw) as isize, (c * kh * kw) as isize,
                            padded[s0 + ky * wp + kx..].as_ptr(), 1, plane as isize,
                            1.0, 1.0, false, false, false, par,
                        );
                    }
                }
            }
        };
        if stripes >= 2 * threads {
            buf.par_chunks_mut(o * stripe).enumerate().for_each(|(si, st)| run(si, st, gemm::Parallelism::None));
        } else {
            let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
            buf.chunks_mut(o * stripe).enumerate().for_each(|(si, st)| run(si, st, par));
        }
        // Keep the first `ow` columns of every padded-width row.
        dst.par_chunks_mut(oh * ow).enumerate().for_each(|(oi, plane_out)| {
            for (y, line) in plane_out.chunks_exact_mut(ow).enumerate() {
                let (mut q, mut at) = (y * wp, 0);
                while at < ow {
                    let (si, off) = (q / stripe, q % stripe);
                    let take = (ow - at).min(stripe - off);
                    line[at..at + take].copy_from_slice(&buf[(si * o + oi) * stripe + off..][..take]);
                    (q, at) = (q + take, at + take);
                }
            }
        });
    }
    Tensor::from_vec(out, (b, o, oh, ow), x.device())
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
