//! `LGATrSlim`: Lorentz vectors + scalars only (no multivectors, no geometric product).
//!
//! Hidden vectors are channel-last `(B·N, 4, C)` as in lgatr; metric `m = (1, −1, −1, −1)`.
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::attention::sdpa;
use super::config::{Nonlinearity, SlimConfig};
use super::net::{batch_slice, check_inputs, combined_bias, ITEM_CHUNK};
use crate::error::{Error, Result};
use crate::models::{Model, NamedTensors};

/// `SlimRMSNorm` epsilon (additive, unlike `EquiLayerNorm`'s clamp).
pub(crate) const SLIM_EPSILON: f64 = 0.01;

fn metric_col(device: &Device, dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(vec![1.0f64, -1.0, -1.0, -1.0], (4, 1), device)?.to_dtype(dtype)?)
}

fn host(t: Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

fn permute_rows(w: &[f64], cols: usize, order: &[usize]) -> Vec<f64> {
    order.iter().flat_map(|&r| w[r * cols..(r + 1) * cols].iter().copied()).collect()
}

/// `SlimLinear`: `v′ = v · weight_vᵀ` per component (no bias), `s′ = linear_s(s)` or zeros.
#[derive(Debug, Clone)]
pub(crate) struct SlimLinear {
    wv_t: Option<Tensor>,
    ws_t: Option<Tensor>,
    bs: Option<Tensor>,
    in_v: usize,
    out_v: usize,
    out_s: usize,
}

impl SlimLinear {
    /// Loads `weight_v`, `linear_s.weight`, `linear_s.bias` under `vb`; `v_rows` / `s_rows`
    /// optionally reorder the output rows (new row r = old row order[r]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        vb: &VarBuilder,
        in_v: usize,
        out_v: usize,
        in_s: usize,
        out_s: usize,
        bias: bool,
        v_rows: Option<&[usize]>,
        s_rows: Option<&[usize]>,
    ) -> Result<Self> {
        let (dev, dt) = (vb.device(), vb.dtype());
        let wv = host(vb.get((out_v, in_v), "weight_v")?)?;
        let wv_t = if in_v > 0 && out_v > 0 {
            let wv = v_rows.map_or(wv.clone(), |o| permute_rows(&wv, in_v, o));
            Some(Tensor::from_vec(wv, (out_v, in_v), dev)?.to_dtype(dt)?.t()?.contiguous()?)
        } else {
            None
        };
        let (ws_t, bs) = if in_s > 0 && out_s > 0 {
            let ws = host(vb.get((out_s, in_s), "linear_s.weight")?)?;
            let ws = s_rows.map_or(ws.clone(), |o| permute_rows(&ws, in_s, o));
            let ws_t = Tensor::from_vec(ws, (out_s, in_s), dev)?.to_dtype(dt)?.t()?.contiguous()?;
            let bs = if bias {
                let b = host(vb.get(out_s, "linear_s.bias")?)?;
                let b = s_rows.map_or(b.clone(), |o| permute_rows(&b, 1, o));
                Some(Tensor::from_vec(b, out_s, dev)?.to_dtype(dt)?)
            } else {
                None
            };
            (Some(ws_t), bs)
        } else {
            (None, None)
        };
        Ok(Self { wv_t, ws_t, bs, in_v, out_v, out_s })
    }

    /// `v (R, 4, in_v)`, `s (R, in_s)` → `(R, 4, out_v)`, `(R, out_s)`.
    pub(crate) fn forward(&self, v: &Tensor, s: &Tensor) -> Result<(Tensor, Tensor)> {
        let r = v.dim(0)?;
        let ov = match &self.wv_t {
            Some(w) => v.contiguous()?.reshape((r * 4, self.in_v))?.matmul(w)?.reshape((r, 4, self.out_v))?,
            None => Tensor::zeros((r, 4, self.out_v), v.dtype(), v.device())?,
        };
        let os = match &self.ws_t {
            Some(w) => {
                let y = s.contiguous()?.matmul(w)?;
                match &self.bs {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                }
            }
            None => Tensor::zeros((r, self.out_s), v.dtype(), v.device())?,
        };
        Ok((ov, os))
    }
}

