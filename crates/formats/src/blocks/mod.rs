//! ggml's block-quantized formats: the on-disk blocks, their f32 dequantization twins, their exact
//! repacking into the kernel layouts of `tinygpt_kernels::quant`, and reference quantizers.
//!
//! Each block struct is `#[repr(C)]` with only byte-array fields, so it has alignment 1 and a slice of
//! tensor bytes can be viewed as a slice of blocks wherever it sits in a (memory-mapped) file. The f16
//! fields are kept as raw little-endian bytes and converted on use.
//!
//! Dequantization twins are written after ggml's reference `dequantize_row_*` (ggml-quants.c), with the
//! same f32 operations in the same order, so they are the exact-math reference the kernel layouts are
//! tested against. The repacks reproduce the twins bit for bit for every finite scale (Q4_0: up to the
//! sign of zero results); with infinite or NaN scales, which no real file has, they agree on the value
//! class (the same infinities, NaN where NaN) except Q4_0, see its module.
//!
//! The quantizers follow ggml's `quantize_row_*_ref`; they are not guaranteed to be
//! bit-identical to ggml's output, only to be valid encodings with the format's usual precision.

pub mod float;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q6_k;
pub mod q8_0;

pub use q4_0::BlockQ4_0;
pub use q4_1::BlockQ4_1;
pub use q4_k::BlockQ4K;
pub use q5_0::BlockQ5_0;
pub use q6_k::BlockQ6K;
pub use q8_0::BlockQ8_0;

use half::f16;

use crate::ggml_type::GgmlType;

/// A ggml quantization block.
pub trait Block: bytemuck::Pod {
    const GGML_TYPE: GgmlType;
    /// Values per block.
    const VALUES: usize;

    /// The f32 twin of ggml's `dequantize_row_*` for one block; `out.len()` must be `VALUES`.
    fn dequantize(&self, out: &mut [f32]);

    /// ggml's reference quantizer for one block; `values.len()` must be `VALUES`.
    fn quantize(values: &[f32]) -> Self;
}

/// A block that maps exactly onto `Q8Matrix` (signed 8-bit quants, one scale per `Q8_BLOCK` values).
pub trait RepackQ8: Block {
    /// `Q8Matrix::block` of the result.
    const Q8_BLOCK: usize;
    /// Appends `VALUES / Q8_BLOCK` scales and `VALUES / 4` packed quant words.
    fn repack_q8(&self, scales: &mut Vec<f32>, quants: &mut Vec<u32>);
}

/// A block that maps exactly onto `Q4Matrix` (unsigned 4-bit quants, scale and offset per 32 values).
pub trait RepackQ4: Block {
    /// Appends `VALUES / 32` scales and offsets and `VALUES / 8` packed quant words.
    fn repack_q4(&self, scales: &mut Vec<f32>, mins: &mut Vec<f32>, quants: &mut Vec<u32>);
}

/// Converts a stored IEEE half (little-endian bytes) to f32; exact, like ggml's `GGML_FP16_TO_FP32`.
#[inline]
pub fn f16_to_f32(bits: [u8; 2]) -> f32 {
    f16::from_le_bytes(bits).to_f32()
}

/// Rounds f32 to the nearest half (ties to even), like ggml's `GGML_FP32_TO_FP16`.
#[inline]
pub fn f32_to_f16(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// Round to nearest, ties to even: ggml's `nearest_int` for the magnitudes it is used on.
#[inline]
pub(crate) fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Appends signed 8-bit quants packed four per little-endian word (`Q8Matrix::quants`).
#[inline]
pub(crate) fn push_i8_words(q: &[i8], quants: &mut Vec<u32>) {
    debug_assert_eq!(q.len() % 4, 0);
    quants.extend(
        q.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8])),
    );
}

