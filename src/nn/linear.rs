//! A linear layer whose weight is dense or kept block-quantized (QMatMul), chosen by how it is stored.
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Module, Tensor};

use crate::kernels::gemm::{cpu_f32_product, finish_rows, frozen_bias, widened_xwt_plus_bias, Post, BIAS_ROWS_PER_TASK};
use crate::kernels::int8_gemm::{self, PackedQ8};
use crate::kernels::q8_rows::Q8Rows;
use crate::error::Result;
use crate::weights::Vb;

/// The weight of a linear layer.
#[derive(Debug, Clone)]
enum Weight {
    /// Dense `[out, in]`, in the compute dtype.
    Dense(Tensor),
    /// A frozen f32 weight on the CPU, held transposed: `[in, out]`. The GEMM reads its rows in
    /// place; held `[out, in]`, the `gemm` crate gathered it into panels again on every product
    /// (ViT-L linears at 681 tokens on Zen 4: 161–178 → 209–214 GFLOP/s).
    Transposed(Tensor),
    /// Block-quantized `[out, in]`.
    Quantized(QMatMul),
    /// f16 `[in, out]` (an f16-stored matrix used in f32 on the CPU, held transposed like
    /// [`Weight::Transposed`]), widened to f32 for each product: half the memory of f32 at f32
    /// speed, where the CPU has no fast f16 arithmetic.
    Half(Tensor),
    /// A Q8_0 matrix repacked for the int8 GEMM (CPUs with AVX-512 VNNI or AVX-VNNI).
    Int8(std::sync::Arc<PackedQ8>),
    /// A Q8_0 matrix widened to f32 a block of rows per product (other CPUs).
    Q8Rows(std::sync::Arc<Q8Rows>),
}

/// The number of rows of the warm-up product that makes Candle repack a quantized weight: one that
/// selects the same packing as a forward pass over an image's tokens (Q4K switches to AMX tiles from
/// 32 rows where AMX exists; every other repacked type takes the same tiles for any row count from 4).
fn settle_rows(dtype: GgmlDType) -> usize {
    if dtype == GgmlDType::Q4K {
        32
    } else {
        4
    }
}

/// From this many rows a product with a block-quantized weight whose Candle CPU kernel is slower
/// than f32 runs as "dequantize the weight, f32 GEMM" (DA-V2-Small's qkv at 1370 tokens, Q8_0:
/// 6.4 ms against 34.6 ms, and exact with respect to the quantized weight, where Candle's kernel also
/// rounds the activations to 8 bits). Fewer rows (a batch of a few vectors) keep Candle's kernel.
const DEQUANTIZE_FROM_ROWS: usize = 32;

/// The types whose Candle CPU matmul loses to dequantize + f32 GEMM at ViT token counts (measured:
/// Q8_0 and Q4_0 5.4×, Q8_1 21×; Q4_K's repacked kernel beats f32 and keeps its path).
fn dequantize_wins(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q8_1 | GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1)
}

/// The weight of `q` dequantized to f32 when that path is faster for `x` (CPU, enough rows).
fn dequantized_for(q: &QMatMul, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    match q {
        QMatMul::QTensor(qt) if x.device().is_cpu() && x.dim(0)? >= DEQUANTIZE_FROM_ROWS && dequantize_wins(qt.dtype()) => {
            Ok(Some(qt.dequantize(x.device())?))
        }
        _ => Ok(None),
    }
}

/// Whether a matrix stored as `dtype` runs the int8 GEMM on this CPU: Q8_0 as it is, Q4_K rounded to
/// Q8_0 at load ([`held_for_cpu`]).
pub(crate) fn runs_int8_when_stored_as(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4K) && int8_gemm::available()
}

