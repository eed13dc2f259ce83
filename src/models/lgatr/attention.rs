//! Scaled dot-product attention (chunked over queries, additive masks) and L-GATr's geometric
//! self-attention on the fused per-item layout.
//!
//! lgatr concatenates per head `q = [(q_mv · IPF) (C, 16) | q_s (S)]`, `k = [k_mv | k_s]`,
//! `v = [v_mv | v_s]` and calls torch SDPA with its default scale `1/sqrt(16C + S)`. Heads are
//! split from the QKV linear with the head index innermost (`channel = qkv·C·H + c·H + h`) and merged
//! with the head index outermost (`h·C + c`). Here the split order is baked into the folded QKV
//! matrix (its rows come out as `(qkv, h, [c, 16 | s])`), the merge order and `head_scale` into the
//! folded output matrix, so the only data movement is one transpose each way.
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use super::algebra::inner_product_factors;
use super::config::LgatrConfig;
use super::equi_linear::{DenseMap, EquiLinearWeights, FusedLinear};
use super::norm::EquiNorm;
use crate::error::{Error, Result};
use crate::kernels::fused_attention;

/// Largest score block (elements) materialised at once; queries are processed in chunks above it.
pub(crate) const SCORE_BUDGET: usize = 1 << 24;

/// Turns a torch-style `attn_mask` into an additive bias of rank 4 (right-aligned broadcasting
/// against `(B, H, Nq, Nk)`): boolean / integer masks (nonzero = attend) become `0 / −inf`,
/// floating masks are added as they are.
pub(crate) fn mask_to_bias(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    if mask.rank() < 2 || mask.rank() > 4 {
        return Err(Error::Input(format!(
            "attention_mask must have rank 2..4 (broadcastable to (B, H, Nq, Nk)), got {:?}",
            mask.dims()
        )));
    }
    let mut m = mask.clone();
    while m.rank() < 4 {
        m = m.unsqueeze(0)?;
    }
    if m.dtype().is_float() {
        return Ok(m.to_dtype(dtype)?);
    }
    let keep = m.ne(0u32)?;
    let zeros = Tensor::zeros(m.shape(), dtype, m.device())?;
    let ninf = Tensor::full(f32::NEG_INFINITY, m.shape(), m.device())?.to_dtype(dtype)?;
    Ok(keep.where_cond(&zeros, &ninf)?)
}

/// `(B, N)` key-padding mask (nonzero = real item) → additive bias `(B, 1, 1, N)`.
pub fn padding_to_bias(pad: &Tensor, dtype: DType) -> Result<Tensor> {
    let (b, n) = pad.dims2()?;
    let pad = if pad.dtype().is_float() { pad.ne(0f64)?.to_dtype(DType::U8)? } else { pad.clone() };
    mask_to_bias(&pad.reshape((b, 1, 1, n))?, dtype)
}

/// `softmax(q kᵀ + bias) v` with `q (B, H, Nq, D)` already scaled, `k (B, Hk, Nk, D)`,
/// `v (B, Hk, Nk, Dv)`, `Hk ∈ {H, 1}` (multi-query), `bias` broadcastable to `(B, H, Nq, Nk)`.
/// Score blocks above [`SCORE_BUDGET`] elements are processed in query chunks.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    sdpa_with_budget(q, k, v, bias, SCORE_BUDGET)
}

