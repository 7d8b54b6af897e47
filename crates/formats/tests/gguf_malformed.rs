//! Hand-made malformed files: each must give the specific error, naming the field and offset.

use tinygpt_formats::{FormatError, GgmlType, GgufFile, GgufHeader, GgufWriter};

/// A little-endian byte builder for hand-written GGUF files.
#[derive(Default, Clone)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensors: u64, kvs: u64) -> Raw {
        Raw::default()
            .bytes(b"GGUF")
            .u32(version)
            .u64(tensors)
            .u64(kvs)
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn u8(self, v: u8) -> Self {
        self.bytes(&[v])
    }
    fn u32(self, v: u32) -> Self {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(self, v: u64) -> Self {
        self.bytes(&v.to_le_bytes())
    }
    fn str(self, s: &str) -> Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A tensor-info record.
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ty).u64(offset)
    }
    fn pad_to(mut self, alignment: usize) -> Self {
        while !self.0.len().is_multiple_of(alignment) {
            self.0.push(0);
        }
        self
    }
    fn parse(&self) -> Result<GgufHeader, FormatError> {
        GgufHeader::parse(&self.0)
    }
}

fn err(raw: &Raw) -> FormatError {
    match raw.parse() {
        Ok(h) => panic!("expected an error, parsed {} tensors", h.tensors.len()),
        Err(e) => e,
    }
}

