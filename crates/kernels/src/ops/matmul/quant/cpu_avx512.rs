//! AVX-512F row kernels for [`super::cpu`]: the contract of `cpu_avx2` (pointers validated by the safe
//! entry points, output (r, j) at `y[r * ldy + j]`), with 16-lane vectors and up to 8 activation rows per
//! pass (32 vector registers).
//!
//! Two ways to apply a block's scale, chosen by cost:
//!
//! * **scale the partial sum** (Q8, one activation row): t = Σ q·x over the block, acc += scale·t. One
//!   multiply per block per row — cheapest when a block meets a single row.
//! * **dequantize in registers** (Q4 always, Q8 with several rows): w = scale·q (+ min) as 16-lane f32
//!   vectors, then acc += w·x for every row. The dequantization is paid once per block and shared by all
//!   rows; each weight is the correctly rounded f32 value of scale·q + min (one FMA), i.e. the f32 weight of
//!   the `dequantize()` twin up to that one rounding, so the sums are f32 math on dequantized weights.
//!
//! Q4 dequantizes with a table: `vpermps` reads only the low 4 bits of each index lane, so a 16-entry table
//! tab[i] = scale·i + min (one FMA on the vector 0..15) turns widened bytes straight into weights — the low
//! nibble directly, the high nibble after a 4-bit shift — with no mask, no int→float conversion and no
//! separate min term.

use std::arch::x86_64::*;

use super::cpu_avx2::{PREFETCH_BYTES, prefetch};

#[inline(always)]
unsafe fn ld(p: *const f32) -> __m512 {
    unsafe { _mm512_loadu_ps(p) }
}

/// 16 signed bytes at `p` as 16 f32 (every i8 is exact in f32).
#[inline(always)]
unsafe fn i8x16(p: *const u8) -> __m512 {
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
}

/// Block `b` of one Q8 row against one activation row: acc += scale · Σ q·x.
#[inline(always)]
unsafe fn q8_block_1<const BLOCK: usize>(
    x: *const f32,
    b: usize,
    qr: *const u8,
    sr: *const f32,
    a: &mut __m512,
) {
    unsafe {
        let sc = _mm512_set1_ps(*sr.add(b));
        let xp = x.add(b * BLOCK);
        let qp = qr.add(b * BLOCK);
        let mut t = _mm512_mul_ps(i8x16(qp), ld(xp));
        if BLOCK == 32 {
            t = _mm512_fmadd_ps(i8x16(qp.add(16)), ld(xp.add(16)), t);
        }
        *a = _mm512_fmadd_ps(sc, t, *a);
    }
}

/// Q8, one activation row, scale applied to each block's partial sum. Four accumulators in rotation hide
/// the latency of the loop-carried `acc = fma(scale, t, acc)` (a block is only 3-6 vector ops).
#[target_feature(enable = "avx512f,fma")]
unsafe fn q8_rows_1<const BLOCK: usize>(
    x: *const f32,
    k: usize,
    q: *const u8,
    s: *const f32,
    rows: usize,
    y: *mut f32,
) {
    let nb = k / BLOCK;
    let ahead = (PREFETCH_BYTES / (k + 4 * nb)).max(1);
    unsafe {
        for n in 0..rows {
            let qr = q.add(n * k);
            let sr = s.add(n * nb);
            if n + ahead < rows {
                prefetch(qr.wrapping_add(ahead * k), k);
                prefetch(sr.wrapping_add(ahead * nb).cast(), 4 * nb);
            }
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut b = 0;
            while b + 4 <= nb {
                for (u, a) in acc.iter_mut().enumerate() {
                    q8_block_1::<BLOCK>(x, b + u, qr, sr, a);
                }
                b += 4;
            }
            while b < nb {
                q8_block_1::<BLOCK>(x, b, qr, sr, &mut acc[0]);
                b += 1;
            }
            let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            *y.add(n) = _mm512_reduce_add_ps(v);
        }
    }
}