/// [`sdpa`] with an explicit score-block budget (elements of `(B, H, chunk, Nk)`).
pub fn sdpa_with_budget(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>, budget: usize) -> Result<Tensor> {
    let (b, h, nq, d) = q.dims4()?;
    let (bk, hk, nk, dk) = k.dims4()?;
    let (bv, hv, nv, dv) = v.dims4()?;
    if bk != b || bv != b || dk != d || hv != hk || nv != nk || !(hk == h || hk == 1) {
        return Err(Error::Input(format!("sdpa: incompatible q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims())));
    }
    let shared = hk == 1 && h > 1;
    if bias.is_none() && dv == d {
        // f32 on the CPU: one fused pass per head and query block (no score tensor, the fast exp).
        let (kh, vh) = if shared { (k.broadcast_as((b, h, nk, d))?, v.broadcast_as((b, h, nk, d))?) } else { (k.clone(), v.clone()) };
        if fused_attention::applies(q, &kh, &vh) {
            return fused_attention::attention(q, &kh, &vh, 1.0);
        }
    }
    let g = if shared { b } else { b * h };
    let kt = k.contiguous()?.reshape((g, nk, d))?.transpose(1, 2)?;
    let vv = v.contiguous()?.reshape((g, nk, dv))?;
    let chunk = (budget / (b * h * nk).max(1)).clamp(1, nq.max(1));
    let mut outs = Vec::with_capacity(nq.div_ceil(chunk));
    let mut start = 0;
    while start < nq {
        let len = chunk.min(nq - start);
        let qc = if len == nq { q.contiguous()? } else { q.narrow(2, start, len)?.contiguous()? };
        let qg = if shared { qc.reshape((b, h * len, d))? } else { qc.reshape((g, len, d))? };
        let mut scores = qg.matmul(&kt)?;
        if let Some(bias) = bias {
            let bc = if bias.dim(2)? == 1 { bias.clone() } else { bias.narrow(2, start, len)? };
            scores = scores.reshape((b, h, len, nk))?.broadcast_add(&bc)?.reshape((g, scores.dim(1)?, nk))?;
        }
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        outs.push(p.matmul(&vv)?.reshape((b, h, len, dv))?);
        start += len;
    }
    Ok(if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(&outs, 2)? })
}

/// Shapes of one geometric self-attention layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    /// Block mv / scalar channels.
    pub c: usize,
    pub s: usize,
    /// Reinserted mv / scalar channels (extra QK inputs).
    pub r_mv: usize,
    pub r_s: usize,
    /// Heads and per-head mv / scalar channels.
    pub heads: usize,
    pub hc: usize,
    pub hs: usize,
    pub multi_query: bool,
}

impl AttnDims {
    /// Per-head feature width `16·hc + hs`.
    pub(crate) fn d(&self) -> usize {
        16 * self.hc + self.hs
    }
}

/// Column order of the fused attention input `[h_mv | h_s | add_mv | add_s]` in terms of the
/// logical EquiLinear input `[mv (C + R_mv, 16) | s (S + R_s)]`.
fn qk_input_order(d: &AttnDims) -> Vec<Option<usize>> {
    let m = 16 * (d.c + d.r_mv);
    let mut o: Vec<Option<usize>> = (0..16 * d.c).map(Some).collect();
    o.extend((0..d.s).map(|k| Some(m + k)));
    o.extend((16 * d.c..m).map(Some));
    o.extend((0..d.r_s).map(|k| Some(m + d.s + k)));
    o
}

/// Rows of a head-split output, in `(h, [c, 16 | s])` order, for an EquiLinear whose mv output
/// channel is `base_mv(h, c)` and scalar output is `base_s(h, s)`.
fn head_rows(
    d: &AttnDims,
    heads: usize,
    out_mv_total: usize,
    mv_ch: impl Fn(usize, usize) -> usize,
    s_ch: impl Fn(usize, usize) -> usize,
) -> Vec<usize> {
    let mut rows = Vec::with_capacity(heads * d.d());
    for h in 0..heads {
        for c in 0..d.hc {
            rows.extend((0..16).map(|i| mv_ch(h, c) * 16 + i));
        }
        rows.extend((0..d.hs).map(|s| 16 * out_mv_total + s_ch(h, s)));
    }
    rows
}

/// L-GATr `SelfAttention` (incl. its QKV module) on fused rows `(B·N, 16C + S)`.
#[derive(Debug, Clone)]
pub(crate) struct GaSelfAttention {
    dims: AttnDims,
    qkv: FusedLinear,
    norm: EquiNorm,
    q_scale: Tensor,
    out: FusedLinear,
}

impl GaSelfAttention {
    /// Loads `qkv_module.*`, `out_linear.*` and `head_scale` under `vb` (= `blocks.{i}.attention`).
    pub(crate) fn load(vb: &VarBuilder, cfg: &LgatrConfig) -> Result<Self> {
        let p = cfg.primitives();
        let sub = p.subgroup;
        let d = AttnDims {
            c: cfg.hidden_mv_channels,
            s: cfg.hidden_s_channels,
            r_mv: cfg.reinsert_mv_channels.as_ref().map_or(0, |v| v.len()),
            r_s: if cfg.hidden_s_channels > 0 { cfg.reinsert_s_channels.as_ref().map_or(0, |v| v.len()) } else { 0 },
            heads: cfg.attention.num_heads,
            hc: cfg.head_mv_channels(),
            hs: cfg.head_s_channels(),
            multi_query: cfg.attention.multi_query,
        };
        let (h, hc, hs) = (d.heads, d.hc, d.hs);
        let (in_mv, in_s) = (d.c + d.r_mv, d.s + d.r_s);
        let qk_cols = qk_input_order(&d);
        let map = if !d.multi_query {
            let w = EquiLinearWeights::load(
                &vb.pp("qkv_module.in_linear"),
                in_mv,
                3 * hc * h,
                in_s,
                3 * hs * h,
                sub,
                false,
            )?;
            let m = w.fold().reorder_cols(&qk_cols)?;
            let mut rows = vec![];
            for qkv in 0..3 {
                rows.extend(head_rows(
                    &d,
                    h,
                    3 * hc * h,
                    |hh, c| (qkv * hc + c) * h + hh,
                    |hh, s| (qkv * hs + s) * h + hh,
                ));
            }
            m.reorder_rows(&rows)?
        } else {
            let vbq = vb.pp("qkv_module");
            let q = EquiLinearWeights::load(&vbq.pp("q_linear"), in_mv, hc * h, in_s, hs * h, sub, false)?;
            let k = EquiLinearWeights::load(&vbq.pp("k_linear"), in_mv, hc, in_s, hs, sub, false)?;
            let v = EquiLinearWeights::load(&vbq.pp("v_linear"), d.c, hc, d.s, hs, sub, false)?;
            let q = q.fold().reorder_cols(&qk_cols)?.reorder_rows(&head_rows(
                &d,
                h,
                hc * h,
                |hh, c| c * h + hh,
                |hh, s| s * h + hh,
            ))?;
            let k = k.fold().reorder_cols(&qk_cols)?.reorder_rows(&head_rows(&d, 1, hc, |_, c| c, |_, s| s))?;
            // v sees no reinserted features
            let mut v_cols: Vec<Option<usize>> = (0..16 * d.c + d.s).map(Some).collect();
            v_cols.extend(std::iter::repeat_n(None, 16 * d.r_mv + d.r_s));
            let v = v.fold().reorder_cols(&v_cols)?.reorder_rows(&head_rows(&d, 1, hc, |_, c| c, |_, s| s))?;
            DenseMap::vstack(&[&q, &k, &v])?
        };
        let qkv = map.to_fused(vb.device(), vb.dtype(), cfg.hold_maps)?;

        let ow = EquiLinearWeights::load(&vb.pp("out_linear"), hc * h, d.c, hs * h, d.s, sub, true)?;
        let mut cols = Vec::with_capacity(h * d.d());
        for hh in 0..h {
            for c in 0..hc {
                cols.extend((0..16).map(|j| Some((hh * hc + c) * 16 + j)));
            }
            cols.extend((0..hs).map(|s| Some(16 * hc * h + hh * hs + s)));
        }
        let mut om = ow.fold().reorder_cols(&cols)?;
        if cfg.attention.head_scale {
            let hsv = vb.get(h, "head_scale")?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            let scale: Vec<f64> = (0..h).flat_map(|hh| std::iter::repeat_n(hsv[hh], d.d())).collect();
            om.scale_cols(&scale);
        }
        let out = om.to_fused(vb.device(), vb.dtype(), cfg.hold_maps)?;

        let ipf = inner_product_factors();
        let scale = 1.0 / (d.d() as f64).sqrt();
        let mut qs: Vec<f64> = (0..hc).flat_map(|_| ipf.iter().map(|v| v * scale)).collect();
        qs.extend(std::iter::repeat_n(scale, hs));
        let q_scale = Tensor::from_vec(qs, d.d(), vb.device())?.to_dtype(vb.dtype())?;
        let norm = EquiNorm::plain(hc, hs, vb.device(), vb.dtype())?;
        Ok(Self { dims: d, qkv, norm, q_scale, out })
    }

    /// `x (B·N, 16C + S)`, reinserted features `add (B·N, 16R + R_s)` → `(B·N, 16C + S)`.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        b: usize,
        n: usize,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let d = &self.dims;
        let inp = match add {
            Some(a) => Tensor::cat(&[x, a], 1)?,
            None => x.clone(),
        };
        let qkv = self.qkv.forward(&inp)?;
        let hk = if d.multi_query { 1 } else { d.heads };
        let groups = d.heads + 2 * hk;
        let dd = d.d();
        let normed = self.norm.forward(&qkv.reshape((b * n * groups, dd))?)?.reshape((b, n, groups, dd))?;
        let q = normed.narrow(2, 0, d.heads)?.transpose(1, 2)?.broadcast_mul(&self.q_scale)?;
        let k = normed.narrow(2, d.heads, hk)?.transpose(1, 2)?.contiguous()?;
        let v = normed.narrow(2, d.heads + hk, hk)?.transpose(1, 2)?.contiguous()?;
        let o = sdpa(&q, &k, &v, bias)?;
        let o = o.transpose(1, 2)?.contiguous()?.reshape((b * n, d.heads * dd))?;
        self.out.forward(&o)
    }
}
