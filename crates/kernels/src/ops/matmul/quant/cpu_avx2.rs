//! AVX2 + FMA row kernels for [`super::cpu`]: f32 FMAs on quants widened straight from memory.
//!
//! Every function here is `unsafe` for two reasons: it must only run on a CPU with AVX2 and FMA (the
//! caller checks once, see `CpuIsa::detected`), and it walks raw pointers whose extents the safe entry
//! points in `cpu.rs` have validated. The contract shared by all kernels:
//!
//! * `x` points at `R` activation rows of `k` floats, `ldx` floats apart;
//! * the weight pointers point at the first of `rows` consecutive weight rows;
//! * `y` points at output (row 0, column 0) of the tile; output (r, j) is `y[r * ldy + j]`, j < `rows`.
//!
//! Summation order (per output): each 8-lane vector accumulates `scale_b * Σ_{4 or 2 vectors} q·x` over
//! blocks, then the lanes are added. That differs from a sequential dot only by f32 rounding. One row
//! alone splits the blocks between two accumulators (even and odd blocks); with `alone`, every row of a
//! multi-row pass does the same, so batched rows equal single-row calls bit for bit while the weights
//! are still unpacked once per pass.

use std::arch::x86_64::*;

/// Sum of the 8 lanes.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// 8 signed bytes at `p` widened to 8 f32 (`vpmovsxbd ymm, m64` + `vcvtdq2ps`; every i8 is exact in f32).
#[inline(always)]
unsafe fn i8x8(p: *const u8) -> __m256 {
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
}

/// 8 unsigned bytes at `p` widened to 8 i32 lanes (`vpmovzxbd ymm, m64`).
#[inline(always)]
unsafe fn u8x8(p: *const u8) -> __m256i {
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
}

/// Prefetch distance, in weight bytes. Batch-1 decode streams every weight once: the hardware
/// prefetchers follow the streams, but not far enough ahead to overlap DRAM latency with the FMAs, so each
/// row asks for the row about this many bytes ahead — within the tile only: a prefetch never faults, but
/// one into an unmapped page past the matrix costs a page walk (measured: +20% on a cache-hot 128×2048
/// call when the last row prefetched past the end).
///
/// Measured on SmolLM2 decode steps, one thread: without prefetch 6.1 GB/s on a Xeon (whose plain
/// streaming read does 10.5 GB/s per thread), with 2-8 KiB ahead 9.8-11 GB/s, 16 KiB no better; on the
/// 2-core EPYC (best of 40 steps, noisy) 13.6 GB/s without, 15.5-15.6 with 2-4 KiB, 14.1 with 8 KiB.
pub(super) const PREFETCH_BYTES: usize = 4096;

/// Prefetches the cache lines of `len` bytes at `p`.
#[inline(always)]
pub(super) unsafe fn prefetch(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len {
        // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o).cast()) };
        o += 64;
    }
}

#[inline(always)]
unsafe fn ld(p: *const f32) -> __m256 {
    unsafe { _mm256_loadu_ps(p) }
}

/// One Q8 block of 32 for `R` activation rows: acc[r] += scale · Σ q·x (lane-wise).
#[inline(always)]
unsafe fn q8_block32<const R: usize>(
    x: *const f32,
    ldx: usize,
    q: *const u8,
    scale: *const f32,
    acc: &mut [__m256; R],
) {
    unsafe {
        let w0 = i8x8(q);
        let w1 = i8x8(q.add(8));
        let w2 = i8x8(q.add(16));
        let w3 = i8x8(q.add(24));
        let sc = _mm256_broadcast_ss(&*scale);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.add(r * ldx);
            let mut t = _mm256_mul_ps(w0, ld(xp));
            t = _mm256_fmadd_ps(w1, ld(xp.add(8)), t);
            t = _mm256_fmadd_ps(w2, ld(xp.add(16)), t);
            t = _mm256_fmadd_ps(w3, ld(xp.add(24)), t);
            *a = _mm256_fmadd_ps(sc, t, *a);
        }
    }
}

/// One Q8 block of 16 for `R` activation rows.
#[inline(always)]
unsafe fn q8_block16<const R: usize>(
    x: *const f32,
    ldx: usize,
    q: *const u8,
    scale: *const f32,
    acc: &mut [__m256; R],
) {
    unsafe {
        let w0 = i8x8(q);
        let w1 = i8x8(q.add(8));
        let sc = _mm256_broadcast_ss(&*scale);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.add(r * ldx);
            let t = _mm256_mul_ps(w0, ld(xp));
            let t = _mm256_fmadd_ps(w1, ld(xp.add(8)), t);
            *a = _mm256_fmadd_ps(sc, t, *a);
        }
    }
}

#[inline(always)]
unsafe fn q8_block<const R: usize, const BLOCK: usize>(
    x: *const f32,
    ldx: usize,
    q: *const u8,
    scale: *const f32,
    acc: &mut [__m256; R],
) {
    unsafe {
        if BLOCK == 32 {
            q8_block32::<R>(x, ldx, q, scale, acc)
        } else {
            q8_block16::<R>(x, ldx, q, scale, acc)
        }
    }
}

