//! The depthwise conv kernel (`edgerun::kernels::depthwise`) against Candle's grouped `conv2d`
//! (groups = C): forward values and input/weight/bias gradients, over odd sizes, padding,
//! stride, dilation, non-square kernels and channel multipliers.
use candle_core::{DType, Device, Tensor, Var};
use edgerun::kernels::depthwise::{depthwise_conv2d, depthwise_conv2d_grouped, DepthwiseConfig, DepthwiseConv2d, DepthwiseImpl};

/// The device of every tensor here: the kernel under test is a CPU kernel and other devices run the
/// grouped conv itself, so these tests stay on the CPU whatever `EDGERUN_TEST_DEVICE` says.
fn cpu() -> Device {
    Device::Cpu
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift), so failures reproduce.
fn rand(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &cpu()).unwrap()
}

/// Max |a − b|, computed in f64.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) as f32
}

fn max_abs(a: &Tensor) -> f32 {
    a.to_dtype(DType::F32).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// (B, C, H, W, multiplier, kh, kw, stride, padding, dilation)
type Case = (usize, usize, usize, usize, usize, usize, usize, usize, usize, usize);
const CASES: &[Case] = &[
    (2, 8, 16, 16, 1, 3, 3, 1, 1, 1),  // SegFormer Mix-FFN
    (1, 5, 7, 9, 1, 3, 3, 1, 1, 1),    // odd sizes
    (2, 3, 11, 6, 1, 3, 3, 2, 1, 1),   // stride 2, odd
    (1, 4, 10, 13, 1, 3, 3, 2, 0, 1),  // stride 2, no padding
    (2, 3, 9, 9, 1, 5, 5, 1, 2, 1),    // 5x5
    (1, 2, 12, 10, 1, 3, 3, 1, 2, 2),  // dilation 2
    (1, 3, 8, 7, 1, 3, 5, 1, 1, 1),    // non-square kernel
    (2, 3, 8, 8, 2, 3, 3, 1, 1, 1),    // channel multiplier 2
    (1, 2, 5, 5, 1, 7, 7, 3, 3, 1),    // kernel larger than image with padding, stride 3
    (1, 6, 1, 1, 1, 3, 3, 1, 1, 1),    // 1x1 image
    (3, 1, 6, 4, 3, 1, 1, 1, 0, 1),    // 1x1 kernel
    (1, 2, 9, 8, 1, 3, 3, 2, 3, 1),    // padding larger than kernel half
];

#[test]
fn forward_matches_grouped_conv() {
    for (i, &(b, c, h, w, m, kh, kw, s, p, d)) in CASES.iter().enumerate() {
        let x = rand(&[b, c, h, w], 1 + i as u64);
        let wt = rand(&[c * m, 1, kh, kw], 100 + i as u64);
        let bias = rand(&[c * m], 200 + i as u64);
        let cfg = DepthwiseConfig { stride: s, padding: p, dilation: d };
        for bias in [None, Some(&bias)] {
            let got = depthwise_conv2d(&x, &wt, bias, cfg).unwrap();
            let want = depthwise_conv2d_grouped(&x, &wt, bias, cfg).unwrap();
            assert_eq!(got.dims(), want.dims(), "case {i}");
            let err = max_abs_diff(&got, &want);
            assert!(err <= 1e-5 * max_abs(&want).max(1.0), "case {i}: max abs err {err}");
        }
    }
}

#[test]
fn non_contiguous_input() {
    // A [B, H·W, C] token tensor transposed to NCHW, as SegFormer feeds it.
    let t = rand(&[2, 6 * 5, 4], 7);
    let x = t.transpose(1, 2).unwrap().reshape((2, 4, 6, 5)).unwrap();
    let xt = rand(&[2, 5, 4, 6], 8).transpose(2, 3).unwrap(); // strided view [2,5,6,4]
    let wt = rand(&[4, 1, 3, 3], 9);
    let wt5 = rand(&[5, 1, 3, 3], 10);
    let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
    let err = max_abs_diff(
        &depthwise_conv2d(&x, &wt, None, cfg).unwrap(),
        &depthwise_conv2d_grouped(&x.contiguous().unwrap(), &wt, None, cfg).unwrap(),
    );
    assert!(err < 1e-5, "{err}");
    let err = max_abs_diff(
        &depthwise_conv2d(&xt, &wt5, None, cfg).unwrap(),
        &depthwise_conv2d_grouped(&xt.contiguous().unwrap(), &wt5, None, cfg).unwrap(),
    );
    assert!(err < 1e-5, "{err}");
}

/// An independent differentiable reference built from Candle's autograd ops: zero-pad, then
/// for every kernel tap gather the strided input rows/columns with `index_select` and accumulate
/// `w[:, tap] · x_tap` (the multiplier repeats input channels).
fn tap_sum_reference(x: &Tensor, w: &Tensor, bias: &Tensor, cfg: DepthwiseConfig) -> Tensor {
    let (_, c, h, wd) = x.dims4().unwrap();
    let (co, _, kh, kw) = w.dims4().unwrap();
    let m = co / c;
    let (s, p, d) = (cfg.stride, cfg.padding, cfg.dilation);
    let oh = (h + 2 * p - d * (kh - 1) - 1) / s + 1;
    let ow = (wd + 2 * p - d * (kw - 1) - 1) / s + 1;
    let x = if m > 1 {
        let idx: Vec<u32> = (0..co as u32).map(|o| o / m as u32).collect();
        x.index_select(&Tensor::new(idx, &cpu()).unwrap(), 1).unwrap()
    } else {
        x.clone()
    };
    let xp = x.pad_with_zeros(2, p, p).unwrap().pad_with_zeros(3, p, p).unwrap();
    let mut y: Option<Tensor> = None;
    for ki in 0..kh {
        let rows: Vec<u32> = (0..oh).map(|oy| (oy * s + ki * d) as u32).collect();
        let xr = xp.index_select(&Tensor::new(rows, &cpu()).unwrap(), 2).unwrap();
        for kj in 0..kw {
            let cols: Vec<u32> = (0..ow).map(|ox| (ox * s + kj * d) as u32).collect();
            let xt = xr.index_select(&Tensor::new(cols, &cpu()).unwrap(), 3).unwrap();
            let wk = w.narrow(2, ki, 1).unwrap().narrow(3, kj, 1).unwrap().reshape((1, co, 1, 1)).unwrap();
            let t = xt.broadcast_mul(&wk).unwrap();
            y = Some(match y {
                None => t,
                Some(y) => (y + t).unwrap(),
            });
        }
    }
    y.unwrap().broadcast_add(&bias.reshape((1, co, 1, 1)).unwrap()).unwrap()
}

#[test]
fn tap_sum_reference_matches_grouped_conv() {
    for (i, &(b, c, h, w, m, kh, kw, s, p, d)) in CASES.iter().enumerate() {
        let cfg = DepthwiseConfig { stride: s, padding: p, dilation: d };
        let x = rand(&[b, c, h, w], 700 + i as u64);
        let wt = rand(&[c * m, 1, kh, kw], 800 + i as u64);
        let bias = rand(&[c * m], 900 + i as u64);
        let err = max_abs_diff(&tap_sum_reference(&x, &wt, &bias, cfg), &depthwise_conv2d_grouped(&x, &wt, Some(&bias), cfg).unwrap());
        assert!(err < 1e-5, "case {i}: {err}");
    }
}

/// Gradients w.r.t. input, weight and bias against the tap-sum reference (every case, in f64) and
/// against Candle's grouped conv where Candle's conv backward works (stride 1: its conv2d backward
/// fails with a shape mismatch for stride 2 when the output size needs output padding).
#[test]
fn gradients_match_references() {
    for (i, &(b, c, h, w, m, kh, kw, s, p, d)) in CASES.iter().enumerate() {
        let cfg = DepthwiseConfig { stride: s, padding: p, dilation: d };
        let x0 = rand(&[b, c, h, w], 300 + i as u64);
        let w0 = rand(&[c * m, 1, kh, kw], 400 + i as u64);
        let b0 = rand(&[c * m], 500 + i as u64);
        #[derive(Clone, Copy, PartialEq)]
        enum Which {
            Kernel,
            Grouped,
            TapSum,
        }
        let grads = |which: Which, dt: DType| {
            let var = |t: &Tensor| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap();
            let (x, wt, bias) = (var(&x0), var(&w0), var(&b0));
            let y = match which {
                Which::Kernel => depthwise_conv2d(x.as_tensor(), wt.as_tensor(), Some(bias.as_tensor()), cfg).unwrap(),
                Which::Grouped => depthwise_conv2d_grouped(x.as_tensor(), wt.as_tensor(), Some(bias.as_tensor()), cfg).unwrap(),
                Which::TapSum => tap_sum_reference(x.as_tensor(), wt.as_tensor(), bias.as_tensor(), cfg),
            };
            // A non-uniform upstream gradient: L = Σ y · r.
            let r = rand(y.dims(), 600 + i as u64).to_dtype(dt).unwrap();
            let loss = (y * r).unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            let get = |v: &Var| g.get(v.as_tensor()).expect("missing gradient").clone();
            [get(&x), get(&wt), get(&bias)]
        };
        let got = grads(Which::Kernel, DType::F32);
        let got64 = grads(Which::Kernel, DType::F64);
        let want = grads(Which::TapSum, DType::F64);
        let grouped = (s == 1).then(|| grads(Which::Grouped, DType::F32));
        for (k, name) in ["x", "w", "bias"].iter().enumerate() {
            assert_eq!(got[k].dims(), want[k].dims(), "case {i} grad {name}");
            let tol = 1e-5 * max_abs(&want[k]).max(1.0);
            let err = max_abs_diff(&got[k], &want[k]);
            assert!(err <= tol, "case {i} grad {name} (f32 vs tap-sum): max abs err {err}");
            let err = max_abs_diff(&got64[k], &want[k]);
            assert!(err <= 1e-9 * max_abs(&want[k]).max(1.0), "case {i} grad {name} (f64 vs tap-sum): max abs err {err}");
            if let Some(gr) = &grouped {
                let err = max_abs_diff(&got[k], &gr[k]);
                assert!(err <= tol, "case {i} grad {name} (vs grouped conv): max abs err {err}");
            }
        }
    }
}

#[test]
fn half_precision_and_f64() {
    let (b, c, h, w) = (2, 6, 9, 11);
    let x = rand(&[b, c, h, w], 11);
    let wt = rand(&[c, 1, 3, 3], 12);
    let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
    let want = depthwise_conv2d_grouped(&x, &wt, None, cfg).unwrap();
    let x64 = x.to_dtype(DType::F64).unwrap();
    let w64 = wt.to_dtype(DType::F64).unwrap();
    let got64 = depthwise_conv2d(&x64, &w64, None, cfg).unwrap();
    assert_eq!(got64.dtype(), DType::F64);
    assert!(max_abs_diff(&got64, &want) < 1e-5);
    for (dt, tol) in [(DType::F16, 1e-2), (DType::BF16, 8e-2)] {
        let got = depthwise_conv2d(&x.to_dtype(dt).unwrap(), &wt.to_dtype(dt).unwrap(), None, cfg).unwrap();
        assert_eq!(got.dtype(), dt);
        let err = max_abs_diff(&got, &want);
        assert!(err < tol, "{dt:?}: {err}");
    }
}

#[test]
fn module_impls_agree_and_bad_shapes_error() {
    let x = rand(&[1, 4, 6, 6], 21);
    let wt = rand(&[4, 1, 3, 3], 22);
    let bias = rand(&[4], 23);
    let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
    let mut m = DepthwiseConv2d::new(wt.clone(), Some(bias.clone()), cfg);
    let a = candle_core::Module::forward(&m, &x).unwrap();
    m.set_impl(DepthwiseImpl::Grouped);
    let b = candle_core::Module::forward(&m, &x).unwrap();
    assert!(max_abs_diff(&a, &b) < 1e-5);

    // Weight channels not a multiple of the input channels, wrong rank, kernel larger than padded input.
    assert!(depthwise_conv2d(&x, &rand(&[6, 1, 3, 3], 1), None, cfg).is_err());
    assert!(depthwise_conv2d(&x, &rand(&[4, 2, 3, 3], 1), None, cfg).is_err());
    assert!(depthwise_conv2d(&x.flatten_all().unwrap(), &wt, None, cfg).is_err());
    assert!(depthwise_conv2d(&x, &rand(&[4, 1, 9, 9], 1), None, cfg).is_err());
    assert!(depthwise_conv2d(&x, &wt, Some(&rand(&[3], 1)), cfg).is_err());
    assert!(depthwise_conv2d(&x, &wt, None, DepthwiseConfig { stride: 0, padding: 1, dilation: 1 }).is_err());
}

/// The channels-last op (`[B, H, W, C]`, fused bias and optional exact GELU) against the grouped conv
/// on permuted tensors, for every case.
#[test]
fn nhwc_forward_matches_grouped_conv() {
    use edgerun::kernels::depthwise::{depthwise_conv2d_nhwc, DwActivation};
    for (i, &(b, c, h, w, m, kh, kw, s, p, d)) in CASES.iter().enumerate() {
        let cfg = DepthwiseConfig { stride: s, padding: p, dilation: d };
        let x = rand(&[b, h, w, c], 1000 + i as u64);
        let wt = rand(&[c * m, 1, kh, kw], 1100 + i as u64);
        let bias = rand(&[c * m], 1200 + i as u64);
        let nchw = x.permute((0, 3, 1, 2)).unwrap();
        for act in [DwActivation::None, DwActivation::GeluErf] {
            for bias in [None, Some(&bias)] {
                let got = depthwise_conv2d_nhwc(&x, &wt, bias, act, cfg).unwrap();
                let mut want = depthwise_conv2d_grouped(&nchw.contiguous().unwrap(), &wt, bias, cfg).unwrap();
                if act == DwActivation::GeluErf {
                    want = want.gelu_erf().unwrap();
                }
                let want = want.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
                assert_eq!(got.dims(), want.dims(), "case {i}");
                let err = max_abs_diff(&got, &want);
                assert!(err <= 1e-5 * max_abs(&want).max(1.0), "case {i} {act:?}: max abs err {err}");
            }
        }
    }
    // A strided view (token layout [B, N, C] viewed as [B, H, W, C]) and f16 / f64.
    let t = rand(&[2, 5 * 6, 8], 77).transpose(1, 2).unwrap().transpose(1, 2).unwrap().reshape((2, 5, 6, 8)).unwrap();
    let wt = rand(&[8, 1, 3, 3], 78);
    let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
    let want = depthwise_conv2d_nhwc(&t, &wt, None, DwActivation::GeluErf, cfg).unwrap();
    let x64 = t.to_dtype(DType::F64).unwrap();
    let got64 = depthwise_conv2d_nhwc(&x64, &wt.to_dtype(DType::F64).unwrap(), None, DwActivation::GeluErf, cfg).unwrap();
    assert!(max_abs_diff(&got64, &want) < 1e-5);
    let got16 = depthwise_conv2d_nhwc(&t.to_dtype(DType::F16).unwrap(), &wt.to_dtype(DType::F16).unwrap(), None, DwActivation::GeluErf, cfg).unwrap();
    assert_eq!(got16.dtype(), DType::F16);
    assert!(max_abs_diff(&got16, &want) < 1e-2);
    // Shape errors.
    assert!(depthwise_conv2d_nhwc(&t, &rand(&[6, 1, 3, 3], 1), None, DwActivation::None, cfg).is_err());
    assert!(depthwise_conv2d_nhwc(&t, &wt, Some(&rand(&[3], 1)), DwActivation::None, cfg).is_err());
}

fn exact_gelu(y: &Tensor) -> Tensor {
    let cdf = (((y * std::f64::consts::FRAC_1_SQRT_2).unwrap().erf().unwrap() + 1.0).unwrap() * 0.5).unwrap();
    (y * cdf).unwrap()
}

/// Channels-last gradients (input, weight, bias; with and without the fused GELU) against the
/// tap-sum reference in f64 (permutes + Candle's differentiable `gelu_erf`).
#[test]
fn nhwc_gradients_match_reference() {
    use edgerun::kernels::depthwise::{depthwise_conv2d_nhwc, DwActivation};
    for (i, &(b, c, h, w, m, kh, kw, s, p, d)) in CASES.iter().enumerate() {
        let cfg = DepthwiseConfig { stride: s, padding: p, dilation: d };
        let x0 = rand(&[b, h, w, c], 1300 + i as u64);
        let w0 = rand(&[c * m, 1, kh, kw], 1400 + i as u64);
        let b0 = rand(&[c * m], 1500 + i as u64);
        for act in [DwActivation::None, DwActivation::GeluErf] {
            let grads = |reference: bool, dt: DType| {
                let var = |t: &Tensor| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap();
                let (x, wt, bias) = (var(&x0), var(&w0), var(&b0));
                let y = if reference {
                    let y = tap_sum_reference(&x.as_tensor().permute((0, 3, 1, 2)).unwrap().contiguous().unwrap(), wt.as_tensor(), bias.as_tensor(), cfg);
                    // x·Φ(x) from erf (exact derivative; Candle's gelu_erf backward rounds 1/sqrt(2π) to 0.398942).
                    let y = if act == DwActivation::GeluErf { exact_gelu(&y) } else { y };
                    y.permute((0, 2, 3, 1)).unwrap()
                } else {
                    depthwise_conv2d_nhwc(x.as_tensor(), wt.as_tensor(), Some(bias.as_tensor()), act, cfg).unwrap()
                };
                let r = rand(y.dims(), 1600 + i as u64).to_dtype(dt).unwrap();
                let g = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
                let get = |v: &Var| g.get(v.as_tensor()).expect("missing gradient").clone();
                [get(&x), get(&wt), get(&bias)]
            };
            let want = grads(true, DType::F64);
            let got = grads(false, DType::F32);
            let got64 = grads(false, DType::F64);
            for (k, name) in ["x", "w", "bias"].iter().enumerate() {
                assert_eq!(got[k].dims(), want[k].dims(), "case {i} grad {name}");
                let err = max_abs_diff(&got[k], &want[k]);
                assert!(err <= 1e-5 * max_abs(&want[k]).max(1.0), "case {i} {act:?} grad {name}: {err}");
                let err = max_abs_diff(&got64[k], &want[k]);
                assert!(err <= 1e-9 * max_abs(&want[k]).max(1.0), "case {i} {act:?} grad {name} (f64): {err}");
            }
        }
    }
}