#[test]
fn a_minimal_hand_written_file_parses() {
    // Guards the builder itself: the malformed cases below are this file with one thing broken.
    let raw = Raw::header(3, 1, 1)
        .str("general.architecture")
        .u32(8)
        .str("llama")
        .tensor("w", &[4, 2], GgmlType::F32 as u32, 0)
        .pad_to(32)
        .bytes(&[0; 32]);
    let h = raw.parse().unwrap();
    assert_eq!(h.metadata.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(h.tensors[0].data_start, h.data_offset);
    assert_eq!(h.data_offset % 32, 0);
}

#[test]
fn bad_magic() {
    let e = err(&Raw::default().bytes(b"GGML").u32(3).u64(0).u64(0));
    assert!(matches!(e, FormatError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("GGUF"), "{e}");
}

#[test]
fn unsupported_versions() {
    for (version, hint) in [(1, "obsolete"), (4, ""), (0x0300_0000, "big-endian")] {
        let e = err(&Raw::header(version, 0, 0));
        assert!(
            matches!(e, FormatError::UnsupportedVersion { version: v } if v == version),
            "{e}"
        );
        assert!(e.to_string().contains(hint), "{e}");
    }
}

#[test]
fn truncated_header() {
    for len in 0..24 {
        let full = Raw::header(3, 0, 0);
        let raw = Raw(full.0[..len].to_vec());
        let e = err(&raw);
        assert!(matches!(e, FormatError::Truncated { .. }), "len {len}: {e}");
    }
    let e = err(&Raw(Raw::header(3, 0, 0).0[..13].to_vec())).to_string();
    assert!(e.contains("tensor_count") && e.contains("offset 8"), "{e}");
    // An empty file with a complete header is valid.
    assert!(Raw::header(3, 0, 0).parse().is_ok());
}

#[test]
fn string_length_past_end_of_file() {
    let raw = Raw::header(3, 0, 1).u64(1000).bytes(&[b'a'; 20]);
    let e = err(&raw);
    assert!(
        matches!(&e, FormatError::Truncated { what, offset: 32, needed: 1000, available: 20 } if what.contains("metadata[0] key")),
        "{e}"
    );
    let raw = Raw::header(3, 0, 1).str("k").u32(8).u64(u64::MAX);
    let e = err(&raw).to_string();
    assert!(
        e.contains("metadata[0] 'k' value") && e.contains(&u64::MAX.to_string()),
        "{e}"
    );
}

#[test]
fn array_count_two_to_the_sixty() {
    let raw = Raw::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(4)
        .u64(1 << 60)
        .bytes(&[0; 64]);
    let e = err(&raw);
    assert!(
        matches!(&e, FormatError::CountTooLarge { count, min_elem_bytes: 4, available: 64, .. } if *count == 1 << 60),
        "{e}"
    );
    assert!(e.to_string().contains("'a' value element count"), "{e}");
    // Strings and nested arrays are bounded by their minimum encoded size too.
    for (elem_type, min) in [(8u32, 8u64), (9, 12)] {
        let raw = Raw::header(3, 0, 1)
            .str("a")
            .u32(9)
            .u32(elem_type)
            .u64(10)
            .bytes(&[0; 79]);
        let e = err(&raw);
        assert!(
            matches!(e, FormatError::CountTooLarge { min_elem_bytes, .. } if min_elem_bytes == min),
            "{e}"
        );
    }
    // Header counts are bounded the same way.
    let e = err(&Raw::header(3, 1 << 60, 0));
    assert!(e.to_string().contains("tensor_count"), "{e}");
    let e = err(&Raw::header(3, 0, u64::MAX));
    assert!(e.to_string().contains("kv_count"), "{e}");
}

#[test]
fn tensor_data_past_end_of_file() {
    let raw = Raw::header(3, 1, 0)
        .tensor("w", &[8, 8], 0, 0)
        .pad_to(32)
        .bytes(&[0; 255]);
    let e = err(&raw);
    assert!(
        matches!(&e, FormatError::TensorOutOfBounds { tensor, end, file_len, .. } if tensor == "w" && *end == *file_len + 1),
        "{e}"
    );
    // An offset that overflows when added to the data start.
    let raw = Raw::header(3, 1, 0)
        .tensor("w", &[1], 0, u64::MAX - 31)
        .pad_to(32);
    assert!(matches!(err(&raw), FormatError::TensorOutOfBounds { .. }));
    // The exact fit is fine.
    let raw = Raw::header(3, 1, 0)
        .tensor("w", &[8, 8], 0, 0)
        .pad_to(32)
        .bytes(&[0; 256]);
    assert!(raw.parse().is_ok());
}

#[test]
fn misaligned_tensor_offset() {
    let raw = Raw::header(3, 1, 0)
        .tensor("w", &[4], 0, 16)
        .pad_to(32)
        .bytes(&[0; 64]);
    let e = err(&raw);
    assert!(
        matches!(
            &e,
            FormatError::MisalignedTensor {
                offset: 16,
                alignment: 32,
                ..
            }
        ),
        "{e}"
    );
    // With general.alignment = 16 the same offset is fine.
    let raw = Raw::header(3, 1, 1)
        .str("general.alignment")
        .u32(4)
        .u32(16)
        .tensor("w", &[4], 0, 16)
        .pad_to(16)
        .bytes(&[0; 32]);
    assert_eq!(raw.parse().unwrap().alignment, 16);
}

#[test]
fn dims_that_overflow() {
    let raw = Raw::header(3, 1, 0).tensor("w", &[1 << 32, 1 << 32], 0, 0);
    let e = err(&raw);
    assert!(
        matches!(&e, FormatError::Invalid { what, .. } if what.contains("'w' ne[1]")),
        "{e}"
    );
    // A single dimension beyond i64, and a byte size that overflows although the count does not.
    assert!(matches!(
        err(&Raw::header(3, 1, 0).tensor("w", &[u64::MAX], 0, 0)),
        FormatError::Invalid { .. }
    ));
    let e = err(&Raw::header(3, 1, 0).tensor("w", &[1 << 62], 0, 0));
    assert!(matches!(e, FormatError::TensorShape { .. }), "{e}");
    // An empty dimension (which would make a huge ne[0] cost no data bytes).
    let e = err(&Raw::header(3, 1, 0).tensor("w", &[1 << 58, 0], 0, 0));
    assert!(
        e.to_string().contains("ne[1]") && e.to_string().contains("dimension is 0"),
        "{e}"
    );
    // Five dimensions.
    let e = err(&Raw::header(3, 1, 0).tensor("w", &[1, 1, 1, 1, 1], 0, 0));
    assert!(e.to_string().contains("at most 4"), "{e}");
    // ne[0] not a whole number of blocks.
    let e = err(&Raw::header(3, 1, 0).tensor("w", &[48], GgmlType::Q4_K as u32, 0));
    assert!(e.to_string().contains("block size 256"), "{e}");
}

#[test]
fn unknown_types() {
    let e = err(&Raw::header(3, 0, 1).str("k").u32(13).u32(0));
    assert!(
        matches!(
            e,
            FormatError::UnknownValueType {
                type_id: 13,
                offset: 33,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&Raw::header(3, 0, 1).str("k").u32(9).u32(77).u64(0));
    assert!(
        matches!(e, FormatError::UnknownValueType { type_id: 77, .. }),
        "{e}"
    );
    for id in [4u32, 31, 40, 1000] {
        let e = err(&Raw::header(3, 1, 0)
            .tensor("w", &[32], id, 0)
            .pad_to(32)
            .bytes(&[0; 64]));
        assert!(
            matches!(&e, FormatError::UnknownTensorType { type_id, tensor, .. } if *type_id == id && tensor == "w"),
            "{e}"
        );
    }
}

#[test]
fn invalid_values() {
    let e = err(&Raw::header(3, 0, 1).str("b").u32(7).u8(2));
    assert!(e.to_string().contains("bool must be 0 or 1"), "{e}");
    let e = err(&Raw::header(3, 0, 1)
        .str("s")
        .u32(8)
        .u64(2)
        .bytes(&[0xff, 0xfe]));
    assert!(e.to_string().contains("UTF-8"), "{e}");
    let e = err(&Raw::header(3, 0, 1)
        .u64(2)
        .bytes(&[0xc3, 0x28])
        .u32(0)
        .u8(0));
    assert!(e.to_string().contains("metadata[0] key"), "{e}");
    let e = err(&Raw::header(3, 0, 2)
        .str("k")
        .u32(0)
        .u8(1)
        .str("k")
        .u32(0)
        .u8(2));
    assert!(
        matches!(&e, FormatError::DuplicateKey { key, offset: 38 } if key == "k"),
        "{e}"
    );
    let e = err(&Raw::header(3, 2, 0)
        .tensor("w", &[1], 0, 0)
        .tensor("w", &[1], 0, 32)
        .pad_to(32)
        .bytes(&[0; 64]));
    assert!(
        matches!(&e, FormatError::DuplicateTensor { name, .. } if name == "w"),
        "{e}"
    );
}

#[test]
fn invalid_alignment() {
    for (ty, value, expect) in [
        (4u32, 0u32.to_le_bytes().to_vec(), "power of two"),
        (4, 48u32.to_le_bytes().to_vec(), "power of two"),
        (10, 32u64.to_le_bytes().to_vec(), "expected a u32"),
    ] {
        let raw = Raw::header(3, 0, 1)
            .str("general.alignment")
            .u32(ty)
            .bytes(&value);
        let e = err(&raw);
        assert!(
            matches!(&e, FormatError::Invalid { what, offset: 53, .. } if what == "general.alignment"),
            "{e}"
        );
        assert!(e.to_string().contains(expect), "{e}");
    }
}

#[test]
fn deeply_nested_arrays_are_refused_not_recursed() {
    // 100000 levels of array-of-one-array would overflow the stack of a naive recursive reader.
    let mut raw = Raw::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..100_000 {
        raw = raw.u32(9).u64(1);
    }
    raw = raw.u32(0).u64(0);
    let e = err(&raw);
    assert!(e.to_string().contains("nested more than 8"), "{e}");
}

#[test]
fn every_truncation_of_a_real_layout_fails_cleanly() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("tokens", vec!["a".to_string(), "bc".to_string()])
        .unwrap();
    w.add_tensor_f32("a", &[32, 2], GgmlType::Q8_0, &[0.5; 64])
        .unwrap();
    w.add_tensor_f32("b", &[256], GgmlType::Q6_K, &[0.25; 256])
        .unwrap();
    let bytes = w.to_bytes().unwrap();
    let full = GgufFile::from_bytes(bytes.clone()).unwrap();
    let last_end = full
        .tensors()
        .iter()
        .map(|t| t.data_start + t.n_bytes)
        .max()
        .unwrap() as usize;
    for len in 0..bytes.len() {
        let result = GgufHeader::parse(&bytes[..len]);
        if len < last_end {
            assert!(result.is_err(), "a prefix of {len} bytes parsed");
        } else {
            // Only the final padding is missing: the tensors are all there.
            assert!(result.is_ok(), "prefix {len}: {:?}", result.err());
        }
    }
}
