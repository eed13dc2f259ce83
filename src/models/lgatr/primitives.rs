//! lgatr's functional primitives on `(..., 16)` multivector tensors, and the embed / extract
//! interface. The nets use the fused-layout versions in [`super::norm`] and [`super::mlp`]; these
//! are the reference forms (and what the primitive parity tests call).
use candle_core::{DType, Device, Tensor, D};

use super::algebra::{inner_product_factors, linear_basis, metric_grades, Mat16};
use super::config::Nonlinearity;
use crate::error::{Error, Result};

fn vec16(v: &[f64; 16], device: &Device, dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(v.to_vec(), 16, device)?.to_dtype(dtype)?)
}

fn check16(x: &Tensor, what: &str) -> Result<()> {
    if x.dims().last() != Some(&16) {
        return Err(Error::Input(format!("{what} expects (..., 16), got {:?}", x.dims())));
    }
    Ok(())
}

/// `(16, 5)` tensor of [`metric_grades`].
pub(crate) fn metric_grades_tensor(device: &Device, dtype: DType) -> Result<Tensor> {
    let m = metric_grades();
    let flat: Vec<f64> = m.iter().flatten().copied().collect();
    Ok(Tensor::from_vec(flat, (16, 5), device)?.to_dtype(dtype)?)
}

/// `Σ_i IPF_i x_i y_i`, shape `(..., 1)`.
pub fn inner_product(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    check16(x, "inner_product")?;
    let ipf = vec16(&inner_product_factors(), x.device(), x.dtype())?;
    Ok(x.broadcast_mul(&ipf)?.broadcast_mul(y)?.sum_keepdim(D::Minus1)?)
}

/// `Σ_g |Σ_{i∈g} IPF_i x_i²|`, shape `(..., 1)`.
pub fn abs_squared_norm(x: &Tensor) -> Result<Tensor> {
    check16(x, "abs_squared_norm")?;
    let m = metric_grades_tensor(x.device(), x.dtype())?;
    let sq = x.sqr()?;
    let dims = sq.dims().to_vec();
    let r = sq.elem_count() / 16;
    let per_grade = sq.reshape((r, 16))?.matmul(&m)?.abs()?.sum_keepdim(1)?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = 1;
    }
    Ok(per_grade.reshape(out)?)
}

/// `equi_layer_norm(x)` over the channel dim −2: `x / sqrt(max(mean_c abs_squared_norm, eps))`.
pub fn equi_layer_norm(x: &Tensor, epsilon: f64) -> Result<Tensor> {
    let n = abs_squared_norm(x)?.mean_keepdim(D::Minus2)?;
    Ok(x.broadcast_mul(&n.maximum(epsilon)?.sqrt()?.recip()?)?)
}

/// `ScalarGatedNonlinearity`: `f(x[..., 0:1]) · x` on multivectors, `f(s)` on scalars.
pub fn gated_nonlinearity(x: &Tensor, s: Option<&Tensor>, f: Nonlinearity) -> Result<(Tensor, Option<Tensor>)> {
    check16(x, "gated_nonlinearity")?;
    let gate = f.apply(&x.narrow(D::Minus1, 0, 1)?)?;
    let mv = x.broadcast_mul(&gate)?;
    let s = s.map(|s| f.apply(s)).transpose()?;
    Ok((mv, s))
}

/// `equi_linear(x (..., in, 16), coeffs (out, in, NB))` → `(..., out, 16)`.
pub fn equi_linear(x: &Tensor, coeffs: &Tensor, subgroup: bool) -> Result<Tensor> {
    check16(x, "equi_linear")?;
    let (out, inp, nb) = coeffs.dims3()?;
    let basis = linear_basis(subgroup);
    if nb != basis.len() {
        return Err(Error::Input(format!("equi_linear: {nb} coefficients per map, basis has {}", basis.len())));
    }
    let flat: Vec<f64> = basis.iter().flat_map(|w| w.iter().flatten().copied()).collect();
    let basis = Tensor::from_vec(flat, (nb, 256), x.device())?.to_dtype(x.dtype())?;
    // W[y, x, i, j] -> matrix ((x, j), (y, i)) so that out = x_flat @ W
    let w = coeffs.reshape((out * inp, nb))?.matmul(&basis)?.reshape((out, inp, 16, 16))?;
    let wt = w.permute((1, 3, 0, 2))?.contiguous()?.reshape((inp * 16, out * 16))?;
    let dims = x.dims();
    let lead = &dims[..dims.len() - 2];
    let r: usize = lead.iter().product();
    let y = x.reshape((r, inp * 16))?.matmul(&wt)?;
    let mut shape = lead.to_vec();
    shape.extend([out, 16]);
    Ok(y.reshape(shape)?)
}

