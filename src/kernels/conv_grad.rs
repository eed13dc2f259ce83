//! The backward of a dense f32 conv on the CPU ([`Dense`]): the weight gradient as one GEMM of the
//! output gradient by the image-to-columns matrix, built a cache-sized stripe at a time and summed
//! per thread; the input gradient of a stride-1 conv as the forward conv kernels' convolution of
//! the output gradient with the flipped, transposed kernel (Winograd / direct / stripe GEMM), of
//! the others as a GEMM into columns scattered back onto the input (columns-to-image).
use rayon::prelude::*;

use super::conv2d::{conv_f32, Dense, COLUMNS};
use super::cpu_slice::with_scratch;

/// `∂L/∂w` `[o, c·kh·kw]` of the conv `g` from its input `xs` `[b, c, h, w]` and output gradient
/// `gy` `[b, o, oh, ow]`; `None` when a length disagrees with `g`.
pub(crate) fn weight_grad(g: &Dense, xs: &[f32], gy: &[f32]) -> Option<Vec<f32>> {
    let (oh, ow) = g.output()?;
    let Dense { b, c, h, w, o, .. } = *g;
    if xs.len() != b * c * h * w || gy.len() != b * o * oh * ow {
        return None;
    }
    let k = g.taps();
    let rows = g.stripe_rows((oh, ow));
    let stripes = oh.div_ceil(rows);
    let tasks = b * stripes;
    let parts = rayon::current_num_threads().clamp(1, tasks.max(1));
    // Each part sums its share of (image, stripe) products into its own `[o, k]`; then the parts.
    let partial = |p: usize| -> Vec<f32> {
        let mut acc = vec![0f32; o * k];
        for t in (p * tasks / parts)..((p + 1) * tasks / parts) {
            let (img, si) = (t / stripes, t % stripes);
            let (y0, n) = (si * rows, rows.min(oh - si * rows) * ow);
            let x = &xs[img * c * h * w..][..c * h * w];
            let dy = &gy[img * o * oh * ow + y0 * ow..];
            // acc[o, k] += dy[o, n] · colsᵀ[n, k], the columns' element (j, r) at `rhs + r·rhs_cs + j`.
            let mut multiply = |rhs: *const f32, rhs_cs: isize| {
                // SAFETY: `acc` is `o × k`; `dy` holds o rows of n values at stride oh·ow from
                // output row y0 on; `rhs` addresses k rows of n values at stride `rhs_cs`.
                unsafe {
                    gemm::gemm(
                        o, k, n,
                        acc.as_mut_ptr(), 1, k as isize, true,
                        dy.as_ptr(), 1, (oh * ow) as isize,
                        rhs, rhs_cs, 1,
                        1.0, 1.0, false, false, false, gemm::Parallelism::None,
                    );
                }
            };
            if g.pointwise() {
                multiply(x[y0 * ow..].as_ptr(), (h * w) as isize);
                continue;
            }
            with_scratch(&COLUMNS, |cols| {
                cols.clear();
                cols.resize(k * n, 0.0);
                cols.chunks_exact_mut(n).enumerate().for_each(|(r, col)| g.fill_column_row(x, ow, y0, r, col));
                multiply(cols.as_ptr(), n as isize);
            });
        }
        acc
    };
    let parts: Vec<Vec<f32>> = (0..parts).into_par_iter().map(partial).collect();
    let mut sum = vec![0f32; o * k];
    for part in &parts {
        sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
    }
    Some(sum)
}

/// `∂L/∂x` `[b, c, h, w]` of the conv `g` from its weight `ws` `[o, c, kh, kw]` and output
/// gradient `gy` `[b, o, oh, ow]`; `None` when a length disagrees with `g`.
pub(crate) fn input_grad(g: &Dense, ws: &[f32], gy: &[f32]) -> Option<Vec<f32>> {
    let (oh, ow) = g.output()?;
    if ws.len() != g.o * g.taps() || gy.len() != g.b * g.o * oh * ow {
        return None;
    }
    if g.stride == 1 && g.kh == g.kw && g.pad < g.kh {
        // A stride-1 conv's input gradient is the "full" conv of the output gradient with the
        // kernel flipped in space and its channel axes swapped: padding kh − 1 − pad, h rows out.
        let flipped = flip_transpose(g, ws);
        let back = Dense { b: g.b, c: g.o, h: oh, w: ow, o: g.c, kh: g.kh, kw: g.kw, pad: g.kh - 1 - g.pad, stride: 1 };
        if back.output() == Some((g.h, g.w)) {
            return conv_f32(&back, gy, &flipped, None);
        }
    }
    Some(columns_to_image(g, ws, gy))
}

