//! AVX-512F row kernels for [`super::cpu`]: same contract and summation structure as `cpu_avx2`, with
//! 16-lane vectors (one 512-bit vector per 16 quants).
//!
//! Q4 converts nibbles with a 16-entry table lookup (`vpermps` uses only the low 4 bits of each index lane,
//! so the table maps nibble → f32 with no mask and no int→float conversion).

use std::arch::x86_64::*;

use super::cpu_avx2::{PREFETCH_BYTES, prefetch};

#[inline(always)]
unsafe fn ld(p: *const f32) -> __m512 {
    unsafe { _mm512_loadu_ps(p) }
}

/// 16 signed bytes at `p` as 16 f32.
#[inline(always)]
unsafe fn i8x16(p: *const u8) -> __m512 {
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
}

#[inline(always)]
unsafe fn q8_block<const R: usize, const BLOCK: usize>(
    x: *const f32,
    ldx: usize,
    q: *const u8,
    scale: *const f32,
    acc: &mut [__m512; R],
) {
    unsafe {
        let sc = _mm512_set1_ps(*scale);
        if BLOCK == 32 {
            let w0 = i8x16(q);
            let w1 = i8x16(q.add(16));
            for (r, a) in acc.iter_mut().enumerate() {
                let xp = x.add(r * ldx);
                let t = _mm512_mul_ps(w0, ld(xp));
                let t = _mm512_fmadd_ps(w1, ld(xp.add(16)), t);
                *a = _mm512_fmadd_ps(sc, t, *a);
            }
        } else {
            let w0 = i8x16(q);
            for (r, a) in acc.iter_mut().enumerate() {
                let t = _mm512_mul_ps(w0, ld(x.add(r * ldx)));
                *a = _mm512_fmadd_ps(sc, t, *a);
            }
        }
    }
}

/// Q8 rows, block `BLOCK` (16 or 32); arguments as `cpu_avx2::q8_rows`. R = 1 alternates two accumulator
/// sets (four for block 16, where a block is only three vector ops) to hide the FMA latency of the
/// loop-carried `acc = fma(scale, t, acc)`.
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
) {
    let nb = k / BLOCK;
    let ahead = (PREFETCH_BYTES / (k + 4 * nb)).max(1);
    unsafe {
        for n in 0..rows {
            let qr = q.add(n * k);
            let sr = s.add(n * nb);
            prefetch(qr.wrapping_add(ahead * k), k);
            prefetch(sr.wrapping_add(ahead * nb).cast(), 4 * nb);
            let mut acc = [[_mm512_setzero_ps(); R]; 4];
            let mut b = 0;
            if R == 1 {
                while b + 4 <= nb {
                    for (u, a) in acc.iter_mut().enumerate() {
                        let bb = b + u;
                        q8_block::<R, BLOCK>(
                            x.add(bb * BLOCK),
                            ldx,
                            qr.add(bb * BLOCK),
                            sr.add(bb),
                            a,
                        );
                    }
                    b += 4;
                }
            }
            while b < nb {
                q8_block::<R, BLOCK>(
                    x.add(b * BLOCK),
                    ldx,
                    qr.add(b * BLOCK),
                    sr.add(b),
                    &mut acc[0],
                );
                b += 1;
            }
            let [a0, a1, a2, a3] = acc;
            for r in 0..R {
                let v = _mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r]));
                *y.add(r * ldy + n) = _mm512_reduce_add_ps(v);
            }
        }
    }
}

/// One Q4 block: byte j (= q_j + 16·q_{j+16}) widened to lane j; `tlo[lane & 15]` is q_j and
/// `thi[(lane >> 4) & 15]` is 16·q_{j+16}, the ×16 cancelled by the prepared activations as in AVX2.
#[inline(always)]
unsafe fn q4_block<const R: usize>(
    x: *const f32,
    ldx: usize,
    q: *const u8,
    scale: *const f32,
    acc: &mut [__m512; R],
    tlo: __m512,
    thi: __m512,
) {
    unsafe {
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.cast()));
        let w0 = _mm512_permutexvar_ps(v, tlo);
        let w1 = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), thi);
        let sc = _mm512_set1_ps(*scale);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.add(r * ldx);
            let t = _mm512_mul_ps(w0, ld(xp));
            let t = _mm512_fmadd_ps(w1, ld(xp.add(16)), t);
            *a = _mm512_fmadd_ps(sc, t, *a);
        }
    }
}

/// Q4 rows; arguments as `cpu_avx2::q4_rows`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn q4_rows<const R: usize>(
    x: *const f32,
    ldx: usize,
    sx: *const f32,
    ldsx: usize,
    k: usize,
    q: *const u8,
    s: *const f32,
    mn: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
) {
    let nb = k / 32;
    let ahead = (PREFETCH_BYTES / (k / 2 + 8 * nb)).max(1);
    let tlo = _mm512_setr_ps(
        0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
    );
    let thi = _mm512_mul_ps(tlo, _mm512_set1_ps(16.0));
    unsafe {
        for n in 0..rows {
            let qr = q.add(n * (k / 2));
            let sr = s.add(n * nb);
            let mr = mn.add(n * nb);
            prefetch(qr.wrapping_add(ahead * k / 2), k / 2);
            prefetch(sr.wrapping_add(ahead * nb).cast(), 4 * nb);
            prefetch(mr.wrapping_add(ahead * nb).cast(), 4 * nb);
            let mut acc0 = [_mm512_setzero_ps(); R];
            let mut acc1 = [_mm512_setzero_ps(); R];
            let mut b = 0;
            if R == 1 {
                while b + 2 <= nb {
                    q4_block(
                        x.add(b * 32),
                        ldx,
                        qr.add(b * 16),
                        sr.add(b),
                        &mut acc0,
                        tlo,
                        thi,
                    );
                    q4_block(
                        x.add(b * 32 + 32),
                        ldx,
                        qr.add(b * 16 + 16),
                        sr.add(b + 1),
                        &mut acc1,
                        tlo,
                        thi,
                    );
                    b += 2;
                }
            }
            while b < nb {
                q4_block(
                    x.add(b * 32),
                    ldx,
                    qr.add(b * 16),
                    sr.add(b),
                    &mut acc0,
                    tlo,
                    thi,
                );
                b += 1;
            }
            for r in 0..R {
                // Min term: Σ_b mins[b]·sx[b], 16 blocks at a time, the tail masked (nothing past a row is read).
                let sxr = sx.add(r * ldsx);
                let mut m = _mm512_setzero_ps();
                let mut c = 0;
                while c + 16 <= nb {
                    m = _mm512_fmadd_ps(ld(mr.add(c)), ld(sxr.add(c)), m);
                    c += 16;
                }
                if c < nb {
                    let mask: __mmask16 = (1u16 << (nb - c)) - 1;
                    let a = _mm512_maskz_loadu_ps(mask, mr.add(c));
                    let b2 = _mm512_maskz_loadu_ps(mask, sxr.add(c));
                    m = _mm512_fmadd_ps(a, b2, m);
                }
                *y.add(r * ldy + n) =
                    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), m));
            }
        }
    }
}