/// `SlimRMSNorm`: joint over both streams,
/// `n = rsqrt((Σ_c |Σ_μ m_μ v_μc²| + Σ s²) / (C_v + C_s) + 0.01)`, then optional gains.
#[derive(Debug, Clone)]
pub(crate) struct SlimRmsNorm {
    cv: usize,
    cs: usize,
    wv: Option<Tensor>,
    ws: Option<Tensor>,
    metric: Tensor,
}

impl SlimRmsNorm {
    /// No-affine norm.
    pub(crate) fn plain(cv: usize, cs: usize, device: &Device, dtype: DType) -> Result<Self> {
        Ok(Self { cv, cs, wv: None, ws: None, metric: metric_col(device, dtype)? })
    }

    /// Loads `weight_v`, `weight_s` when `affine`.
    pub(crate) fn load(vb: &VarBuilder, cv: usize, cs: usize, affine: bool) -> Result<Self> {
        let mut n = Self::plain(cv, cs, vb.device(), vb.dtype())?;
        if affine {
            if cv > 0 {
                n.wv = Some(vb.get(cv, "weight_v")?);
            }
            if cs > 0 {
                n.ws = Some(vb.get(cs, "weight_s")?);
            }
        }
        Ok(n)
    }

    /// `v (R, 4, C_v)`, `s (R, C_s)` → same.
    pub(crate) fn forward(&self, v: &Tensor, s: &Tensor) -> Result<(Tensor, Tensor)> {
        let r = v.dim(0)?;
        let mut total = Tensor::zeros((r, 1), v.dtype(), v.device())?;
        if self.cv > 0 {
            total = (total + v.sqr()?.broadcast_mul(&self.metric)?.sum(1)?.abs()?.sum_keepdim(1)?)?;
        }
        if self.cs > 0 {
            total = (total + s.sqr()?.sum_keepdim(1)?)?;
        }
        let n = ((total / (self.cv + self.cs) as f64)? + SLIM_EPSILON)?.sqrt()?.recip()?;
        let mut ov = v.broadcast_mul(&n.unsqueeze(2)?)?;
        let mut os = s.broadcast_mul(&n)?;
        if let Some(w) = &self.wv {
            ov = ov.broadcast_mul(w)?;
        }
        if let Some(w) = &self.ws {
            os = os.broadcast_mul(w)?;
        }
        Ok((ov, os))
    }
}

/// `SlimGLU`: `v = σ_v(½ Σ_μ m_μ g1_μ g2_μ) · v_pre`, `s = σ(s_gate) · s_pre`.
#[derive(Debug, Clone)]
struct SlimGlu {
    linear: SlimLinear,
    out_v: usize,
    out_s: usize,
    f: Nonlinearity,
    fv: Nonlinearity,
    metric: Tensor,
}

impl SlimGlu {
    fn forward(&self, v: &Tensor, s: &Tensor) -> Result<(Tensor, Tensor)> {
        let (vf, sf) = self.linear.forward(v, s)?;
        let ov = self.out_v;
        let pre = vf.narrow(2, 0, ov)?;
        let gate = (vf.narrow(2, ov, ov)? * vf.narrow(2, 2 * ov, ov)?)?
            .broadcast_mul(&self.metric)?
            .sum_keepdim(1)?
            .affine(0.5, 0.0)?;
        let out_v = self.fv.apply(&gate)?.broadcast_mul(&pre)?;
        let os = self.out_s;
        let out_s = (self.f.apply(&sf.narrow(1, os, os)?)? * sf.narrow(1, 0, os)?)?;
        Ok((out_v, out_s))
    }
}

/// `SlimSelfAttention`.
#[derive(Debug, Clone)]
struct SlimAttention {
    linear_in: SlimLinear,
    norm: SlimRmsNorm,
    linear_out: SlimLinear,
    heads: usize,
    hv: usize,
    hs: usize,
    q_scale: Tensor,
}