/// How a block-quantized `[n, k]` matrix is held on the CPU when not by Candle's kernel: Q8_0 repacked
/// for the int8 GEMM, or in rows widened per product where this CPU has no int8 kernel; Q4_K rounded
/// to Q8_0 for the int8 GEMM where it has one (its 16 levels per block of 32 land within half an
/// 8-bit step, far inside the 4-bit step; Candle's Q4_K kernel ran CHMv2 at 1.45 × f32's time, and it
/// too rounds the activations to 8 bits). The rounding holds 8.5 bits per value where Candle's repacked
/// copy holds ~6: `EDGERUN_NO_INT8=1` keeps Candle's kernel and its memory. `None`: Candle's kernel.
fn held_for_cpu(q: &candle_core::quantized::QTensor, n: usize, k: usize) -> candle_core::Result<Option<Weight>> {
    use std::sync::Arc;
    let int8 = |p: Option<PackedQ8>| p.map(|p| Weight::Int8(Arc::new(p)));
    Ok(match q.dtype() {
        GgmlDType::Q4K if runs_int8_when_stored_as(GgmlDType::Q4K) => int8(PackedQ8::from_q4k(&q.data()?, n, k)),
        GgmlDType::Q8_0 if runs_int8_when_stored_as(GgmlDType::Q8_0) => int8(PackedQ8::from_q8_0(&q.data()?, n, k)),
        GgmlDType::Q8_0 => Q8Rows::from_q8_0(&q.data()?, n, k).map(|r| Weight::Q8Rows(Arc::new(r))),
        _ => None,
    })
}

/// Whether `vb`'s `weight` is stored in f16 (GGUF or safetensors) and is to be used in f32 on the CPU,
/// frozen: then it is held in f16 and widened per product ([`Weight::Half`]), or widened once at
/// load when small ([`widened_at_load`]).
fn stored_f16_for_f32_cpu(vb: &Vb) -> bool {
    vb.device().is_cpu()
        && vb.dtype() == DType::F32
        && !vb.is_trainable("weight")
        && vb.store().stored_dtype(&vb.path("weight")).and_then(|d| d.plain()) == Some(DType::F16)
}

/// The most values an f16 weight widened once at load may hold ([`widened_at_load`]): 512 KiB in
/// f32.
const WIDENED_AT_LOAD_VALUES: usize = 1 << 17;

/// Whether an f16 weight `[out_dim, in_dim]` is held widened to f32 from load on: a small one that
/// the AMX tiles do not take. Widening it again for each product made SegFormer-B0's narrow
/// matrices 5–25 % slower than in f32 (~0.2 ms a forward, timed per call); its copies hold 0.56 M
/// of its 2.4 M matrix values, 1.1 MB more.
fn widened_at_load(in_dim: usize, out_dim: usize) -> bool {
    in_dim * out_dim <= WIDENED_AT_LOAD_VALUES && !crate::kernels::half_amx::runs_for(crate::kernels::half_amx::MIN_ROWS, in_dim, out_dim)
}

/// Whether `vb`'s dense `weight` is used frozen in f32 on the CPU: then it is held transposed
/// ([`Weight::Transposed`]).
fn frozen_f32_cpu(vb: &Vb) -> bool {
    vb.device().is_cpu() && vb.dtype() == DType::F32 && !vb.is_trainable("weight")
}

/// The `[out]` bias under `vb` when the layer has one.
fn load_bias(vb: &Vb, out_dim: usize, bias: bool) -> Result<Option<Tensor>> {
    Ok(if bias { Some(vb.get(out_dim, "bias")?) } else { None })
}

/// `w [out, in]` as a contiguous `[in, out]` CPU tensor of the same dtype (f32 or f16).
fn hold_transposed(w: Tensor) -> Result<Tensor> {
    let (out_dim, in_dim) = w.dims2()?;
    let t = match w.dtype() {
        DType::F32 => crate::kernels::cpu_slice::with_contiguous(&w, |ws: &[f32]| Tensor::from_vec(crate::kernels::cpu_slice::transposed(ws, out_dim, in_dim), (in_dim, out_dim), w.device()))?,
        DType::F16 => crate::kernels::cpu_slice::with_contiguous(&w, |ws: &[half::f16]| Tensor::from_vec(crate::kernels::cpu_slice::transposed(ws, out_dim, in_dim), (in_dim, out_dim), w.device()))?,
        _ => None,
    };
    match t {
        Some(t) => Ok(t?),
        None => Ok(w.t()?.contiguous()?),
    }
}