/// `w` `[o, c, kh, kw]` as `[c, o, kh, kw]` with each kernel rotated by 180°.
fn flip_transpose(g: &Dense, ws: &[f32]) -> Vec<f32> {
    let (o, c, kk) = (g.o, g.c, g.kh * g.kw);
    let mut out = vec![0f32; ws.len()];
    for co in 0..o {
        for ci in 0..c {
            let src = &ws[(co * c + ci) * kk..][..kk];
            let dst = &mut out[(ci * o + co) * kk..][..kk];
            dst.iter_mut().zip(src.iter().rev()).for_each(|(d, &s)| *d = s);
        }
    }
    out
}

/// The input gradient of any dense conv: per image (in parallel) and stripe of output rows, the
/// columns' gradient `wᵀ · gy` by one GEMM, added back onto the input pixels each column read.
fn columns_to_image(g: &Dense, ws: &[f32], gy: &[f32]) -> Vec<f32> {
    let Some((oh, ow)) = g.output() else { return Vec::new() };
    let Dense { b, c, h, w, o, kh, kw, pad, stride } = *g;
    let k = g.taps();
    let rows = g.stripe_rows((oh, ow));
    let mut gx = vec![0f32; b * c * h * w];
    let par = if b < rayon::current_num_threads() { super::gemm::pool_parallelism() } else { gemm::Parallelism::None };
    gx.par_chunks_exact_mut(c * h * w).enumerate().for_each(|(img, dx)| {
        let dy = &gy[img * o * oh * ow..][..o * oh * ow];
        let mut cols = Vec::new();
        for y0 in (0..oh).step_by(rows) {
            let n = rows.min(oh - y0) * ow;
            cols.clear();
            cols.resize(k * n, 0.0);
            // SAFETY: cols is `k × n`; wᵀ's element (r, co) is ws[co·k + r]; dy holds o rows of n
            // values at stride oh·ow from output row y0 on.
            unsafe {
                gemm::gemm(
                    k, n, o,
                    cols.as_mut_ptr(), 1, n as isize, false,
                    ws.as_ptr(), k as isize, 1,
                    dy[y0 * ow..].as_ptr(), 1, (oh * ow) as isize,
                    0.0, 1.0, false, false, false, par,
                );
            }
            for (r, col) in cols.chunks_exact(n).enumerate() {
                let (ci, ky, kx) = (r / (kh * kw), (r / kw) % kh, r % kw);
                let plane = &mut dx[ci * h * w..][..h * w];
                for (dyy, line) in col.chunks_exact(ow).enumerate() {
                    let iy = ((y0 + dyy) * stride + ky) as isize - pad as isize;
                    if iy < 0 || iy >= h as isize {
                        continue;
                    }
                    let row = &mut plane[iy as usize * w..][..w];
                    for (x, &v) in line.iter().enumerate() {
                        let ix = (x * stride + kx) as isize - pad as isize;
                        if ix >= 0 && (ix as usize) < w {
                            row[ix as usize] += v;
                        }
                    }
                }
            }
        }
    });
    gx
}