/// Q8 rows, block `BLOCK` (16 or 32): `q` is the tile's quants as bytes (row stride `k`), `s` its scales
/// (row stride `k / BLOCK`).
///
/// With one activation row the per-block `acc = fma(scale, t, acc)` is a loop-carried chain with FMA
/// latency (4 cycles on Zen 4, about the cost of a whole block), so R = 1 alternates two accumulator sets;
/// with R ≥ 2 the rows already give independent chains and the second set would only spill registers.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
            let mut acc0 = [_mm256_setzero_ps(); R];
            let mut acc1 = [_mm256_setzero_ps(); R];
            let mut b = 0;
            // One row alternates two accumulators over the blocks (more FMAs in flight); with `alone`,
            // every row of a pass does, so each comes out bit for bit as in a call of its own.
            if R == 1 || alone {
                while b + 2 <= nb {
                    q8_block::<R, BLOCK>(
                        x.add(b * BLOCK),
                        ldx,
                        qr.add(b * BLOCK),
                        sr.add(b),
                        &mut acc0,
                    );
                    q8_block::<R, BLOCK>(
                        x.add((b + 1) * BLOCK),
                        ldx,
                        qr.add((b + 1) * BLOCK),
                        sr.add(b + 1),
                        &mut acc1,
                    );
                    b += 2;
                }
            }
            while b < nb {
                q8_block::<R, BLOCK>(
                    x.add(b * BLOCK),
                    ldx,
                    qr.add(b * BLOCK),
                    sr.add(b),
                    &mut acc0,
                );
                b += 1;
            }
            for r in 0..R {
                *y.add(r * ldy + n) = hsum(_mm256_add_ps(acc0[r], acc1[r]));
            }
        }
    }
}

/// One Q4 block for `R` rows of *prepared* activations (high half of each block pre-scaled by 1/16).
///
/// `vpmovzxbd` puts byte j of the block (= q_j + 16·q_{j+16}) in a 32-bit lane; `& 0x0F` gives q_j and
/// `& 0xF0` gives 16·q_{j+16} without a shift. The factor 16 is cancelled by the 1/16 folded into
/// x_{j+16} when the activations were prepared: (16·q)·(x/16) = q·x exactly, powers of two being exact
/// (short of x/16 going subnormal, i.e. |x| < 2^-122).
#[inline(always)]
unsafe fn q4_block<const R: usize>(
    x: *const f32,
    ldx: usize,
    q: *const u8,
    scale: *const f32,
    acc: &mut [__m256; R],
    lo: __m256i,
    hi: __m256i,
) {
    unsafe {
        let v0 = u8x8(q);
        let v1 = u8x8(q.add(8));
        let w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, lo));
        let w1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, lo));
        let w2 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, hi));
        let w3 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, hi));
        let sc = _mm256_broadcast_ss(&*scale);
        for (r, a) in acc.iter_mut().enumerate() {
            let xp = x.add(r * ldx);
            let mut t = _mm256_mul_ps(w0, ld(xp));
            t = _mm256_fmadd_ps(w1, ld(xp.add(8)), t);
            t = _mm256_fmadd_ps(w2, ld(xp.add(16)), t);
            t = _mm256_fmadd_ps(w3, ld(xp.add(24)), t);
            *a = _mm256_fmadd_ps(sc, t, *a);
        }
    }
}

/// Σ_b mins[b]·sx[b] over `nb` blocks, 8 at a time; the tail uses a masked load so nothing past either
/// row is touched.
#[inline(always)]
unsafe fn min_dot(mins: *const f32, sx: *const f32, nb: usize) -> __m256 {
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let mut b = 0;
        while b + 8 <= nb {
            acc = _mm256_fmadd_ps(ld(mins.add(b)), ld(sx.add(b)), acc);
            b += 8;
        }
        if b < nb {
            let rem = (nb - b) as i32;
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(rem),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            let m = _mm256_maskload_ps(mins.add(b), mask);
            let s = _mm256_maskload_ps(sx.add(b), mask);
            acc = _mm256_fmadd_ps(m, s, acc);
        }
        acc
    }
}

/// Q4 rows: `q` the tile's quants as bytes (row stride `k / 2`), `s` / `mn` its scales and mins (row stride
/// `k / 32`), `x` prepared activations and `sx` their per-block sums (`R` rows, `ldsx` apart).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
    alone: bool,
) {
    let nb = k / 32;
    let ahead = (PREFETCH_BYTES / (k / 2 + 8 * nb)).max(1);
    let lo = _mm256_set1_epi32(0x0f);
    let hi = _mm256_set1_epi32(0xf0);
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
            let mut acc0 = [_mm256_setzero_ps(); R];
            let mut acc1 = [_mm256_setzero_ps(); R];
            let mut b = 0;
            // One row alternates two accumulators over the blocks (more FMAs in flight); with `alone`,
            // every row of a pass does, so each comes out bit for bit as in a call of its own.
            if R == 1 || alone {
                while b + 2 <= nb {
                    q4_block(
                        x.add(b * 32),
                        ldx,
                        qr.add(b * 16),
                        sr.add(b),
                        &mut acc0,
                        lo,
                        hi,
                    );
                    q4_block(
                        x.add(b * 32 + 32),
                        ldx,
                        qr.add(b * 16 + 16),
                        sr.add(b + 1),
                        &mut acc1,
                        lo,
                        hi,
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
                    lo,
                    hi,
                );
                b += 1;
            }
            for r in 0..R {
                let m = min_dot(mr, sx.add(r * ldsx), nb);
                *y.add(r * ldy + n) = hsum(_mm256_add_ps(_mm256_add_ps(acc0[r], acc1[r]), m));
            }
        }
    }
}