impl SlimAttention {
    fn load(vb: &VarBuilder, cfg: &SlimConfig) -> Result<Self> {
        let (h, hv, hs) = (cfg.num_heads, cfg.head_v_channels(), cfg.head_s_channels());
        let (cv, cs) = (cfg.hidden_v_channels, cfg.hidden_s_channels);
        // lgatr splits (qkv, c, h); reorder the rows to (qkv, h, c)
        let order = |c: usize| -> Vec<usize> {
            let mut o = vec![];
            for qkv in 0..3 {
                for hh in 0..h {
                    o.extend((0..c).map(|k| (qkv * c + k) * h + hh));
                }
            }
            o
        };
        let (ov, os) = (order(hv), order(hs));
        let linear_in =
            SlimLinear::load(&vb.pp("linear_in"), cv, 3 * hv * h, cs, 3 * hs * h, false, Some(&ov), Some(&os))?;
        let linear_out = SlimLinear::load(&vb.pp("linear_out"), hv * h, cv, hs * h, cs, true, None, None)?;
        let d = 4 * hv + hs;
        let scale = 1.0 / (d as f64).sqrt();
        let mut qs: Vec<f64> =
            [1.0, -1.0, -1.0, -1.0].iter().flat_map(|m| std::iter::repeat_n(m * scale, hv)).collect();
        qs.extend(std::iter::repeat_n(scale, hs));
        let q_scale = Tensor::from_vec(qs, d, vb.device())?.to_dtype(vb.dtype())?;
        let norm = SlimRmsNorm::plain(hv, hs, vb.device(), vb.dtype())?;
        Ok(Self { linear_in, norm, linear_out, heads: h, hv, hs, q_scale })
    }

    fn forward(&self, v: &Tensor, s: &Tensor, b: usize, n: usize, bias: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (h, hv, hs) = (self.heads, self.hv, self.hs);
        let (qv, qs) = self.linear_in.forward(v, s)?;
        let rows = 3 * b * h * n;
        let qv = qv.reshape((b, n, 4, 3, h, hv))?.permute((3, 0, 4, 1, 2, 5))?.contiguous()?.reshape((rows, 4, hv))?;
        let qs = qs.reshape((b, n, 3, h, hs))?.permute((2, 0, 3, 1, 4))?.contiguous()?.reshape((rows, hs))?;
        let (nv, ns) = self.norm.forward(&qv, &qs)?;
        let d = 4 * hv + hs;
        let qkv = Tensor::cat(&[&nv.reshape((rows, 4 * hv))?, &ns], 1)?.reshape((3, b, h, n, d))?;
        let q = qkv.get(0)?.broadcast_mul(&self.q_scale)?;
        let o = sdpa(&q, &qkv.get(1)?, &qkv.get(2)?, bias)?;
        let t = b * n;
        let ov = o
            .narrow(3, 0, 4 * hv)?
            .reshape((b, h, n, 4, hv))?
            .permute((0, 2, 3, 1, 4))?
            .contiguous()?
            .reshape((t, 4, h * hv))?;
        let os = o.narrow(3, 4 * hv, hs)?.permute((0, 2, 1, 3))?.contiguous()?.reshape((t, h * hs))?;
        self.linear_out.forward(&ov, &os)
    }
}

#[derive(Debug, Clone)]
enum MlpLayer {
    Glu(SlimGlu),
    Linear(SlimLinear),
}

#[derive(Debug, Clone)]
struct SlimBlock {
    norm1: SlimRmsNorm,
    attention: SlimAttention,
    norm2: SlimRmsNorm,
    mlp: Vec<MlpLayer>,
}

