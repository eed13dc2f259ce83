//! `EquiLinear`, folded at load time into one dense matrix.
//!
//! An lgatr `EquiLinear(in_mv → out_mv, in_s → out_s)` is linear in the concatenated per-item input
//! `[x_mv (in_mv·16, channel-major) | x_s (in_s)]`, so it is one `(out_mv·16 + out_s) × (in_mv·16 + in_s)`
//! matrix plus a bias: the mv→mv block is `Σ_a weight[y, x, a] · W_a[i, j]` (the equivariant basis),
//! `s2mvs` feeds components 0 (and 15 with `subgroup`), `mvs2s` reads components 0 (and 15), `s2s`
//! is the scalar block. [`DenseMap`] holds that matrix on the host in f64 so that layers can permute,
//! stack and rescale rows and columns before it becomes a [`FusedLinear`] (one GEMM).
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use super::algebra::linear_basis;
use crate::error::{Error, Result};
use crate::nn::linear::Linear;

/// A dense affine map `y = M x + b` kept on the host (row-major `rows × cols`).
#[derive(Debug, Clone, PartialEq)]
pub struct DenseMap {
    /// Output dimension.
    pub rows: usize,
    /// Input dimension.
    pub cols: usize,
    /// Row-major matrix.
    pub m: Vec<f64>,
    /// Bias, one per row.
    pub b: Vec<f64>,
}

impl DenseMap {
    /// The zero map.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self { rows, cols, m: vec![0.0; rows * cols], b: vec![0.0; rows] }
    }

    /// `n` rows that copy input columns `cols[k]` (a pass-through).
    pub(crate) fn identity_rows(cols: usize, which: impl IntoIterator<Item = usize>) -> Self {
        let which: Vec<usize> = which.into_iter().collect();
        let mut d = Self::zeros(which.len(), cols);
        for (r, &c) in which.iter().enumerate() {
            d.m[r * cols + c] = 1.0;
        }
        d
    }

    /// Entry `(r, c)`.
    pub fn at(&self, r: usize, c: usize) -> f64 {
        self.m[r * self.cols + c]
    }

    fn add(&mut self, r: usize, c: usize, v: f64) {
        self.m[r * self.cols + c] += v;
    }

    /// New row `r` = old row `order[r]`.
    pub(crate) fn reorder_rows(&self, order: &[usize]) -> Result<Self> {
        let mut d = Self::zeros(order.len(), self.cols);
        for (r, &o) in order.iter().enumerate() {
            if o >= self.rows {
                return Err(Error::Config(format!("row {o} out of range ({} rows)", self.rows)));
            }
            d.m[r * self.cols..(r + 1) * self.cols].copy_from_slice(&self.m[o * self.cols..(o + 1) * self.cols]);
            d.b[r] = self.b[o];
        }
        Ok(d)
    }

    /// New column `c` = old column `order[c]`, or zero for `None` (an input the map ignores).
    /// Every old column must appear (nothing may be dropped silently).
    pub(crate) fn reorder_cols(&self, order: &[Option<usize>]) -> Result<Self> {
        let mut seen = vec![false; self.cols];
        let mut d = Self::zeros(self.rows, order.len());
        for (c, o) in order.iter().enumerate() {
            if let Some(o) = *o {
                if o >= self.cols {
                    return Err(Error::Config(format!("column {o} out of range ({} cols)", self.cols)));
                }
                seen[o] = true;
                for r in 0..self.rows {
                    d.m[r * d.cols + c] = self.m[r * self.cols + o];
                }
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(Error::Config(format!("reorder_cols drops input column {missing}")));
        }
        d.b.copy_from_slice(&self.b);
        Ok(d)
    }

    /// Multiplies column `c` by `scale[c]`.
    pub(crate) fn scale_cols(&mut self, scale: &[f64]) {
        for r in 0..self.rows {
            for (c, s) in scale.iter().enumerate() {
                self.m[r * self.cols + c] *= s;
            }
        }
    }

    /// Stacks maps with the same input vertically.
    pub(crate) fn vstack(parts: &[&DenseMap]) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(0);
        let mut d = Self { rows: 0, cols, m: vec![], b: vec![] };
        for p in parts {
            if p.cols != cols {
                return Err(Error::Config(format!("vstack: {} vs {} input columns", p.cols, cols)));
            }
            d.rows += p.rows;
            d.m.extend_from_slice(&p.m);
            d.b.extend_from_slice(&p.b);
        }
        Ok(d)
    }

    /// Uploads as a [`FusedLinear`] in `dtype` on `device`, an f32 CPU map held as `hold` says
    /// (Q8_0 only where this CPU has the int8 GEMM and the input width allows it).
    pub fn to_fused(&self, device: &Device, dtype: DType, hold: MapStorage) -> Result<FusedLinear> {
        let b = if self.b.iter().any(|&v| v != 0.0) {
            Some(Tensor::from_vec(self.b.clone(), self.rows, device)?.to_dtype(dtype)?)
        } else {
            None
        };
        let (rows, cols) = (self.rows, self.cols);
        if hold == MapStorage::Int8 && dtype == DType::F32 {
            let m = Tensor::from_vec(self.m.iter().map(|&v| v as f32).collect::<Vec<f32>>(), (rows, cols), device)?;
            if let Some(linear) = Linear::int8_from_f32(&m, b.clone())? {
                return Ok(FusedLinear { held: Held::Int8(linear), rows, cols });
            }
        }
        let wt = crate::kernels::cpu_slice::transposed(&self.m, rows, cols);
        // Held in f16, an f32 CPU map is widened per product, or multiplied on AMX-BF16 tiles.
        let held = if hold == MapStorage::Half && dtype == DType::F32 && device.is_cpu() { DType::F16 } else { dtype };
        let wt = Tensor::from_vec(wt, (cols, rows), device)?.to_dtype(held)?;
        Ok(FusedLinear { held: Held::Dense { wt, b }, rows, cols })
    }
}