/// Applies a 16×16 component map `x′ = A x` (e.g. [`super::algebra::outermorphism`]) to `(..., 16)`.
pub fn apply_mat16(x: &Tensor, a: &Mat16) -> Result<Tensor> {
    check16(x, "apply_mat16")?;
    let mut at = vec![0.0f64; 256];
    for i in 0..16 {
        for j in 0..16 {
            at[j * 16 + i] = a[i][j];
        }
    }
    let at = Tensor::from_vec(at, (16, 16), x.device())?.to_dtype(x.dtype())?;
    let dims = x.dims().to_vec();
    let r = x.elem_count() / 16;
    Ok(x.contiguous()?.reshape((r, 16))?.matmul(&at)?.reshape(dims)?)
}

/// Applies a 4×4 matrix `v′ = L v` to `(..., 4)` four-vectors.
pub fn apply_mat4(v: &Tensor, l: &super::algebra::Mat4) -> Result<Tensor> {
    if v.dims().last() != Some(&4) {
        return Err(Error::Input(format!("apply_mat4 expects (..., 4), got {:?}", v.dims())));
    }
    let mut lt = vec![0.0f64; 16];
    for i in 0..4 {
        for j in 0..4 {
            lt[j * 4 + i] = l[i][j];
        }
    }
    let lt = Tensor::from_vec(lt, (4, 4), v.device())?.to_dtype(v.dtype())?;
    let dims = v.dims().to_vec();
    let r = v.elem_count() / 4;
    Ok(v.contiguous()?.reshape((r, 4))?.matmul(&lt)?.reshape(dims)?)
}

// ------------------------------------------------------------------------------------------------
// interface

fn embed(x: &Tensor, width: usize, left: usize) -> Result<Tensor> {
    if x.dims().last() != Some(&width) {
        return Err(Error::Input(format!("expected (..., {width}), got {:?}", x.dims())));
    }
    Ok(x.pad_with_zeros(D::Minus1, left, 16 - left - width)?)
}

fn flip_last(x: &Tensor) -> Result<Tensor> {
    let n = *x.dims().last().unwrap_or(&0);
    let idx: Vec<u32> = (0..n as u32).rev().collect();
    let idx = Tensor::from_vec(idx, n, x.device())?;
    Ok(x.contiguous()?.index_select(&idx, x.rank() - 1)?)
}

/// `(..., 1)` → scalar component (index 0).
pub fn embed_scalar(s: &Tensor) -> Result<Tensor> {
    embed(s, 1, 0)
}
/// `(..., 4)` four-vectors `(t, x, y, z)` → indices 1..5.
pub fn embed_vector(v: &Tensor) -> Result<Tensor> {
    embed(v, 4, 1)
}
/// `(..., 6)` bivectors `(tx, ty, tz, xy, xz, yz)` → indices 5..11.
pub fn embed_bivector(b: &Tensor) -> Result<Tensor> {
    embed(b, 6, 5)
}
/// `(..., 4)` axial vectors `(t, x, y, z)` → indices 11..15 **flipped** (e012 ← z, …, e123 ← t).
pub fn embed_axialvector(a: &Tensor) -> Result<Tensor> {
    embed(&flip_last(a)?, 4, 11)
}
/// `(..., 1)` → pseudoscalar component (index 15).
pub fn embed_pseudoscalar(p: &Tensor) -> Result<Tensor> {
    embed(p, 1, 15)
}
/// `mv[..., 11:15].flip(-1)`.
pub fn extract_axialvector(x: &Tensor) -> Result<Tensor> {
    check16(x, "extract_axialvector")?;
    flip_last(&x.narrow(D::Minus1, 11, 4)?)
}

/// lgatr's `get_spurions(beam_spurion, add_time_spurion, beam_mirror)` → `(num, 16)`.
/// `beam_spurion`: `Some("xyplane" | "lightlike" | "spacelike" | "timelike")` or `None`.
pub fn get_spurions(
    beam_spurion: Option<&str>,
    add_time_spurion: bool,
    beam_mirror: bool,
    device: &Device,
    dtype: DType,
) -> Result<Tensor> {
    let mut rows: Vec<[f64; 16]> = vec![];
    let vector = |v: [f64; 4]| {
        let mut m = [0.0; 16];
        m[1..5].copy_from_slice(&v);
        m
    };
    match beam_spurion {
        None => {}
        Some("xyplane") => {
            let mut m = [0.0; 16];
            m[8] = 1.0;
            rows.push(m);
        }
        Some(kind @ ("lightlike" | "spacelike" | "timelike")) => {
            let beam = match kind {
                "lightlike" => [1.0, 0.0, 0.0, 1.0],
                "timelike" => [2f64.sqrt(), 0.0, 0.0, 1.0],
                _ => [0.0, 0.0, 0.0, 1.0],
            };
            rows.push(vector(beam));
            if beam_mirror {
                let mut m = vector(beam);
                m[4] = -1.0;
                rows.push(m);
            }
        }
        Some(other) => return Err(Error::Config(format!("unknown beam_spurion `{other}`"))),
    }
    if add_time_spurion {
        rows.push(vector([1.0, 0.0, 0.0, 0.0]));
    }
    let n = rows.len();
    let flat: Vec<f64> = rows.into_iter().flatten().collect();
    Ok(Tensor::from_vec(flat, (n, 16), device)?.to_dtype(dtype)?)
}
