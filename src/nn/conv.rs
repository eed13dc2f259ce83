//! 2-D convolution with faster CPU paths for f32: 3×3 convs with padding 1 run Winograd's F(2×2, 3×3)
//! ([`crate::kernels::winograd`]) on AVX-512, other stride-1 convs wider than 1×1 (and those on AVX2) the
//! direct kernel of [`crate::kernels::direct_conv`] where the CPU has one; the others (1×1, other
//! CPUs, strided convs with long columns) an image-to-columns GEMM in row stripes small enough
//! that each stripe's columns stay in cache (the GEMM writes the stripe's NCHW output rows in
//! place), 3–5× Candle's conv2d at the DPT heads' shapes. Recording (training) f32 CPU inputs take the
//! same kernels with their own backward ([`super::dense_conv`]), other devices and dtypes Candle's conv.
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Conv2dConfig;
use crate::kernels::conv2d::{direct, stripe_gemm_conv, winograd};

/// Columns (C·kh·kw) from which a strided conv takes the image-to-columns GEMM.
const MIN_STRIDED_TAPS: usize = 2048;

/// A conv layer: weight `[O, C/groups, kh, kw]`, optional bias `[O]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    inner: candle_nn::Conv2d,
    /// The weight rounded to Q8_0 for [`Conv2d::forward_tokens`] ([`Conv2d::hold_int8_for_tokens`]).
    tokens_int8: Option<std::sync::Arc<crate::kernels::conv_nhwc::Int8Weight>>,
}

impl Conv2d {
    /// Builds from a weight, an optional bias and the conv settings.
    pub fn new(weight: Tensor, bias: Option<Tensor>, cfg: Conv2dConfig) -> Self {
        Conv2d { inner: candle_nn::Conv2d::new(weight, bias, cfg), tokens_int8: None }
    }

    /// Holds the weight rounded to Q8_0 as well, so that [`Conv2d::forward_tokens`] runs the int8
    /// GEMM on f32 CPU tokens (a Q8_0 model's convs); a no-op where the weight trains, this CPU has
    /// no int8 kernel or a patch is not whole Q8_0 blocks.
    pub(crate) fn hold_int8_for_tokens(&mut self) -> Result<()> {
        let cfg = self.config();
        if cfg.groups == 1 && cfg.dilation == 1 && !super::grad::records(self.weight()) {
            self.tokens_int8 = crate::kernels::conv_nhwc::Int8Weight::new(self.weight())?.map(std::sync::Arc::new);
        }
        Ok(())
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

    /// The conv of tokens `[B, h·w, C]` of an `h × w` map: tokens `[B, OH·OW, O]` and `(OH, OW)`. f32
    /// on the CPU outside autograd by [`crate::kernels::conv_nhwc`] (no transposes); elsewhere through NCHW.
    pub(crate) fn forward_tokens(&self, x: &Tensor, (h, w): (usize, usize)) -> Result<(Tensor, (usize, usize))> {
        let cfg = self.config();
        let (kh, kw) = self.weight().dims4().map(|(_, _, kh, kw)| (kh, kw))?;
        if cfg.groups == 1 && cfg.dilation == 1 {
            let window = crate::kernels::conv_nhwc::Window { kernel: (kh, kw), stride: cfg.stride, pad: cfg.padding };
            if let Some(held) = &self.tokens_int8 {
                if let Some(y) = crate::kernels::conv_nhwc::conv2d_int8(x, (h, w), held, self.bias(), window)? {
                    return Ok(y);
                }
            }
            if let Some(y) = crate::kernels::conv_nhwc::conv2d(x, (h, w), self.weight(), self.bias(), window)? {
                return Ok(y);
            }
        }
        let (b, _, c) = x.dims3()?;
        let y = self.forward(&crate::kernels::cpu_slice::transpose_last_two(x)?.reshape((b, c, h, w))?)?;
        let (_, _, oh, ow) = y.dims4()?;
        Ok((crate::kernels::cpu_slice::transpose_last_two(&y.flatten_from(2)?)?, (oh, ow)))
    }

    /// `relu(conv(x))`: on a CPU with AVX-512 a 3×3 "same" conv applies the ReLU as it writes
    /// (no pass over the map of its own); elsewhere, and while autograd records, the two ops.
    pub(crate) fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.winograd_fused(x, false, None, true)? {
            return Ok(y);
        }
        self.forward(x)?.relu()
    }

