//! Criterion benchmarks of the hot kernels at the models' real shapes (`cargo bench --bench kernels`;
//! one group: `cargo bench --bench kernels -- conv3x3`). Shapes: DA-V2-Small at 518² (1370 tokens of
//! width 384, 6 heads, DPT head convs at 518² and fusion at 296²), SegFormer-B0 at 512² (the Mix-FFN
//! depthwise convs of its four stages), L-GATr at 32 jets × 200 particles (the geometric product).
//! Whole models side by side with PyTorch and ONNX Runtime: `tools/bench/compare.py`.
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use candle_nn::{Conv2dConfig, ConvTranspose2dConfig, LayerNorm};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use edgerun::nn::attention::{sdpa, sdpa_candle};
use edgerun::nn::conv::Conv2d;
use edgerun::nn::conv_transpose::ConvTranspose2d;
use edgerun::models::lgatr::bilinear::{geometric_product_with, GpImpl};
use edgerun::kernels::direct_conv;
use edgerun::kernels::depthwise::{depthwise_conv2d, depthwise_conv2d_grouped, depthwise_conv2d_nhwc, DepthwiseConfig, DwActivation};
use edgerun::kernels::int8_gemm::{self, Kernel, PackedQ8};
use edgerun::nn::linear::Linear;

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

fn flops(c: &mut Criterion, group: &str, id: &str, n: u64, f: &mut dyn FnMut() -> Tensor) {
    let mut g = c.benchmark_group(group);
    g.sample_size(10).throughput(Throughput::Elements(n));
    g.bench_function(BenchmarkId::from_parameter(id), |b| b.iter(&mut *f));
    g.finish();
}

/// The ViT block's matmuls: qkv, attention output, MLP up and down (f32, f16-held weights, Candle's
/// Q8_0 and Q4_K, edgerun's int8 GEMM on Q8_0 weights).
fn gemm(c: &mut Criterion) {
    let x = randn(&[1370, 384]);
    let xh = randn(&[1370, 1536]);
    for (name, input, out) in [("qkv", &x, 1152), ("proj", &x, 384), ("mlp_up", &x, 1536), ("mlp_down", &xh, 384)] {
        let k = input.dim(1).unwrap();
        let w = randn(&[out, k]);
        let n = (2 * 1370 * k * out) as u64;
        let lin = Linear::from_tensors(w.clone(), None).unwrap();
        flops(c, "gemm_f32", name, n, &mut || lin.forward(input).unwrap());
        // An f16 weight held transposed, as an f16 file's linear holds it (AMX-BF16 tiles where
        // they run; `EDGERUN_NO_AMX=1`: widened to f32 per product).
        let wt = w.t().unwrap().contiguous().unwrap().to_dtype(candle_core::DType::F16).unwrap();
        flops(c, "gemm_f16_held", name, n, &mut || edgerun::kernels::gemm::cpu_xw_plus_bias(input, &wt, None).unwrap().unwrap());
        // Q4_K needs rows that are whole 256-value super-blocks (the MLP down projection).
        for dt in [GgmlDType::Q8_0, GgmlDType::Q4K].into_iter().filter(|d| k % d.block_size() == 0) {
            let q = QMatMul::from_qtensor(QTensor::quantize(&w, dt).unwrap()).unwrap();
            flops(c, &format!("gemm_{dt:?}"), name, n, &mut || q.forward(input).unwrap());
        }
        if int8_gemm::available() {
            let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
            let packed = PackedQ8::from_q8_0(&q.data().unwrap(), out, k).unwrap();
            let xs = input.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let rows = input.dim(0).unwrap();
            for kernel in [Kernel::Avx512Vnni, Kernel::AvxVnni].into_iter().filter(|k| k.runs_here()) {
                let group = format!("gemm_int8_q8_0_{kernel:?}").to_lowercase();
                flops(c, &group, name, n, &mut || Tensor::from_vec(packed.matmul_with(kernel, &xs, rows, None).unwrap(), (rows, out), &Device::Cpu).unwrap());
            }
        }
    }
}

