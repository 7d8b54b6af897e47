//! Q5_0: 32 unsigned 5-bit quants with one f16 scale and an implicit offset of -16.
//!
//! Defined by `block_q5_0` in ggml's `ggml-common.h`; reference code `dequantize_row_q5_0` /
//! `quantize_row_q5_0_ref` in `ggml-quants.c`.
//!
//! ```text
//!   offset  0      2            6                                   22
//!           +------+------------+-----------------------------------+
//!           | d    | qh         | qs[0] qs[1] ...            qs[15] |
//!           | f16  | u32 (LE)   | u8 x 16: low 4 bits, two per byte |
//!           +------+------------+-----------------------------------+
//!   low 4 bits:  qs[j] = lo[j] | lo[j + 16] << 4
//!   5th bit:     bit j of qh is bit 4 of q[j]   (j = 0..32)
//!   value[j] = (q[j] - 16) * d
//! ```
//!
//! Kernel layout: `Q8Matrix` with block 32, scale `d` and the signed quant `q - 16` (in -16..=15). The
//! kernel's `scale * q` is the same single f32 product as ggml's: exact.

use super::{Block, RepackQ8, f16_to_f32, f32_to_f16, push_i8_words};
use crate::ggml_type::GgmlType;

pub const QK5_0: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale, f16 little-endian.
    pub d: [u8; 2],
    /// Fifth bits, a little-endian u32: bit j belongs to value j.
    pub qh: [u8; 4],
    /// Low four bits: value j low nibble, value j + 16 high nibble.
    pub qs: [u8; QK5_0 / 2],
}

const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(align_of::<BlockQ5_0>() == 1);

impl BlockQ5_0 {
    /// The signed quants `q - 16`, in value order.
    pub fn signed_quants(&self) -> [i8; QK5_0] {
        let qh = u32::from_le_bytes(self.qh);
        let mut q = [0i8; QK5_0];
        for (j, &b) in self.qs.iter().enumerate() {
            let h0 = ((qh >> j) & 1) as u8;
            let h1 = ((qh >> (j + 16)) & 1) as u8;
            q[j] = ((b & 0x0f) | (h0 << 4)) as i8 - 16;
            q[j + QK5_0 / 2] = ((b >> 4) | (h1 << 4)) as i8 - 16;
        }
        q
    }
}

impl BlockQ5_0 {
    /// A block from its f16 scale and signed quants (each in -16..=15, value order); the inverse of
    /// [`BlockQ5_0::signed_quants`].
    pub fn from_signed_quants(d: [u8; 2], signed: &[i8; QK5_0]) -> BlockQ5_0 {
        let q: [u8; QK5_0] = std::array::from_fn(|j| (signed[j].clamp(-16, 15) + 16) as u8);
        let mut qs = [0u8; QK5_0 / 2];
        let mut qh = 0u32;
        for j in 0..QK5_0 / 2 {
            let (q0, q1) = (q[j], q[j + QK5_0 / 2]);
            qs[j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= u32::from(q0 >> 4) << j;
            qh |= u32::from(q1 >> 4) << (j + QK5_0 / 2);
        }
        BlockQ5_0 {
            d,
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

impl Block for BlockQ5_0 {
    const GGML_TYPE: GgmlType = GgmlType::Q5_0;
    const VALUES: usize = QK5_0;

    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_to_f32(self.d);
        let qh = u32::from_le_bytes(self.qh);
        for (j, &b) in self.qs.iter().enumerate() {
            let xh0 = ((qh >> j) << 4) & 0x10;
            let xh1 = (qh >> (j + 12)) & 0x10;
            let x0 = ((b as u32 & 0x0f) | xh0) as i32 - 16;
            let x1 = ((b as u32 >> 4) | xh1) as i32 - 16;
            out[j] = x0 as f32 * d;
            out[j + QK5_0 / 2] = x1 as f32 * d;
        }
    }

    fn quantize(values: &[f32]) -> Self {
        let x = &values[..QK5_0];
        let max = x
            .iter()
            .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: [i8; QK5_0] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).clamp(0, 31) - 16);
        BlockQ5_0::from_signed_quants(f32_to_f16(d), &q)
    }
}

impl RepackQ8 for BlockQ5_0 {
    const Q8_BLOCK: usize = QK5_0;

    fn repack_q8(&self, scales: &mut Vec<f32>, quants: &mut Vec<u32>) {
        scales.push(f16_to_f32(self.d));
        push_i8_words(&self.signed_quants(), quants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::test_support::*;
    use crate::blocks::{dequantize_blocks, quantize_blocks};
    use crate::tensor::repack_q8;

    fn random_block(rng: &mut impl rand::Rng) -> BlockQ5_0 {
        BlockQ5_0 {
            d: random_f16(rng),
            qh: random_bytes(rng),
            qs: random_bytes(rng),
        }
    }

    #[test]
    fn layout_matches_ggml_bit_order() {
        // Value 0: low 0, high bit 1 -> 16 - 16 = 0. Value 16: low 0xf, high bit 1 -> 31 - 16 = 15.
        // Value 31: low 0, high bit 0 -> -16.
        let mut qs = [0u8; 16];
        qs[0] = 0xf0;
        let block = BlockQ5_0 {
            d: 0x3c00u16.to_le_bytes(),
            qh: (1u32 | 1 << 16).to_le_bytes(),
            qs,
        };
        let mut out = [0.0; 32];
        block.dequantize(&mut out);
        assert_eq!((out[0], out[16], out[31]), (0.0, 15.0, -16.0));
        assert_eq!(block.signed_quants()[16], 15);
    }

    #[test]
    fn repack_is_bit_exact_with_the_twin() {
        let mut rng = rng(50);
        let mut blocks: Vec<BlockQ5_0> = (0..640).map(|_| random_block(&mut rng)).collect();
        // Every 5-bit value at every position: block i has q[j] = (i + j) % 32.
        for (i, b) in blocks.iter_mut().take(32).enumerate() {
            let q: [i8; 32] = std::array::from_fn(|j| ((i + j) % 32) as i8 - 16);
            *b = BlockQ5_0::from_signed_quants(b.d, &q);
            assert_eq!(b.signed_quants(), q);
        }
        let (rows, cols) = (64, 320);
        let m = repack_q8(&blocks, rows, cols);
        assert_eq!(m.block, 32);
        let mut twin = vec![0.0; rows * cols];
        dequantize_blocks(&blocks, &mut twin);
        assert_bits_eq(&m.dequantize(), &twin, "Q5_0");
    }

    #[test]
    fn quantize_round_trip_error_is_within_one_step() {
        let mut rng = rng(51);
        let x = random_values(&mut rng, 32 * 500, 32);
        let blocks: Vec<BlockQ5_0> = quantize_blocks(&x);
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(&blocks, &mut y);
        let (mut err_sum, mut step_sum) = (0.0f64, 0.0f64);
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 16.0;
            let bound = step + amax * 2f32.powi(-10) + 16.0 * 2f32.powi(-25);
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
                err_sum += f64::from((a - b).abs());
                step_sum += f64::from(step);
            }
        }
        assert!(
            err_sum / step_sum < 0.3,
            "mean error {} steps",
            err_sum / step_sum
        );
    }
}
