//! The AVX-512 VNNI kernel of [`super::cpu_int`] (layouts and numerics there): per record, the 16 rows'
//! quants are loaded (and, for Q4, split into low and high nibbles) once and serve every activation row
//! of the pass; each row then takes one `vpdpbusd` per four values and byte half, and three float
//! operations per block.

use std::arch::x86_64::*;

use super::QKind;
use super::cpu::OutPtr;
use super::cpu_int::{ActPtrs, Acts, GROUP, IntMatrix};

/// Most activation rows one pass over a group's records serves (their accumulators stay in registers).
const ROWS: usize = 8;
/// Weight bytes of the groups one pass of row chunks goes over while they sit in L2.
const L2_BYTES: usize = 192 * 1024;

/// Output columns n0..n1 (n0 a multiple of 16; y at column n0, rows `ldy` apart), every activation row.
///
/// # Safety
/// AVX-512 F, BW and VNNI available; `a` prepared from m rows of `w.cols()`; y covers m rows of the
/// columns n0..n1 with n1 ≤ w.rows().
pub(super) unsafe fn tile(
    a: &Acts,
    w: &IntMatrix,
    m: usize,
    n0: usize,
    n1: usize,
    y: OutPtr,
    ldy: usize,
) {
    let p = a.ptrs();
    let (g0, g1) = (n0 / GROUP, n1.div_ceil(GROUP));
    let per_group = w.bytes() as usize / w.rows().div_ceil(GROUP);
    // Groups per L2 sub-tile: all row chunks pass over them before the next.
    let sub = if m <= ROWS {
        g1 - g0
    } else {
        (L2_BYTES / per_group.max(1)).max(1)
    };
    let mut s0 = g0;
    while s0 < g1 {
        let s1 = (s0 + sub).min(g1);
        let mut i = 0;
        while i < m {
            let r = m - i;
            let r = if r >= 8 {
                8
            } else if r >= 4 {
                4
            } else if r >= 2 {
                2
            } else {
                1
            };
            for g in s0..s1 {
                let valid = (n1 - g * GROUP).min(GROUP);
                let yg = y.at(i * ldy + g * GROUP - n0);
                // SAFETY: as the caller's contract; group g < ceil(rows / 16) has its records.
                unsafe {
                    match r {
                        8 => group::<8>(&p, w, i, g, yg, ldy, valid),
                        4 => group::<4>(&p, w, i, g, yg, ldy, valid),
                        2 => group::<2>(&p, w, i, g, yg, ldy, valid),
                        _ => group::<1>(&p, w, i, g, yg, ldy, valid),
                    }
                }
            }
            i += r;
        }
        s0 = s1;
    }
}

/// Activation rows i0..i0 + R against the 16 weight rows of group g; `valid` of the 16 outputs exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group<const R: usize>(
    a: &ActPtrs,
    w: &IntMatrix,
    i0: usize,
    g: usize,
    y: OutPtr,
    ldy: usize,
    valid: usize,
) {
    let k = w.cols();
    let rec = w.group_ptr(g);
    let acc = unsafe {
        match w.kind() {
            QKind::Q4 => q4::<R>(a, rec, k, i0),
            QKind::Q8 { block: 32 } => q8::<R, 32>(a, rec, k, i0),
            QKind::Q8 { .. } => q8::<R, 16>(a, rec, k, i0),
        }
    };
    let mask: __mmask16 = if valid >= 16 {
        0xffff
    } else {
        (1u16 << valid) - 1
    };
    for (r, v) in acc.iter().enumerate() {
        // SAFETY: row i0 + r's `valid` outputs of this group lie inside y.
        unsafe { _mm512_mask_storeu_ps(y.at(r * ldy).0, mask, *v) };
    }
}

/// Prepares one row block of 32 activations (the SIMD twin of `Acts::prepare`'s loop body, same bits):
/// writes xh and xl (32 bytes each) and returns (sx, Σx, [Σxi of each half]).
///
/// # Safety
/// AVX-512 F, BW available; `x` holds 32 values, `xh` and `xl` 32 bytes each.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn prepare_block(
    x: *const f32,
    xh: *mut i8,
    xl: *mut i8,
    top: f32,
    eight_bit: bool,
) -> (f32, f32, [i32; 2]) {
    unsafe {
        let v = [_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16))];
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[0], v[1]) != 0;
        let (sx, inv) = super::cpu_int::block_scale(amax, nan, top);
        let inv = _mm512_set1_ps(inv);
        let mut half = [0i32; 2];
        for (h, v) in v.iter().enumerate() {
            // Round to nearest, ties to even (the default MXCSR mode), as `round_ties_even` in the twin.
            let mut xi = _mm512_cvtps_epi32(_mm512_mul_ps(*v, inv));
            let t = _mm512_set1_epi32(top as i32);
            xi = _mm512_max_epi32(
                _mm512_min_epi32(xi, t),
                _mm512_sub_epi32(_mm512_setzero_si512(), t),
            );
            if eight_bit {
                xi = _mm512_slli_epi32::<7>(xi);
            }
            half[h] = _mm512_reduce_add_epi32(xi);
            let hi = _mm512_srai_epi32::<7>(xi);
            let lo = _mm512_and_si512(xi, _mm512_set1_epi32(127));
            _mm_storeu_si128(xh.add(16 * h).cast(), _mm512_cvtepi32_epi8(hi));
            _mm_storeu_si128(xl.add(16 * h).cast(), _mm512_cvtepi32_epi8(lo));
        }
        // Σx in the twin's order: the halves lane by lane, then halving trees of 8, 4, 2, 1.
        let s = _mm512_add_ps(v[0], v[1]);
        let s8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps::<1>(s));
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        (sx, _mm_cvtss_f32(s1), half)
    }
}

