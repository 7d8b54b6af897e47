//! Plain float element types: F32, F16 (IEEE half) and BF16 (the upper half of an f32), all
//! little-endian. Conversions to f32 are exact; conversions from f32 round to nearest even.

use half::{bf16, f16};

/// Decodes little-endian f32 bytes (any alignment).
pub fn f32_from_bytes(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Decodes little-endian IEEE half bytes to f32.
pub fn f16_from_bytes(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

/// Decodes little-endian bfloat16 bytes to f32 (a 16-bit shift, as ggml's `GGML_BF16_TO_FP32`).
pub fn bf16_from_bytes(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
    }
}

pub fn f32_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn f32_to_f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect()
}

/// Rounds to bfloat16 to nearest even, NaN kept NaN (ggml's `ggml_compute_fp32_to_bf16`).
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_decode_exactly() {
        // Subnormal, smallest normal, one, -2, max finite, infinity.
        let bits: [u16; 6] = [0x0001, 0x0400, 0x3c00, 0xc000, 0x7bff, 0x7c00];
        let want = [
            2f32.powi(-24),
            2f32.powi(-14),
            1.0,
            -2.0,
            65504.0,
            f32::INFINITY,
        ];
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let mut out = [0.0; 6];
        f16_from_bytes(&bytes, &mut out);
        assert_eq!(out, want);
        assert_eq!(f32_to_f16_bytes(&want), bytes);
    }

    #[test]
    fn bf16_is_the_upper_half_and_rounds_to_nearest_even() {
        let x = [
            1.0f32,
            -3.5,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            1e-40,
        ];
        let bytes = f32_to_bf16_bytes(&x);
        let mut out = [0.0; 5];
        bf16_from_bytes(&bytes, &mut out);
        // 0x3f808000 is a tie: rounds down to the even 0x3f80; 0x3f818000 rounds up to 0x3f82.
        assert_eq!(out[..2], [1.0, -3.5]);
        assert_eq!(out[2].to_bits(), 0x3f80_0000);
        assert_eq!(out[3].to_bits(), 0x3f82_0000);
        assert_eq!(out[4].to_bits() & 0xffff, 0);
        let mut round = [0.0; 5];
        f32_from_bytes(&f32_to_bytes(&x), &mut round);
        assert_eq!(round, x);
    }
}
