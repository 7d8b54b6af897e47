//! `exp` and `tanh` for the CPU twins in plain f32 arithmetic with no branches and no calls, so a
//! loop over them vectorises (libm's `expf`/`tanhf` are one scalar call per element, which made
//! GELU the second-largest cost of a CPU training step after the GEMMs).
//!
//! Accuracy (tested against f64 below): `exp` within 3 ulp wherever the result is a normal f32,
//! exactly 0 below −87.3 (where f32 turns subnormal) and clamped at e^88 above; `tanh` within
//! 3e-7 absolute everywhere — below f32's spacing near ±1 — and ±1 past |u| = 9.

const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding and subtracting 1.5 · 2²³ rounds an f32 of magnitude below 2²² to the nearest integer
/// (SSE2 has no round instruction; this is two adds).
const ROUND: f32 = 12_582_912.0;

/// e^x.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(-87.3, 88.0);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let k = t - ROUND;
    // Cody–Waite: r = x − k·ln 2 in two parts, |r| ≤ ln2/2 + rounding.
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    // e^r by its Taylor series to r⁷/7! (truncation below 6e-9 relative for |r| ≤ 0.35).
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^k from t's bits: they hold 0x4B40_0000 + k, and 0x4B40_0000 << 23 wraps to 0, so the
    // exponent field is k + 127 (within 1..=254 after the clamp). No float-to-int conversion,
    // whose saturating semantics would keep the loop scalar.
    let scale = f32::from_bits(t.to_bits().wrapping_add(127) << 23);
    // NaN compares false, so a NaN argument stays NaN through the product below.
    if x < -87.3 { 0.0 } else { p * scale }
}

/// tanh(u).
#[inline(always)]
pub fn tanh(u: f32) -> f32 {
    let e = exp(2.0 * u.clamp(-9.0, 9.0));
    (e - 1.0) / (e + 1.0)
}

/// Applies `f` to every element of `out` (with the element of `a` at the same index), in chunks
/// compiled for AVX2 + FMA where the CPU has them (twice the lanes of the baseline build). The
/// results are the same either way: no operation here is contracted into an FMA.
#[inline(always)]
pub fn map1(out: &mut [f32], a: &[f32], f: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { map1_avx2(out, a, &f) };
        return;
    }
    map1_plain(out, a, &f)
}

/// [`map1`] with two inputs.
#[inline(always)]
pub fn map2(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as in `map1`.
        unsafe { map2_avx2(out, a, b, &f) };
        return;
    }
    map2_plain(out, a, b, &f)
}

/// Σ x in eight lanes (vectorises; the order differs from a left-to-right sum).
#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    sum_by(x, |v| v)
}

/// Σ f(x) in eight lanes, as [`sum`] adds.
#[inline(always)]
pub fn sum_by(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            acc[j] += f(c[j]);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f32>() + tail
}

/// Σ a·b in eight lanes.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    for (ca, cb) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += ca[j] * cb[j];
        }
    }
    let tail: f32 = (n / 8 * 8..n).map(|i| a[i] * b[i]).sum();
    acc.iter().sum::<f32>() + tail
}