/// The four activation bytes at `p` (index i of the i32 words there) broadcast to every lane.
#[inline(always)]
unsafe fn bcast(p: *const i8, i: usize) -> __m512i {
    unsafe { _mm512_set1_epi32(p.cast::<i32>().add(i).read_unaligned()) }
}

#[inline(always)]
unsafe fn load_line(p: *const u8, line: usize) -> __m512i {
    unsafe { _mm512_load_si512(p.add(64 * line).cast()) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn q4<const R: usize>(a: &ActPtrs, rec: *const u8, k: usize, i0: usize) -> [__m512; R] {
    const REC: usize = 384;
    let nb = k / 32;
    unsafe {
        let nib = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let p = rec.add(b * REC);
            let v: [__m512i; 4] = std::array::from_fn(|t| load_line(p, t));
            let lo: [__m512i; 4] = std::array::from_fn(|t| _mm512_and_si512(v[t], nib));
            let hi: [__m512i; 4] =
                std::array::from_fn(|t| _mm512_and_si512(_mm512_srli_epi16::<4>(v[t]), nib));
            let d = _mm512_load_ps(p.add(256).cast());
            let mn = _mm512_load_ps(p.add(320).cast());
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = (i0 + r) * k + b * 32;
                let (xh, xl) = (a.xh.add(row), a.xl.add(row));
                let z = _mm512_setzero_si512();
                let (mut h0, mut h1, mut l0, mut l1) = (z, z, z, z);
                for t in 0..4 {
                    h0 = _mm512_dpbusd_epi32(h0, lo[t], bcast(xh, t));
                    h1 = _mm512_dpbusd_epi32(h1, hi[t], bcast(xh, 4 + t));
                    l0 = _mm512_dpbusd_epi32(l0, lo[t], bcast(xl, t));
                    l1 = _mm512_dpbusd_epi32(l1, hi[t], bcast(xl, 4 + t));
                }
                let h = _mm512_add_epi32(h0, h1);
                let dot = _mm512_add_epi32(_mm512_slli_epi32::<7>(h), _mm512_add_epi32(l0, l1));
                let ab = row / 32;
                let s = _mm512_mul_ps(d, _mm512_set1_ps(*a.sx.add(ab)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *acc);
                *acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(*a.sumx.add(ab)), *acc);
            }
        }
        acc
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn q8<const R: usize, const B: usize>(
    a: &ActPtrs,
    rec: *const u8,
    k: usize,
    i0: usize,
) -> [__m512; R] {
    let rec_bytes = 16 * B + 64;
    let nb = k / B;
    unsafe {
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let p = rec.add(b * rec_bytes);
            // B / 4 lines of quants (8 or 4): a fixed-size array keeps them in registers.
            let mut q = [_mm512_setzero_si512(); 8];
            for (t, q) in q.iter_mut().enumerate().take(B / 4) {
                *q = load_line(p, t);
            }
            let d = _mm512_load_ps(p.add(16 * B).cast());
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = (i0 + r) * k + b * B;
                let (xh, xl) = (a.xh.add(row), a.xl.add(row));
                let z = _mm512_setzero_si512();
                let (mut h0, mut h1, mut l0, mut l1) = (z, z, z, z);
                for t in (0..B / 4).step_by(2) {
                    h0 = _mm512_dpbusd_epi32(h0, q[t], bcast(xh, t));
                    h1 = _mm512_dpbusd_epi32(h1, q[t + 1], bcast(xh, t + 1));
                    l0 = _mm512_dpbusd_epi32(l0, q[t], bcast(xl, t));
                    l1 = _mm512_dpbusd_epi32(l1, q[t + 1], bcast(xl, t + 1));
                }
                let corr = if B == 32 {
                    *a.corr16.add(row / 16) + *a.corr16.add(row / 16 + 1)
                } else {
                    *a.corr16.add(row / 16)
                };
                let h = _mm512_add_epi32(h0, h1);
                let dot = _mm512_sub_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32::<7>(h), _mm512_add_epi32(l0, l1)),
                    _mm512_set1_epi32(corr),
                );
                let s = _mm512_mul_ps(d, _mm512_set1_ps(*a.sx.add(row / 32)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *acc);
            }
        }
        acc
    }
}