/// Q8, R ≥ 2 activation rows (`ldx` apart), weights dequantized in registers once per block.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
unsafe fn q8_rows_deq<const R: usize, const BLOCK: usize>(
    x: *const f32,
    ldx: usize,
    k: usize,
    q: *const u8,
    s: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
) {
    let nb = k / BLOCK;
    let ahead = (PREFETCH_BYTES / (k + 4 * nb)).max(1);
    unsafe {
        for n in 0..rows {
            let qr = q.add(n * k);
            let sr = s.add(n * nb);
            if n + ahead < rows {
                prefetch(qr.wrapping_add(ahead * k), k);
                prefetch(sr.wrapping_add(ahead * nb).cast(), 4 * nb);
            }
            // Two accumulators per row: the two 16-lane halves of a block of 32, or even/odd blocks of 16
            // (unrolled by hand: an array indexed by `b % 2` would live in memory).
            let mut a0 = [_mm512_setzero_ps(); R];
            let mut a1 = [_mm512_setzero_ps(); R];
            if BLOCK == 32 {
                for b in 0..nb {
                    let sc = _mm512_set1_ps(*sr.add(b));
                    let qp = qr.add(b * 32);
                    let w0 = _mm512_mul_ps(i8x16(qp), sc);
                    let w1 = _mm512_mul_ps(i8x16(qp.add(16)), sc);
                    for r in 0..R {
                        let xp = x.add(r * ldx + b * 32);
                        a0[r] = _mm512_fmadd_ps(w0, ld(xp), a0[r]);
                        a1[r] = _mm512_fmadd_ps(w1, ld(xp.add(16)), a1[r]);
                    }
                }
            } else {
                let mut b = 0;
                while b < nb {
                    let w = _mm512_mul_ps(i8x16(qr.add(b * 16)), _mm512_set1_ps(*sr.add(b)));
                    for (r, ar) in a0.iter_mut().enumerate() {
                        *ar = _mm512_fmadd_ps(w, ld(x.add(r * ldx + b * 16)), *ar);
                    }
                    if b + 1 < nb {
                        let sc = _mm512_set1_ps(*sr.add(b + 1));
                        let w = _mm512_mul_ps(i8x16(qr.add(b * 16 + 16)), sc);
                        for (r, ar) in a1.iter_mut().enumerate() {
                            *ar = _mm512_fmadd_ps(w, ld(x.add(r * ldx + b * 16 + 16)), *ar);
                        }
                    }
                    b += 2;
                }
            }
            for r in 0..R {
                *y.add(r * ldy + n) = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
            }
        }
    }
}

/// Block `b` of one Q8 row into accumulator `u` of each of R activation rows, each row's arithmetic that
/// of [`q8_block_1`]; the quants are converted once.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn q8_block_alone<const R: usize, const BLOCK: usize, const S: usize>(
    x: *const f32,
    ldx: usize,
    b: usize,
    u: usize,
    qr: *const u8,
    sr: *const f32,
    acc: &mut [[__m512; S]; R],
) {
    unsafe {
        let sc = _mm512_set1_ps(*sr.add(b));
        let qp = qr.add(b * BLOCK);
        let q0 = i8x16(qp);
        let q1 = if BLOCK == 32 { i8x16(qp.add(16)) } else { q0 };
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.add(r * ldx + b * BLOCK);
            let mut t = _mm512_mul_ps(q0, ld(xp));
            if BLOCK == 32 {
                t = _mm512_fmadd_ps(q1, ld(xp.add(16)), t);
            }
            a[u] = _mm512_fmadd_ps(sc, t, a[u]);
        }
    }
}

