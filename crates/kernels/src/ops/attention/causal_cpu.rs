//! The CPU backend's training attention forward, in blocks of query rows so the causal mask skips
//! work: a block of rows r0..r1 scores only keys 0..r1 and mixes only those values (the batched GEMMs
//! over whole T×T score matrices compute a masked half that softmax then zeroes). Each (sequence,
//! head, row block) is one task; its scores, softmax, dropout and product stay in cache together.
//! The probabilities it keeps (zeros above the diagonal) are those of the unblocked form.

use super::AttnShape;
use crate::cpu::{CpuBackend, SendPtr as Ptr};
use crate::ops::dropout::kept_fn;
use crate::ops::fastmath;
use crate::ops::softmax::{row_backward, row_forward};
use rayon::prelude::*;

/// Query rows per task.
const ROWS: usize = 64;

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
                    // Scores of keys 0..r1: Q[rows] · K[0..r1]ᵀ / √d.
                    product(
                        (r1 - r0, r1, hd),
                        (rows.as_mut_ptr(), t),
                        (qkv.as_ptr().add(q + r0 * 3 * cw), 3 * cw, 1),
                        (qkv.as_ptr().add(k), 1, 3 * cw),
                        scale,
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
                    // Y[rows] = P[rows, 0..r1] · V[0..r1].
                    product(
                        (r1 - r0, hd, r1),
                        (yp.get().add(b * t * cw + r0 * cw + h * hd), cw),
                        (mixed, t, 1),
                        (qkv.as_ptr().add(v), 3 * cw, 1),
                        1.0,
                    );
                }
            })
    });
}

/// One product of a block: dst[m × n] = alpha · A · B, every operand given by its first
/// element and its (row, column) strides. The gemm crate's own argument order, spelled out once.
///
/// # Safety
/// Every element the strides reach must lie inside the allocation its pointer points into; no other
/// task may touch `dst`'s elements meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize, usize),
    alpha: f32,
) {
    // SAFETY: the caller's.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            1,
            dst.1 as isize,
            false,
            a.0,
            a.2 as isize,
            a.1 as isize,
            b.0,
            b.2 as isize,
            b.1 as isize,
            0.0,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// dqkv (overwritten) from dy, as [`super::attention_backward`] defines it, in blocks that skip the
/// masked half: for each (sequence, head), dV from the probabilities the product used (keys c0..c1
/// take rows c0..t), then per block of query rows r0..r1 the probabilities' gradient over keys 0..r1,
/// dropout's and softmax's backward in place in `scratch` and dQ,
/// then dK from the scores' gradient like dV.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    c: &CpuBackend,
    qkv: &[f32],
    probs: &[f32],
    dropped: Option<&[f32]>,
    dy: &[f32],
    dqkv: &mut [f32],
    scratch: &mut [f32],
    s: AttnShape,
    drop: Option<(f32, u32)>,
) {
    let (t, hd, heads) = (s.t, s.head_dim, s.heads);
    let cw = heads * hd;
    let blocks = t.div_ceil(ROWS);
    let scale = s.scale();
    let use_drop = matches!(drop, Some((p, _)) if p > 0.0) && dropped.is_some();
    let (dq, sp) = (Ptr(dqkv.as_mut_ptr()), Ptr(scratch.as_mut_ptr()));
    c.install(|| {
        (0..s.batch * heads).into_par_iter().for_each(|z| {
            let (b, h) = (z / heads, z % heads);
            let q = b * t * 3 * cw + h * hd;
            let (k, v) = (q + cw, q + 2 * cw);
            let yo = b * t * cw + h * hd;
            let pz = z * t * t;
            // SAFETY: this task alone writes score matrix z of `scratch` and head h's
            // columns of sequence b in dqkv; all indices stay inside the slices (qkv and dqkv:
            // batch·t·3c, probs, dropped and scratch: batch·heads·t·t, dy: batch·t·c).
            unsafe {
                let used = match (use_drop, dropped) {
                    (true, Some(d)) => d.as_ptr().add(pz),
                    _ => probs.as_ptr().add(pz),
                };
                // dV[c0..c1] = Σ_{i ≥ c0} P'[i, c0..c1]ᵀ dY[i].
                for kb in 0..blocks {
                    let (c0, c1) = (kb * ROWS, (kb * ROWS + ROWS).min(t));
                    product(
                        (c1 - c0, hd, t - c0),
                        (dq.get().add(v + c0 * 3 * cw), 3 * cw),
                        (used.add(c0 * t + c0), 1, t),
                        (dy.as_ptr().add(yo + c0 * cw), cw, 1),
                        1.0,
                    );
                }
                let ds = sp.get().add(pz);
                for rb in 0..blocks {
                    let (r0, r1) = (rb * ROWS, (rb * ROWS + ROWS).min(t));
                    let rows =
                        std::slice::from_raw_parts_mut(sp.get().add(pz + r0 * t), (r1 - r0) * t);
                    // dP'[rows, 0..r1] = dY[rows] · V[0..r1]ᵀ; the masked keys' gradient is 0.
                    product(
                        (r1 - r0, r1, hd),
                        (rows.as_mut_ptr(), t),
                        (dy.as_ptr().add(yo + r0 * cw), cw, 1),
                        (qkv.as_ptr().add(v), 1, 3 * cw),
                        1.0,
                    );
                    for row in rows.chunks_mut(t) {
                        row[r1..].fill(0.0);
                    }
                    // dP = dropout'(dP'), in place.
                    if let (true, Some((p, seed))) = (use_drop, drop) {
                        fastmath::apply1i(rows, (pz + r0 * t) as u32, kept_fn(p, seed));
                    }
                    let dsr = rows;
                    fastmath::wide(|| {
                        let pr = &probs[pz + r0 * t..pz + r1 * t];
                        for (i, (g, y)) in dsr.chunks_mut(t).zip(pr.chunks(t)).enumerate() {
                            row_backward(g, y, r0 + i + 1, 1.0);
                        }
                    });
                    // dQ[rows] = dS[rows, 0..r1] · K[0..r1] / √d.
                    product(
                        (r1 - r0, hd, r1),
                        (dq.get().add(q + r0 * 3 * cw), 3 * cw),
                        (dsr.as_ptr(), t, 1),
                        (qkv.as_ptr().add(k), 3 * cw, 1),
                        scale,
                    );
                }
                // dK[c0..c1] = Σ_{i ≥ c0} dS[i, c0..c1]ᵀ Q[i] / √d.
                for kb in 0..blocks {
                    let (c0, c1) = (kb * ROWS, (kb * ROWS + ROWS).min(t));
                    product(
                        (c1 - c0, hd, t - c0),
                        (dq.get().add(k + c0 * 3 * cw), 3 * cw),
                        (ds.add(c0 * t + c0) as *const f32, 1, t),
                        (qkv.as_ptr().add(q + c0 * 3 * cw), 3 * cw, 1),
                        scale,
                    );
                }
            }
        })
    });
}
