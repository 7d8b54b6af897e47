//! Q4_0: 32 unsigned 4-bit quants with one f16 scale and an implicit offset of -8.
//!
//! Defined by `block_q4_0` in ggml's `ggml-common.h`; reference code `dequantize_row_q4_0` /
//! `quantize_row_q4_0_ref` in `ggml-quants.c`.
//!
//! ```text
//!   offset  0      2                                   18
//!           +------+-----------------------------------+
//!           | d    | qs[0] qs[1] ...            qs[15] |
//!           | f16  | u8 x 16: two 4-bit quants each    |
//!           +------+-----------------------------------+
//!   qs[j] = q[j] | q[j + 16] << 4      (value j in the low nibble, value j + 16 in the high one)
//!   value[j] = (q[j] - 8) * d
//! ```
//!
//! Kernel layout: `Q4Matrix` with scale `d`, offset `-8 d`, nibbles copied as they are (Q4Matrix uses
//! this very nibble order). The kernel computes `d * q + (-8 d)`: `d * q` and `-8 d` are exact in f32
//! (an 11-bit half mantissa times a 4-bit integer), and so is their sum `(q - 8) d`, the value ggml
//! rounds to. The result is therefore the same number, with one exception the `a * q + m` form cannot
//! express: where ggml's product is a *negative zero* (q = 8 with d < 0, or d = ±0), the kernel layout
//! yields +0. Values compare equal; only the sign bit of those zeros differs. (With an infinite `d`,
//! which no real file has, the kernel form gives NaN where ggml gives an infinity.)

use super::{Block, RepackQ4, f16_to_f32, f32_to_f16, push_nibble_bytes};
use crate::ggml_type::GgmlType;

pub const QK4_0: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Nibbles: value j low, value j + 16 high.
    pub qs: [u8; QK4_0 / 2],
}

const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(align_of::<BlockQ4_0>() == 1);

impl Block for BlockQ4_0 {
    const GGML_TYPE: GgmlType = GgmlType::Q4_0;
    const VALUES: usize = QK4_0;

    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        for (j, &b) in self.qs.iter().enumerate() {
            let x0 = (b & 0x0f) as i32 - 8;
            let x1 = (b >> 4) as i32 - 8;
            out[j] = x0 as f32 * d;
            out[j + QK4_0 / 2] = x1 as f32 * d;
        }
    }

    fn quantize(values: &[f32]) -> Self {
        let x = &values[..QK4_0];
        // The value of largest magnitude, with its sign: it maps to q = 0 exactly, so the block uses the
        // 8 steps of its own side and 7 of the other.
        let max = x
            .iter()
            .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; QK4_0];
        for (q, &v) in q.iter_mut().zip(x) {
            // Truncation after +8.5 rounds to nearest; the value is in 0.5..=16.5 for finite input.
            *q = ((v * id + 8.5) as i8).clamp(0, 15) as u8;
        }
        let mut qs = [0u8; QK4_0 / 2];
        for (j, b) in qs.iter_mut().enumerate() {
            *b = q[j] | (q[j + QK4_0 / 2] << 4);
        }
        BlockQ4_0 {
            d: f32_to_f16(d),
            qs,
        }
    }
}

impl RepackQ4 for BlockQ4_0 {
    fn repack_q4(&self, scales: &mut Vec<f32>, mins: &mut Vec<f32>, quants: &mut Vec<u32>) {
        let d = f16_to_f32(self.d);
        scales.push(d);
        mins.push(-8.0 * d);
        push_nibble_bytes(&self.qs, quants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::test_support::*;
    use crate::blocks::{dequantize_blocks, quantize_blocks};
    use crate::tensor::repack_q4;

    fn random_block(rng: &mut impl rand::Rng) -> BlockQ4_0 {
        BlockQ4_0 {
            d: random_f16(rng),
            qs: random_bytes(rng),
        }
    }

    #[test]
    fn layout_matches_ggml_nibble_order() {
        let mut qs = [0x88u8; 16]; // q = 8 -> 0 everywhere
        qs[0] = 0xf0; // value 0: q 0 -> -8; value 16: q 15 -> 7
        let block = BlockQ4_0 {
            d: 0x4000u16.to_le_bytes(), // 2.0
            qs,
        };
        let mut out = [0.0; 32];
        block.dequantize(&mut out);
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
        assert_eq!(out[1], 0.0);
    }

    #[test]
    fn repack_matches_the_twin_exactly_except_the_sign_of_zero() {
        let mut rng = rng(40);
        let mut blocks: Vec<BlockQ4_0> = (0..600).map(|_| random_block(&mut rng)).collect();
        // All 256 nibble pairs.
        for (i, b) in blocks.iter_mut().take(16).enumerate() {
            for (j, q) in b.qs.iter_mut().enumerate() {
                *q = (i * 16 + j) as u8;
            }
        }
        let (rows, cols) = (100, 192);
        let m = repack_q4(&blocks, rows, cols);
        let mut twin = vec![0.0; rows * cols];
        dequantize_blocks(&blocks, &mut twin);
        let got = m.dequantize();
        let mut signed_zeros = 0;
        for (i, (&a, &b)) in got.iter().zip(&twin).enumerate() {
            if a.to_bits() != b.to_bits() {
                // The one documented exception: ggml's -0.0 comes out as +0.0.
                assert!(
                    a == 0.0 && b == 0.0,
                    "value {i}: kernel {a:e} vs twin {b:e}"
                );
                signed_zeros += 1;
            }
        }
        // The exception is real (so the doc comment stays honest) and rare.
        assert!(
            signed_zeros > 0 && signed_zeros < got.len() / 8,
            "{signed_zeros}"
        );
    }

    #[test]
    fn quantize_round_trip_error_is_within_one_step() {
        let mut rng = rng(41);
        let x = random_values(&mut rng, 32 * 500, 32);
        let blocks: Vec<BlockQ4_0> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        let (mut err_sum, mut step_sum) = (0.0f64, 0.0f64);
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 8.0;
            // Rounding costs half a step, except on the side opposite the largest value, which has only
            // 7 steps and clamps (up to a full step); plus the f16 rounding of d.
            let bound = step + amax * 2f32.powi(-10) + 8.0 * 2f32.powi(-25);
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
                err_sum += f64::from((a - b).abs());
                step_sum += f64::from(step);
            }
        }
        // Uniform rounding error averages a quarter step.
        assert!(
            err_sum / step_sum < 0.3,
            "mean error {} steps",
            err_sum / step_sum
        );
    }
}
