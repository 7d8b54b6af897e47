//! Q8_0: 32 signed 8-bit quants with one f16 scale.
//!
//! Defined by `block_q8_0` in ggml's `ggml-common.h`; reference code `dequantize_row_q8_0` /
//! `quantize_row_q8_0_ref` in `ggml-quants.c`.
//!
//! ```text
//!   offset  0      2                                  34
//!           +------+----------------------------------+
//!           | d    | qs[0] qs[1] ...           qs[31] |
//!           | f16  | i8 x 32                          |
//!           +------+----------------------------------+
//!   value[j] = qs[j] * d
//! ```
//!
//! Kernel layout: `Q8Matrix` with block 32, scale `d`, quant `qs[j]` unchanged: exact, since the kernel
//! computes `scale * q` and ggml computes `q * d`, the same single f32 product.

use super::{Block, RepackQ8, f16_to_f32, f32_to_f16, push_i8_words};
use crate::ggml_type::GgmlType;

pub const QK8_0: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Quants, two's complement.
    pub qs: [i8; QK8_0],
}

const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(align_of::<BlockQ8_0>() == 1);

impl Block for BlockQ8_0 {
    const GGML_TYPE: GgmlType = GgmlType::Q8_0;
    const VALUES: usize = QK8_0;

    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for (o, &q) in out[..QK8_0].iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }

    fn quantize(values: &[f32]) -> Self {
        let x = &values[..QK8_0];
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK8_0];
        for (q, &v) in qs.iter_mut().zip(x) {
            // ggml uses roundf (half away from zero); |v * id| <= 127 so the cast cannot saturate for
            // finite input.
            *q = (v * id).round() as i8;
        }
        BlockQ8_0 {
            d: f32_to_f16(d),
            qs,
        }
    }
}

impl RepackQ8 for BlockQ8_0 {
    const Q8_BLOCK: usize = QK8_0;

    fn repack_q8(&self, scales: &mut Vec<f32>, quants: &mut Vec<u32>) {
        scales.push(f16_to_f32(self.d));
        push_i8_words(&self.qs, quants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::test_support::*;
    use crate::blocks::{dequantize_blocks, quantize_blocks};
    use crate::tensor::repack_q8;

    fn random_block(rng: &mut impl rand::Rng) -> BlockQ8_0 {
        BlockQ8_0 {
            d: random_f16(rng),
            qs: bytemuck::cast(random_bytes::<32>(rng)),
        }
    }

    #[test]
    fn layout_matches_ggml_byte_order() {
        let mut bytes = [0u8; 34];
        bytes[..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1.0
        bytes[2] = 0x80; // -128
        bytes[33] = 0x7f; // 127
        let block: BlockQ8_0 = bytemuck::cast(bytes);
        let mut out = [0.0; 32];
        block.dequantize(&mut out);
        assert_eq!(out[0], -128.0);
        assert_eq!(out[31], 127.0);
        assert_eq!(out[1], 0.0);
    }

    #[test]
    fn repack_is_bit_exact_with_the_twin() {
        let mut rng = rng(8);
        // Every quant value appears: rows of 4 blocks, 200 random rows plus one row that walks all 256 bytes.
        let mut blocks: Vec<BlockQ8_0> = (0..800).map(|_| random_block(&mut rng)).collect();
        for (i, b) in blocks.iter_mut().take(8).enumerate() {
            for (j, q) in b.qs.iter_mut().enumerate() {
                *q = (i * 32 + j) as u8 as i8;
            }
        }
        let (rows, cols) = (200, 128);
        let m = repack_q8(&blocks, rows, cols);
        assert_eq!((m.rows, m.cols, m.block), (rows, cols, 32));
        let mut twin = vec![0.0; rows * cols];
        dequantize_blocks(&blocks, &mut twin);
        assert_bits_eq(&m.dequantize(), &twin, "Q8_0");
    }

    #[test]
    fn quantize_round_trip_error_is_within_half_a_step() {
        let mut rng = rng(81);
        let x = random_values(&mut rng, 32 * 500, 32);
        let blocks: Vec<BlockQ8_0> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 127.0;
            // Half a step of rounding, plus the f16 rounding of d times |q| <= 127: relative 2^-11 for a
            // normal half, absolute 2^-25 (half the subnormal spacing) below that.
            let bound = step * 0.5 + amax * 2f32.powi(-11) + 127.0 * 2f32.powi(-25);
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
            }
        }
    }
}