/// How the folded maps of an f32 model on the CPU are held, chosen from how its file stores its
/// matrices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MapStorage {
    /// In the compute dtype.
    #[default]
    Plain,
    /// In f16 (an f16 file): half the memory; maps folded from f16 coefficients by lgatr's basis.
    Half,
    /// Rounded to Q8_0 for the int8 GEMM (a Q8_0 file).
    Int8,
}

/// How a [`FusedLinear`] holds its map.
#[derive(Debug, Clone)]
enum Held {
    /// `wt`: `(cols, rows)`, the transposed matrix, contiguous; `b`: `(rows,)`, absent when zero.
    Dense { wt: Tensor, b: Option<Tensor> },
    /// Rounded to Q8_0 for the int8 GEMM (a Q8_0 file's maps, f32 on the CPU).
    Int8(Linear),
}

/// `y = x · Wᵀ + b` on `(R, cols)` rows: one GEMM.
#[derive(Debug, Clone)]
pub struct FusedLinear {
    held: Held,
    /// Output width.
    pub rows: usize,
    /// Input width.
    pub cols: usize,
}

impl FusedLinear {
    /// Whether the map is held rounded to Q8_0 for the int8 GEMM.
    pub fn is_int8(&self) -> bool {
        matches!(self.held, Held::Int8(_))
    }

