//! L-GATr port (issue 7): tables and primitives vs lgatr's, parity of whole nets with fixtures
//! built by lgatr 2.0.0 (`tools/fixtures/lgatr.py`), Lorentz equivariance, event batching.
mod common;
use common::dev;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use edgerun::models::lgatr::algebra::{
    self, boost, dual_signs, geometric_product_table, inner_product_factors, is_lorentz, linear_basis, mat4_mul,
    outermorphism, parity, rotation, time_reversal, Mat4, GP_INDEX, GP_SIGN,
};
use edgerun::models::lgatr::attention::{sdpa, sdpa_with_budget};
use edgerun::models::lgatr::bilinear::{geometric_product_with, GpImpl};
use edgerun::models::lgatr::primitives as prim;
use edgerun::models::lgatr::{self, forward_events, pack_events, unpack_events, Nonlinearity};
use edgerun::models::{Model, NamedTensors};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn read(path: &Path) -> NamedTensors {
    candle_core::safetensors::load(path, &dev())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

fn load_model(name: &str, dtype: DType) -> Box<dyn Model> {
    let dir = fixture(name);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    // SAFETY: the fixture file is not modified while it is mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], dtype, &dev())
    }
    .unwrap();
    lgatr::load(vb, &lgatr::Config::from_json(&config).unwrap(), lgatr::MapStorage::Plain).unwrap()
}

fn max_abs(t: &Tensor) -> f64 {
    if t.elem_count() == 0 {
        return 0.0;
    }
    t.to_dtype(DType::F64).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    if a.elem_count() == 0 {
        return 0.0; // (Candle's CUDA backend cannot allocate the empty difference)
    }
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    max_abs(&(a - b).unwrap())
}

/// f32 parity: max abs error ≤ 1e-4 · max(1, max|ref|).
fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    let tol = 1e-4 * max_abs(want).max(1.0);
    let err = max_diff(got, want);
    eprintln!("{what}: max abs error {err:.2e} (tol {tol:.2e})");
    assert!(err <= tol, "{what}: max abs error {err:.3e} > {tol:.3e}");
}

// ------------------------------------------------------------------------------------------------
// deterministic RNG (no dev-dependency needed)

struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    fn tensor(&mut self, shape: &[usize], dtype: DType) -> Tensor {
        self.tensor_on(shape, dtype, &dev())
    }
    fn tensor_on(&mut self, shape: &[usize], dtype: DType, device: &candle_core::Device) -> Tensor {
        let n: usize = shape.iter().product();
        if n == 0 {
            return edgerun::device::empty_tensor(shape, dtype, device).unwrap();
        }
        let v: Vec<f64> = (0..n).map(|_| self.normal()).collect();
        Tensor::from_vec(v, shape, device).unwrap().to_dtype(dtype).unwrap()
    }
    /// A random proper orthochronous Lorentz matrix `R · B`: uniform rotation, boost with
    /// velocity components ~ N(0, 0.4²) (|β| capped at 0.9).
    fn so13(&mut self) -> Mat4 {
        let q = [self.normal(), self.normal(), self.normal(), self.normal()];
        let mut beta = [0.4 * self.normal(), 0.4 * self.normal(), 0.4 * self.normal()];
        let b = beta.iter().map(|x| x * x).sum::<f64>().sqrt();
        if b > 0.9 {
            beta.iter_mut().for_each(|x| *x *= 0.9 / b);
        }
        mat4_mul(&rotation(q), &boost(beta))
    }
}

// ------------------------------------------------------------------------------------------------
// tables