/// `∂L/∂bias` `[o]`: the output gradient `[b, o, oh·ow]` summed over images and pixels.
pub(crate) fn bias_grad(b: usize, o: usize, pixels: usize, gy: &[f32]) -> Vec<f32> {
    (0..o)
        .into_par_iter()
        .map(|co| (0..b).map(|i| gy[(i * o + co) * pixels..][..pixels].iter().map(|&v| v as f64).sum::<f64>()).sum::<f64>() as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::conv2d::stripe_conv;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::kernels::test_values::spread(n, seed, &candle_core::Device::Cpu).to_vec1().unwrap()
    }

    /// The loss Σ gy ∘ conv(x, w) in f64 (the finite-difference reference).
    fn loss(g: &Dense, xs: &[f64], ws: &[f64], gy: &[f32]) -> f64 {
        let (oh, ow) = g.output().unwrap();
        let mut total = 0f64;
        for b in 0..g.b {
            for co in 0..g.o {
                for y in 0..oh {
                    for x in 0..ow {
                        let mut acc = 0f64;
                        for ci in 0..g.c {
                            for ky in 0..g.kh {
                                for kx in 0..g.kw {
                                    let iy = (y * g.stride + ky) as isize - g.pad as isize;
                                    let ix = (x * g.stride + kx) as isize - g.pad as isize;
                                    if iy >= 0 && ix >= 0 && (iy as usize) < g.h && (ix as usize) < g.w {
                                        acc += xs[((b * g.c + ci) * g.h + iy as usize) * g.w + ix as usize] * ws[((co * g.c + ci) * g.kh + ky) * g.kw + kx];
                                    }
                                }
                            }
                        }
                        total += acc * gy[((b * g.o + co) * oh + y) * ow + x] as f64;
                    }
                }
            }
        }
        total
    }

    #[test]
    fn gradients_match_finite_differences_in_f64() {
        let shapes = [
            Dense { b: 2, c: 3, h: 7, w: 6, o: 4, kh: 3, kw: 3, pad: 1, stride: 1 },
            Dense { b: 1, c: 5, h: 6, w: 5, o: 3, kh: 1, kw: 1, pad: 0, stride: 1 },
            Dense { b: 2, c: 2, h: 9, w: 8, o: 3, kh: 3, kw: 3, pad: 1, stride: 2 },
            Dense { b: 1, c: 3, h: 11, w: 10, o: 2, kh: 7, kw: 7, pad: 3, stride: 4 },
            Dense { b: 1, c: 2, h: 6, w: 7, o: 2, kh: 5, kw: 5, pad: 2, stride: 1 },
            Dense { b: 1, c: 2, h: 5, w: 6, o: 3, kh: 2, kw: 2, pad: 0, stride: 1 },
        ];
        for (i, g) in shapes.iter().enumerate() {
            let (oh, ow) = g.output().unwrap();
            let xs = values(g.b * g.c * g.h * g.w, 1 + i as u64);
            let ws = values(g.o * g.taps(), 11 + i as u64);
            let gy = values(g.b * g.o * oh * ow, 21 + i as u64);
            let gw = weight_grad(g, &xs, &gy).unwrap();
            let gx = input_grad(g, &ws, &gy).unwrap();
            let (x64, w64): (Vec<f64>, Vec<f64>) = (xs.iter().map(|&v| v as f64).collect(), ws.iter().map(|&v| v as f64).collect());
            let eps = 1e-6;
            for (j, &got) in gw.iter().enumerate() {
                let (mut up, mut down) = (w64.clone(), w64.clone());
                up[j] += eps;
                down[j] -= eps;
                let want = (loss(g, &x64, &up, &gy) - loss(g, &x64, &down, &gy)) / (2.0 * eps);
                assert!((got as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{g:?} weight {j}: {got} vs {want}");
            }
            for (j, &got) in gx.iter().enumerate() {
                let (mut up, mut down) = (x64.clone(), x64.clone());
                up[j] += eps;
                down[j] -= eps;
                let want = (loss(g, &up, &w64, &gy) - loss(g, &down, &w64, &gy)) / (2.0 * eps);
                assert!((got as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{g:?} input {j}: {got} vs {want}");
            }
            let gb = bias_grad(g.b, g.o, oh * ow, &gy);
            for (co, &got) in gb.iter().enumerate() {
                let want: f64 = (0..g.b).map(|b| gy[(b * g.o + co) * oh * ow..][..oh * ow].iter().map(|&v| v as f64).sum::<f64>()).sum();
                assert!((got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0));
            }
        }
    }

    #[test]
    fn stripes_cover_large_maps_exactly_once() {
        // Maps of many stripes (and a last, shorter one): the sum over stripes equals one product.
        let g = Dense { b: 2, c: 8, h: 70, w: 66, o: 5, kh: 3, kw: 3, pad: 1, stride: 1 };
        let (oh, ow) = g.output().unwrap();
        assert!(g.stripe_rows((oh, ow)) < oh);
        let xs = values(g.b * g.c * g.h * g.w, 3);
        let gy = values(g.b * g.o * oh * ow, 4);
        let gw = weight_grad(&g, &xs, &gy).unwrap();
        // Σ_j gy·conv(x, e_j) = gw[j]: check through the conv of x by each unit weight.
        for j in [0, 17, g.o * g.taps() - 1] {
            let mut unit = vec![0f32; g.o * g.taps()];
            unit[j] = 1.0;
            let y = stripe_conv(&g, &xs, &unit, None);
            let want: f64 = y.iter().zip(&gy).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!((gw[j] as f64 - want).abs() <= 1e-3 * want.abs().max(1.0), "weight {j}: {} vs {want}", gw[j]);
        }
    }
}
