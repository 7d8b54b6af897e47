//! Q4_1: 32 unsigned 4-bit quants with an f16 scale and an f16 offset.
//!
//! Defined by `block_q4_1` in ggml's `ggml-common.h`; reference code `dequantize_row_q4_1` /
//! `quantize_row_q4_1_ref` in `ggml-quants.c`.
//!
//! ```text
//!   offset  0      2      4                                   20
//!           +------+------+-----------------------------------+
//!           | d    | m    | qs[0] qs[1] ...            qs[15] |
//!           | f16  | f16  | u8 x 16: two 4-bit quants each    |
//!           +------+------+-----------------------------------+
//!   qs[j] = q[j] | q[j + 16] << 4
//!   value[j] = q[j] * d + m
//! ```
//!
//! Kernel layout: `Q4Matrix` with scale `d`, offset `m`, nibbles unchanged. The kernel computes
//! `d * q + m`, the same two f32 operations as ggml's `q * d + m`: exact.

use super::{Block, RepackQ4, f16_to_f32, f32_to_f16, push_nibble_bytes};
use crate::ggml_type::GgmlType;

pub const QK4_1: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Offset (the block minimum), f16 little-endian.
    pub m: [u8; 2],
    /// Nibbles: value j low, value j + 16 high.
    pub qs: [u8; QK4_1 / 2],
}

const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(align_of::<BlockQ4_1>() == 1);

impl Block for BlockQ4_1 {
    const GGML_TYPE: GgmlType = GgmlType::Q4_1;
    const VALUES: usize = QK4_1;

    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        let m = f16_to_f32(self.m);
        for (j, &b) in self.qs.iter().enumerate() {
            let x0 = (b & 0x0f) as i32;
            let x1 = (b >> 4) as i32;
            out[j] = x0 as f32 * d + m;
            out[j + QK4_1 / 2] = x1 as f32 * d + m;
        }
    }

    fn quantize(values: &[f32]) -> Self {
        let x = &values[..QK4_1];
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; QK4_1];
        for (q, &v) in q.iter_mut().zip(x) {
            *q = (((v - min) * id + 0.5) as i8).clamp(0, 15) as u8;
        }
        let mut qs = [0u8; QK4_1 / 2];
        for (j, b) in qs.iter_mut().enumerate() {
            *b = q[j] | (q[j + QK4_1 / 2] << 4);
        }
        BlockQ4_1 {
            d: f32_to_f16(d),
            m: f32_to_f16(min),
            qs,
        }
    }
}

impl RepackQ4 for BlockQ4_1 {
    fn repack_q4(&self, scales: &mut Vec<f32>, mins: &mut Vec<f32>, quants: &mut Vec<u32>) {
        scales.push(f16_to_f32(self.d));
        mins.push(f16_to_f32(self.m));
        push_nibble_bytes(&self.qs, quants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::test_support::*;
    use crate::blocks::{dequantize_blocks, quantize_blocks};
    use crate::tensor::repack_q4;

    fn random_block(rng: &mut impl rand::Rng) -> BlockQ4_1 {
        BlockQ4_1 {
            d: random_f16(rng),
            m: random_f16(rng),
            qs: random_bytes(rng),
        }
    }

    #[test]
    fn layout_matches_ggml_field_order() {
        let mut qs = [0u8; 16];
        qs[1] = 0x3f; // value 1: q 15, value 17: q 3
        let block = BlockQ4_1 {
            d: 0x3800u16.to_le_bytes(), // 0.5
            m: 0xc000u16.to_le_bytes(), // -2.0
            qs,
        };
        let mut out = [0.0; 32];
        block.dequantize(&mut out);
        assert_eq!(out[0], -2.0);
        assert_eq!(out[1], 5.5);
        assert_eq!(out[17], -0.5);
    }

    #[test]
    fn repack_is_bit_exact_with_the_twin() {
        let mut rng = rng(41);
        let mut blocks: Vec<BlockQ4_1> = (0..600).map(|_| random_block(&mut rng)).collect();
        for (i, b) in blocks.iter_mut().take(16).enumerate() {
            for (j, q) in b.qs.iter_mut().enumerate() {
                *q = (i * 16 + j) as u8;
            }
        }
        let (rows, cols) = (150, 128);
        let m = repack_q4(&blocks, rows, cols);
        let mut twin = vec![0.0; rows * cols];
        dequantize_blocks(&blocks, &mut twin);
        assert_bits_eq(&m.dequantize(), &twin, "Q4_1");
    }

    #[test]
    fn quantize_round_trip_error_is_within_half_a_step() {
        let mut rng = rng(411);
        let x = random_values(&mut rng, 32 * 500, 32);
        let blocks: Vec<BlockQ4_1> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let min = xb.iter().copied().fold(f32::INFINITY, f32::min);
            let max = xb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let step = (max - min) / 15.0;
            // Half a step, plus the f16 rounding of d (times q <= 15) and of m.
            let amax = max.abs().max(min.abs());
            let bound = step * 0.5 + 16.0 * amax * 2f32.powi(-11) + 16.0 * 2f32.powi(-25);
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
            }
        }
    }
}