fn table(t: &NamedTensors, name: &str) -> Vec<f64> {
    t[name].to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// The Cl(1,3) tables generated in Rust from first principles equal lgatr's shipped tables
/// bit for bit: linear basis (10 / 5 maps), 16×16×16 geometric product, its gather form
/// (indices and signs), inner-product factors and the dual sign of the sparse linear kernel.
#[test]
fn tables_match_lgatr() {
    let t = read(&fixture("lgatr_primitives/tables.safetensors"));
    for (name, sub, nb) in [("linear_basis_subgroup", true, 10), ("linear_basis_full", false, 5)] {
        let b = linear_basis(sub);
        assert_eq!(b.len(), nb);
        let ours: Vec<f64> = b.iter().flat_map(|m| m.iter().flatten().copied()).collect();
        assert_eq!(ours, table(&t, name), "{name}");
    }
    let gp: Vec<f64> = geometric_product_table().iter().flat_map(|m| m.iter().flatten().copied()).collect();
    assert_eq!(gp, table(&t, "geometric_product"));
    assert_eq!(gp.iter().filter(|v| **v != 0.0).count(), 256);
    let idx: Vec<f64> = GP_INDEX.iter().flatten().map(|&k| k as f64).collect();
    assert_eq!(idx, table(&t, "gp_indices"));
    let sgn: Vec<f64> = GP_SIGN.iter().flatten().copied().collect();
    assert_eq!(sgn, table(&t, "gp_signs"));
    assert_eq!(inner_product_factors().to_vec(), table(&t, "inner_product_factors"));
    assert_eq!(dual_signs().to_vec(), table(&t, "dual_sign"));
    assert_eq!(algebra::GRADE_INDEX, [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 4]);
}

/// The functional primitives reproduce lgatr's on random inputs: inner product,
/// abs_squared_norm, equi_layer_norm (input scales 0.1, 1, 50 and a tiny one that hits the 0.01
/// clamp floor), scalar-gated nonlinearities (gelu = tanh approximation, relu, sigmoid, tanh, silu),
/// the geometric product (kernel, dense GEMM and gather forms), equi_linear for both groups,
/// embeddings and spurions.
#[test]
fn primitives_match_lgatr() {
    let t = read(&fixture("lgatr_primitives/primitives.safetensors"));
    let (x, y) = (&t["x"], &t["y"]);
    assert_close("inner_product", &prim::inner_product(x, y).unwrap(), &t["inner_product"]);
    assert_close("abs_squared_norm", &prim::abs_squared_norm(x).unwrap(), &t["abs_squared_norm"]);
    for tag in ["0.1", "1", "50", "tiny"] {
        let out = prim::equi_layer_norm(&t[&format!("layer_norm_in.{tag}")], 0.01).unwrap();
        assert_close(&format!("layer_norm {tag}"), &out, &t[&format!("layer_norm_out.{tag}")]);
    }
    // the tiny input is scaled by 1/sqrt(0.01) = 10, not normalised to unit norm
    let tiny = prim::equi_layer_norm(&t["layer_norm_in.tiny"], 0.01).unwrap();
    assert!(max_diff(&tiny, &(&t["layer_norm_in.tiny"] * 10.0).unwrap()) < 1e-6);
    for nl in ["gelu", "relu", "sigmoid", "tanh", "silu"] {
        let f = Nonlinearity::parse(nl).unwrap();
        let (mv, s) = prim::gated_nonlinearity(x, Some(&t["gate_s_in"]), f).unwrap();
        assert_close(&format!("gated {nl} mv"), &mv, &t[&format!("gated_{nl}.mv")]);
        assert_close(&format!("gated {nl} s"), &s.unwrap(), &t[&format!("gated_{nl}.s")]);
    }
    for imp in [GpImpl::Kernel, GpImpl::Dense, GpImpl::Gather] {
        let g = geometric_product_with(x, y, imp).unwrap();
        assert_close(&format!("gp {imp:?} vs sparse"), &g, &t["geometric_product.sparse_True"]);
        assert_close(&format!("gp {imp:?} vs dense"), &g, &t["geometric_product.sparse_False"]);
    }
    for sub in [true, false] {
        let c = &t[&format!("equi_linear.coeffs.subgroup_{}", if sub { "True" } else { "False" })];
        let out = prim::equi_linear(x, c, sub).unwrap();
        assert_close(
            "equi_linear",
            &out,
            &t[&format!("equi_linear.out.subgroup_{}", if sub { "True" } else { "False" })],
        );
    }
    let v4 = &t["embed.vector_in"];
    assert_close("embed_vector", &prim::embed_vector(v4).unwrap(), &t["embed.vector"]);
    assert_close("embed_bivector", &prim::embed_bivector(&t["embed.bivector_in"]).unwrap(), &t["embed.bivector"]);
    assert_close("embed_axialvector", &prim::embed_axialvector(v4).unwrap(), &t["embed.axialvector"]);
    let first = v4.narrow(1, 0, 1).unwrap();
    assert_close("embed_scalar", &prim::embed_scalar(&first).unwrap(), &t["embed.scalar"]);
    assert_close("embed_pseudoscalar", &prim::embed_pseudoscalar(&first).unwrap(), &t["embed.pseudoscalar"]);
    let ax = prim::extract_axialvector(&t["embed.axialvector"]).unwrap();
    assert_close("extract_axialvector", &ax, v4);
    for beam in ["xyplane", "lightlike", "spacelike", "timelike"] {
        let s = prim::get_spurions(Some(beam), true, true, &dev(), DType::F32).unwrap();
        assert_close(&format!("spurions {beam}"), &s, &t[&format!("spurions.{beam}")]);
    }
}

/// `gp(Ax, Ay) = A gp(x, y)` for the outermorphism A of random Lorentz matrices (incl. parity
/// and time reversal), A is a homomorphism, and `inner_product` is invariant — the algebraic
/// facts the equivariance tests rest on. f64, tolerance 1e-10.
#[test]
fn outermorphism_is_an_algebra_automorphism() {
    let mut rng = Rng(11);
    let x = rng.tensor(&[7, 16], DType::F64);
    let y = rng.tensor(&[7, 16], DType::F64);
    for k in 0..6 {
        let mut l = rng.so13();
        if k % 3 == 1 {
            l = mat4_mul(&l, &parity());
        } else if k % 3 == 2 {
            l = mat4_mul(&time_reversal(), &l);
        }
        assert!(is_lorentz(&l, 1e-12));
        let a = outermorphism(&l);
        let ax = prim::apply_mat16(&x, &a).unwrap();
        let ay = prim::apply_mat16(&y, &a).unwrap();
        let lhs = geometric_product_with(&ax, &ay, GpImpl::Kernel).unwrap();
        let rhs = prim::apply_mat16(&geometric_product_with(&x, &y, GpImpl::Kernel).unwrap(), &a).unwrap();
        assert!(max_diff(&lhs, &rhs) < 1e-10 * max_abs(&rhs).max(1.0), "gp equivariance, draw {k}");
        let ip = prim::inner_product(&ax, &ay).unwrap();
        assert!(max_diff(&ip, &prim::inner_product(&x, &y).unwrap()) < 1e-10 * max_abs(&ip).max(1.0));
        let l2 = rng.so13();
        let a12 = outermorphism(&mat4_mul(&l, &l2));
        let a2 = outermorphism(&l2);
        for i in 0..16 {
            for j in 0..16 {
                let v: f64 = (0..16).map(|m| a[i][m] * a2[m][j]).sum();
                assert!((v - a12[i][j]).abs() < 1e-10);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// parity with lgatr

fn parity_case(name: &str, x_name: &str, out_x: &str) {
    let dir = fixture(name);
    let model = load_model(name, DType::F32);
    let inp = read(&dir.join("input.safetensors"));
    let exp = read(&dir.join("expected.safetensors"));
    let max_ref = max_abs(&exp[out_x]).max(max_abs(&exp["outputs_s"]));
    assert!(max_ref > 0.5 && max_ref < 50.0, "{name}: reference outputs are not O(1) ({max_ref})");

    let mut inputs = NamedTensors::new();
    inputs.insert(x_name.into(), inp[x_name].clone());
    inputs.insert("scalars".into(), inp["scalars"].clone());
    let out = model.forward_named(&inputs).unwrap();
    assert_close(&format!("{name} {out_x}"), &out[out_x], &exp[out_x]);
    assert_close(&format!("{name} outputs_s"), &out["outputs_s"], &exp["outputs_s"]);

    // key-padding mask, as `padding_mask` and as the equivalent torch-style `attention_mask`
    let pad = &inp["padding_mask"];
    let masked_x = format!("masked_{out_x}");
    let mut with_pad = inputs.clone();
    with_pad.insert("padding_mask".into(), pad.clone());
    let out = model.forward_named(&with_pad).unwrap();
    assert_close(&format!("{name} masked {out_x}"), &out[out_x], &exp[&masked_x]);
    assert_close(&format!("{name} masked outputs_s"), &out["outputs_s"], &exp["masked_outputs_s"]);
    let (b, n) = pad.dims2().unwrap();
    let mut with_mask = inputs.clone();
    with_mask.insert("attention_mask".into(), pad.reshape((b, 1, 1, n)).unwrap());
    let out = model.forward_named(&with_mask).unwrap();
    assert_close(&format!("{name} attention_mask {out_x}"), &out[out_x], &exp[&masked_x]);
    // the mask changes the padded event's outputs (so the test has teeth)
    assert!(max_diff(&exp[&masked_x], &exp[out_x]) > 1e-2);
}

/// Default LGATr config (subgroup=True, mlp_ratio 4), 2 blocks, vs lgatr.
#[test]
fn parity_lgatr_default() {
    parity_case("lgatr_tiny", "multivectors", "outputs_mv");
}

/// `primitives.subgroup = false` (5-map Pin(1,3) basis, no scalar↔pseudoscalar mixing).
#[test]
fn parity_lgatr_full_group() {
    parity_case("lgatr_full_group", "multivectors", "outputs_mv");
}

/// multi_query + head_scale + attn_ratio 2 + 3-layer MLP + bivector=false + reinserted channels.
#[test]
fn parity_lgatr_multi_query_head_scale_reinsert() {
    parity_case("lgatr_mq_headscale", "multivectors", "outputs_mv");
}

/// geometric_product=false (gate + EquiLinear), silu, no norm affine.
#[test]
fn parity_lgatr_no_geometric_product() {
    parity_case("lgatr_nogp", "multivectors", "outputs_mv");
}

/// LGATrSlim default config.
#[test]
fn parity_lgatr_slim() {
    parity_case("lgatr_slim_tiny", "vectors", "outputs_v");
}

// ------------------------------------------------------------------------------------------------
// equivariance (f64)

/// Max relative error of `f(A x) − A f(x)` (mv outputs) and `f(A x)_s − f(x)_s` for LGATr.
fn lgatr_equivariance_error(model: &dyn Model, l: &Mat4, rng: &mut Rng, in_mv: usize, in_s: usize) -> f64 {
    let a = outermorphism(l);
    let x = rng.tensor(&[2, 9, in_mv, 16], DType::F64);
    let s = rng.tensor(&[2, 9, in_s], DType::F64);
    let run = |x: &Tensor| {
        let mut m = NamedTensors::new();
        m.insert("multivectors".into(), x.clone());
        m.insert("scalars".into(), s.clone());
        model.forward_named(&m).unwrap()
    };
    let base = run(&x);
    let moved = run(&prim::apply_mat16(&x, &a).unwrap());
    let want_mv = prim::apply_mat16(&base["outputs_mv"], &a).unwrap();
    let scale = max_abs(&want_mv).max(max_abs(&base["outputs_s"])).max(1.0);
    max_diff(&moved["outputs_mv"], &want_mv).max(max_diff(&moved["outputs_s"], &base["outputs_s"])) / scale
}

/// Equivariance tolerance in f64, relative to max(1, max|output|) (observed: ~1e-15).
const EQUI_TOL: f64 = 1e-12;

/// LGATr (default config, subgroup=True) commutes with random SO⁺(1,3) transformations
/// (boosts and rotations) acting on the multivector inputs through the 16×16 outermorphism;
/// scalar outputs are invariant. f64, relative tolerance 1e-12.
#[test]
fn equivariance_lgatr_so13() {
    let mut rng = Rng(1);
    for name in ["lgatr_tiny", "lgatr_mq_headscale", "lgatr_nogp"] {
        let model = load_model(name, DType::F64);
        let (in_mv, in_s) = if name == "lgatr_mq_headscale" { (2, 3) } else { (1, 2) };
        for draw in 0..3 {
            let l = rng.so13();
            let err = lgatr_equivariance_error(model.as_ref(), &l, &mut rng, in_mv, in_s);
            eprintln!("{name} draw {draw}: relative equivariance error {err:.2e}");
            assert!(err < EQUI_TOL, "{name} draw {draw}: relative equivariance error {err:.3e}");
        }
    }
}

/// LGATr with subgroup=False commutes with the full Lorentz group: SO⁺(1,3) combined with
/// parity and time reversal.
#[test]
fn equivariance_lgatr_full_group_with_parity() {
    let mut rng = Rng(2);
    let model = load_model("lgatr_full_group", DType::F64);
    let cases = [parity(), time_reversal(), mat4_mul(&parity(), &time_reversal())];
    for (k, extra) in cases.iter().enumerate() {
        let l = mat4_mul(&rng.so13(), extra);
        let err = lgatr_equivariance_error(model.as_ref(), &l, &mut rng, 1, 2);
        eprintln!("full group case {k}: relative equivariance error {err:.2e}");
        assert!(err < EQUI_TOL, "case {k}: relative equivariance error {err:.3e}");
    }
}

/// Negative control: a subgroup=True net (it mixes scalars into pseudoscalars) must NOT commute
/// with parity — the error is O(1), not round-off.
#[test]
fn parity_breaks_subgroup_net() {
    let mut rng = Rng(3);
    let model = load_model("lgatr_tiny", DType::F64);
    let err = lgatr_equivariance_error(model.as_ref(), &parity(), &mut rng, 1, 2);
    eprintln!("subgroup net under parity: relative error {err:.2e}");
    assert!(err > 1e-2, "subgroup=True net commutes with parity (error {err:.3e})");
    // and the same harness accepts a proper transformation on the same net
    let ok = lgatr_equivariance_error(model.as_ref(), &rng.so13(), &mut rng, 1, 2);
    assert!(ok < EQUI_TOL);
}

/// LGATrSlim commutes with SO⁺(1,3) on its four-vector inputs (and, since it only uses
/// Minkowski products, also with parity). f64, relative tolerance 1e-12.
#[test]
fn equivariance_lgatr_slim() {
    let mut rng = Rng(4);
    let model = load_model("lgatr_slim_tiny", DType::F64);
    for draw in 0..4 {
        let mut l = rng.so13();
        if draw == 3 {
            l = mat4_mul(&l, &parity());
        }
        let v = rng.tensor(&[2, 9, 1, 4], DType::F64);
        let s = rng.tensor(&[2, 9, 2], DType::F64);
        let run = |v: &Tensor| {
            let mut m = NamedTensors::new();
            m.insert("vectors".into(), v.clone());
            m.insert("scalars".into(), s.clone());
            model.forward_named(&m).unwrap()
        };
        let base = run(&v);
        let moved = run(&prim::apply_mat4(&v, &l).unwrap());
        let want = prim::apply_mat4(&base["outputs_v"], &l).unwrap();
        let scale = max_abs(&want).max(max_abs(&base["outputs_s"])).max(1.0);
        let err = max_diff(&moved["outputs_v"], &want).max(max_diff(&moved["outputs_s"], &base["outputs_s"])) / scale;
        eprintln!("slim draw {draw}: relative equivariance error {err:.2e}");
        assert!(err < EQUI_TOL, "draw {draw}: relative equivariance error {err:.3e}");
    }
}

// ------------------------------------------------------------------------------------------------
// events, attention, config

fn lgatr_event(rng: &mut Rng, n: usize) -> NamedTensors {
    let mut e = NamedTensors::new();
    e.insert("multivectors".into(), rng.tensor(&[n, 1, 16], DType::F32));
    e.insert("scalars".into(), rng.tensor(&[n, 2], DType::F32));
    e
}

/// `forward_events` pads and masks variable-length events: each event's outputs equal what it
/// gets alone (batch of one, no padding), whatever the batch grouping, and changing one event
/// does not change another's outputs. Also checks pack/unpack round-trips.
#[test]
fn events_have_no_cross_talk() {
    let mut rng = Rng(5);
    let model = load_model("lgatr_tiny", DType::F32);
    let lens = [5usize, 12, 1, 9, 12, 3, 0];
    let events: Vec<NamedTensors> = lens.iter().map(|&n| lgatr_event(&mut rng, n)).collect();
    // (an empty event gets empty outputs)
    let solo: Vec<NamedTensors> =
        events.iter().map(|e| forward_events(model.as_ref(), std::slice::from_ref(e), 0).unwrap().remove(0)).collect();
    for max_batch in [0, 2, 4] {
        let out = forward_events(model.as_ref(), &events, max_batch).unwrap();
        assert_eq!(out.len(), events.len());
        for (i, (o, s)) in out.iter().zip(&solo).enumerate() {
            assert_eq!(o["outputs_mv"].dims(), &[lens[i], 1, 16]);
            assert!(max_diff(&o["outputs_mv"], &s["outputs_mv"]) < 1e-5, "event {i}, max_batch {max_batch}");
            assert!(max_diff(&o["outputs_s"], &s["outputs_s"]) < 1e-5, "event {i}, max_batch {max_batch}");
        }
    }
    // a solo event through the plain batched forward (no padding) gives the same
    let mut one = NamedTensors::new();
    for (k, t) in &events[1] {
        one.insert(k.clone(), t.unsqueeze(0).unwrap());
    }
    let direct = model.forward_named(&one).unwrap();
    for name in ["outputs_mv", "outputs_s"] {
        assert!(max_diff(&direct[name].squeeze(0).unwrap(), &solo[1][name]) < 1e-5, "{name}");
    }
    // perturb event 4 (same length as event 1, so they share a batch): event 1 is unchanged
    let mut changed = events.clone();
    changed[4] = lgatr_event(&mut rng, 12);
    let a = forward_events(model.as_ref(), &events, 0).unwrap();
    let b = forward_events(model.as_ref(), &changed, 0).unwrap();
    for name in ["outputs_mv", "outputs_s"] {
        assert!(max_diff(&a[1][name], &b[1][name]) < 1e-6, "event 1 {name} changed with event 4");
        assert!(max_diff(&a[4][name], &b[4][name]) > 1e-3, "event 4 {name} did not change");
    }
    // packing
    let packed = pack_events(&events).unwrap();
    assert_eq!(packed["multivectors"].dims(), &[lens.iter().sum::<usize>(), 1, 16]);
    let back = unpack_events(&packed).unwrap();
    assert_eq!(back.len(), events.len());
    for (e, b) in events.iter().zip(&back) {
        assert_eq!(e.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
        for (name, t) in e {
            assert_eq!(max_diff(t, &b[name]), 0.0, "{name}");
        }
    }
}

/// Slim nets batch events the same way.
#[test]
fn slim_events_have_no_cross_talk() {
    let mut rng = Rng(6);
    let model = load_model("lgatr_slim_tiny", DType::F32);
    let events: Vec<NamedTensors> = [4usize, 10, 7]
        .iter()
        .map(|&n| {
            let mut e = NamedTensors::new();
            e.insert("vectors".into(), rng.tensor(&[n, 1, 4], DType::F32));
            e.insert("scalars".into(), rng.tensor(&[n, 2], DType::F32));
            e
        })
        .collect();
    let out = forward_events(model.as_ref(), &events, 0).unwrap();
    assert_eq!(out.len(), events.len());
    for (e, o) in events.iter().zip(&out) {
        let solo = forward_events(model.as_ref(), std::slice::from_ref(e), 0).unwrap().remove(0);
        assert!(max_diff(&o["outputs_v"], &solo["outputs_v"]) < 1e-5);
        assert!(max_diff(&o["outputs_s"], &solo["outputs_s"]) < 1e-5);
    }
}

/// Query-chunked attention equals the one-shot computation (with masks and multi-query).
#[test]
fn chunked_attention_matches_full() {
    let mut rng = Rng(7);
    let (b, h, n, d) = (2, 3, 37, 8);
    let q = rng.tensor(&[b, h, n, d], DType::F64);
    let pad: Vec<u8> = (0..b * n).map(|i| u8::from(i % n < n - 4 * (i / n))).collect();
    let pad = Tensor::from_vec(pad, (b, n), &dev()).unwrap();
    let bias = lgatr::attention::padding_to_bias(&pad, DType::F64).unwrap();
    for hk in [h, 1] {
        let k = rng.tensor(&[b, hk, n, d], DType::F64);
        let v = rng.tensor(&[b, hk, n, 5], DType::F64);
        let full = sdpa(&q, &k, &v, Some(&bias)).unwrap();
        let chunked = sdpa_with_budget(&q, &k, &v, Some(&bias), b * h * n * 5).unwrap();
        assert!(max_diff(&full, &chunked) < 1e-12);
        // reference: explicit softmax
        let kk = if hk == 1 { k.broadcast_as((b, h, n, d)).unwrap().contiguous().unwrap() } else { k.clone() };
        let vv = if hk == 1 { v.broadcast_as((b, h, n, 5)).unwrap().contiguous().unwrap() } else { v.clone() };
        let scores = q.matmul(&kk.transpose(2, 3).unwrap()).unwrap().broadcast_add(&bias).unwrap();
        let p = candle_nn::ops::softmax(&scores, 3).unwrap();
        let want = p.matmul(&vv).unwrap();
        assert!(max_diff(&full, &want) < 1e-12);
    }
}

/// Without a mask, f32 attention on the CPU takes the fused kernel (multi-query keys broadcast
/// across heads); it matches the explicit softmax.
#[test]
fn unmasked_f32_attention_matches_explicit_softmax() {
    let mut rng = Rng(11);
    let (b, h, n, d) = (2, 3, 37, 8);
    let q = rng.tensor(&[b, h, n, d], DType::F32);
    for hk in [h, 1] {
        let k = rng.tensor(&[b, hk, n, d], DType::F32);
        let v = rng.tensor(&[b, hk, n, d], DType::F32);
        let got = sdpa(&q, &k, &v, None).unwrap();
        let kk = k.broadcast_as((b, h, n, d)).unwrap().contiguous().unwrap();
        let vv = v.broadcast_as((b, h, n, d)).unwrap().contiguous().unwrap();
        let p = candle_nn::ops::softmax(&q.matmul(&kk.transpose(2, 3).unwrap()).unwrap(), 3).unwrap();
        let want = p.matmul(&vv).unwrap();
        assert!(max_diff(&got, &want) < 1e-5, "{hk} key heads: {}", max_diff(&got, &want));
    }
}

/// Unknown keys, unknown model types and unsupported options are config errors.
#[test]
fn config_errors_are_reported() {
    let vb = candle_nn::VarBuilder::zeros(DType::F32, &dev());
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("lgatr_tiny/config.json")).unwrap()).unwrap();
    let expect_config_err = |v: serde_json::Value, what: &str| match lgatr::Config::from_json(&v).and_then(|c| lgatr::load(vb.clone(), &c, lgatr::MapStorage::Plain)) {
        Err(edgerun::error::Error::Config(msg)) => eprintln!("{what}: {msg}"),
        Err(e) => panic!("{what}: wrong error kind {e}"),
        Ok(_) => panic!("{what}: accepted"),
    };
    let mut v = base.clone();
    v["bogus"] = serde_json::json!(1);
    expect_config_err(v, "unknown key");
    let mut v = base.clone();
    v["model_type"] = serde_json::json!("gatr");
    expect_config_err(v, "model_type");
    let mut v = base.clone();
    v["mlp"]["nonlinearity"] = serde_json::json!("swish");
    expect_config_err(v, "nonlinearity");
    let mut v = base.clone();
    v["attention"]["heads"] = serde_json::json!(2);
    expect_config_err(v, "unknown attention key");
    let mut v = base.clone();
    v["hidden_s_channels"] = serde_json::json!(0);
    expect_config_err(v, "gp without scalars");
    let mut v = base;
    v["reinsert_mv_channels"] = serde_json::json!([3]);
    expect_config_err(v, "reinsert out of range");
    // defaults: an `{}` mlp / attention parse to lgatr's defaults
    let c = lgatr::LgatrConfig::from_json(&serde_json::json!({
        "model_type": "lgatr", "num_blocks": 1, "in_mv_channels": 1, "out_mv_channels": 1,
        "hidden_mv_channels": 16, "in_s_channels": 1, "out_s_channels": 1, "hidden_s_channels": 32,
        "attention": {}, "mlp": {}
    }))
    .unwrap();
    assert_eq!((c.attention.num_heads, c.attention.attn_ratio, c.mlp.mlp_ratio, c.mlp.num_layers_mlp), (8, 1, 4, 2));
    assert!(c.primitives().subgroup && c.norm_elementwise_affine);
    assert_eq!((c.head_mv_channels(), c.head_s_channels()), (2, 4));
}

/// Missing / mis-shaped inputs are input errors, not panics.
#[test]
fn bad_inputs_are_reported() {
    let model = load_model("lgatr_tiny", DType::F32);
    let mut rng = Rng(8);
    let mut m = NamedTensors::new();
    m.insert("multivectors".into(), rng.tensor(&[2, 5, 1, 16], DType::F32));
    assert!(matches!(model.forward_named(&m), Err(edgerun::error::Error::Input(_))));
    m.insert("scalars".into(), rng.tensor(&[2, 5, 3], DType::F32));
    assert!(matches!(model.forward_named(&m), Err(edgerun::error::Error::Input(_))));
    m.insert("scalars".into(), rng.tensor(&[2, 5, 2], DType::F32));
    m.insert("multivector".into(), rng.tensor(&[2, 5, 1, 16], DType::F32));
    assert!(matches!(model.forward_named(&m), Err(edgerun::error::Error::Input(_))));
    let mut short = BTreeMap::new();
    short.insert("multivectors".to_string(), rng.tensor(&[2, 5, 1, 15], DType::F32));
    assert!(model.forward_named(&short).is_err());
}

/// The CPU row kernels (equivariant layer norm with gains, gated nonlinearity, geometric
/// product with pass-through and bivector switch) equal their tensor-op reference forms, which
/// are what other devices run. Pinned to the CPU whatever `EDGERUN_TEST_DEVICE` says: elsewhere the
/// "kernel" would be the reference itself.
#[test]
fn cpu_kernels_match_tensor_ops() {
    let cpu = candle_core::Device::Cpu;
    use lgatr::bilinear::gp_fused;
    use lgatr::mlp::{gate_fused, gate_fused_reference};
    use lgatr::norm::EquiNorm;
    let mut rng = Rng(9);
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 2e-5 } else { 1e-12 };
        // 5 channels: a partial tile; 37: two full tiles of 16 and a partial one
        for (c, s) in [(5, 7), (37, 9)] {
            let x = rng.tensor_on(&[33, 16 * c + s], dtype, &cpu);
            // gains through a VarBuilder
            let mut w = std::collections::HashMap::new();
            w.insert(
                "weight_mv".to_string(),
                (rng.tensor_on(&[c, 5], DType::F64, &cpu).abs().unwrap() + 0.5).unwrap().to_dtype(dtype).unwrap(),
            );
            w.insert("weight_s".to_string(), rng.tensor_on(&[s], dtype, &cpu));
            let vb = candle_nn::VarBuilder::from_tensors(w, dtype, &cpu);
            for norm in [EquiNorm::plain(c, s, &cpu, dtype).unwrap(), EquiNorm::load(&vb, c, s, true).unwrap()] {
                let scaled = (&x * 1e-3).unwrap();
                for input in [&x, &scaled] {
                    let d = max_diff(&norm.forward(input).unwrap(), &norm.forward_reference(input).unwrap());
                    assert!(d < tol, "norm kernel vs reference {dtype:?} {c} channels: {d:.2e}");
                }
            }
        }
        let (c, s) = (5, 7);
        let x = rng.tensor_on(&[33, 16 * c + s], dtype, &cpu);
        // 21 channels: one full block of 16 gates and a partial one; inputs to ±40 saturate
        let (gc, gs) = (21, 40);
        let wide = (rng.tensor_on(&[17, 16 * gc + gs], dtype, &cpu) * 10.0).unwrap();
        for f in ["gelu", "relu", "sigmoid", "tanh", "silu"] {
            let f = Nonlinearity::parse(f).unwrap();
            for (x, c, s) in [(&x, c, s), (&wide, gc, gs)] {
                let got = gate_fused(x, c, s, f).unwrap();
                let want = gate_fused_reference(x, c, s, f).unwrap();
                let d = max_diff(&got, &want) / max_abs(&want).max(1.0);
                assert!(d < tol, "gate kernel vs reference {f:?} {dtype:?} {c} channels: {d:.2e}");
            }
        }
        // 21 channels: full tiles and a partial one (16 lanes in f32, 8 in f64)
        let ch = 21;
        let lr = rng.tensor_on(&[9, 2 * ch * 16 + 3], dtype, &cpu);
        for bivector in [true, false] {
            let g = gp_fused(&lr, ch, 3, bivector).unwrap();
            let left = lr.narrow(1, 0, ch * 16).unwrap().reshape((9, ch, 16)).unwrap();
            let right = lr.narrow(1, ch * 16, ch * 16).unwrap().reshape((9, ch, 16)).unwrap();
            let mut want =
                geometric_product_with(&left, &right, GpImpl::Gather).unwrap().reshape((9, ch * 16)).unwrap();
            if !bivector {
                let mask: Vec<f64> = (0..16).map(|i| if (5..11).contains(&i) { 0.0 } else { 1.0 }).collect();
                let mask =
                    Tensor::from_vec(mask, 16, &cpu).unwrap().to_dtype(dtype).unwrap().repeat(ch).unwrap();
                want = want.broadcast_mul(&mask).unwrap();
            }
            let want = Tensor::cat(&[&want, &lr.narrow(1, 2 * ch * 16, 3).unwrap()], 1).unwrap();
            let d = max_diff(&g, &want);
            assert!(d < tol * 10.0, "gp kernel {dtype:?} bivector={bivector}: {d:.2e}");
        }
    }
}

/// Sub-batching inside the forward pass (events are processed ~512 items at a time) does not
/// change results: a batch of 70 events of 30 items (five sub-batches) equals each event alone.
#[test]
fn sub_batched_forward_matches_single_events() {
    let mut rng = Rng(10);
    let model = load_model("lgatr_tiny", DType::F32);
    let (b, n) = (70, 30);
    let mut m = NamedTensors::new();
    m.insert("multivectors".into(), rng.tensor(&[b, n, 1, 16], DType::F32));
    m.insert("scalars".into(), rng.tensor(&[b, n, 2], DType::F32));
    let all = model.forward_named(&m).unwrap();
    for i in [0, 33, 34, 69] {
        let mut one = NamedTensors::new();
        for (k, t) in &m {
            one.insert(k.clone(), t.narrow(0, i, 1).unwrap());
        }
        let o = model.forward_named(&one).unwrap();
        for name in ["outputs_mv", "outputs_s"] {
            assert!(max_diff(&o[name], &all[name].narrow(0, i, 1).unwrap()) < 1e-5, "event {i} {name}");
        }
    }
}

/// A folded map held for the int8 GEMM (a Q8_0 file's maps) agrees with the f32 map to within
/// 8-bit rounding of weights and inputs; widths that are not whole Q8_0 blocks stay f32.
#[test]
fn int8_fused_map_tracks_f32() {
    use edgerun::models::lgatr::equi_linear::DenseMap;
    let (rows, cols) = (48, 96);
    let mut map = DenseMap::zeros(rows, cols);
    for (i, v) in map.m.iter_mut().enumerate() {
        *v = ((i * 7919 % 1009) as f64 / 504.5 - 1.0) * 0.3;
    }
    for (i, v) in map.b.iter_mut().enumerate() {
        *v = i as f64 * 0.01;
    }
    let dev = candle_core::Device::Cpu;
    let x: Vec<f32> = (0..5 * cols).map(|i| ((i * 104729 % 997) as f32 / 498.5 - 1.0) * 2.0).collect();
    let x = Tensor::from_vec(x, (5, cols), &dev).unwrap();
    let exact = map.to_fused(&dev, DType::F32, lgatr::MapStorage::Plain).unwrap();
    let held = map.to_fused(&dev, DType::F32, lgatr::MapStorage::Int8).unwrap();
    assert!(!exact.is_int8());
    assert_eq!(held.is_int8(), edgerun::kernels::int8_gemm::available());
    let want = exact.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let got = held.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err <= 0.02 * scale, "int8 map error {err} against max {scale}");
    if held.is_int8() {
        assert!(err > 0.0, "the int8 map gave the f32 result exactly: its path did not run");
    }
    let odd = DenseMap::zeros(4, 18).to_fused(&dev, DType::F32, lgatr::MapStorage::Int8).unwrap();
    assert!(!odd.is_int8(), "18 inputs are not whole Q8_0 blocks");
}

/// A folded map held in f16 (an f16 file's maps) gives the product of its f16-rounded values: at a
/// width and row count that run the AMX-BF16 tiles where the CPU has them, and at one that widens.
#[test]
fn half_fused_map_multiplies_as_its_f16_values() {
    use edgerun::models::lgatr::equi_linear::DenseMap;
    let dev = candle_core::Device::Cpu;
    for (tokens, rows, cols) in [(64, 576, 288), (5, 20, 18)] {
        let mut map = DenseMap::zeros(rows, cols);
        for (i, v) in map.m.iter_mut().enumerate() {
            *v = ((i * 7919 % 1009) as f64 / 504.5 - 1.0) * 0.3;
        }
        for (i, v) in map.b.iter_mut().enumerate() {
            *v = i as f64 * 0.01;
        }
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104729 % 997) as f32 / 498.5 - 1.0) * 2.0).collect();
        let held = map.to_fused(&dev, DType::F32, lgatr::MapStorage::Half).unwrap();
        let got = held.forward(&Tensor::from_vec(x.clone(), (tokens, cols), &dev).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for t in 0..tokens {
            for r in 0..rows {
                let (mut want, mut scale) = (map.b[r], 0f64);
                for c in 0..cols {
                    let term = x[t * cols + c] as f64 * half::f16::from_f64(map.m[r * cols + c]).to_f64();
                    want += term;
                    scale += term.abs();
                }
                let err = (got[t * rows + r] as f64 - want).abs();
                assert!(err <= 1e-5 * scale.max(1.0), "{tokens}×{cols}→{rows} at ({t}, {r}): {} against {want}", got[t * rows + r]);
            }
        }
    }
}