impl SlimBlock {
    fn load(vb: &VarBuilder, cfg: &SlimConfig) -> Result<Self> {
        let (cv, cs) = (cfg.hidden_v_channels, cfg.hidden_s_channels);
        let (f, fv) = cfg.nonlinearities()?;
        let nl = cfg.num_layers_mlp;
        let mut vl = vec![cv];
        vl.extend(std::iter::repeat_n(cfg.mlp_ratio * cv, nl - 1));
        vl.push(cv);
        let mut sl = vec![cs];
        sl.extend(std::iter::repeat_n(cfg.mlp_ratio * cs, nl - 1));
        sl.push(cs);
        let vbm = vb.pp("mlp");
        let mut mlp = vec![];
        let mut idx = 0;
        for i in 0..nl - 1 {
            let linear = SlimLinear::load(
                &vbm.pp(format!("layers.{idx}.linear")),
                vl[i],
                3 * vl[i + 1],
                sl[i],
                2 * sl[i + 1],
                true,
                None,
                None,
            )?;
            mlp.push(MlpLayer::Glu(SlimGlu {
                linear,
                out_v: vl[i + 1],
                out_s: sl[i + 1],
                f,
                fv,
                metric: metric_col(vb.device(), vb.dtype())?,
            }));
            idx += 1;
            if cfg.dropout_prob.is_some() {
                idx += 1;
            }
        }
        mlp.push(MlpLayer::Linear(SlimLinear::load(
            &vbm.pp(format!("layers.{idx}")),
            vl[nl - 1],
            vl[nl],
            sl[nl - 1],
            sl[nl],
            true,
            None,
            None,
        )?));
        Ok(Self {
            norm1: SlimRmsNorm::load(&vb.pp("norm1"), cv, cs, cfg.norm_elementwise_affine)?,
            attention: SlimAttention::load(&vb.pp("attention"), cfg)?,
            norm2: SlimRmsNorm::load(&vb.pp("norm2"), cv, cs, cfg.norm_elementwise_affine)?,
            mlp,
        })
    }

    fn forward(&self, v: &Tensor, s: &Tensor, b: usize, n: usize, bias: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (hv, hs) = self.norm1.forward(v, s)?;
        let (av, as_) = self.attention.forward(&hv, &hs, b, n, bias)?;
        let (v, s) = ((v + av)?, (s + as_)?);
        let (mut hv, mut hs) = self.norm2.forward(&v, &s)?;
        for l in &self.mlp {
            (hv, hs) = match l {
                MlpLayer::Glu(g) => g.forward(&hv, &hs)?,
                MlpLayer::Linear(lin) => lin.forward(&hv, &hs)?,
            };
        }
        Ok(((v + hv)?, (s + hs)?))
    }
}

/// `lgatr.LGATrSlim`.
#[derive(Debug, Clone)]
pub(crate) struct LgatrSlim {
    cfg: SlimConfig,
    linear_in: SlimLinear,
    blocks: Vec<SlimBlock>,
    linear_out: SlimLinear,
    device: Device,
    dtype: DType,
}

impl LgatrSlim {
    /// Builds the net from a state-dict `VarBuilder`.
    pub(crate) fn load(vb: VarBuilder, cfg: SlimConfig) -> Result<Self> {
        cfg.validate()?;
        let linear_in = SlimLinear::load(
            &vb.pp("linear_in"),
            cfg.in_v_channels,
            cfg.hidden_v_channels,
            cfg.in_s_channels,
            cfg.hidden_s_channels,
            true,
            None,
            None,
        )?;
        let blocks = (0..cfg.num_blocks)
            .map(|i| SlimBlock::load(&vb.pp(format!("blocks.{i}")), &cfg))
            .collect::<Result<Vec<_>>>()?;
        let linear_out = SlimLinear::load(
            &vb.pp("linear_out"),
            cfg.hidden_v_channels,
            cfg.out_v_channels,
            cfg.hidden_s_channels,
            cfg.out_s_channels,
            true,
            None,
            None,
        )?;
        Ok(Self { cfg, linear_in, blocks, linear_out, device: vb.device().clone(), dtype: vb.dtype() })
    }

