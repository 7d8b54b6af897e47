//! The CPU backend's training attention forward, in blocks of query rows so the causal mask skips
//! work: a block of rows r0..r1 scores only keys 0..r1 and mixes only those values (the batched GEMMs
//! over whole T×T score matrices compute a masked half that softmax then zeroes). Each (sequence,
//! head, row block) is one task; its scores, softmax, dropout and product stay in cache together.
//! The probabilities it keeps (zeros above the diagonal) are those of the unblocked form.

use super::AttnShape;
use crate::cpu::CpuBackend;
use crate::ops::dropout::kept_fn;
use crate::ops::fastmath;
use crate::ops::softmax::row_forward;
use rayon::prelude::*;

/// Query rows per task.
const ROWS: usize = 64;

#[derive(Clone, Copy)]
struct Ptr(*mut f32);
// SAFETY: each task writes its own rows of `probs`, `dropped` and `y` (disjoint; see `forward`).
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}
impl Ptr {
    /// (A method, so closures capture the whole `Ptr`, not its raw field.)
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// y, probs (and dropped) from qkv, as [`super::attention_forward`] defines them. Slices are exactly
/// the tensors' lengths (checked by the caller).
pub(super) fn forward(
    c: &CpuBackend,
    qkv: &[f32],
    y: &mut [f32],
    probs: &mut [f32],
    dropped: Option<&mut [f32]>,
    s: AttnShape,
    drop: Option<(f32, u32)>,
) {
    let (t, hd, heads) = (s.t, s.head_dim, s.heads);
    let cw = heads * hd;
    let blocks = t.div_ceil(ROWS);
    let (yp, pp) = (Ptr(y.as_mut_ptr()), Ptr(probs.as_mut_ptr()));
    let dp = dropped.map(|d| Ptr(d.as_mut_ptr()));
    let scale = s.scale();
    c.install(|| {
        (0..s.batch * heads * blocks)
            .into_par_iter()
            .for_each(|task| {
                let (z, rb) = (task / blocks, task % blocks);
                let (b, h) = (z / heads, z % heads);
                let (r0, r1) = (rb * ROWS, (rb * ROWS + ROWS).min(t));
                let q = b * t * 3 * cw + h * hd;
                let (k, v) = (q + cw, q + 2 * cw);
                let pz = z * t * t;
                // SAFETY: this task alone writes rows r0..r1 of score matrix z (probs, dropped) and
                // rows r0..r1 of head h's columns in sequence b of y; every index stays inside the
                // slices (qkv: batch·t·3c, probs: batch·heads·t·t, y: batch·t·c).
                unsafe {
                    let rows =
                        std::slice::from_raw_parts_mut(pp.get().add(pz + r0 * t), (r1 - r0) * t);
                    gemm::gemm(
                        r1 - r0,
                        r1,
                        hd,
                        rows.as_mut_ptr(),
                        1,
                        t as isize,
                        false,
                        qkv.as_ptr().add(q + r0 * 3 * cw),
                        1,
                        (3 * cw) as isize,
                        qkv.as_ptr().add(k),
                        (3 * cw) as isize,
                        1,
                        0.0,
                        scale,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                    fastmath::wide(|| {
                        for (i, row) in rows.chunks_mut(t).enumerate() {
                            row_forward(row, r0 + i + 1, 1.0);
                        }
                    });
                    let mixed = match (drop, dp) {
                        (Some((p, seed)), Some(d)) if p > 0.0 => {
                            let out = std::slice::from_raw_parts_mut(
                                d.get().add(pz + r0 * t),
                                (r1 - r0) * t,
                            );
                            let base = (pz + r0 * t) as u32;
                            fastmath::map1i(out, rows, base, kept_fn(p, seed));
                            out.as_ptr()
                        }
                        _ => rows.as_ptr(),
                    };
                    gemm::gemm(
                        r1 - r0,
                        hd,
                        r1,
                        yp.get().add(b * t * cw + r0 * cw + h * hd),
                        1,
                        cw as isize,
                        false,
                        mixed,
                        1,
                        t as isize,
                        qkv.as_ptr().add(v),
                        1,
                        (3 * cw) as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            })
    });
}