/// `y = x Wᵀ + b` over the last dimension; any number of leading dimensions.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    out_dim: usize,
}

impl Linear {
    /// Loads `weight` `[out, in]` (and `bias` `[out]` when `bias`) under `vb`.
    pub fn load(vb: &Vb, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let weight = match vb.qtensor("weight")? {
            Some(q) => {
                if q.shape().dims() != [out_dim, in_dim] {
                    return Err(crate::Error::bad_tensor(
                        vb.store().root(),
                        vb.path("weight"),
                        format!("expected shape {:?}, found {:?}", [out_dim, in_dim], q.shape().dims()),
                    ));
                }
                if let Some(weight) = vb.device().is_cpu().then(|| held_for_cpu(&q, out_dim, in_dim)).transpose()?.flatten() {
                    vb.store().release_pages();
                    return Ok(Linear { weight, bias: load_bias(vb, out_dim, bias)?, out_dim });
                }
                let rows = settle_rows(q.dtype());
                let q = QMatMul::from_qtensor(q)?;
                if vb.device().is_cpu() {
                    // Candle's tiled CPU kernels repack a weight on its first use and keep that copy;
                    // do it now and let the mapped blocks go, so the weight is held once.
                    q.forward(&Tensor::zeros((rows, in_dim), DType::F32, vb.device())?)?;
                    vb.store().release_pages();
                }
                Weight::Quantized(q)
            }
            None if stored_f16_for_f32_cpu(vb) => {
                let w = vb.with_dtype(DType::F16).get((out_dim, in_dim), "weight")?;
                vb.store().release_pages();
                match widened_at_load(in_dim, out_dim) {
                    true => Weight::Transposed(hold_transposed(w.to_dtype(DType::F32)?)?),
                    false => Weight::Half(hold_transposed(w)?),
                }
            }
            None if frozen_f32_cpu(vb) => Weight::Transposed(hold_transposed(vb.get((out_dim, in_dim), "weight")?)?),
            None => Weight::Dense(vb.get((out_dim, in_dim), "weight")?),
        };
        Ok(Linear { weight, bias: load_bias(vb, out_dim, bias)?, out_dim })
    }

    /// Builds from tensors already in memory (`weight` `[out, in]`; held transposed when it is a
    /// frozen f32 CPU tensor, as [`Linear::load`] holds one).
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let out_dim = weight.dim(0)?;
        let weight = if weight.device().is_cpu() && weight.dtype() == DType::F32 && !weight.track_op() {
            Weight::Transposed(hold_transposed(weight)?)
        } else {
            Weight::Dense(weight)
        };
        Ok(Linear { weight, bias, out_dim })
    }

    /// `weight` `[out, in]` (f32, CPU) rounded to Q8_0 and held for the int8 GEMM, as a Q8_0 file's
    /// linear is held; `None` where this CPU has no int8 kernel or `in` is not a whole number of blocks.
    pub(crate) fn int8_from_f32(weight: &Tensor, bias: Option<Tensor>) -> Result<Option<Self>> {
        let out_dim = weight.dim(0)?;
        if !weight.device().is_cpu() || !int8_gemm::available() {
            return Ok(None);
        }
        let packed = PackedQ8::from_f32(weight)?;
        Ok(packed.map(|p| Linear { weight: Weight::Int8(std::sync::Arc::new(p)), bias, out_dim }))
    }

    /// `[rows, out]` from activations already rounded to 8 bits in Q8_0 blocks (`q` `[rows, in]`,
    /// `d` `[rows, in/32]`, [`int8_gemm::quantize_rows`]' rounding), on the CPU, where the weight
    /// runs the int8 GEMM and the bias does not train; `None` otherwise.
    pub(crate) fn forward_quantized(&self, q: &[u8], d: &[f32], rows: usize) -> candle_core::Result<Option<Tensor>> {
        let Weight::Int8(packed) = &self.weight else { return Ok(None) };
        let Some(bias) = frozen_bias(self.bias.as_ref())? else { return Ok(None) };
        let y = packed.matmul_quantized(q, d, rows, bias.as_deref())?;
        Ok(Some(Tensor::from_vec(y, (rows, packed.n()), &candle_core::Device::Cpu)?))
    }

    /// Whether the product runs through the int8 GEMM (its activations rounded to 8 bits).
    pub(crate) fn runs_int8(&self) -> bool {
        matches!(self.weight, Weight::Int8(_))
    }

    /// Whether the weight is kept quantized.
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, Weight::Quantized(_) | Weight::Int8(_) | Weight::Q8Rows(_))
    }
}

