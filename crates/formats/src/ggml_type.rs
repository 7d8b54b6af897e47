//! The ggml tensor types that can appear in a GGUF tensor-info record.
//!
//! Numbers and block geometry follow `enum ggml_type` in ggml's `ggml.h` and the `type_traits` table in
//! `ggml.c` (mirrored by `GGML_QUANT_SIZES` in the `gguf` Python package). The reader needs the geometry of
//! every type, supported or not, to validate a file's tensor data ranges; which types this crate can
//! *decode* is a separate question (see [`GgmlType::can_dequantize`]).

/// A ggml tensor element type, as stored (u32) in a GGUF tensor-info record.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    // 4 and 5 were Q4_2 and Q4_3, removed from ggml long ago.
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    // 31..=33 were the Q4_0_4_4 / Q4_0_4_8 / Q4_0_8_8 repacked types, removed from files.
    TQ1_0 = 34,
    TQ2_0 = 35,
    // 36..=38 were IQ4_NL_4_4 / _4_8 / _8_8, likewise removed.
    MXFP4 = 39,
}

/// Values per super-block of the k-quants (`QK_K` in ggml).
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every known type, in numeric order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    /// The type with ggml number `id`, if it is one this crate knows the geometry of.
    pub fn from_u32(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// ggml's name for the type (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// Number of values in one block (1 for plain element types).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes of one block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        const K: usize = QK_K;
        match self {
            F32 => 4,
            F16 => 2,
            BF16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 => 8,
            F64 => 8,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 4 + 4 + 32,
            Q2_K => 2 + 2 + K / 16 + K / 4,
            Q3_K => 2 + K / 4 + K / 8 + 12,
            Q4_K => 2 + 2 + K / 2 + 12,
            Q5_K => 2 + 2 + K / 2 + K / 8 + 12,
            Q6_K => 2 + K / 2 + K / 4 + K / 16,
            Q8_K => 4 + K + K / 8,
            IQ2_XXS => 2 + K / 4,
            IQ2_XS => 2 + K / 4 + K / 32,
            IQ3_XXS => 2 + K / 4 + K / 8,
            IQ1_S => 2 + K / 8 + K / 16,
            IQ4_NL => 2 + 16,
            IQ3_S => 2 + K / 4 + K / 8 + K / 32 + 4,
            IQ2_S => 2 + K / 4 + K / 16,
            IQ4_XS => 2 + 2 + K / 2 + K / 64,
            IQ1_M => K / 8 + K / 16 + K / 32,
            TQ1_0 => 2 + 4 * 13,
            TQ2_0 => 2 + 64,
            MXFP4 => 1 + 16,
        }
    }

    /// Whether [`crate::dequantize_tensor`] and friends can decode this type to f32.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q8_0 | Q4_K | Q6_K
        )
    }

    /// Whether [`crate::quantize`] can produce this type from f32.
    pub fn can_quantize(self) -> bool {
        self.can_dequantize()
    }

    /// Bytes taken by `n_values` values of this type, or `None` when `n_values` is not a whole number of
    /// blocks or the byte count overflows.
    pub fn bytes_for(self, n_values: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !n_values.is_multiple_of(block) {
            return None;
        }
        (n_values / block).checked_mul(self.type_size() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), *self as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_round_trip_and_all_is_complete() {
        let mut seen = std::collections::HashSet::new();
        for t in GgmlType::ALL {
            assert!(seen.insert(t), "{t} listed twice in ALL");
            assert_eq!(GgmlType::from_u32(t as u32), Some(t));
        }
        let known = (0..64).filter(|&i| GgmlType::from_u32(i).is_some()).count();
        assert_eq!(known, GgmlType::ALL.len());
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
            assert_eq!(GgmlType::from_u32(removed), None);
        }
    }

    #[test]
    fn geometry_of_the_types_we_decode_matches_ggml_common_h() {
        // sizeof(block_*) from ggml-common.h, spelled out independently of type_size's arithmetic.
        let expect = [
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q6_K, 256, 210),
            (GgmlType::F16, 1, 2),
            (GgmlType::BF16, 1, 2),
            (GgmlType::F32, 1, 4),
        ];
        for (t, block, size) in expect {
            assert_eq!((t.block_size(), t.type_size()), (block, size), "{t}");
        }
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
