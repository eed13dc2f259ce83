//! The spacetime algebra Cl(1,3) in lgatr's basis, generated from first principles.
//!
//! Metric η = diag(+1, −1, −1, −1) (e0 is time). Basis (index → blade), grade-major and lexicographic
//! within a grade, exactly as lgatr 2.0.0:
//!
//! | 0 | 1..4 | 5..10 | 11..14 | 15 |
//! |---|---|---|---|---|
//! | 1 | e0 e1 e2 e3 | e01 e02 e03 e12 e13 e23 | e012 e013 e023 e123 | e0123 |
//!
//! Everything here is computed from that definition (blade bitmasks, reordering signs and the metric);
//! the tests compare the results with lgatr's shipped tables.

/// The metric signature η_μμ of e0..e3.
pub(crate) const METRIC: [f64; 4] = [1.0, -1.0, -1.0, -1.0];

/// Blade of each basis index as a bitmask over {e0, e1, e2, e3} (bit μ = e_μ).
pub(crate) const BLADES: [u8; 16] = blades();

/// Grade of each basis index: `[0, 1,1,1,1, 2,2,2,2,2,2, 3,3,3,3, 4]`.
pub const GRADE_INDEX: [usize; 16] = grade_index();

/// Component range `[start, end)` of each grade.
pub(crate) const GRADE_SLICES: [(usize, usize); 5] = [(0, 1), (1, 5), (5, 11), (11, 15), (15, 16)];

/// Geometric product as a gather: `out[i] = Σ_j GP_SIGN[i][j] · x[j] · y[GP_INDEX[i][j]]`
/// (`x` is the left factor).
pub const GP_INDEX: [[usize; 16]; 16] = gp_gather().0;

/// Signs of the gather form of the geometric product (see [`GP_INDEX`]).
pub const GP_SIGN: [[f64; 16]; 16] = gp_gather().1;

const fn blades() -> [u8; 16] {
    let mut out = [0u8; 16];
    let mut n = 0;
    let mut grade = 0;
    while grade <= 4 {
        // Lexicographic order of the k-subsets of {0,1,2,3} = increasing order of the reversed
        // bit patterns; enumerate all masks and keep those of the right popcount, sorted by the
        // subset's index list.
        let mut chosen = [0u8; 16];
        let mut m = 0;
        let mut mask = 0u8;
        while mask < 16 {
            if mask.count_ones() as usize == grade {
                chosen[m] = mask;
                m += 1;
            }
            mask += 1;
        }
        // insertion sort by lexicographic index list
        let mut a = 1;
        while a < m {
            let mut b = a;
            while b > 0 && lex_less(chosen[b], chosen[b - 1]) {
                let t = chosen[b];
                chosen[b] = chosen[b - 1];
                chosen[b - 1] = t;
                b -= 1;
            }
            a += 1;
        }
        let mut c = 0;
        while c < m {
            out[n] = chosen[c];
            n += 1;
            c += 1;
        }
        grade += 1;
    }
    out
}

/// Lexicographic comparison of two equal-size subsets given as bitmasks.
const fn lex_less(a: u8, b: u8) -> bool {
    let mut bit = 0;
    while bit < 4 {
        let ia = (a >> bit) & 1;
        let ib = (b >> bit) & 1;
        if ia != ib {
            // the subset that contains the smaller element first is smaller
            return ia == 1;
        }
        bit += 1;
    }
    false
}

const fn grade_index() -> [usize; 16] {
    let b = blades();
    let mut out = [0usize; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = b[i].count_ones() as usize;
        i += 1;
    }
    out
}

const fn index_of_blade(mask: u8) -> usize {
    let b = blades();
    let mut i = 0;
    while i < 16 {
        if b[i] == mask {
            return i;
        }
        i += 1;
    }
    usize::MAX
}

/// Sign and result blade of the product of basis blades `a · b` (bitmasks): the number of
/// transpositions needed to sort the concatenated index list, times η for every contracted pair.
pub const fn blade_product(a: u8, b: u8) -> (f64, u8) {
    let mut swaps = 0u32;
    let mut x = a >> 1;
    while x != 0 {
        swaps += (x & b).count_ones();
        x >>= 1;
    }
    let mut sign = if swaps.is_multiple_of(2) { 1.0 } else { -1.0 };
    let common = a & b;
    let mut mu = 0;
    while mu < 4 {
        if (common >> mu) & 1 == 1 {
            sign *= METRIC[mu];
        }
        mu += 1;
    }
    (sign, a ^ b)
}