impl Linear {
    /// `x [rows, in] → [rows, out]`, then `post`.
    fn forward_rows(&self, x2: &Tensor, post: Post) -> candle_core::Result<Tensor> {
        if let Weight::Transposed(w) | Weight::Half(w) = &self.weight {
            if let Some(y) = cpu_f32_product(x2, w, self.bias.as_ref(), post)? {
                return Ok(y);
            }
        }
        let y = match &self.weight {
            Weight::Dense(w) => x2.matmul(&w.t()?)?,
            Weight::Transposed(w) => x2.matmul(w)?,
            Weight::Half(w) => x2.matmul(&w.to_dtype(x2.dtype())?)?,
            Weight::Quantized(q) => {
                let dt = x2.dtype();
                let x32 = if dt == DType::F32 { x2.clone() } else { x2.to_dtype(DType::F32)? };
                let y = match dequantized_for(q, &x32)? {
                    Some(w) => x32.matmul(&w.t()?)?,
                    None => q.forward(&x32)?,
                };
                if dt == DType::F32 { y } else { y.to_dtype(dt)? }
            }
            Weight::Int8(packed) => {
                let n = packed.n();
                return self.forward_outside_candle(x2, packed.k(), post, |x, rows, bias| {
                    let mut y = packed.matmul(x, rows, bias)?;
                    if post != Post::None {
                        use rayon::prelude::*;
                        y.par_chunks_mut(n.max(1) * BIAS_ROWS_PER_TASK).for_each(|c| finish_rows(c, n, None, post));
                    }
                    Ok(y)
                });
            }
            Weight::Q8Rows(q) => {
                let widen = |j0: usize, dst: &mut [f32]| q.widen_rows(j0, dst);
                return self.forward_outside_candle(x2, q.k(), post, |x, rows, bias| Ok(widened_xwt_plus_bias(x, rows, q.k(), q.n(), bias, post, widen)));
            }
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        apply_post(y, post)
    }

    /// `x2 [rows, k] → [rows, out]` by `product(x, rows, bias)`, a CPU kernel outside Candle's ops
    /// over f32 rows that adds a frozen bias and applies `post` itself (no autograd: the weight is
    /// quantized; a trainable bias is added outside, and `post` after it, so its gradient is recorded).
    fn forward_outside_candle(
        &self,
        x2: &Tensor,
        k: usize,
        post: Post,
        product: impl FnOnce(&[f32], usize, Option<&[f32]>) -> candle_core::Result<Vec<f32>>,
    ) -> candle_core::Result<Tensor> {
        let dt = x2.dtype();
        let x32 = if dt == DType::F32 { x2.clone() } else { x2.to_dtype(DType::F32)? };
        let (rows, in_dim) = x32.dims2()?;
        if in_dim != k {
            candle_core::bail!("linear: input has {in_dim} features, the weight expects {k}");
        }
        let frozen_bias = frozen_bias(self.bias.as_ref())?.flatten();
        let trainable_bias = self.bias.is_some() && frozen_bias.is_none();
        let product = |x: &[f32]| -> candle_core::Result<Vec<f32>> {
            if trainable_bias && post != Post::None {
                // The bias must come before `post`, and only Candle's op records its gradient.
                return product(x, rows, None);
            }
            product(x, rows, frozen_bias.as_deref())
        };
        let out = crate::kernels::cpu_slice::with_contiguous(&x32, product)?.transpose()?;
        let Some(out) = out else { candle_core::bail!("linear: a quantized weight held for the CPU needs a CPU input") };
        let y = Tensor::from_vec(out, (rows, self.out_dim), x2.device())?;
        let y = if dt == DType::F32 { y } else { y.to_dtype(dt)? };
        match &self.bias {
            Some(b) if trainable_bias && post != Post::None => apply_post(y.broadcast_add(b)?, post),
            Some(b) if trainable_bias => y.broadcast_add(b),
            _ => Ok(y),
        }
    }
}

/// `post` by Candle's ops (or the vectorised GELU where it applies), for the paths whose product
/// ran in Candle.
fn apply_post(y: Tensor, post: Post) -> candle_core::Result<Tensor> {
    match post {
        Post::None => Ok(y),
        Post::GeluErf => super::activation::gelu_erf(&y),
    }
}

impl Module for Linear {
    /// `[…, in] → […, out]`. A batch (leading dimension of a rank ≥ 3 input) is computed item by
    /// item: the GEMM kernels pick their blocking by the row count, so folding the batch into the
    /// rows would make an item's result depend on the batch it came in (in the last bits).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_then(x, Post::None)
    }
}