/// max x in eight lanes (f32::MIN for an empty slice; NaN is skipped as by `f32::max`).
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::MIN; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            acc[j] = acc[j].max(c[j]);
        }
    }
    let tail = chunks.remainder().iter().fold(f32::MIN, |m, &v| m.max(v));
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// Runs `f` (which should be `#[inline(always)]` code over slices) inside a function compiled for
/// AVX2 + FMA where the CPU has them. Only if LLVM inlines the closure there does its body get the
/// wider instructions (a large closure can stay a call, and then runs at the baseline width, still
/// vectorised): the `map*` helpers below therefore keep a target-feature function of their own that
/// calls an `#[inline(always)]` loop, which is always inlined.
#[inline(always)]
pub fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { wide_avx2(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn wide_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// [`map1`] where `f` also takes the element's index, counted from `base`.
#[inline(always)]
pub fn map1i(out: &mut [f32], a: &[f32], base: u32, f: impl Fn(u32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as in `map1`.
        unsafe { map1i_avx2(out, a, base, &f) };
        return;
    }
    map1i_plain(out, a, base, &f)
}

/// [`map1i`] in place: x[i] = f(base + i, x[i]).
#[inline(always)]
pub fn apply1i(x: &mut [f32], base: u32, f: impl Fn(u32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as in `map1`.
        unsafe { apply1i_avx2(x, base, &f) };
        return;
    }
    apply1i_plain(x, base, &f)
}

/// [`map2`] where `f` also takes the element's index, counted from `base`.
#[inline(always)]
pub fn map2i(out: &mut [f32], a: &[f32], b: &[f32], base: u32, f: impl Fn(u32, f32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as in `map1`.
        unsafe { map2i_avx2(out, a, b, base, &f) };
        return;
    }
    map2i_plain(out, a, b, base, &f)
}

#[inline(always)]
fn map1i_plain(out: &mut [f32], a: &[f32], base: u32, f: &impl Fn(u32, f32) -> f32) {
    for (i, (o, &x)) in out.iter_mut().zip(a).enumerate() {
        *o = f(base.wrapping_add(i as u32), x);
    }
}

#[inline(always)]
fn apply1i_plain(x: &mut [f32], base: u32, f: &impl Fn(u32, f32) -> f32) {
    for (i, v) in x.iter_mut().enumerate() {
        *v = f(base.wrapping_add(i as u32), *v);
    }
}

#[inline(always)]
fn map2i_plain(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    base: u32,
    f: &impl Fn(u32, f32, f32) -> f32,
) {
    for (i, ((o, &x), &y)) in out.iter_mut().zip(a).zip(b).enumerate() {
        *o = f(base.wrapping_add(i as u32), x, y);
    }
}

#[inline(always)]
fn map1_plain(out: &mut [f32], a: &[f32], f: &impl Fn(f32) -> f32) {
    for (o, &x) in out.iter_mut().zip(a) {
        *o = f(x);
    }
}

#[inline(always)]
fn map2_plain(out: &mut [f32], a: &[f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn map1_avx2(out: &mut [f32], a: &[f32], f: &impl Fn(f32) -> f32) {
    map1_plain(out, a, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn map2_avx2(out: &mut [f32], a: &[f32], b: &[f32], f: &impl Fn(f32, f32) -> f32) {
    map2_plain(out, a, b, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn map1i_avx2(out: &mut [f32], a: &[f32], base: u32, f: &impl Fn(u32, f32) -> f32) {
    map1i_plain(out, a, base, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn apply1i_avx2(x: &mut [f32], base: u32, f: &impl Fn(u32, f32) -> f32) {
    apply1i_plain(x, base, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn map2i_avx2(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    base: u32,
    f: &impl Fn(u32, f32, f32) -> f32,
) {
    map2i_plain(out, a, b, base, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_three_ulp_of_f64_over_the_normal_range() {
        let mut worst = 0;
        let mut x = -87.3f32;
        while x < 88.0 {
            let want = (x as f64).exp() as f32;
            worst = worst.max(ulps(exp(x), want));
            x += 0.000_37;
        }
        assert!(worst <= 3, "worst {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(100.0).is_finite());
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_is_within_3e_7_of_f64_everywhere() {
        let mut worst = 0.0f64;
        let mut u = -20.0f32;
        while u < 20.0 {
            worst = worst.max((tanh(u) as f64 - (u as f64).tanh()).abs());
            u += 0.000_13;
        }
        assert!(worst <= 3e-7, "worst {worst:e}");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(30.0), 1.0);
        assert_eq!(tanh(-30.0), -1.0);
    }

    #[test]
    fn the_avx2_build_gives_the_plain_build_s_bits() {
        let a: Vec<f32> = (0..4099).map(|i| (i as f32 - 2000.0) * 0.013).collect();
        let b: Vec<f32> = a.iter().map(|x| x * 0.5 - 1.0).collect();
        let f = |x: f32, y: f32| tanh(x) * y + exp(-x.abs());
        let (mut fast, mut plain) = (vec![0.0; a.len()], vec![0.0; a.len()]);
        map2(&mut fast, &a, &b, f);
        map2_plain(&mut plain, &a, &b, &f);
        assert_eq!(fast, plain);
        map1(&mut fast, &a, tanh);
        map1_plain(&mut plain, &a, &tanh);
        assert_eq!(fast, plain);
        let g = |i: u32, x: f32, y: f32| if i.is_multiple_of(3) { x } else { exp(y) };
        map2i(&mut fast, &a, &b, 7, g);
        map2i_plain(&mut plain, &a, &b, 7, &g);
        assert_eq!(fast, plain);
        map1i(&mut fast, &a, 7, |i, x| x * i as f32);
        map1i_plain(&mut plain, &a, 7, &|i, x| x * i as f32);
        assert_eq!(fast, plain);
    }
}