/// 3×3 convs of the DPT head and fusion: edgerun's (Winograd F(2×2, 3×3) on AVX-512, the direct
/// kernel on AVX2, else the stripe GEMM), the direct kernel alone, and Candle's conv2d; 1×1; the
/// reassemble ×4 transposed conv.
fn convs(c: &mut Criterion) {
    for (ch, hw) in [(32usize, 518usize), (64, 296), (64, 74)] {
        let x = randn(&[1, ch, hw, hw]);
        let conv = Conv2d::new(randn(&[ch, ch, 3, 3]), Some(randn(&[ch])), Conv2dConfig { padding: 1, ..Default::default() });
        let n = (2 * hw * hw * ch * ch * 9) as u64;
        flops(c, "conv3x3_edgerun", &format!("{ch}ch_{hw}"), n, &mut || conv.forward(&x).unwrap());
        if direct_conv::available() {
            let s = direct_conv::Shape { b: 1, c: ch, h: hw, w: hw, o: ch, kh: 3, kw: 3, pad: 1 };
            let (xs, ws) = (x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), conv.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let bs = conv.bias().unwrap().to_vec1::<f32>().unwrap();
            flops(c, "conv3x3_direct", &format!("{ch}ch_{hw}"), n, &mut || {
                Tensor::from_vec(direct_conv::conv2d(&s, &xs, &ws, Some(&bs)).unwrap(), (1, ch, hw, hw), &Device::Cpu).unwrap()
            });
        }
        flops(c, "conv3x3_candle", &format!("{ch}ch_{hw}"), n, &mut || conv.forward_candle(&x).unwrap());
    }
    let x = randn(&[1, 384, 37, 37]);
    let conv = Conv2d::new(randn(&[384, 384, 1, 1]), Some(randn(&[384])), Conv2dConfig::default());
    let n = (2 * 37 * 37 * 384 * 384) as u64;
    flops(c, "conv1x1_edgerun", "384ch_37", n, &mut || conv.forward(&x).unwrap());
    flops(c, "conv1x1_candle", "384ch_37", n, &mut || conv.forward_candle(&x).unwrap());
    // Reassemble ×4: a stride-4 transposed conv on the 48-channel map.
    let x = randn(&[1, 48, 37, 37]);
    let tconv = ConvTranspose2d::new(randn(&[48, 48, 4, 4]), Some(randn(&[48])), ConvTranspose2dConfig { stride: 4, ..Default::default() });
    flops(c, "conv_transpose_edgerun", "48ch_37_x4", (2 * 148 * 148 * 48 * 48) as u64, &mut || tconv.forward(&x).unwrap());
    flops(c, "conv_transpose_candle", "48ch_37_x4", (2 * 148 * 148 * 48 * 48) as u64, &mut || tconv.forward_candle(&x).unwrap());
}

/// SegFormer-B0's Mix-FFN depthwise 3×3 convs at its four stage shapes (512² input): edgerun's
/// channels-last kernel with bias and GELU fused, its NCHW kernel, and Candle's grouped conv.
fn depthwise(c: &mut Criterion) {
    let cfg = DepthwiseConfig { stride: 1, padding: 1, dilation: 1 };
    for (ch, hw) in [(128usize, 128usize), (256, 64), (640, 32), (1024, 16)] {
        let x = randn(&[1, ch, hw, hw]);
        let xt = x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
        let (w, b) = (randn(&[ch, 1, 3, 3]), randn(&[ch]));
        let (id, n) = (format!("{ch}ch_{hw}"), (2 * ch * hw * hw * 9) as u64);
        flops(c, "depthwise_nhwc_gelu", &id, n, &mut || depthwise_conv2d_nhwc(&xt, &w, Some(&b), DwActivation::GeluErf, cfg).unwrap());
        flops(c, "depthwise_nchw", &id, n, &mut || depthwise_conv2d(&x, &w, Some(&b), cfg).unwrap());
        flops(c, "depthwise_candle_grouped", &id, n, &mut || depthwise_conv2d_grouped(&x, &w, Some(&b), cfg).unwrap());
    }
}