impl Linear {
    /// `gelu_erf(self.forward(x))`, with the bias and the GELU in one pass over the product on the
    /// CPU f32 paths (the transformer MLPs' first layer).
    pub(crate) fn forward_gelu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_then(x, Post::GeluErf)
    }

    /// [`Module::forward`] followed by `post`.
    fn forward_then(&self, x: &Tensor, post: Post) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        let in_dim = *dims.last().unwrap_or(&0);
        let mut out_dims = dims.clone();
        if let Some(last) = out_dims.last_mut() {
            *last = self.out_dim;
        }
        if let Weight::Dense(w) | Weight::Transposed(w) = &self.weight {
            if super::train_linear::applies(x, w, self.bias.as_ref()) {
                // Training: every row in one op with its own backward, whatever the batch.
                let transposed = matches!(self.weight, Weight::Transposed(_));
                let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
                let y = super::train_linear::linear(&x.reshape((rows, in_dim))?, w, transposed, self.bias.as_ref())?;
                return apply_post(y, post)?.reshape(out_dims);
            }
        }
        if dims.len() >= 3 && dims[0] > 1 {
            let per_item: usize = dims[1..dims.len() - 1].iter().product();
            let items = (0..dims[0]).map(|i| self.forward_rows(&x.get(i)?.reshape((per_item, in_dim))?, post)).collect::<candle_core::Result<Vec<_>>>()?;
            return Tensor::stack(&items, 0)?.reshape(out_dims);
        }
        let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
        self.forward_rows(&x.reshape((rows, in_dim))?, post)?.reshape(out_dims)
    }
}

