//! Transposed 2-D convolution with a fast CPU path for the DPT reassemble upsampling (kernel =
//! stride, no padding): the output blocks do not overlap, so it is one GEMM, `[out·k·k, in] ×
//! [in, H·W]`, whose rows are then spread into the `k × k` blocks (Candle's transposed conv ran
//! DA-V2-Small's ×4 layer at ~12 GFLOP/s, 8 ms). While autograd records, the same GEMM as one op
//! with its own backward (the output gradient gathered into blocks, then two GEMMs). Other settings,
//! devices and dtypes take Candle's op.
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Module, Result, Shape, Tensor};
use candle_nn::ConvTranspose2dConfig;

use crate::kernels::conv_transpose::{blocks_backward, blocks_by_gemm, blocks_forward, Blocks};
use crate::kernels::cpu_slice::{contiguous_f32, with_f32, with_f32_pair};

/// A transposed conv layer: weight `[in, out, k, k]`, optional bias `[out]`.
#[derive(Debug, Clone)]
pub struct ConvTranspose2d {
    inner: candle_nn::ConvTranspose2d,
}

impl ConvTranspose2d {
    /// Builds from a weight, an optional bias and the settings.
    pub fn new(weight: Tensor, bias: Option<Tensor>, cfg: ConvTranspose2dConfig) -> Self {
        ConvTranspose2d { inner: candle_nn::ConvTranspose2d::new(weight, bias, cfg) }
    }

    /// Candle's transposed conv (the reference the fast path is tested against).
    pub fn forward_candle(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)
    }

    /// Whether the block GEMM runs this layer on `x` (f32 CPU, kernel = stride, no padding), and
    /// whether autograd records through it.
    fn block_path(&self, x: &Tensor) -> (bool, bool) {
        let (c, w) = (self.inner.config(), self.inner.weight());
        let square_kernel_is_stride = w.dims4().is_ok_and(|(_, _, kh, kw)| kh == kw && kw == c.stride);
        let records = super::grad::records(x) || super::grad::records(w) || self.inner.bias().is_some_and(super::grad::records);
        let applies = x.device().is_cpu()
            && x.dtype() == DType::F32
            && w.dtype() == DType::F32
            && self.inner.bias().is_none_or(|b| b.dtype() == DType::F32)
            && x.rank() == 4
            && c.padding == 0
            && c.output_padding == 0
            && c.dilation == 1
            && square_kernel_is_stride
            && x.elem_count() > 0;
        (applies, records)
    }
}

impl Module for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.block_path(x) {
            (true, false) => {
                if let Some(y) = blocks_by_gemm(x, self.inner.weight(), self.inner.bias())? {
                    return Ok(y);
                }
                self.inner.forward(x)
            }
            (true, true) => {
                let ((b, c, h, w), (_, o, k, _)) = (x.dims4()?, self.inner.weight().dims4()?);
                let op = TrainBlocks(Blocks { b, c, h, w, o, k });
                let (x, wt) = (x.contiguous()?, self.inner.weight().contiguous()?);
                match self.inner.bias() {
                    Some(bias) => x.apply_op3_arc(&wt, &bias.contiguous()?, std::sync::Arc::new(Box::new(op))),
                    None => x.apply_op2_arc(&wt, std::sync::Arc::new(Box::new(op))),
                }
            }
            _ => self.inner.forward(x),
        }
    }
}

/// The block transposed conv of f32 CPU training: its sizes.
struct TrainBlocks(Blocks);

impl TrainBlocks {
    fn forward(&self, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Result<(CpuStorage, Shape)> {
        let g = &self.0;
        match crate::profile::tally("conv transpose forward", || blocks_forward(g, x, w, bias)) {
            Some(y) => Ok((CpuStorage::F32(y), Shape::from((g.b, g.o, g.h * g.k, g.w * g.k)))),
            None => candle_core::bail!("conv_transpose2d: operand sizes do not match {g:?}"),
        }
    }

    fn backward(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, gy: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let g = &self.0;
        let gy = gy.to_dtype(DType::F32)?.contiguous()?;
        let want = (x.track_op(), w.track_op());
        let (dx, dw) = crate::profile::tally("conv transpose backward", || {
            with_f32_pair(x, w, |xs, ws| {
                with_f32(&gy, |dy| blocks_backward(g, xs, ws, dy, want).ok_or_else(|| candle_core::Error::Msg(format!("conv_transpose2d backward: operand sizes do not match {g:?}"))))
            })
        })?;
        let gx = if want.0 { Some(Tensor::from_vec(dx, x.shape(), x.device())?) } else { None };
        let gw = if want.1 { Some(Tensor::from_vec(dw, w.shape(), w.device())?) } else { None };
        let gb = match bias {
            Some(b) if b.track_op() => {
                let pixels = g.h * g.k * g.w * g.k;
                Some(Tensor::from_vec(with_f32(&gy, |dy| Ok(crate::kernels::conv_grad::bias_grad(g.b, g.o, pixels, dy)))?, g.o, b.device())?)
            }
            _ => None,
        };
        Ok([gx, gw, gb])
    }
}

impl CustomOp2 for TrainBlocks {
    fn name(&self) -> &'static str {
        "train-conv-transpose-blocks"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let [gx, gw, _] = self.backward(x, w, None, gy)?;
        Ok((gx, gw))
    }
}

