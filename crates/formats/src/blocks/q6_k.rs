//! Q6_K: a 256-value super-block of 6-bit quants in sixteen sub-blocks of 16, each with a signed 8-bit
//! scale, all scaled by one f16 `d`.
//!
//! Defined by `block_q6_K` in ggml's `ggml-common.h`; reference code `dequantize_row_q6_K` and
//! `quantize_row_q6_K_ref` (with `make_qx_quants`) in `ggml-quants.c`.
//!
//! ```text
//!   offset  0                 128              192              208    210
//!           +-----------------+----------------+----------------+------+
//!           | ql[128]         | qh[64]         | scales[16]     | d    |
//!           | low 4 bits      | high 2 bits    | i8 per 16      | f16  |
//!           +-----------------+----------------+----------------+------+
//!
//!   Two halves h = 0, 1 of 128 values; within a half, with l = 0..32, L = ql[64h..], H = qh[32h..]:
//!     q[128h +      l] = (L[l]      & 15) | ((H[l] >> 0) & 3) << 4
//!     q[128h + 32 + l] = (L[l + 32] & 15) | ((H[l] >> 2) & 3) << 4
//!     q[128h + 64 + l] = (L[l]      >> 4) | ((H[l] >> 4) & 3) << 4
//!     q[128h + 96 + l] = (L[l + 32] >> 4) | ((H[l] >> 6) & 3) << 4
//!
//!   value[v] = (d * scales[v / 16]) * (q[v] - 32)
//! ```
//!
//! Kernel layout: `Q8Matrix` with block 16, scale `d * scales[i]` and signed quant `q - 32` (in
//! -32..=31). ggml evaluates `d * sc * q` left to right, i.e. `(d * sc) * q`; the kernel multiplies the
//! stored `d * sc` by `q`: the same two f32 operations, so exact. (`d * sc` is itself exact: an 11-bit
//! mantissa times an 8-bit integer fits f32's 24 bits.)

use super::{Block, RepackQ8, f16_to_f32, f32_to_f16, nearest_int, push_i8_words};
use crate::ggml_type::{GgmlType, QK_K};

#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low four bits of each quant.
    pub ql: [u8; QK_K / 2],
    /// High two bits of each quant.
    pub qh: [u8; QK_K / 4],
    /// One signed scale per 16 values.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale, f16 little-endian.
    pub d: [u8; 2],
}

const _: () = assert!(size_of::<BlockQ6K>() == 210);
const _: () = assert!(align_of::<BlockQ6K>() == 1);

impl BlockQ6K {
    /// The signed quants `q - 32`, in value order.
    pub fn signed_quants(&self) -> [i8; QK_K] {
        let mut q = [0i8; QK_K];
        for half in 0..2 {
            let ql = &self.ql[64 * half..64 * half + 64];
            let qh = &self.qh[32 * half..32 * half + 32];
            let y = &mut q[128 * half..128 * half + 128];
            for l in 0..32 {
                y[l] = ((ql[l] & 0x0f) | (qh[l] & 3) << 4) as i8 - 32;
                y[l + 32] = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) as i8 - 32;
                y[l + 64] = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i8 - 32;
                y[l + 96] = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i8 - 32;
            }
        }
        q
    }
}

impl BlockQ6K {
    /// Stores signed quants (each in -32..=31, value order) into `ql` and `qh`; the inverse of
    /// [`BlockQ6K::signed_quants`].
    pub fn set_signed_quants(&mut self, signed: &[i8; QK_K]) {
        let q: [u8; QK_K] = std::array::from_fn(|v| (signed[v].clamp(-32, 31) + 32) as u8);
        for half in 0..2 {
            let q = &q[128 * half..128 * half + 128];
            for l in 0..32 {
                self.ql[64 * half + l] = (q[l] & 0x0f) | ((q[l + 64] & 0x0f) << 4);
                self.ql[64 * half + l + 32] = (q[l + 32] & 0x0f) | ((q[l + 96] & 0x0f) << 4);
                self.qh[32 * half + l] = (q[l] >> 4)
                    | ((q[l + 32] >> 4) << 2)
                    | ((q[l + 64] >> 4) << 4)
                    | ((q[l + 96] >> 4) << 6);
            }
        }
    }
}

impl Block for BlockQ6K {
    const GGML_TYPE: GgmlType = GgmlType::Q6_K;
    const VALUES: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for half in 0..2 {
            let ql = &self.ql[64 * half..64 * half + 64];
            let qh = &self.qh[32 * half..32 * half + 32];
            let sc = &self.scales[8 * half..8 * half + 8];
            let y = &mut out[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }

    fn quantize(values: &[f32]) -> Self {
        quantize_q6_k(&values[..QK_K])
    }
}

impl RepackQ8 for BlockQ6K {
    const Q8_BLOCK: usize = 16;

