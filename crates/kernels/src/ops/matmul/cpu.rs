//! The CPU twin of the GEMM: the `gemm` crate (blocked, SIMD, rayon) for speed, and a plain f64 loop
//! that the tests hold both backends against.

use super::Gemm;
use crate::cpu::SendPtr;
use rayon::prelude::*;

/// [`gemm`], or with independent rows one row at a time (the `gemm` crate's kernels differ by shape,
/// so a row's rounding would otherwise depend on how many rows come with it).
pub(crate) fn gemm_rows(a: &[f32], b: &[f32], c: &mut [f32], g: &Gemm) {
    if g.rows == super::RowMode::Shared || g.m <= 1 || g.batches() != 1 {
        return gemm(a, b, c, g);
    }
    let (sa, sc) = (if g.trans_a { 1 } else { g.lda }, g.ldc);
    for r in 0..g.m {
        let one = Gemm { m: 1, ..*g };
        let [ea, _, ec] = one.extents();
        gemm(&a[r * sa..][..ea], b, &mut c[r * sc..][..ec], &one);
    }
}

/// C = alpha * op(A) op(B) + beta * C on host slices (each starting at its view's offset).
pub(crate) fn gemm(a: &[f32], b: &[f32], c: &mut [f32], g: &Gemm) {
    if g.m == 0 || g.n == 0 || g.batches() == 0 {
        return;
    }
    let (a_rs, a_cs) = if g.trans_a {
        (1, g.lda as isize)
    } else {
        (g.lda as isize, 1)
    };
    let (b_rs, b_cs) = if g.trans_b {
        (1, g.ldb as isize)
    } else {
        (g.ldb as isize, 1)
    };
    let one = |z1: usize, z2: usize, c: *mut f32, par: gemm::Parallelism| {
        let ao = z1 * g.stride_a[0] + z2 * g.stride_a[1];
        let bo = z1 * g.stride_b[0] + z2 * g.stride_b[1];
        if g.k == 0 {
            // An empty sum: C = beta * C.
            for r in 0..g.m {
                for col in 0..g.n {
                    // SAFETY: (r, col) is inside this batch entry's C block, which `extents` bounds.
                    unsafe {
                        let p = c.add(r * g.ldc + col);
                        *p = if g.beta == 0.0 { 0.0 } else { g.beta * *p };
                    }
                }
            }
            return;
        }
        // SAFETY: `extents()` bounds every index the product touches, and `matmul` checked the slices
        // against it; batch entries of C never overlap (distinct strides), so parallel entries write
        // disjoint elements. The gemm crate computes dst = alpha*dst + beta*lhs*rhs: its alpha is our
        // beta and its beta our alpha.
        unsafe {
            gemm::gemm(
                g.m,
                g.n,
                g.k,
                c,
                1,
                g.ldc as isize,
                g.beta != 0.0,
                a.as_ptr().add(ao),
                a_cs,
                a_rs,
                b.as_ptr().add(bo),
                b_cs,
                b_rs,
                g.beta,
                g.alpha,
                false,
                false,
                false,
                par,
            );
        }
    };
    let batches = g.batches();
    if batches == 1 {
        one(0, 0, c.as_mut_ptr(), gemm::Parallelism::Rayon(0));
    } else {
        let cp = SendPtr(c.as_mut_ptr());
        (0..batches).into_par_iter().for_each(|z| {
            let (z1, z2) = (z / g.batch[1], z % g.batch[1]);
            let off = z1 * g.stride_c[0] + z2 * g.stride_c[1];
            // SAFETY: see above; `off` is this entry's own block of C.
            one(
                z1,
                z2,
                unsafe { cp.get().add(off) },
                gemm::Parallelism::None,
            );
        });
    }
}

/// The same product in plain loops with f64 accumulation: the reference the tests compare with.
pub fn gemm_reference(a: &[f32], b: &[f32], c: &mut [f32], g: &Gemm) {
    for z1 in 0..g.batch[0] {
        for z2 in 0..g.batch[1] {
            let ao = z1 * g.stride_a[0] + z2 * g.stride_a[1];
            let bo = z1 * g.stride_b[0] + z2 * g.stride_b[1];
            let co = z1 * g.stride_c[0] + z2 * g.stride_c[1];
            for i in 0..g.m {
                for j in 0..g.n {
                    let mut s = 0.0f64;
                    for l in 0..g.k {
                        let av = if g.trans_a {
                            a[ao + l * g.lda + i]
                        } else {
                            a[ao + i * g.lda + l]
                        };
                        let bv = if g.trans_b {
                            b[bo + j * g.ldb + l]
                        } else {
                            b[bo + l * g.ldb + j]
                        };
                        s += av as f64 * bv as f64;
                    }
                    let ci = co + i * g.ldc + j;
                    let old = if g.beta == 0.0 {
                        0.0
                    } else {
                        g.beta as f64 * c[ci] as f64
                    };
                    c[ci] = (g.alpha as f64 * s + old) as f32;
                }
            }
        }
    }
}