impl CustomOp3 for TrainBlocks {
    fn name(&self) -> &'static str {
        "train-conv-transpose-blocks-bias"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(contiguous_f32(s1, l1)?, contiguous_f32(s2, l2)?, Some(contiguous_f32(s3, l3)?))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [gx, gw, gb] = self.backward(x, w, Some(b), gy)?;
        Ok((gx, gw, gb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_fast_path_equals_candles_transposed_conv() {
        let dev = Device::Cpu;
        for &(b, c, o, h, w, k) in &[(1, 5, 3, 4, 6, 4), (2, 3, 7, 5, 3, 2), (1, 2, 2, 3, 3, 1)] {
            let x = Tensor::randn(0f32, 1.0, (b, c, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (c, o, k, k), &dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, o, &dev).unwrap();
            let conv = ConvTranspose2d::new(wt, Some(bias), ConvTranspose2dConfig { stride: k, ..Default::default() });
            assert_eq!(conv.block_path(&x), (true, false));
            let want = conv.forward_candle(&x).unwrap();
            let got = conv.forward(&x).unwrap();
            assert_eq!(got.dims(), want.dims());
            let err = (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-5, "{:?}: max abs error {err}", (b, c, o, h, w, k));
        }
    }

    #[test]
    fn overlapping_kernels_take_candles_op() {
        let x = Tensor::randn(0f32, 1.0, (1, 2, 4, 4), &Device::Cpu).unwrap();
        let wt = Tensor::randn(0f32, 1.0, (2, 3, 3, 3), &Device::Cpu).unwrap();
        let conv = ConvTranspose2d::new(wt, None, ConvTranspose2dConfig { stride: 2, ..Default::default() });
        assert!(!conv.block_path(&x).0);
        assert_eq!(conv.forward(&x).unwrap().dims(), &[1, 3, 9, 9]);
    }

    /// The training op and Candle's transposed conv in f64 (whose backward the finite-difference
    /// tests check): the same output and gradients of the input, weight and bias.
    #[test]
    fn the_training_op_equals_candles_with_its_gradients() {
        use crate::kernels::test_values::spread;
        use candle_core::Var;
        let dev = Device::Cpu;
        let max_abs = |t: &Tensor| t.abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        for k in [2, 4] {
            let (x, w, b) = (spread((2, 3, 5, 4), 1, &dev), spread((3, 6, k, k), 2, &dev), spread(6, 3, &dev));
            let gy = spread((2, 6, 5 * k, 4 * k), 4, &dev);
            let cfg = ConvTranspose2dConfig { stride: k, ..Default::default() };
            let run = |dt: DType, candle: bool| {
                let vars = [&x, &w, &b].map(|t| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap());
                let layer = ConvTranspose2d::new(vars[1].as_tensor().clone(), Some(vars[2].as_tensor().clone()), cfg);
                let y = if candle { layer.forward_candle(vars[0].as_tensor()) } else { layer.forward(vars[0].as_tensor()) }.unwrap();
                let g = (&y * gy.to_dtype(dt).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                let grads: Vec<Tensor> = vars.iter().map(|v| g.get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap()).collect();
                (y.to_dtype(DType::F64).unwrap(), grads)
            };
            let ((y, g), (y64, g64)) = (run(DType::F32, false), run(DType::F64, true));
            assert!(max_abs(&(y - y64).unwrap()) < 1e-5);
            for (got, want) in g.iter().zip(&g64) {
                assert!(max_abs(&(got - want).unwrap()) <= 1e-5 * max_abs(want).max(1.0), "k = {k}");
            }
        }
    }
}