    /// `conv(bilinear(x → oh × ow))`, through a ReLU with `relu`: on a CPU with AVX-512 a 3×3
    /// "same" conv interpolates its input rows as it reads them (the upsampled map is never
    /// stored; the same values bit for bit); elsewhere, and while autograd records, the resize
    /// ([`super::interpolate::bilinear`], with its size checks) and the conv apart.
    pub(crate) fn forward_upsampled(&self, x: &Tensor, (oh, ow): (usize, usize), align_corners: bool, relu: bool) -> Result<Tensor> {
        if let Some(y) = self.winograd_upsampled(x, (oh, ow), align_corners, relu)? {
            return Ok(y);
        }
        let up = super::interpolate::bilinear(x, oh, ow, align_corners).map_err(candle_core::Error::wrap)?;
        if relu { self.forward_relu(&up) } else { self.forward(&up) }
    }

    /// [`Self::forward_upsampled`] by the Winograd kernel; `None` where it does not apply.
    fn winograd_upsampled(&self, x: &Tensor, (oh, ow): (usize, usize), align_corners: bool, relu: bool) -> Result<Option<Tensor>> {
        use crate::kernels::cpu_slice::with_contiguous;
        if !self.winograd_applies(x, None)? {
            return Ok(None);
        }
        let ((b, c, h, w), o) = (x.dims4()?, self.weight().dim(0)?);
        super::interpolate::check_bilinear(x, oh, ow).map_err(candle_core::Error::wrap)?;
        let bias = self.bias().map(|b| b.to_vec1::<f32>()).transpose()?;
        let fused = crate::kernels::winograd::Fused { relu_output: relu, ..Default::default() };
        let out = with_contiguous(x, |xs: &[f32]| {
            with_contiguous(self.weight(), |ws: &[f32]| crate::kernels::winograd::conv3x3_upsampled(b, c, (h, w), (oh, ow), align_corners, o, xs, ws, bias.as_deref(), fused))
        })?
        .transpose()?
        .flatten()
        .flatten();
        out.map(|v| Tensor::from_vec(v, (b, o, oh, ow), x.device())).transpose()
    }

    /// `conv(relu(x)) (+ residual)`: on a CPU with AVX-512, a 3×3 "same" conv takes the ReLU as
    /// it reads `x` and adds the residual as it writes (no passes of their own); elsewhere, and
    /// while autograd records, the separate ops.
    pub(crate) fn forward_pre_relu(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        if let Some(y) = self.winograd_fused(x, true, residual, false)? {
            return Ok(y);
        }
        let y = self.forward(&x.relu()?)?;
        match residual {
            Some(r) => y + r,
            None => Ok(y),
        }
    }

    /// [`Self::forward_pre_relu`] and [`Self::forward_relu`] by the fused Winograd kernel; `None`
    /// where it does not apply.
    fn winograd_fused(&self, x: &Tensor, relu_input: bool, residual: Option<&Tensor>, relu_output: bool) -> Result<Option<Tensor>> {
        if !self.winograd_applies(x, residual)? {
            return Ok(None);
        }
        let bias = self.bias().map(|b| b.to_vec1::<f32>()).transpose()?;
        winograd(x, self.weight(), bias.as_deref(), (relu_input, relu_output), residual)
    }

