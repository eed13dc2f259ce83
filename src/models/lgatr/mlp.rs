//! `GeometricBilinear`, `ScalarGatedNonlinearity` and `GeoMLP` on the fused per-item layout.
use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::bilinear::gp_fused;
use super::config::{LgatrConfig, Nonlinearity};
use super::equi_linear::{DenseMap, EquiLinearWeights, FusedLinear, MapStorage};
use super::kernels::{kernel_ok, GateKernel};
use super::norm::EquiNorm;
use crate::error::Result;

/// `ScalarGatedNonlinearity` on rows `(R, 16C + S)`: every mv channel times `f(its scalar
/// component)`, scalars through `f` (a row kernel on CPU, tensor ops elsewhere).
pub fn gate_fused(x: &Tensor, c: usize, s: usize, f: Nonlinearity) -> Result<Tensor> {
    if kernel_ok(x) {
        return Ok(x.contiguous()?.apply_op1_no_bwd(&GateKernel { c, s, f })?);
    }
    gate_fused_reference(x, c, s, f)
}

/// The tensor-op form of [`gate_fused`] (any device).
pub fn gate_fused_reference(x: &Tensor, c: usize, s: usize, f: Nonlinearity) -> Result<Tensor> {
    let (r, _) = x.dims2()?;
    let mut parts = Vec::with_capacity(2);
    if c > 0 {
        let mv = if s == 0 { x.clone() } else { x.narrow(1, 0, 16 * c)? };
        let mv = mv.contiguous()?.reshape((r * c, 16))?;
        let g = f.apply(&mv.narrow(1, 0, 1)?)?;
        parts.push(mv.broadcast_mul(&g)?.reshape((r, 16 * c))?);
    }
    if s > 0 {
        let sc = if c == 0 { x.clone() } else { x.narrow(1, 16 * c, s)? };
        parts.push(f.apply(&sc)?);
    }
    Ok(if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? })
}

/// `GeometricBilinear(in → out, hidden = out)`: left and right EquiLinears fused into one GEMM
/// (which also passes the input scalars through), the channel-wise geometric product, the output
/// EquiLinear (fed by the product and the input scalars) and a no-affine `EquiLayerNorm`.
#[derive(Debug, Clone)]
pub(crate) struct GeometricBilinear {
    left_right: FusedLinear,
    out: FusedLinear,
    norm: EquiNorm,
    hidden: usize,
    in_s: usize,
    bivector: bool,
}

impl GeometricBilinear {
    /// Loads `linear_left`, `linear_right`, `linear_out` under `vb`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        vb: &VarBuilder,
        in_mv: usize,
        out_mv: usize,
        in_s: usize,
        out_s: usize,
        subgroup: bool,
        bivector: bool,
        hold: MapStorage,
    ) -> Result<Self> {
        let hidden = out_mv;
        let left = EquiLinearWeights::load(&vb.pp("linear_left"), in_mv, hidden, in_s, 0, subgroup, true)?.fold();
        let right = EquiLinearWeights::load(&vb.pp("linear_right"), in_mv, hidden, in_s, 0, subgroup, true)?.fold();
        let pass = DenseMap::identity_rows(16 * in_mv + in_s, 16 * in_mv..16 * in_mv + in_s);
        let left_right = DenseMap::vstack(&[&left, &right, &pass])?.to_fused(vb.device(), vb.dtype(), hold)?;
        let out = EquiLinearWeights::load(&vb.pp("linear_out"), hidden, out_mv, in_s, out_s, subgroup, true)?
            .fold()
            .to_fused(vb.device(), vb.dtype(), hold)?;
        let norm = EquiNorm::plain(out_mv, out_s, vb.device(), vb.dtype())?;
        Ok(Self { left_right, out, norm, hidden, in_s, bivector })
    }

    /// `(R, 16·in_mv + in_s)` → `(R, 16·out_mv + out_s)`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let lr = self.left_right.forward(x)?;
        let g = gp_fused(&lr, self.hidden, self.in_s, self.bivector)?;
        self.norm.forward(&self.out.forward(&g)?)
    }
}

#[derive(Debug, Clone)]
enum Layer {
    Bilinear(GeometricBilinear),
    Gate { c: usize, s: usize, f: Nonlinearity },
    Linear(FusedLinear),
}

/// `GeoMLP`: channel lists `[C] + [ratio·C]·(L−1) + [C]`; layer 0 is a `GeometricBilinear` (or a
/// gate + EquiLinear with `geometric_product = false`), then gate + EquiLinear per further layer.
/// Dropout layers (present when `dropout_prob` is set) are identities but take module indices.
#[derive(Debug, Clone)]
pub(crate) struct GeoMlp {
    layers: Vec<Layer>,
}

impl GeoMlp {
    /// Loads `layers.{i}` under `vb` (= `blocks.{b}.mlp`).
    pub(crate) fn load(vb: &VarBuilder, cfg: &LgatrConfig) -> Result<Self> {
        let p = cfg.primitives();
        let f = Nonlinearity::parse(&cfg.mlp.nonlinearity)?;
        let (c, s, ratio, nl) =
            (cfg.hidden_mv_channels, cfg.hidden_s_channels, cfg.mlp.mlp_ratio, cfg.mlp.num_layers_mlp);
        let mut mv = vec![c];
        mv.extend(std::iter::repeat_n(ratio * c, nl - 1));
        mv.push(c);
        let mut sc = vec![s];
        sc.extend(std::iter::repeat_n(ratio * s, nl - 1));
        sc.push(s);
        let dropout = cfg.dropout_prob.is_some();
        let mut layers = vec![];
        let mut idx = 0usize;
        let linear = |idx: usize, i: usize| -> Result<FusedLinear> {
            EquiLinearWeights::load(
                &vb.pp(format!("layers.{idx}")),
                mv[i],
                mv[i + 1],
                sc[i],
                sc[i + 1],
                p.subgroup,
                true,
            )?
            .fold()
            .to_fused(vb.device(), vb.dtype(), cfg.hold_maps)
        };
        if p.geometric_product {
            layers.push(Layer::Bilinear(GeometricBilinear::load(
                &vb.pp(format!("layers.{idx}")),
                mv[0],
                mv[1],
                sc[0],
                sc[1],
                p.subgroup,
                p.bivector,
                cfg.hold_maps,
            )?));
            idx += 1;
        } else {
            layers.push(Layer::Gate { c: mv[0], s: sc[0], f });
            idx += 1;
            layers.push(Layer::Linear(linear(idx, 0)?));
            idx += 1;
        }
        if dropout {
            idx += 1;
        }
        for i in 1..mv.len() - 1 {
            layers.push(Layer::Gate { c: mv[i], s: sc[i], f });
            idx += 1;
            layers.push(Layer::Linear(linear(idx, i)?));
            idx += 1;
            if dropout {
                idx += 1;
            }
        }
        Ok(Self { layers })
    }

    /// `(R, 16C + S)` → same.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = match l {
                Layer::Bilinear(gb) => gb.forward(&h)?,
                Layer::Gate { c, s, f } => gate_fused(&h, *c, *s, *f)?,
                Layer::Linear(lin) => lin.forward(&h)?,
            };
        }
        Ok(h)
    }
}
