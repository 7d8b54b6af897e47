//! Q4_K: a 256-value super-block of unsigned 4-bit quants in eight sub-blocks of 32, each with a 6-bit
//! scale and a 6-bit min, themselves scaled by the f16 super-block `d` and `dmin`.
//!
//! Defined by `block_q4_K` in ggml's `ggml-common.h`; reference code `dequantize_row_q4_K`,
//! `get_scale_min_k4` and `quantize_row_q4_K_ref` (with `make_qkx2_quants`) in `ggml-quants.c`.
//!
//! ```text
//!   offset  0      2      4                  16                                  144
//!           +------+------+------------------+-----------------------------------+
//!           | d    | dmin | scales[12]       | qs[128]                           |
//!           | f16  | f16  | 8 x (6-bit sc,   | u8: two 4-bit quants each         |
//!           |      |      |      6-bit m)    |                                   |
//!           +------+------+------------------+-----------------------------------+
//!
//!   scales, for sub-block i = 0..8 (bytes b0..b11):
//!     i < 4:  sc = b[i] & 63                      m = b[i + 4] & 63
//!     i >= 4: sc = b[i + 4] & 15 | (b[i - 4] >> 6) << 4
//!             m  = b[i + 4] >> 4 | (b[i]     >> 6) << 4
//!
//!   qs, in four chunks of 32 bytes; chunk c holds sub-blocks 2c and 2c + 1:
//!     qs[32c + l] = q[64c + l] | q[64c + 32 + l] << 4          (l = 0..32)
//!
//!   value[32i + l] = (d * sc_i) * q - (dmin * m_i)
//! ```
//!
//! Note the nibble order differs from Q4_0's: a sub-block's 32 quants are the low (or high) nibbles of
//! 32 consecutive bytes, whereas Q4_0 (and Q4Matrix) put values j and j + 16 in one byte.
//!
//! Kernel layout: `Q4Matrix` with, per sub-block, scale `d * sc` and offset `-(dmin * m)` (both computed
//! as ggml computes them), quants re-paired into Q4Matrix's nibble order. The kernel's
//! `scale * q + offset` equals ggml's `scale * q - dmin*m` exactly: IEEE defines `a - b` as `a + (-b)`.

use super::{Block, RepackQ4, f16_to_f32, f32_to_f16, nearest_int, push_q4_block};
use crate::ggml_type::{GgmlType, QK_K};

pub const K_SCALE_SIZE: usize = 12;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale for the sub-block scales, f16 little-endian.
    pub d: [u8; 2],
    /// Super-block scale for the sub-block mins, f16 little-endian.
    pub dmin: [u8; 2],
    /// Eight 6-bit scales and eight 6-bit mins, packed (see the module docs).
    pub scales: [u8; K_SCALE_SIZE],
    /// Quants: chunk c of 32 bytes holds sub-block 2c in low nibbles, 2c + 1 in high nibbles.
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(size_of::<BlockQ4K>() == 144);
const _: () = assert!(align_of::<BlockQ4K>() == 1);

/// Unpacks the 6-bit scale and min of sub-block `i` (ggml's `get_scale_min_k4`).
#[inline]
pub fn scale_min_k4(i: usize, b: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if i < 4 {
        (b[i] & 63, b[i + 4] & 63)
    } else {
        (
            (b[i + 4] & 0x0f) | ((b[i - 4] >> 6) << 4),
            (b[i + 4] >> 4) | ((b[i] >> 6) << 4),
        )
    }
}

/// Packs eight 6-bit scales and mins (each 0..=63) into the 12-byte layout `scale_min_k4` reads.
pub fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut b = [0u8; K_SCALE_SIZE];
    for i in 0..8 {
        let (s, mm) = (sc[i] & 63, m[i] & 63);
        if i < 4 {
            b[i] |= s;
            b[i + 4] |= mm;
        } else {
            b[i + 4] = (s & 0x0f) | ((mm & 0x0f) << 4);
            b[i - 4] |= (s >> 4) << 6;
            b[i] |= (mm >> 4) << 6;
        }
    }
    b
}

impl BlockQ4K {
    /// The 4-bit quant of value `v` (0..256) of the super-block.
    #[inline]
    fn quant(&self, v: usize) -> u8 {
        let chunk = v / 64;
        let l = v % 32;
        let byte = self.qs[32 * chunk + l];
        if v % 64 < 32 { byte & 0x0f } else { byte >> 4 }
    }
}