impl Linear {
    /// Fuses several layers over the same input into one (outputs concatenated) when all are dense
    /// and held alike (`[out, in]`, transposed, or f16); None when any part is quantized, held
    /// otherwise or trainable (a fused copy would not follow the optimiser's updates).
    pub fn concat(parts: &[Linear]) -> Result<Option<Linear>> {
        let mut ws = Vec::with_capacity(parts.len());
        let mut bs = Vec::with_capacity(parts.len());
        let Some(first) = parts.first() else { return Ok(None) };
        if let Weight::Int8(_) = first.weight {
            return Self::concat_int8(parts);
        }
        for p in parts {
            let w = match (&first.weight, &p.weight) {
                (Weight::Dense(_), Weight::Dense(w)) | (Weight::Transposed(_), Weight::Transposed(w)) | (Weight::Half(_), Weight::Half(w)) => w,
                _ => return Ok(None),
            };
            if w.is_variable() || p.bias.as_ref().is_some_and(|b| b.is_variable()) {
                return Ok(None);
            }
            ws.push(w.clone());
            bs.push(p.bias.clone());
        }
        let bias = if bs.iter().all(|b| b.is_some()) {
            let bs: Vec<Tensor> = bs.into_iter().flatten().collect();
            Some(Tensor::cat(&bs, 0)?)
        } else if bs.iter().all(|b| b.is_none()) {
            None
        } else {
            return Ok(None);
        };
        let out_dim = parts.iter().map(|p| p.out_dim).sum();
        let weight = match first.weight {
            Weight::Dense(_) => Weight::Dense(Tensor::cat(&ws, 0)?),
            Weight::Transposed(_) => Weight::Transposed(Tensor::cat(&ws, 1)?),
            _ => Weight::Half(Tensor::cat(&ws, 1)?),
        };
        Ok(Some(Linear { out_dim, weight, bias }))
    }