    /// Whether the Winograd kernel runs this conv on `x` (with `residual`): a 3×3 "same" f32 conv
    /// on a CPU with AVX-512, nothing recording for autograd.
    fn winograd_applies(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<bool> {
        let cfg = self.config();
        let records = super::grad::records(x) || super::grad::records(self.weight()) || self.bias().is_some_and(super::grad::records) || residual.is_some_and(super::grad::records);
        let (_, _, kh, kw) = self.weight().dims4()?;
        Ok(!records && self.fast_path_applies(x) && (kh, kw, cfg.padding, cfg.stride) == (3, 3, 1, 1) && crate::kernels::winograd::available())
    }

    fn fast_path_applies(&self, x: &Tensor) -> bool {
        let c = self.config();
        // Strided convs only with long columns (DPT's 3×3 / 2 over 384+ channels: 12 → 4 ms); for
        // SegFormer's few-channel patch embeddings Candle's conv is faster.
        let taps = self.weight().dims4().map_or(0, |(_, c, kh, kw)| c * kh * kw);
        x.device().is_cpu()
            && x.dtype() == DType::F32
            && self.weight().dtype() == DType::F32
            && (c.stride == 1 || (c.stride > 1 && taps >= MIN_STRIDED_TAPS))
            && c.dilation == 1
            && c.groups == 1
            && x.rank() == 4
    }

    /// Conv2d whose backward Candle gets right. Candle 0.11.1 derives the input gradient's
    /// `output_padding` from the height alone and applies it to the width too, so a strided conv whose
    /// axes leave different remainders fails in backward (4×5 input, stride 2: a 4×6 gradient; Candle
    /// computes that gradient even when only the weights train). [`Conv2d::forward`] takes this when `x`
    /// or the weights record: a strided conv is applied to the explicitly padded input cut to the rows and columns its
    /// windows read, which leaves no remainder on either axis.
    fn forward_differentiable(&self, x: &Tensor) -> Result<Tensor> {
        let conv = self;
        let cfg = conv.config();
        if cfg.stride == 1 {
            return conv.forward_candle(x);
        }
        let (_, _, h, w) = x.dims4()?;
        let (_, _, kh, kw) = conv.weight().dims4()?;
        let p = cfg.padding;
        let span = |n: usize, k: usize| {
            let reach = cfg.dilation * (k - 1) + 1;
            let out = (n + 2 * p).saturating_sub(reach) / cfg.stride + 1;
            (out - 1) * cfg.stride + reach
        };
        let xp = x.pad_with_zeros(2, p, p)?.pad_with_zeros(3, p, p)?;
        let xp = xp.narrow(2, 0, span(h, kh))?.narrow(3, 0, span(w, kw))?;
        let y = xp.conv2d(conv.weight(), 0, cfg.stride, cfg.dilation, cfg.groups)?;
        match conv.bias() {
            Some(b) => y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?),
            None => Ok(y),
        }
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let recording = super::grad::records(x) || super::grad::records(self.weight()) || self.bias().is_some_and(super::grad::records);
        let cfg = self.config();
        if recording && super::dense_conv::applies(x, self.weight(), cfg.groups, cfg.dilation) {
            super::dense_conv::conv(x, self.weight(), self.bias(), cfg.padding, cfg.stride)
        } else if recording {
            self.forward_differentiable(x)
        } else if self.fast_path_applies(x) {
            let (pad, stride) = (self.config().padding, self.config().stride);
            match direct(x, self.weight(), self.bias(), pad, stride)? {
                Some(y) => Ok(y),
                None => stripe_gemm_conv(x, self.weight(), self.bias(), pad, stride),
            }
        } else {
            self.inner.forward(x)
        }
    }
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