const fn gp_gather() -> ([[usize; 16]; 16], [[f64; 16]; 16]) {
    let b = blades();
    let mut idx = [[0usize; 16]; 16];
    let mut sgn = [[0f64; 16]; 16];
    // e_j · e_k = s · e_i  ⇒  out[i] gets s · x[j] · y[k]; for fixed (i, j), k = index(b_i ^ b_j).
    let mut j = 0;
    while j < 16 {
        let mut k = 0;
        while k < 16 {
            let (s, r) = blade_product(b[j], b[k]);
            let i = index_of_blade(r);
            idx[i][j] = k;
            sgn[i][j] = s;
            k += 1;
        }
        j += 1;
    }
    (idx, sgn)
}

/// The dense geometric-product table `GP[i][j][k]` with `out_i = Σ_jk GP[i][j][k] x_j y_k`.
pub fn geometric_product_table() -> Vec<[[f64; 16]; 16]> {
    let mut gp = vec![[[0.0; 16]; 16]; 16];
    for (i, gpi) in gp.iter_mut().enumerate() {
        for j in 0..16 {
            gpi[j][GP_INDEX[i][j]] = GP_SIGN[i][j];
        }
    }
    gp
}

/// Sign of the reverse on each component: `+1` on grades 0, 1, 4, `−1` on grades 2, 3.
pub(crate) fn reverse_signs() -> [f64; 16] {
    let mut out = [0.0; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let k = GRADE_INDEX[i];
        *o = if (k * k.saturating_sub(1) / 2).is_multiple_of(2) { 1.0 } else { -1.0 };
    }
    out
}

/// Inner-product factors `<~e_i e_i>_0`: `inner_product(x, y) = Σ_i IPF_i x_i y_i`.
pub fn inner_product_factors() -> [f64; 16] {
    let rev = reverse_signs();
    let mut out = [0.0; 16];
    for i in 0..16 {
        let (s, r) = blade_product(BLADES[i], BLADES[i]);
        debug_assert_eq!(r, 0);
        out[i] = rev[i] * s;
    }
    out
}

/// `(16, 5)` matrix with `M[i][g] = IPF_i` if component `i` has grade `g`, else 0, so that
/// `abs_squared_norm(x) = Σ_g |Σ_i x_i² M[i][g]|`.
pub(crate) fn metric_grades() -> [[f64; 5]; 16] {
    let ipf = inner_product_factors();
    let mut m = [[0.0; 5]; 16];
    for i in 0..16 {
        m[i][GRADE_INDEX[i]] = ipf[i];
    }
    m
}

/// The equivariant linear basis, `(NB, 16, 16)` with `out_i = Σ_j W[a][i][j] x_j`:
/// `a = 0..4` the grade projectors, and (with `subgroup`) `a = 5..9` the maps
/// `x ↦ <x>_{a−5} · e0123` (right multiplication by the pseudoscalar). `NB = 10` with
/// `subgroup = true` (SO⁺(1,3)), `5` without (the full Pin(1,3) group).
pub fn linear_basis(subgroup: bool) -> Vec<[[f64; 16]; 16]> {
    let nb = if subgroup { 10 } else { 5 };
    let mut basis = vec![[[0.0; 16]; 16]; nb];
    for (i, g) in GRADE_INDEX.iter().enumerate() {
        basis[*g][i][i] = 1.0;
    }
    if subgroup {
        let ps = BLADES[15];
        for j in 0..16 {
            let (s, r) = blade_product(BLADES[j], ps);
            let i = index_of_blade(r);
            basis[5 + GRADE_INDEX[j]][i][j] = s;
        }
    }
    basis
}

/// The signed reversal that the sum of the five pseudoscalar maps forms:
/// `Σ_{a=5..9} W[a] x = (s_i · x_{15−i})_i`.
pub fn dual_signs() -> [f64; 16] {
    let b = linear_basis(true);
    let mut out = [0.0; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (5..10).map(|a| b[a][i][15 - i]).sum();
    }
    out
}

// ------------------------------------------------------------------------------------------------
// Lorentz transformations and their action on multivectors

/// A 4×4 matrix acting on four-vectors `(t, x, y, z)`: `v′ = L v`.
pub type Mat4 = [[f64; 4]; 4];

/// A 16×16 matrix acting on multivector components: `x′ = A x`.
pub(crate) type Mat16 = [[f64; 16]; 16];

/// Matrix product of two 4×4 matrices.
pub fn mat4_mul(a: &Mat4, b: &Mat4) -> Mat4 {
    let mut out = [[0.0; 4]; 4];
    for (i, row) in out.iter_mut().enumerate() {
        for (j, o) in row.iter_mut().enumerate() {
            *o = (0..4).map(|k| a[i][k] * b[k][j]).sum();
        }
    }
    out
}