/// L-GATr's geometric product over 32 jets × 200 particles × 32 channels of 16-component
/// multivectors: the kernel, the dense bilinear form and the gather implementation.
fn geometric_product(c: &mut Criterion) {
    let n = 32 * 200 * 32;
    let (x, y) = (randn(&[n, 16]), randn(&[n, 16]));
    for imp in [GpImpl::Kernel, GpImpl::Dense, GpImpl::Gather] {
        flops(c, "geometric_product", &format!("{imp:?}"), n as u64, &mut || geometric_product_with(&x, &y, imp).unwrap());
    }
}

/// Attention (6 heads × 1370 tokens × 64: fused kernel, int8 on AMX and Candle ops), LayerNorm, GELU, resizes.
fn elementwise(c: &mut Criterion) {
    let (q, k, v) = (randn(&[1, 6, 1370, 64]), randn(&[1, 6, 1370, 64]), randn(&[1, 6, 1370, 64]));
    let n = 4 * 6 * 1370 * 1370 * 64;
    flops(c, "attention_fused", "6x1370x64", n, &mut || sdpa(&q, &k, &v, 0.125, None).unwrap());
    // The int8 attention of Q8_0 ViT blocks (AMX only).
    if edgerun::kernels::int8_attention::applies(&q, &k, &v) {
        flops(c, "attention_int8_amx", "6x1370x64", n, &mut || edgerun::kernels::int8_attention::attention(&q, &k, &v, 0.125).unwrap());
    }
    // The fused attention's softmax over one score block (128 query rows × 1370 keys), in place.
    let mut block: Vec<f32> = (0..128 * 1370).map(|i| ((i * 7919) % 1000) as f32 * 0.01).collect();
    let mut g = c.benchmark_group("softmax_numerator");
    g.sample_size(10).throughput(Throughput::Elements((128 * 1370) as u64));
    g.bench_function(BenchmarkId::from_parameter("128x1370"), |b| {
        b.iter(|| block.chunks_exact_mut(1370).map(|row| edgerun::kernels::fast_math::softmax_numerator(row, 1.0)).sum::<f32>())
    });
    g.finish();
    flops(c, "attention_candle", "6x1370x64", n, &mut || sdpa_candle(&q, &k, &v, 0.125, None).unwrap());
    let x = randn(&[1, 1370, 384]);
    let ln = LayerNorm::new(randn(&[384]), randn(&[384]), 1e-6);
    flops(c, "layer_norm", "1370x384", 1370 * 384, &mut || ln.forward(&x).unwrap());
    let h = randn(&[1370, 1536]);
    flops(c, "gelu_erf_edgerun", "1370x1536", 1370 * 1536, &mut || edgerun::nn::activation::gelu_erf(&h).unwrap());
    flops(c, "gelu_erf_candle", "1370x1536", 1370 * 1536, &mut || h.gelu_erf().unwrap());
    let m = randn(&[1, 64, 148, 148]);
    flops(c, "bilinear", "64ch_148_to_296", 64 * 296 * 296, &mut || edgerun::nn::interpolate::bilinear(&m, 296, 296, true).unwrap());
    let img = image::RgbImage::from_fn(1024, 768, |x, y| image::Rgb([(x % 251) as u8, (y % 241) as u8, ((x + y) % 239) as u8]));
    let mut g = c.benchmark_group("bicubic_preprocess");
    g.sample_size(10).throughput(Throughput::Elements(518 * 518));
    g.bench_function("1024x768_to_518", |b| b.iter(|| edgerun::imageio::resample::resize(&img, 518, 518, edgerun::imageio::resample::Filter::Bicubic)));
    g.finish();
}

criterion_group!(benches, gemm, convs, depthwise, geometric_product, elementwise);
criterion_main!(benches);