impl Block for BlockQ4K {
    const GGML_TYPE: GgmlType = GgmlType::Q4_K;
    const VALUES: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        for chunk in 0..QK_K / 64 {
            let q = &self.qs[32 * chunk..32 * chunk + 32];
            let (sc1, m1) = scale_min_k4(2 * chunk, &self.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &self.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut out[64 * chunk..64 * chunk + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }

    fn quantize(values: &[f32]) -> Self {
        quantize_q4_k(&values[..QK_K])
    }
}

impl RepackQ4 for BlockQ4K {
    fn repack_q4(&self, scales: &mut Vec<f32>, mins: &mut Vec<f32>, quants: &mut Vec<u32>) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        for sub in 0..QK_K / 32 {
            let (sc, m) = scale_min_k4(sub, &self.scales);
            scales.push(d * sc as f32);
            mins.push(-(min * m as f32));
            let mut q = [0u8; 32];
            for (l, q) in q.iter_mut().enumerate() {
                *q = self.quant(32 * sub + l);
            }
            push_q4_block(&q, quants);
        }
    }
}

/// ggml's reference Q4_K quantizer: fit a scale and min per 32-value sub-block with a weighted
/// least-squares search, quantize those to 6 bits against the super-block maxima, then re-quantize the
/// values with the scales actually stored.
fn quantize_q4_k(x: &[f32]) -> BlockQ4K {
    let mut sub_scales = [0.0f32; 8];
    let mut sub_mins = [0.0f32; 8];
    for (i, xs) in x.chunks_exact(32).enumerate() {
        // Weights favour large values; av_x keeps small values from being ignored entirely.
        let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let w: Vec<f32> = xs.iter().map(|v| av_x + v.abs()).collect();
        let (scale, neg_min) = fit_scale_min(xs, &w, 15, -1.0, 0.1, 20);
        sub_scales[i] = scale;
        sub_mins[i] = neg_min;
    }
    let max_scale = sub_scales.iter().copied().fold(0.0f32, f32::max);
    let max_min = sub_mins.iter().copied().fold(0.0f32, f32::max);
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for i in 0..8 {
        ls[i] = nearest_int(inv_scale * sub_scales[i]).clamp(0, 63) as u8;
        lm[i] = nearest_int(inv_min * sub_mins[i]).clamp(0, 63) as u8;
    }
    let scales = pack_scale_min_k4(&ls, &lm);
    let d_bits = f32_to_f16(max_scale / 63.0);
    let dmin_bits = f32_to_f16(max_min / 63.0);
    let d = f16_to_f32(d_bits);
    let dmin = f16_to_f32(dmin_bits);

    let mut q = [0u8; QK_K];
    for (i, xs) in x.chunks_exact(32).enumerate() {
        let (sc, m) = scale_min_k4(i, &scales);
        let ds = d * sc as f32;
        if ds == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for (l, &v) in xs.iter().enumerate() {
            q[32 * i + l] = nearest_int((v + dm) / ds).clamp(0, 15) as u8;
        }
    }
    let mut qs = [0u8; QK_K / 2];
    for chunk in 0..QK_K / 64 {
        for l in 0..32 {
            qs[32 * chunk + l] = q[64 * chunk + l] | (q[64 * chunk + 32 + l] << 4);
        }
    }
    BlockQ4K {
        d: d_bits,
        dmin: dmin_bits,
        scales,
        qs,
    }
}

/// Fits `x ≈ scale * l - neg_min` with integer `l` in `0..=nmax` by weighted least squares over a sweep
/// of candidate inverse scales (ggml's `make_qkx2_quants` with squared error). Returns
/// `(scale, neg_min)`, both >= 0 (the offset is clamped so the range always includes zero).
pub(crate) fn fit_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let mut min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        return (0.0, -min);
    }
    let sum_w: f32 = w.iter().sum();
    let sum_x: f32 = x.iter().zip(w).map(|(v, w)| v * w).sum();
    let quant = |iscale: f32, v: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);

    let iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error: f32 = x
        .iter()
        .zip(w)
        .map(|(&v, &w)| {
            let diff = scale * quant(iscale, v) as f32 + min - v;
            w * diff * diff
        })
        .sum();
    let mut best_min = min;
    for step in 0..=nstep {
        let iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for (&v, &w) in x.iter().zip(w) {
            let l = quant(iscale, v) as f32;
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_min > 0.0 {
            this_min = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        let error: f32 = x
            .iter()
            .zip(w)
            .map(|(&v, &w)| {
                let diff = this_scale * quant(iscale, v) as f32 + this_min - v;
                w * diff * diff
            })
            .sum();
        if error < best_error {
            best_error = error;
            scale = this_scale;
            best_min = this_min;
        }
    }
    (scale.max(0.0), -best_min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::test_support::*;
    use crate::blocks::{dequantize_blocks, quantize_blocks};
    use crate::tensor::repack_q4;

    fn random_block(rng: &mut impl rand::Rng) -> BlockQ4K {
        BlockQ4K {
            d: random_f16(rng),
            dmin: random_f16(rng),
            scales: random_bytes(rng),
            qs: random_bytes(rng),
        }
    }

    #[test]
    fn scale_packing_round_trips_all_six_bit_values() {
        for base in 0..64usize {
            let sc: [u8; 8] = std::array::from_fn(|i| ((base + 7 * i) % 64) as u8);
            let m: [u8; 8] = std::array::from_fn(|i| ((base * 3 + 11 * i) % 64) as u8);
            let packed = pack_scale_min_k4(&sc, &m);
            for i in 0..8 {
                assert_eq!(
                    scale_min_k4(i, &packed),
                    (sc[i], m[i]),
                    "base {base} sub-block {i}"
                );
            }
        }
    }

    #[test]
    fn layout_matches_ggml_nibble_order() {
        // Sub-block 1 (values 32..64) reads the HIGH nibbles of bytes 0..32; sub-block 2 the low nibbles
        // of bytes 32..64.
        let mut qs = [0u8; 128];
        qs[0] = 0x52; // value 0: 2, value 32: 5
        qs[32] = 0x07; // value 64: 7
        let sc = [1, 2, 3, 4, 5, 6, 7, 8];
        let m = [0, 1, 0, 0, 0, 0, 0, 0];
        let block = BlockQ4K {
            d: 0x3c00u16.to_le_bytes(),    // 1.0
            dmin: 0x3800u16.to_le_bytes(), // 0.5
            scales: pack_scale_min_k4(&sc, &m),
            qs,
        };
        let mut out = [0.0; 256];
        block.dequantize(&mut out);
        assert_eq!(out[0], 2.0); // 1*1*2 - 0
        assert_eq!(out[32], 2.0 * 5.0 - 0.5);
        assert_eq!(out[64], 3.0 * 7.0);
        assert_eq!(out[33], -0.5);
    }

    #[test]
    fn repack_is_bit_exact_with_the_twin() {
        let mut rng = rng(4);
        let mut blocks: Vec<BlockQ4K> = (0..240).map(|_| random_block(&mut rng)).collect();
        // Every 6-bit scale and min, and every nibble pair, appear.
        for (i, b) in blocks.iter_mut().take(8).enumerate() {
            let sc: [u8; 8] = std::array::from_fn(|j| (8 * i + j) as u8);
            let m: [u8; 8] = std::array::from_fn(|j| 63 - (8 * i + j) as u8);
            b.scales = pack_scale_min_k4(&sc, &m);
            for (j, q) in b.qs.iter_mut().enumerate() {
                *q = (i * 128 + j) as u8;
            }
        }
        let (rows, cols) = (60, 1024);
        let m = repack_q4(&blocks, rows, cols);
        assert_eq!(m.scales.len(), rows * cols / 32);
        let mut twin = vec![0.0; rows * cols];
        dequantize_blocks(&blocks, &mut twin);
        assert_bits_eq(&m.dequantize(), &twin, "Q4_K");
    }

    #[test]
    fn quantize_round_trip_error_is_reasonable() {
        let mut rng = rng(44);
        let x = random_values(&mut rng, 256 * 100, 32);
        let blocks: Vec<BlockQ4K> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        for (bx, by) in x.chunks(256).zip(y.chunks(256)) {
            for (xs, ys) in bx.chunks(32).zip(by.chunks(32)) {
                let min = xs.iter().copied().fold(0.0f32, f32::min);
                let max = xs.iter().copied().fold(0.0f32, f32::max);
                // A sub-block spans at most 15 steps; the 6-bit scales and mins are relative to the
                // super-block maxima, so a sub-block much smaller than its neighbours gets a coarser
                // relative step. Bound each value by one step of its own range plus 1/63 of the
                // super-block's largest range (the 6-bit rounding of its scale and min), plus the absolute
                // precision of a subnormal f16 d or dmin (2^-25) magnified by sc, m <= 63 and q <= 15.
                let super_range = bx.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let bound =
                    (max - min) / 15.0 + 2.0 * super_range / 63.0 + 16.0 * 63.0 * 2f32.powi(-25);
                for (a, b) in xs.iter().zip(ys) {
                    assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
                }
            }
        }
        // And on typical weights (one scale for the whole super-block) the RMS error is well under a step.
        let x: Vec<f32> = (0..256 * 50)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let blocks: Vec<BlockQ4K> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        let rms = (x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            / x.len() as f32)
            .sqrt();
        let step = 1.0 / 15.0;
        assert!(rms < 0.35 * step, "rms {rms} vs step {step}");
    }
}