    /// [`Self::concat`] of int8-packed parts (frozen by construction; biases frozen too).
    fn concat_int8(parts: &[Linear]) -> Result<Option<Linear>> {
        let packed: Option<Vec<&PackedQ8>> = parts.iter().map(|p| if let Weight::Int8(w) = &p.weight { Some(&**w) } else { None }).collect();
        let Some(joined) = packed.as_deref().and_then(PackedQ8::concat) else { return Ok(None) };
        let biases: Option<Vec<Tensor>> = parts.iter().map(|p| p.bias.clone().filter(|b| !b.is_variable())).collect();
        let bias = match biases {
            Some(bs) => Some(Tensor::cat(&bs, 0)?),
            None if parts.iter().all(|p| p.bias.is_none()) => None,
            None => return Ok(None),
        };
        Ok(Some(Linear { out_dim: joined.n(), weight: Weight::Int8(std::sync::Arc::new(joined)), bias }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::WeightStore;
    use candle_core::Device;
    use std::collections::HashMap;
    use std::sync::Arc;

    /// An f16-stored weight used in f32 on the CPU is held in f16 and gives the f32 product of its
    /// values (widening is exact), unless it is small and off the tiles: then it is held widened;
    /// a trainable one is loaded dense.
    #[test]
    fn f16_stored_weights_stay_f16_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let cpu = Device::Cpu;
        // `l` is larger than WIDENED_AT_LOAD_VALUES; `s` is small and too narrow for the tiles.
        let (n, k) = (1152, 128);
        let (sn, sk) = (24, 40);
        assert!(n * k > WIDENED_AT_LOAD_VALUES && !crate::kernels::half_amx::runs_for(usize::MAX, sk, sn));
        let w = Tensor::randn(0f32, 1.0, (n, k), &cpu).unwrap().to_dtype(DType::F16).unwrap();
        let b = Tensor::randn(0f32, 1.0, n, &cpu).unwrap();
        let sw = Tensor::randn(0f32, 1.0, (sn, sk), &cpu).unwrap().to_dtype(DType::F16).unwrap();
        let tensors = HashMap::from([("l.weight".to_string(), w.clone()), ("l.bias".to_string(), b.clone()), ("s.weight".to_string(), sw.clone())]);
        candle_core::safetensors::save(&tensors, &path).unwrap();
        let root = Vb::new(Arc::new(WeightStore::open(&path).unwrap()), DType::F32, cpu.clone());
        let vb = root.pp("l");
        let lin = Linear::load(&vb, k, n, true).unwrap();
        assert!(matches!(lin.weight, Weight::Half(_)));
        let small = Linear::load(&root.pp("s"), sk, sn, false).unwrap();
        assert!(matches!(small.weight, Weight::Transposed(_)));
        // 3 rows widen the weight; 45 run the AMX-BF16 tiles where the CPU has them, within 2⁻¹⁷ of
        // Σ|x·w| (~80 here: 6e-4), where a bf16 rounding of either operand would be off by ~1e-2.
        for (rows, bound) in [(3, 2e-5), (45, 1e-3)] {
            let x = Tensor::randn(0f32, 1.0, (rows, k), &cpu).unwrap();
            let want = x.matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap().broadcast_add(&b).unwrap();
            let err = (lin.forward(&x).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < bound, "{rows} rows: {err}");
            let x = Tensor::randn(0f32, 1.0, (rows, sk), &cpu).unwrap();
            let want = x.matmul(&sw.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
            let err = (small.forward(&x).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 2e-5, "small, {rows} rows: {err}");
        }
        let trainable = crate::weights::Trainable::new(|_| true);
        let lin = Linear::load(&vb.with_trainable(trainable), k, n, true).unwrap();
        assert!(matches!(lin.weight, Weight::Dense(_)));
    }

    /// A frozen f32 weight on the CPU is held transposed and gives x·Wᵀ + b, alone and fused with
    /// others by `concat`; a gradient still reaches an input that records one (Candle's ops run).
    #[test]
    fn frozen_f32_weights_are_held_transposed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let cpu = Device::Cpu;
        let (k, n) = (40, 24);
        let ws: Vec<Tensor> = (0..2).map(|_| Tensor::randn(0f32, 1.0, (n, k), &cpu).unwrap()).collect();
        let bs: Vec<Tensor> = (0..2).map(|_| Tensor::randn(0f32, 1.0, n, &cpu).unwrap()).collect();
        let tensors: HashMap<String, Tensor> = (0..2).flat_map(|i| [(format!("l{i}.weight"), ws[i].clone()), (format!("l{i}.bias"), bs[i].clone())]).collect();
        candle_core::safetensors::save(&tensors, &path).unwrap();
        let vb = Vb::new(Arc::new(WeightStore::open(&path).unwrap()), DType::F32, cpu.clone());
        let lins: Vec<Linear> = (0..2).map(|i| Linear::load(&vb.pp(format!("l{i}")), k, n, true).unwrap()).collect();
        assert!(matches!(lins[0].weight, Weight::Transposed(_)));
        let fused = Linear::concat(&lins).unwrap().unwrap();
        assert!(matches!(fused.weight, Weight::Transposed(_)));
        let max_err = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        for rows in [1, 7, 300] {
            let x = Tensor::randn(0f32, 1.0, (rows, k), &cpu).unwrap();
            let want: Vec<Tensor> = (0..2).map(|i| x.matmul(&ws[i].t().unwrap()).unwrap().broadcast_add(&bs[i]).unwrap()).collect();
            assert!(max_err(&lins[1].forward(&x).unwrap(), &want[1]) < 1e-4, "{rows} rows");
            assert!(max_err(&fused.forward(&x).unwrap(), &Tensor::cat(&want, 1).unwrap()) < 1e-4, "{rows} rows, fused");
        }
        let x = candle_core::Var::randn(0f32, 1.0, (5, k), &cpu).unwrap();
        let grads = lins[0].forward(x.as_tensor()).unwrap().sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let y = x.as_tensor().matmul(&ws[0].t().unwrap()).unwrap().broadcast_add(&bs[0]).unwrap();
        let want = y.affine(2.0, 0.0).unwrap().matmul(&ws[0]).unwrap();
        assert!(max_err(grads.get(x.as_tensor()).unwrap(), &want) < 1e-3);
    }

    /// `forward_gelu` is GELU of `forward` for every way a weight is held (f32 transposed, f16,
    /// Q8_0 rows, int8 where the CPU has it, Candle's quantized matmul), with and without a bias,
    /// for a batched input too.
    #[test]
    fn forward_gelu_is_gelu_of_forward_for_every_weight_kind() {
        use candle_core::quantized::QTensor;
        let cpu = Device::Cpu;
        let (n, k) = (256, 128);
        let w = Tensor::randn(0f32, 1.0, (n, k), &cpu).unwrap();
        let b = Tensor::randn(0f32, 1.0, n, &cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let mut kinds = vec![
            ("f32", Weight::Transposed(hold_transposed(w.clone()).unwrap())),
            ("f16", Weight::Half(hold_transposed(w.to_dtype(DType::F16).unwrap()).unwrap())),
            ("q8 rows", Weight::Q8Rows(Arc::new(Q8Rows::from_q8_0(&q.data().unwrap(), n, k).unwrap()))),
            ("candle q8", Weight::Quantized(candle_core::quantized::QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()).unwrap())),
        ];
        if int8_gemm::available() {
            kinds.push(("int8", Weight::Int8(Arc::new(PackedQ8::from_q8_0(&q.data().unwrap(), n, k).unwrap()))));
        }
        for (name, weight) in kinds {
            for bias in [Some(b.clone()), None] {
                let lin = Linear { weight: weight.clone(), bias: bias.clone(), out_dim: n };
                for x in [Tensor::randn(0f32, 1.0, (7, k), &cpu).unwrap(), Tensor::randn(0f32, 1.0, (2, 5, k), &cpu).unwrap(), Tensor::randn(0f32, 1.0, (2, 40, k), &cpu).unwrap()] {
                    let want = crate::nn::activation::gelu_erf(&lin.forward(&x).unwrap()).unwrap();
                    let got = lin.forward_gelu(&x).unwrap();
                    assert_eq!(got.dims(), want.dims());
                    let err = (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                    assert!(err < 1e-6, "{name}, bias {}: {err}", bias.is_some());
                }
            }
        }
    }

    /// Q8_0 and Q4_K matrices run the int8 GEMM where this CPU has it; elsewhere Q8_0 is held in rows
    /// and Q4_K stays with Candle's kernel, as does every other block type.
    #[test]
    fn block_quantized_matrices_take_the_int8_gemm_where_it_runs() {
        use candle_core::quantized::QTensor;
        let (n, k) = (24, 256);
        let w = crate::kernels::test_values::spread((n, k), 3, &Device::Cpu);
        let int8 = int8_gemm::available();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q4_0, GgmlDType::Q6K] {
            let held = held_for_cpu(&QTensor::quantize(&w, dtype).unwrap(), n, k).unwrap();
            let expected = match dtype {
                GgmlDType::Q8_0 | GgmlDType::Q4K if int8 => "int8",
                GgmlDType::Q8_0 => "rows",
                _ => "candle",
            };
            let got = match held {
                Some(Weight::Int8(_)) => "int8",
                Some(Weight::Q8Rows(_)) => "rows",
                None => "candle",
                Some(_) => "other",
            };
            assert_eq!(got, expected, "{dtype:?}");
            assert_eq!(runs_int8_when_stored_as(dtype), expected == "int8", "{dtype:?}");
        }
    }

    /// A Q8_0 weight held in rows gives the f32 product of its dequantized values, bias included,
    /// for row counts on both sides of the block split.
    #[test]
    fn q8_0_rows_multiply_as_their_dequantized_values() {
        use candle_core::quantized::QTensor;
        let cpu = Device::Cpu;
        let (n, k) = (70, 96);
        let w = Tensor::randn(0f32, 1.0, (n, k), &cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let rows = Q8Rows::from_q8_0(&q.data().unwrap(), n, k).unwrap();
        let b = Tensor::randn(0f32, 1.0, n, &cpu).unwrap();
        let lin = Linear { weight: Weight::Q8Rows(Arc::new(rows)), bias: Some(b.clone()), out_dim: n };
        let wq = q.dequantize(&cpu).unwrap();
        for m in [1, 5, 300] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &cpu).unwrap();
            let want = x.matmul(&wq.t().unwrap()).unwrap().broadcast_add(&b).unwrap();
            let err = (lin.forward(&x).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err < 1e-4, "{m} rows: {err}");
        }
    }
}