/// Pure boost with velocity `beta` (|beta| < 1).
pub fn boost(beta: [f64; 3]) -> Mat4 {
    let b2: f64 = beta.iter().map(|b| b * b).sum();
    let gamma = 1.0 / (1.0 - b2).sqrt();
    let mut l = [[0.0; 4]; 4];
    l[0][0] = gamma;
    for i in 0..3 {
        l[0][i + 1] = gamma * beta[i];
        l[i + 1][0] = gamma * beta[i];
        for j in 0..3 {
            let delta = if i == j { 1.0 } else { 0.0 };
            let extra = if b2 > 0.0 { (gamma - 1.0) * beta[i] * beta[j] / b2 } else { 0.0 };
            l[i + 1][j + 1] = delta + extra;
        }
    }
    l
}

/// Spatial rotation from a quaternion `(w, x, y, z)` (normalised here).
pub fn rotation(q: [f64; 4]) -> Mat4 {
    let n = q.iter().map(|v| v * v).sum::<f64>().sqrt();
    let [w, x, y, z] = [q[0] / n, q[1] / n, q[2] / n, q[3] / n];
    let r = [
        [1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y - z * w), 2.0 * (x * z + y * w)],
        [2.0 * (x * y + z * w), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z - x * w)],
        [2.0 * (x * z - y * w), 2.0 * (y * z + x * w), 1.0 - 2.0 * (x * x + y * y)],
    ];
    let mut l = [[0.0; 4]; 4];
    l[0][0] = 1.0;
    for i in 0..3 {
        for j in 0..3 {
            l[i + 1][j + 1] = r[i][j];
        }
    }
    l
}

/// Spatial parity `diag(1, −1, −1, −1)`.
pub fn parity() -> Mat4 {
    diag([1.0, -1.0, -1.0, -1.0])
}

fn diag(d: [f64; 4]) -> Mat4 {
    let mut l = [[0.0; 4]; 4];
    for (i, v) in d.into_iter().enumerate() {
        l[i][i] = v;
    }
    l
}

/// Time reversal `diag(−1, 1, 1, 1)`.
pub fn time_reversal() -> Mat4 {
    diag([-1.0, 1.0, 1.0, 1.0])
}

fn minor(l: &Mat4, rows: &[usize], cols: &[usize]) -> f64 {
    // Laplace expansion along the first row (at most 4×4).
    match rows.len() {
        0 => 1.0,
        1 => l[rows[0]][cols[0]],
        _ => {
            let mut det = 0.0;
            for (c, &col) in cols.iter().enumerate() {
                let sub_cols: Vec<usize> = cols.iter().copied().filter(|&x| x != col).collect();
                let sign = if c % 2 == 0 { 1.0 } else { -1.0 };
                det += sign * l[rows[0]][col] * minor(l, &rows[1..], &sub_cols);
            }
            det
        }
    }
}

fn blade_indices(mask: u8) -> Vec<usize> {
    (0..4).filter(|mu| (mask >> mu) & 1 == 1).collect()
}

/// The outermorphism of a 4×4 Lorentz matrix on multivectors:
/// `A = blockdiag(1, L, C₂(L), C₃(L), det L)` with `C_k(L)[R][C] = det L[R rows, C cols]` over the
/// blades of grade k. It is the (Pin(1,3)) action `x ↦ u x u⁻¹` (or `u x̂ u⁻¹` for odd `u`) of
/// the group element that `L` represents, so `gp(Ax, Ay) = A gp(x, y)`.
pub fn outermorphism(l: &Mat4) -> Mat16 {
    let mut a = [[0.0; 16]; 16];
    for r in 0..16 {
        for c in 0..16 {
            if GRADE_INDEX[r] == GRADE_INDEX[c] {
                a[r][c] = minor(l, &blade_indices(BLADES[r]), &blade_indices(BLADES[c]));
            }
        }
    }
    a
}

/// `Lᵀ η L = η` up to `tol` (so `L` is in O(1,3)).
pub fn is_lorentz(l: &Mat4, tol: f64) -> bool {
    for i in 0..4 {
        for j in 0..4 {
            let v: f64 = (0..4).map(|k| l[k][i] * METRIC[k] * l[k][j]).sum();
            let want = if i == j { METRIC[i] } else { 0.0 };
            if (v - want).abs() > tol {
                return false;
            }
        }
    }
    true
}