/// Q8, R activation rows (`ldx` apart), each computed exactly as [`q8_rows_1`] computes it alone (the
/// same products, partial sums, scale multiplies and four rotating accumulators per row); only the
/// quants' conversion to f32 is shared by the rows.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
unsafe fn q8_rows_alone<const R: usize, const BLOCK: usize>(
    x: *const f32,
    ldx: usize,
    k: usize,
    q: *const u8,
    s: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
) {
    let nb = k / BLOCK;
    let ahead = (PREFETCH_BYTES / (k + 4 * nb)).max(1);
    unsafe {
        for n in 0..rows {
            let qr = q.add(n * k);
            let sr = s.add(n * nb);
            if n + ahead < rows {
                prefetch(qr.wrapping_add(ahead * k), k);
                prefetch(sr.wrapping_add(ahead * nb).cast(), 4 * nb);
            }
            // Two passes over the row's blocks, each with two of the four accumulators: the first
            // takes blocks 4i and 4i + 1 (and the tail, into accumulator 0, after them), the second
            // 4i + 2 and 4i + 3 — each accumulator the same blocks in the same order as in `q8_rows_1`,
            // with 2R vectors live rather than 4R (eight rows fit the registers).
            let nb4 = nb / 4 * 4;
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            let mut b = 0;
            while b < nb4 {
                q8_block_alone::<R, BLOCK, 2>(x, ldx, b, 0, qr, sr, &mut acc);
                q8_block_alone::<R, BLOCK, 2>(x, ldx, b + 1, 1, qr, sr, &mut acc);
                b += 4;
            }
            while b < nb {
                q8_block_alone::<R, BLOCK, 2>(x, ldx, b, 0, qr, sr, &mut acc);
                b += 1;
            }
            let first: [__m512; R] = std::array::from_fn(|r| _mm512_add_ps(acc[r][0], acc[r][1]));
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            let mut b = 0;
            while b < nb4 {
                q8_block_alone::<R, BLOCK, 2>(x, ldx, b + 2, 0, qr, sr, &mut acc);
                q8_block_alone::<R, BLOCK, 2>(x, ldx, b + 3, 1, qr, sr, &mut acc);
                b += 4;
            }
            for (r, a) in acc.iter().enumerate() {
                let v = _mm512_add_ps(first[r], _mm512_add_ps(a[0], a[1]));
                *y.add(r * ldy + n) = _mm512_reduce_add_ps(v);
            }
        }
    }
}

/// Q8 rows, block `BLOCK` (16 or 32), `R` activation rows; arguments as `cpu_avx2::q8_rows`. `alone`:
/// every row computed as it is alone ([`q8_rows_alone`]), else the weights dequantized once for all.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn q8_rows<const R: usize, const BLOCK: usize>(
    x: *const f32,
    ldx: usize,
    k: usize,
    q: *const u8,
    s: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
    alone: bool,
) {
    unsafe {
        if R == 1 {
            q8_rows_1::<BLOCK>(x, k, q, s, rows, y)
        } else if alone {
            q8_rows_alone::<R, BLOCK>(x, ldx, k, q, s, rows, y, ldy)
        } else {
            q8_rows_deq::<R, BLOCK>(x, ldx, k, q, s, rows, y, ldy)
        }
    }
}

/// Block `b` of one Q4 row against R raw activation rows: acc[r][0] += w(low nibbles)·x[0..16],
/// acc[r][1] += w(high nibbles)·x[16..32], the weights dequantized through the table.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn q4_block<const R: usize>(
    x: *const f32,
    ldx: usize,
    b: usize,
    qr: *const u8,
    sr: *const f32,
    mr: *const f32,
    iota: __m512,
    acc: &mut [[__m512; 2]; R],
) {
    unsafe {
        // Byte j of the block = q_j | q_{j+16} << 4, widened to lane j.
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qr.add(b * 16).cast()));
        let tab = _mm512_fmadd_ps(iota, _mm512_set1_ps(*sr.add(b)), _mm512_set1_ps(*mr.add(b)));
        let w0 = _mm512_permutexvar_ps(v, tab);
        let w1 = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), tab);
        for (r, ar) in acc.iter_mut().enumerate() {
            let xp = x.add(r * ldx + b * 32);
            ar[0] = _mm512_fmadd_ps(w0, ld(xp), ar[0]);
            ar[1] = _mm512_fmadd_ps(w1, ld(xp.add(16)), ar[1]);
        }
    }
}