    /// `forward_relu` is `relu(forward)`: bit for bit for 3×3 "same" convs (the Winograd kernel
    /// applies the ReLU as it stores what `forward` stores), and for the other shapes; with a
    /// recorded weight the gradient reaches it through the separate ReLU.
    #[test]
    fn forward_relu_is_the_relu_of_forward() {
        let dev = Device::Cpu;
        for (k, pad) in [(3, 1), (3, 0), (1, 0)] {
            let x = Tensor::randn(0f32, 1.0, (2, 6, 19, 37), &dev).unwrap();
            let conv = Conv2d::new(Tensor::randn(0f32, 1.0, (5, 6, k, k), &dev).unwrap(), Some(Tensor::randn(0f32, 1.0, 5, &dev).unwrap()), Conv2dConfig { padding: pad, ..Default::default() });
            let (got, want) = (conv.forward_relu(&x).unwrap(), conv.forward(&x).unwrap().relu().unwrap());
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&got), flat(&want), "{k}×{k} pad {pad}");
            assert!(flat(&got).contains(&0.0) && flat(&got).iter().any(|&v| v > 0.0));
        }
        let w = candle_core::Var::randn(0f32, 1.0, (3, 2, 3, 3), &dev).unwrap();
        let conv = Conv2d::new(w.as_tensor().clone(), None, Conv2dConfig { padding: 1, ..Default::default() });
        let x = Tensor::randn(0f32, 1.0, (1, 2, 5, 5), &dev).unwrap();
        let grads = conv.forward_relu(&x).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(w.as_tensor()).is_some(), "the weight's gradient is recorded");
    }

    /// `forward_upsampled` is the conv of the resized map, bit for bit, with and without the ReLU,
    /// for 3×3 "same" convs (fused where the CPU has AVX-512) and others (apart); a size out of
    /// range is the resize's error.
    #[test]
    fn forward_upsampled_is_the_conv_of_the_resized_map() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (1, 4, 13, 21), &dev).unwrap();
        for (k, pad) in [(3, 1), (1, 0)] {
            let conv = Conv2d::new(Tensor::randn(0f32, 1.0, (3, 4, k, k), &dev).unwrap(), Some(Tensor::randn(0f32, 1.0, 3, &dev).unwrap()), Conv2dConfig { padding: pad, ..Default::default() });
            for (relu, align) in [(false, true), (true, true), (true, false)] {
                let up = crate::nn::interpolate::bilinear(&x, 26, 50, align).unwrap();
                let want = if relu { conv.forward(&up).unwrap().relu().unwrap() } else { conv.forward(&up).unwrap() };
                let got = conv.forward_upsampled(&x, (26, 50), align, relu).unwrap();
                let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(flat(&got), flat(&want), "{k}×{k} relu {relu} align {align}");
            }
            assert!(conv.forward_upsampled(&x, (0, 50), true, false).is_err());
        }
    }

    /// The image-to-columns GEMM itself (the path of CPUs without AVX2, of 1×1 and of long
    /// strided convs), strides 1 to 4, with and without a bias, against Candle's conv; unpadded
    /// stride-1 1×1 convs (which read the input planes in place) over one stripe and several.
    #[test]
    fn the_stripe_gemm_equals_candles_conv_at_every_stride() {
        let dev = Device::Cpu;
        let shapes = [(3, 5, 3, 1, 1, 7, 9), (3, 4, 5, 2, 1, 4, 11), (4, 6, 3, 1, 2, 9, 10), (2, 3, 3, 0, 2, 7, 8), (3, 2, 7, 3, 4, 17, 13), (5, 4, 2, 0, 2, 6, 6), (2, 2, 3, 1, 3, 1, 1), (3, 4, 1, 0, 1, 6, 7), (3, 4, 1, 0, 1, 300, 301), (3, 4, 1, 1, 1, 6, 7), (3, 4, 1, 0, 2, 9, 9)];
        for (c, o, k, pad, stride, h, w) in shapes {
            let x = Tensor::randn(0f32, 1.0, (2, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (o, c, k, k), &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            for bias in [Some(&b), None] {
                let conv = Conv2d::new(wt.clone(), bias.cloned(), Conv2dConfig { padding: pad, stride, ..Default::default() });
                let (fast, want) = (stripe_gemm_conv(&x, &wt, bias, pad, stride).unwrap(), conv.forward_candle(&x).unwrap());
                assert_eq!(fast.dims(), want.dims(), "c{c} o{o} k{k} p{pad} s{stride}");
                let err = (fast - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
                assert!(err <= 1e-5 * scale, "c{c} o{o} k{k} p{pad} s{stride} {h}×{w} bias {}: {err}", bias.is_some());
            }
        }
    }

    /// Convs run as tasks of a pool whose GEMMs are themselves parallel: a worker that waits inside
    /// one conv's GEMM runs another conv's task, which must not find the thread's buffer taken.
    #[test]
    fn convs_nested_in_parallel_tasks_reenter_safely() {
        use rayon::prelude::*;
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (1, 32, 32, 64), &dev).unwrap();
        let wt = Tensor::randn(0f32, 1.0, (64, 32, 3, 3), &dev).unwrap();
        let want = stripe_gemm_conv(&x, &wt, None, 1, 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let outs: Vec<Vec<f32>> = pool.install(|| {
            (0..64).into_par_iter().map(|_| stripe_gemm_conv(&x, &wt, None, 1, 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
        });
        assert!(outs.iter().all(|o| *o == want));
    }

    #[test]
    fn a_kernel_larger_than_the_padded_input_is_an_error() {
        let dev = Device::Cpu;
        let conv = Conv2d::new(Tensor::zeros((1, 1, 5, 5), DType::F32, &dev).unwrap(), None, Conv2dConfig::default());
        assert!(conv.forward(&Tensor::zeros((1, 1, 3, 3), DType::F32, &dev).unwrap()).is_err());
    }
}