    /// Applies the map to `(R, cols)` → `(R, rows)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, c) = x.dims2()?;
        if c != self.cols {
            return Err(Error::Input(format!("fused linear expects {} input features, got {c}", self.cols)));
        }
        let (wt, b) = match &self.held {
            Held::Int8(linear) => return Ok(linear.forward(x)?),
            Held::Dense { wt, b } => (wt, b),
        };
        if let Some(y) = crate::kernels::gemm::cpu_xw_plus_bias(x, wt, b.as_ref())? {
            return Ok(y);
        }
        let x = if x.is_contiguous() { x.clone() } else { x.contiguous()? };
        let y = x.matmul(wt)?;
        Ok(match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

fn host(t: Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// The parameters of one lgatr `EquiLinear`, as loaded (host copies, f64).
#[derive(Debug, Clone)]
pub struct EquiLinearWeights {
    /// Input multivector channels.
    pub in_mv: usize,
    /// Output multivector channels.
    pub out_mv: usize,
    /// Input scalar channels (0: none).
    pub in_s: usize,
    /// Output scalar channels (0: none).
    pub out_s: usize,
    /// SO⁺(1,3) basis (10 maps) rather than Pin(1,3) (5).
    pub subgroup: bool,
    /// `(out_mv, in_mv, NB)`.
    pub weight: Vec<f64>,
    /// `(out_mv,)`, present when `bias and in_s == 0`.
    pub bias: Option<Vec<f64>>,
    /// `(mix·out_mv, in_s)` and `(mix·out_mv,)`.
    pub s2mvs: Option<(Vec<f64>, Option<Vec<f64>>)>,
    /// `(out_s, mix·in_mv)` and `(out_s,)`.
    pub mvs2s: Option<(Vec<f64>, Option<Vec<f64>>)>,
    /// `(out_s, in_s)`.
    pub s2s: Option<Vec<f64>>,
}

impl EquiLinearWeights {
    /// Loads `weight`, `bias`, `s2mvs.*`, `mvs2s.*`, `s2s.weight` under `vb` with lgatr's rules.
    pub fn load(
        vb: &VarBuilder,
        in_mv: usize,
        out_mv: usize,
        in_s: usize,
        out_s: usize,
        subgroup: bool,
        bias: bool,
    ) -> Result<Self> {
        let nb = if subgroup { 10 } else { 5 };
        let mix = if subgroup { 2 } else { 1 };
        let weight = host(vb.get((out_mv, in_mv, nb), "weight")?)?;
        let bias_mv = if bias && in_s == 0 { Some(host(vb.get((out_mv, 1), "bias")?)?) } else { None };
        let s2mvs = if in_s > 0 {
            let w = host(vb.get((mix * out_mv, in_s), "s2mvs.weight")?)?;
            let b = if bias { Some(host(vb.get(mix * out_mv, "s2mvs.bias")?)?) } else { None };
            Some((w, b))
        } else {
            None
        };
        let mvs2s = if out_s > 0 {
            let w = host(vb.get((out_s, mix * in_mv), "mvs2s.weight")?)?;
            let b = if bias { Some(host(vb.get(out_s, "mvs2s.bias")?)?) } else { None };
            Some((w, b))
        } else {
            None
        };
        let s2s = if in_s > 0 && out_s > 0 { Some(host(vb.get((out_s, in_s), "s2s.weight")?)?) } else { None };
        Ok(Self { in_mv, out_mv, in_s, out_s, subgroup, weight, bias: bias_mv, s2mvs, mvs2s, s2s })
    }

    /// Input width `in_mv·16 + in_s`.
    pub(crate) fn in_width(&self) -> usize {
        self.in_mv * 16 + self.in_s
    }

    /// Output width `out_mv·16 + out_s`.
    pub(crate) fn out_width(&self) -> usize {
        self.out_mv * 16 + self.out_s
    }

    /// The dense map on `[x_mv (in_mv, 16) | x_s]` → `[y_mv (out_mv, 16) | y_s]`.
    pub fn fold(&self) -> DenseMap {
        let basis = linear_basis(self.subgroup);
        let nb = basis.len();
        let (mi, mo) = (self.in_mv * 16, self.out_mv * 16);
        let mut d = DenseMap::zeros(self.out_width(), self.in_width());
        for y in 0..self.out_mv {
            for x in 0..self.in_mv {
                for (a, w) in basis.iter().enumerate() {
                    let c = self.weight[(y * self.in_mv + x) * nb + a];
                    if c == 0.0 {
                        continue;
                    }
                    for (i, wi) in w.iter().enumerate() {
                        for (j, &v) in wi.iter().enumerate() {
                            if v != 0.0 {
                                d.add(y * 16 + i, x * 16 + j, c * v);
                            }
                        }
                    }
                }
            }
        }
        if let Some(b) = &self.bias {
            for (y, bv) in b.iter().enumerate() {
                d.b[y * 16] += bv;
            }
        }
        // destinations of s2mvs rows / sources of mvs2s columns
        let targets: Vec<(usize, usize)> = if self.subgroup {
            (0..self.out_mv).flat_map(|y| [(2 * y, y * 16), (2 * y + 1, y * 16 + 15)]).collect()
        } else {
            (0..self.out_mv).map(|y| (y, y * 16)).collect()
        };
        if let Some((w, b)) = &self.s2mvs {
            for &(row, dst) in &targets {
                for k in 0..self.in_s {
                    d.add(dst, mi + k, w[row * self.in_s + k]);
                }
                if let Some(b) = b {
                    d.b[dst] += b[row];
                }
            }
        }
        let sources: Vec<(usize, usize)> = if self.subgroup {
            (0..self.in_mv).flat_map(|x| [(2 * x, x * 16), (2 * x + 1, x * 16 + 15)]).collect()
        } else {
            (0..self.in_mv).map(|x| (x, x * 16)).collect()
        };
        if let Some((w, b)) = &self.mvs2s {
            let width = sources.len();
            for o in 0..self.out_s {
                for &(col, src) in &sources {
                    d.add(mo + o, src, w[o * width + col]);
                }
                if let Some(b) = b {
                    d.b[mo + o] += b[o];
                }
            }
        }
        if let Some(w) = &self.s2s {
            for o in 0..self.out_s {
                for k in 0..self.in_s {
                    d.add(mo + o, mi + k, w[o * self.in_s + k]);
                }
            }
        }
        d
    }
}

/// A standalone `EquiLinear` with lgatr's call signature (used by tests and helpers; the nets
/// apply folded [`DenseMap`]s directly on their fused per-item layout).
#[derive(Debug, Clone)]
pub struct EquiLinear {
    /// The parameters as loaded.
    pub weights: EquiLinearWeights,
    /// The parameters folded into one dense map.
    pub fused: FusedLinear,
}

impl EquiLinear {
    /// Loads and folds.
    pub fn load(
        vb: &VarBuilder,
        in_mv: usize,
        out_mv: usize,
        in_s: usize,
        out_s: usize,
        subgroup: bool,
        bias: bool,
    ) -> Result<Self> {
        let weights = EquiLinearWeights::load(vb, in_mv, out_mv, in_s, out_s, subgroup, bias)?;
        let fused = weights.fold().to_fused(vb.device(), vb.dtype(), MapStorage::Plain)?;
        Ok(Self { weights, fused })
    }

    /// `x_mv (..., in_mv, 16)`, `x_s (..., in_s)` → `(y_mv (..., out_mv, 16), y_s (..., out_s))`.
    pub fn forward(&self, x_mv: &Tensor, x_s: Option<&Tensor>) -> Result<(Tensor, Option<Tensor>)> {
        let w = &self.weights;
        let dims = x_mv.dims();
        if dims.len() < 2 || dims[dims.len() - 1] != 16 || dims[dims.len() - 2] != w.in_mv {
            return Err(Error::Input(format!("EquiLinear expects (..., {}, 16), got {:?}", w.in_mv, dims)));
        }
        let lead = &dims[..dims.len() - 2];
        let r: usize = lead.iter().product();
        let mut parts = vec![x_mv.reshape((r, w.in_mv * 16))?];
        if w.in_s > 0 {
            let s = x_s.ok_or_else(|| Error::Input("EquiLinear built with in_s_channels > 0 needs scalars".into()))?;
            parts.push(s.reshape((r, w.in_s))?);
        }
        let x = Tensor::cat(&parts, 1)?;
        let y = self.fused.forward(&x)?;
        let mut mv_shape = lead.to_vec();
        mv_shape.extend([w.out_mv, 16]);
        let y_mv = y.narrow(1, 0, w.out_mv * 16)?.contiguous()?.reshape(mv_shape)?;
        let y_s = if w.out_s > 0 {
            let mut s_shape = lead.to_vec();
            s_shape.push(w.out_s);
            Some(y.narrow(1, w.out_mv * 16, w.out_s)?.contiguous()?.reshape(s_shape)?)
        } else {
            None
        };
        Ok((y_mv, y_s))
    }
}