/// Q4 rows with *raw* activations (no preparation: the table gives scale·q + min directly); `R` rows of
/// `x`, `ldx` apart. Other arguments as `cpu_avx2::q4_rows`. `alone`: every row accumulated as one row
/// alone is (blocks alternating between two accumulator pairs), so its sum is the same whatever R.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn q4_rows<const R: usize>(
    x: *const f32,
    ldx: usize,
    k: usize,
    q: *const u8,
    s: *const f32,
    mn: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
    alone: bool,
) {
    let nb = k / 32;
    let ahead = (PREFETCH_BYTES / (k / 2 + 8 * nb)).max(1);
    let iota = _mm512_setr_ps(
        0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
    );
    unsafe {
        for n in 0..rows {
            let qr = q.add(n * (k / 2));
            let sr = s.add(n * nb);
            let mr = mn.add(n * nb);
            if n + ahead < rows {
                prefetch(qr.wrapping_add(ahead * k / 2), k / 2);
                prefetch(sr.wrapping_add(ahead * nb).cast(), 4 * nb);
                prefetch(mr.wrapping_add(ahead * nb).cast(), 4 * nb);
            }
            // a?[r][0] takes the low nibbles (values 0..16 of a block), a?[r][1] the high ones; with one
            // row (or rows computed as alone), blocks alternate between a0 and a1 so four FMA chains run
            // at once. (Unrolled by hand:
            // an accumulator array indexed by `b % 2` would live in memory.)
            if alone && R > 1 {
                // Several rows as alone: a0 takes the even blocks and a1 the odd ones, each in the same
                // order as the alternating loop below gives them, so every sum is the same; one pass
                // per accumulator pair keeps 2R vectors live, not 4R (eight rows fit the registers).
                let mut a = [[_mm512_setzero_ps(); 2]; R];
                let mut b = 0;
                while b < nb {
                    q4_block(x, ldx, b, qr, sr, mr, iota, &mut a);
                    b += 2;
                }
                let even: [__m512; R] = std::array::from_fn(|r| _mm512_add_ps(a[r][0], a[r][1]));
                let mut a = [[_mm512_setzero_ps(); 2]; R];
                let mut b = 1;
                while b < nb {
                    q4_block(x, ldx, b, qr, sr, mr, iota, &mut a);
                    b += 2;
                }
                for r in 0..R {
                    let v = _mm512_add_ps(even[r], _mm512_add_ps(a[r][0], a[r][1]));
                    *y.add(r * ldy + n) = _mm512_reduce_add_ps(v);
                }
                continue;
            }
            let mut a0 = [[_mm512_setzero_ps(); 2]; R];
            let mut a1 = [[_mm512_setzero_ps(); 2]; R];
            let mut b = 0;
            if R == 1 {
                while b + 2 <= nb {
                    q4_block(x, ldx, b, qr, sr, mr, iota, &mut a0);
                    q4_block(x, ldx, b + 1, qr, sr, mr, iota, &mut a1);
                    b += 2;
                }
            }
            while b < nb {
                q4_block(x, ldx, b, qr, sr, mr, iota, &mut a0);
                b += 1;
            }
            for r in 0..R {
                let v = _mm512_add_ps(
                    _mm512_add_ps(a0[r][0], a0[r][1]),
                    _mm512_add_ps(a1[r][0], a1[r][1]),
                );
                *y.add(r * ldy + n) = _mm512_reduce_add_ps(v);
            }
        }
    }
}

/// Activation rows of one packed panel of [`gemm_panel`]: one 16-lane vector.
pub(super) const PANEL: usize = 16;
/// Weight rows one [`gemm_panel`] call takes at most: 24 accumulators and the activation vector; each
/// weight is a broadcast operand of its fused multiply-add (no separate broadcast instruction).
pub(super) const PANEL_COLS: usize = 24;

/// One packed panel of up to 16 activation rows against C dequantized weight rows: `xt[k * 16 + i]` is
/// activation row i's value k (rows past m are zeros), `w[j * ldw + kk]` weight row j's value kk, and
/// y[i * ldy + j] = Σ_k xt[k, i] · w[j, k] for i < `rows` (≤ 16), j < C. Each output is one accumulator
/// summed over k in order with fused multiply-adds, whatever C and the panel's other rows are: a row's
/// result does not depend on the rows beside it.
///
/// # Safety
/// AVX-512F and FMA available; xt holds K × 16 values, w holds C rows of K (`ldw` apart), y holds
/// `rows` rows of C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn gemm_panel<const C: usize>(
    xt: *const f32,
    k: usize,
    w: *const f32,
    ldw: usize,
    y: *mut f32,
    ldy: usize,
    rows: usize,
) {
    unsafe {
        let mut a = [_mm512_setzero_ps(); C];
        for kk in 0..k {
            let xv = ld(xt.add(kk * PANEL));
            for (j, a) in a.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, _mm512_set1_ps(*w.add(j * ldw + kk)), *a);
            }
        }
        let mut t = [0f32; PANEL];
        for (j, a) in a.iter().enumerate() {
            _mm512_storeu_ps(t.as_mut_ptr(), *a);
            for (i, &v) in t.iter().enumerate().take(rows) {
                *y.add(i * ldy + j) = v;
            }
        }
    }
}