/// Appends one Q4Matrix block: `q[j]` (0..16) in the low nibble of byte j, `q[j + 16]` in its high
/// nibble, bytes little-endian in four words.
#[inline]
pub(crate) fn push_q4_block(q: &[u8; 32], quants: &mut Vec<u32>) {
    let mut bytes = [0u8; 16];
    for (j, b) in bytes.iter_mut().enumerate() {
        *b = (q[j] & 0x0f) | (q[j + 16] << 4);
    }
    push_nibble_bytes(&bytes, quants);
}

/// Appends 16 already-packed Q4_0-order bytes as four little-endian words.
#[inline]
pub(crate) fn push_nibble_bytes(bytes: &[u8; 16], quants: &mut Vec<u32>) {
    quants.extend(
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
}

/// Quantizes `values` (a whole number of blocks) block by block.
pub fn quantize_blocks<B: Block>(values: &[f32]) -> Vec<B> {
    values.chunks_exact(B::VALUES).map(B::quantize).collect()
}

/// Dequantizes a slice of blocks into `out` (`blocks.len() * VALUES` values).
pub fn dequantize_blocks<B: Block>(blocks: &[B], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(B::VALUES)) {
        b.dequantize(o);
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Shared helpers for the per-format tests: random blocks and the bit-exact comparison.

    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    pub fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    /// f16 bit patterns worth testing as scales: zeros of both signs, the smallest and largest
    /// subnormals, the smallest normal, one, the largest finite half, and their negatives.
    pub const SPECIAL_F16: [u16; 14] = [
        0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400, 0x8400, 0x3c00, 0xbc00, 0x7bff,
        0xfbff, 0x3555, 0x1234,
    ];

    /// A random finite f16 scale: half the time a special value, otherwise any finite bit pattern
    /// (which covers subnormals and extreme exponents).
    pub fn random_f16(rng: &mut impl Rng) -> [u8; 2] {
        let bits = if rng.random_bool(0.5) {
            SPECIAL_F16[rng.random_range(0..SPECIAL_F16.len())]
        } else {
            loop {
                let b: u16 = rng.random();
                // Exponent all ones is inf/NaN; see the per-format notes on non-finite scales.
                if b & 0x7c00 != 0x7c00 {
                    break b;
                }
            }
        };
        bits.to_le_bytes()
    }

    /// Random bytes for the quant fields; every value of every field is reachable.
    pub fn random_bytes<const N: usize>(rng: &mut impl Rng) -> [u8; N] {
        let mut b = [0u8; N];
        rng.fill(&mut b[..]);
        b
    }

    /// Asserts `a` and `b` are the same f32 bit patterns, reporting the first difference.
    pub fn assert_bits_eq(a: &[f32], b: &[f32], context: &str) {
        assert_eq!(a.len(), b.len(), "{context}: lengths differ");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "{context}: value {i} differs: {x:e} ({:#010x}) vs {y:e} ({:#010x})",
                x.to_bits(),
                y.to_bits()
            );
        }
    }

    /// Random test data with a spread of magnitudes per block, including blocks of zeros and single
    /// outliers, the shapes that stress scale selection.
    pub fn random_values(rng: &mut impl Rng, n: usize, block: usize) -> Vec<f32> {
        let mut v = Vec::with_capacity(n);
        for b in 0..n / block {
            let scale = 10f32.powi(rng.random_range(-4..4));
            let kind = b % 5;
            for j in 0..block {
                let x = match kind {
                    0 => 0.0,
                    1 if j == 3 => scale * 50.0,
                    _ => scale * (rng.random::<f32>() * 2.0 - 1.0),
                };
                v.push(x);
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    //! Behaviour shared by all formats: non-finite scales.

    use super::test_support::*;
    use super::*;
    use crate::tensor::{repack_q4, repack_q8};

    /// Infinities and NaNs of both signs as f16 bits.
    const NON_FINITE_F16: [u16; 4] = [0x7c00, 0xfc00, 0x7e00, 0xfe01];

    /// Kernel value vs twin value when a scale is not finite: the bit-exactness tests use finite scales
    /// (every real file does), and here the two must still agree on the value class: the same infinity,
    /// the same finite number, or NaN on both sides (a NaN's sign and payload may differ).
    fn assert_same_class(kernel: &[f32], twin: &[f32], context: &str) {
        for (i, (&a, &b)) in kernel.iter().zip(twin).enumerate() {
            let same = (a.is_nan() && b.is_nan()) || a == b;
            assert!(same, "{context}: value {i}: kernel {a} vs twin {b}");
        }
    }

    fn check_q8<B: RepackQ8>(blocks: &[B], context: &str) {
        let mut twin = vec![0.0; blocks.len() * B::VALUES];
        dequantize_blocks(blocks, &mut twin);
        let m = repack_q8(blocks, blocks.len(), B::VALUES);
        assert_same_class(&m.dequantize(), &twin, context);
    }

    fn check_q4<B: RepackQ4>(blocks: &[B], context: &str) {
        let mut twin = vec![0.0; blocks.len() * B::VALUES];
        dequantize_blocks(blocks, &mut twin);
        let m = repack_q4(blocks, blocks.len(), B::VALUES);
        assert_same_class(&m.dequantize(), &twin, context);
    }

    #[test]
    fn non_finite_scales_give_the_same_value_class() {
        let mut rng = rng(99);
        let f16 = |i: usize, rng: &mut rand_chacha::ChaCha8Rng| {
            if i.is_multiple_of(2) {
                NON_FINITE_F16[(i / 2) % NON_FINITE_F16.len()].to_le_bytes()
            } else {
                random_f16(rng)
            }
        };
        let n = 16;
        let q8: Vec<BlockQ8_0> = (0..n)
            .map(|i| BlockQ8_0 {
                d: f16(i, &mut rng),
                qs: bytemuck::cast(random_bytes::<32>(&mut rng)),
            })
            .collect();
        check_q8(&q8, "Q8_0");
        let q5: Vec<BlockQ5_0> = (0..n)
            .map(|i| BlockQ5_0 {
                d: f16(i, &mut rng),
                qh: random_bytes(&mut rng),
                qs: random_bytes(&mut rng),
            })
            .collect();
        check_q8(&q5, "Q5_0");
        let q6: Vec<BlockQ6K> = (0..n)
            .map(|i| BlockQ6K {
                ql: random_bytes(&mut rng),
                qh: random_bytes(&mut rng),
                scales: bytemuck::cast(random_bytes::<16>(&mut rng)),
                d: f16(i, &mut rng),
            })
            .collect();
        check_q8(&q6, "Q6_K");
        let q41: Vec<BlockQ4_1> = (0..n)
            .map(|i| BlockQ4_1 {
                d: f16(i, &mut rng),
                m: f16(i + 1, &mut rng),
                qs: random_bytes(&mut rng),
            })
            .collect();
        check_q4(&q41, "Q4_1");
        let q4k: Vec<BlockQ4K> = (0..n)
            .map(|i| BlockQ4K {
                d: f16(i, &mut rng),
                dmin: f16(i + 1, &mut rng),
                scales: random_bytes(&mut rng),
                qs: random_bytes(&mut rng),
            })
            .collect();
        check_q4(&q4k, "Q4_K");
    }

    #[test]
    fn q4_0_with_an_infinite_scale_is_where_the_mapping_breaks() {
        // Q4_0's kernel form d*q + (-8d) turns inf*q - 8*inf into NaN where ggml's (q - 8)*inf is an
        // infinity: documented in blocks::q4_0, and harmless since no real block has an infinite scale.
        let block = BlockQ4_0 {
            d: 0x7c00u16.to_le_bytes(),
            qs: [0x91; 16],
        };
        let mut twin = [0.0; 32];
        block.dequantize(&mut twin);
        let m = repack_q4(&[block], 1, 32);
        let kernel = m.dequantize();
        // Value 0 has q = 1, value 16 has q = 9.
        assert_eq!((twin[0], twin[16]), (f32::NEG_INFINITY, f32::INFINITY));
        assert!(kernel[0].is_nan() && kernel[16].is_nan());
    }
}