    fn repack_q8(&self, scales: &mut Vec<f32>, quants: &mut Vec<u32>) {
        let d = f16_to_f32(self.d);
        scales.extend(self.scales.iter().map(|&sc| d * sc as f32));
        push_i8_words(&self.signed_quants(), quants);
    }
}

/// ggml's reference Q6_K quantizer: a symmetric scale per 16 values (searched to minimise x²-weighted
/// error), those scales quantized to i8 against the largest, then the values re-quantized with the
/// scales actually stored.
fn quantize_q6_k(x: &[f32]) -> BlockQ6K {
    let mut sub_scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    for (i, xs) in x.chunks_exact(16).enumerate() {
        let s = fit_symmetric_scale(xs, 32);
        sub_scales[i] = s;
        if s.abs() > max_scale.abs() {
            max_scale = s;
        }
    }
    let mut block = BlockQ6K {
        ql: [0; QK_K / 2],
        qh: [0; QK_K / 4],
        scales: [0; QK_K / 16],
        d: [0; 2],
    };
    // ggml's GROUP_MAX_EPS: below this the whole block is stored as zeros.
    if max_scale.abs() < 1e-15 {
        return block;
    }
    let iscale = -128.0 / max_scale;
    block.d = f32_to_f16(1.0 / iscale);
    for (s, &sub) in block.scales.iter_mut().zip(&sub_scales) {
        *s = nearest_int(iscale * sub).clamp(-128, 127) as i8;
    }
    let d = f16_to_f32(block.d);
    let mut q = [0i8; QK_K];
    for (i, xs) in x.chunks_exact(16).enumerate() {
        let ds = d * block.scales[i] as f32;
        if ds == 0.0 {
            continue;
        }
        for (l, &v) in xs.iter().enumerate() {
            q[16 * i + l] = nearest_int(v / ds).clamp(-32, 31) as i8;
        }
    }
    block.set_signed_quants(&q);
    block
}

/// Finds a scale `s` such that `x ≈ s * l` with integer `l` in `-nmax..nmax`, minimising the
/// x²-weighted squared error over a small sweep around `nmax / max|x|` (ggml's `make_qx_quants` with
/// `rmse_type` 1). The sign of `s` is chosen so the largest-magnitude value maps to `-nmax`, which uses
/// the asymmetric range fully.
pub(crate) fn fit_symmetric_scale(x: &[f32], nmax: i32) -> f32 {
    let max = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    if max.abs() < 1e-15 {
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let (sumlx, suml2) = sums(-(nmax as f32) / max);
    let mut scale = if suml2 > 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in -9..=9 {
        if step == 0 {
            continue;
        }
        let (sumlx, suml2) = sums(-(nmax as f32 + 0.1 * step as f32) / max);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::test_support::*;
    use crate::blocks::{dequantize_blocks, quantize_blocks};
    use crate::tensor::repack_q8;

    fn random_block(rng: &mut impl rand::Rng) -> BlockQ6K {
        BlockQ6K {
            ql: random_bytes(rng),
            qh: random_bytes(rng),
            scales: bytemuck::cast(random_bytes::<16>(rng)),
            d: random_f16(rng),
        }
    }

    #[test]
    fn layout_matches_ggml_bit_order() {
        let mut block = BlockQ6K {
            ql: [0; 128],
            qh: [0; 64],
            scales: [1; 16],
            d: 0x3c00u16.to_le_bytes(),
        };
        block.ql[0] = 0x21; // value 0 low bits 1, value 64 low bits 2
        block.qh[0] = 0b11_10_01_00; // high bits: value 0 -> 0, 32 -> 1, 64 -> 2, 96 -> 3
        block.ql[64 + 32] = 0xf0; // second half: value 128+96 low bits 15
        block.qh[32] = 0b11_00_00_00; // value 128+96 high bits 3
        block.scales[15] = -2; // values 240..256
        let mut out = [0.0; 256];
        block.dequantize(&mut out);
        assert_eq!(out[0], 1.0 - 32.0);
        assert_eq!(out[32], 16.0 - 32.0);
        assert_eq!(out[64], (2.0 + 32.0) - 32.0);
        assert_eq!(out[96], 48.0 - 32.0);
        assert_eq!(out[128 + 96], 1.0 * (63.0 - 32.0));
        assert_eq!(out[240], -2.0 * (0.0 - 32.0));
    }

    #[test]
    fn repack_is_bit_exact_with_the_twin() {
        let mut rng = rng(6);
        let mut blocks: Vec<BlockQ6K> = (0..300).map(|_| random_block(&mut rng)).collect();
        // All 256 scale bytes, and all 6-bit quants.
        for (i, b) in blocks.iter_mut().take(16).enumerate() {
            for (j, s) in b.scales.iter_mut().enumerate() {
                *s = (16 * i + j) as u8 as i8;
            }
            let q: [i8; 256] = std::array::from_fn(|j| ((i + j) % 64) as i8 - 32);
            b.set_signed_quants(&q);
            assert_eq!(b.signed_quants(), q);
        }
        let (rows, cols) = (100, 768);
        let m = repack_q8(&blocks, rows, cols);
        assert_eq!(m.block, 16);
        let mut twin = vec![0.0; rows * cols];
        dequantize_blocks(&blocks, &mut twin);
        assert_bits_eq(&m.dequantize(), &twin, "Q6_K");
    }

    #[test]
    fn quantize_round_trip_error_is_reasonable() {
        let mut rng = rng(66);
        let x = random_values(&mut rng, 256 * 100, 16);
        let blocks: Vec<BlockQ6K> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        for (bx, by) in x.chunks(256).zip(y.chunks(256)) {
            let super_max = bx.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (xs, ys) in bx.chunks(16).zip(by.chunks(16)) {
                let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // About one 6-bit step of the sub-block, plus the i8 rounding of its scale relative to the
                // largest (1/128 of the super-block maximum's step, times |q| <= 32).
                let bound = amax / 32.0 + super_max / 128.0 + 32.0 * 128.0 * 2f32.powi(-25);
                for (a, b) in xs.iter().zip(ys) {
                    assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
                }
            }
        }
    }
}