    /// `vectors (..., N, in_v, 4)`, `scalars (..., N, in_s)`, optional additive bias broadcastable
    /// to `(B, H, N, N)` → `(outputs_v (..., N, out_v, 4), outputs_s (..., N, out_s))`.
    pub(crate) fn forward(&self, vectors: &Tensor, scalars: &Tensor, bias: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let cfg = &self.cfg;
        let dims = vectors.dims().to_vec();
        let rank = dims.len();
        if rank < 3 || dims[rank - 1] != 4 || dims[rank - 2] != cfg.in_v_channels {
            return Err(Error::Input(format!("vectors must be (..., N, {}, 4), got {dims:?}", cfg.in_v_channels)));
        }
        let mut want = dims[..rank - 2].to_vec();
        want.push(cfg.in_s_channels);
        if scalars.dims() != want.as_slice() {
            return Err(Error::Input(format!("scalars must be {want:?}, got {:?}", scalars.dims())));
        }
        let n = dims[rank - 3];
        let b: usize = dims[..rank - 3].iter().product();
        let t = b * n;
        if t == 0 {
            return Err(Error::Input(format!("empty input {dims:?} (no items)")));
        }
        let v = vectors
            .to_device(&self.device)?
            .to_dtype(self.dtype)?
            .reshape((t, cfg.in_v_channels, 4))?
            .transpose(1, 2)?
            .contiguous()?;
        let s = scalars.to_device(&self.device)?.to_dtype(self.dtype)?.reshape((t, cfg.in_s_channels))?;
        let bias = bias.map(|m| m.to_device(&self.device)?.to_dtype(self.dtype)).transpose()?;
        let per = (ITEM_CHUNK / n.max(1)).clamp(1, b.max(1));
        let (mut vs_out, mut ss_out) = (vec![], vec![]);
        let mut b0 = 0;
        while b0 < b {
            let bc = per.min(b - b0);
            let biasc = bias.as_ref().map(|m| batch_slice(m, b, b0, bc)).transpose()?;
            let (mut vc, mut sc) =
                self.linear_in.forward(&v.narrow(0, b0 * n, bc * n)?, &s.narrow(0, b0 * n, bc * n)?)?;
            for block in &self.blocks {
                (vc, sc) = block.forward(&vc, &sc, bc, n, biasc.as_ref())?;
            }
            let (vc, sc) = self.linear_out.forward(&vc, &sc)?;
            vs_out.push(vc);
            ss_out.push(sc);
            b0 += bc;
        }
        let (v, s) = if vs_out.len() == 1 {
            (vs_out.remove(0), ss_out.remove(0))
        } else {
            (Tensor::cat(&vs_out, 0)?, Tensor::cat(&ss_out, 0)?)
        };
        let mut vs = dims[..rank - 2].to_vec();
        vs.extend([cfg.out_v_channels, 4]);
        let mut ss = dims[..rank - 2].to_vec();
        ss.push(cfg.out_s_channels);
        Ok((v.transpose(1, 2)?.contiguous()?.reshape(vs)?, s.reshape(ss)?))
    }
}

impl Model for LgatrSlim {
    fn architecture(&self) -> &str {
        "lgatr_slim"
    }

    fn input_names(&self) -> Vec<&'static str> {
        vec!["vectors", "scalars"]
    }

    /// Inputs `vectors [B, N, C, 4]`, `scalars [B, N, S]`, optional `attention_mask` /
    /// `padding_mask` as for [`super::net::Lgatr`]. Outputs `outputs_v`, `outputs_s`.
    fn forward_named(&self, inputs: &NamedTensors) -> Result<NamedTensors> {
        check_inputs(inputs, &["vectors", "scalars", "attention_mask", "padding_mask"])?;
        let v = inputs.get("vectors").ok_or_else(|| Error::Input("missing input `vectors`".into()))?;
        let s = inputs
            .get("scalars")
            .ok_or_else(|| Error::Input("missing input `scalars` (LGATrSlim requires scalars)".into()))?;
        let dims = v.dims();
        let b: usize = dims[..dims.len().saturating_sub(3)].iter().product();
        let bias = combined_bias(inputs, b, &self.device, self.dtype)?;
        let (ov, os) = self.forward(v, s, bias.as_ref())?;
        let mut out = NamedTensors::new();
        out.insert("outputs_v".into(), ov);
        out.insert("outputs_s".into(), os);
        Ok(out)
    }
}
