//! Writer -> reader round trips, atomic writes, and the tensor access paths on written files.

mod common;

use common::*;
use proptest::prelude::*;
use tinygpt_formats::{
    FormatError, GgmlType, GgufFile, GgufWriter, KernelWeights, MetadataArray, MetadataValue,
    dequantize_tensor, quantize,
};

/// One value of every metadata type, arrays of every element type, nested and empty arrays.
fn every_metadata_value() -> Vec<(&'static str, MetadataValue)> {
    use MetadataArray as A;
    use MetadataValue as V;
    vec![
        ("t.u8", V::U8(200)),
        ("t.i8", V::I8(-100)),
        ("t.u16", V::U16(60000)),
        ("t.i16", V::I16(-30000)),
        ("t.u32", V::U32(4_000_000_000)),
        ("t.i32", V::I32(-2_000_000_000)),
        ("t.u64", V::U64(u64::MAX - 1)),
        ("t.i64", V::I64(i64::MIN + 1)),
        ("t.f32", V::F32(-1.5e-7)),
        ("t.f64", V::F64(std::f64::consts::PI)),
        ("t.bool_true", V::Bool(true)),
        ("t.bool_false", V::Bool(false)),
        ("t.string", V::String("héllo, wörld ✓".into())),
        ("t.empty_string", V::String(String::new())),
        ("t.a_u8", V::Array(A::U8(vec![0, 1, 255]))),
        ("t.a_i8", V::Array(A::I8(vec![-128, 0, 127]))),
        ("t.a_u16", V::Array(A::U16(vec![1, 65535]))),
        ("t.a_i16", V::Array(A::I16(vec![-32768, 32767]))),
        ("t.a_u32", V::Array(A::U32(vec![7, u32::MAX]))),
        ("t.a_i32", V::Array(A::I32(vec![-1, 1, i32::MIN]))),
        ("t.a_u64", V::Array(A::U64(vec![u64::MAX]))),
        ("t.a_i64", V::Array(A::I64(vec![i64::MIN, -5]))),
        (
            "t.a_f32",
            V::Array(A::F32(vec![0.0, -0.0, f32::INFINITY, 1e-45])),
        ),
        ("t.a_f64", V::Array(A::F64(vec![1e300, -2.5]))),
        ("t.a_bool", V::Array(A::Bool(vec![true, false, true]))),
        (
            "t.a_string",
            V::Array(A::String(vec!["a".into(), String::new(), "日本".into()])),
        ),
        ("t.a_empty", V::Array(A::F32(vec![]))),
        (
            "t.a_nested",
            V::Array(A::Array(vec![
                A::String(vec!["x".into(), "y".into()]),
                A::U32(vec![1, 2, 3]),
                A::Array(vec![A::I8(vec![-1]), A::Array(vec![])]),
                A::Bool(vec![]),
            ])),
        ),
    ]
}

fn sample_values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// A writer with every metadata type and one tensor of each encodable type, in assorted shapes.
/// What was written for one tensor: name, dims, type, encoded bytes.
type Written = (String, Vec<u64>, GgmlType, Vec<u8>);

fn sample_writer() -> (GgufWriter, Vec<Written>) {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    for (k, v) in every_metadata_value() {
        w.add_metadata(k, v).unwrap();
    }
    let shapes: [(GgmlType, &[u64]); 10] = [
        (GgmlType::F32, &[7]),
        (GgmlType::F32, &[3, 5]),
        (GgmlType::F16, &[4, 3, 2]),
        (GgmlType::BF16, &[6, 2]),
        (GgmlType::Q8_0, &[64, 3]),
        (GgmlType::Q4_0, &[32, 5]),
        (GgmlType::Q4_1, &[96, 2]),
        (GgmlType::Q5_0, &[32, 1, 2]),
        (GgmlType::Q4_K, &[256, 3]),
        (GgmlType::Q6_K, &[512, 2]),
    ];
    let mut tensors = Vec::new();
    for (i, (ty, dims)) in shapes.into_iter().enumerate() {
        let n: u64 = dims.iter().product();
        let bytes = quantize(ty, &sample_values(n as usize, i as u32)).unwrap();
        let name = format!("tensor.{i}.{}", ty.name());
        w.add_tensor_bytes(name.clone(), dims, ty, bytes.clone())
            .unwrap();
        tensors.push((name, dims.to_vec(), ty, bytes));
    }
    (w, tensors)
}

#[test]
fn everything_written_reads_back_identically() {
    for alignment in [None, Some(1u32), Some(8), Some(64), Some(4096)] {
        let (mut w, tensors) = sample_writer();
        if let Some(a) = alignment {
            w.set_alignment(a).unwrap();
        }
        let bytes = w.to_bytes().unwrap();
        let file = GgufFile::from_bytes(bytes.clone()).unwrap();
        let a = u64::from(alignment.unwrap_or(32));
        assert_eq!(file.version(), 3);
        assert_eq!(file.alignment(), a);
        assert_eq!(file.metadata(), w.metadata(), "alignment {alignment:?}");
        assert_eq!(file.header().data_offset % a, 0);
        assert_eq!(file.tensors().len(), tensors.len());
        for (info, (name, dims, ty, data)) in file.tensors().iter().zip(&tensors) {
            assert_eq!((&info.name, &info.dims, info.ggml_type), (name, dims, *ty));
            assert_eq!(info.offset % a, 0, "{name} misaligned");
            assert_eq!(info.data_start % a, 0, "{name} misaligned in the file");
            assert_eq!(file.tensor_data(info).unwrap(), &data[..], "{name}");
        }
        // The file ends with the last tensor padded to the alignment, as ggml writes it.
        assert_eq!(bytes.len() as u64 % a, 0);
    }
}

#[test]
fn metadata_values_decode_to_what_was_written() {
    let (w, _) = sample_writer();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let m = file.metadata();
    assert_eq!(m.architecture().unwrap(), "llama");
    for (key, value) in every_metadata_value() {
        assert_eq!(m.get(key), Some(&value), "{key}");
    }
    assert_eq!(m.get_u64("t.u64").unwrap(), u64::MAX - 1);
    assert_eq!(m.get_i32_array("t.a_i32").unwrap(), [-1, 1, i32::MIN]);
    assert_eq!(m.get_str_array("t.a_string").unwrap()[2], "日本");
    assert!(m.get_f32_array("t.a_empty").unwrap().is_empty());
}

#[test]
fn version_2_files_read_like_version_3() {
    let (w, _) = sample_writer();
    let mut bytes = w.to_bytes().unwrap();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let v2 = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(v2.version(), 2);
    assert_eq!(v2.metadata(), w.metadata());
    assert_eq!(v2.tensors().len(), 10);
}

#[test]
fn tensors_load_and_dequantize_through_the_file() {
    let (w, tensors) = sample_writer();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    for (name, dims, ty, _) in &tensors {
        let info = file.tensor_info(name).unwrap();
        let twin = file.dequantize(name).unwrap();
        assert_eq!(twin.len() as u64, dims.iter().product::<u64>());
        let kernel = file.load_matrix(name).unwrap();
        assert_same_bits(&kernel.dequantize(), &twin, *ty == GgmlType::Q4_0, name);
        match &kernel {
            KernelWeights::Q8(m) => {
                assert_eq!((m.rows as u64, m.cols as u64), (info.rows(), info.cols()))
            }
            KernelWeights::Q4(m) => {
                assert_eq!((m.rows as u64, m.cols as u64), (info.rows(), info.cols()))
            }
            KernelWeights::F32(v) => assert_eq!(v.len() as u64, info.rows() * info.cols()),
        }
        // Row by row equals the whole.
        let cols = info.cols() as usize;
        let mut row = vec![0.0; cols];
        for r in 0..info.rows() {
            file.dequantize_row(name, r, &mut row).unwrap();
            let whole = &twin[r as usize * cols..(r as usize + 1) * cols];
            assert_same_bits(&row, whole, false, &format!("{name} row {r}"));
        }
        let past = file
            .dequantize_row(name, info.rows(), &mut row)
            .unwrap_err();
        assert!(matches!(past, FormatError::TensorShape { .. }), "{past}");
        let mut short = vec![0.0; cols + 1];
        assert!(file.dequantize_row(name, 0, &mut short).is_err());
    }
    assert!(matches!(
        file.load_matrix("nope"),
        Err(FormatError::MissingTensor { .. })
    ));
}

#[test]
fn unsupported_types_are_named_in_the_error() {
    let mut w = GgufWriter::new();
    // Q5_1 (ggml type 7): 24 bytes per 32 values. Any bytes are a valid encoding for this test.
    w.add_tensor_bytes("q51", &[32, 2], GgmlType::Q5_1, vec![0x11; 48])
        .unwrap();
    w.add_tensor_bytes("q2k", &[256], GgmlType::Q2_K, vec![0; 84])
        .unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    for (name, number, type_name) in [("q51", "7", "Q5_1"), ("q2k", "10", "Q2_K")] {
        for err in [
            file.load_matrix(name).unwrap_err(),
            file.dequantize(name).unwrap_err(),
            file.dequantize_row(
                name,
                0,
                &mut vec![0.0; file.tensor(name).unwrap().cols() as usize],
            )
            .unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(
                msg.contains(name) && msg.contains(&format!("type {number} ({type_name})")),
                "{msg}"
            );
        }
    }
    let err = quantize(GgmlType::Q5_1, &[0.0; 32])
        .unwrap_err()
        .to_string();
    assert!(err.contains("Q5_1") && err.contains('7'), "{err}");
}

#[test]
fn writer_rejects_inconsistent_input() {
    let mut w = GgufWriter::new();
    w.add_metadata("k", 1u32).unwrap();
    assert!(w.add_metadata("k", 2u32).is_err(), "duplicate key");
    assert!(
        w.add_metadata("general.alignment", 3u32).is_err(),
        "alignment not a power of two"
    );
    assert!(
        w.add_metadata("general.alignment", 16u64).is_err(),
        "alignment not u32"
    );
    assert!(
        w.add_tensor_bytes("t", &[32], GgmlType::Q8_0, vec![0; 33])
            .is_err(),
        "wrong size"
    );
    assert!(
        w.add_tensor_bytes("t", &[33], GgmlType::Q8_0, vec![0; 34])
            .is_err(),
        "partial block"
    );
    assert!(
        w.add_tensor_bytes("t", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4])
            .is_err(),
        "5 dims"
    );
    assert!(
        w.add_tensor_bytes("t", &[1 << 32, 1 << 32], GgmlType::F32, vec![])
            .is_err(),
        "overflow"
    );
    w.add_tensor_bytes("t", &[32], GgmlType::Q8_0, vec![0; 34])
        .unwrap();
    assert!(
        w.add_tensor_bytes("t", &[32], GgmlType::Q8_0, vec![0; 34])
            .is_err(),
        "duplicate name"
    );
    assert!(
        quantize(GgmlType::Q4_K, &[0.0; 100]).is_err(),
        "partial super-block"
    );
    let mut deep = MetadataArray::U8(vec![1]);
    for _ in 0..8 {
        deep = MetadataArray::Array(vec![deep]);
    }
    assert!(w.add_metadata("deep", deep).is_err(), "9 levels of arrays");
    // general.alignment added as plain metadata is honoured.
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", 128u32).unwrap();
    w.add_tensor_bytes("t", &[3], GgmlType::F32, vec![0; 12])
        .unwrap();
    w.add_tensor_bytes("u", &[3], GgmlType::F32, vec![0; 12])
        .unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.alignment(), 128);
    assert_eq!(file.tensor("u").unwrap().offset, 128);
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tinygpt-formats-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn atomic_write_replaces_the_file_and_leaves_no_temporaries() {
    let dir = temp_dir("atomic");
    let path = dir.join("model.gguf");
    std::fs::write(&path, b"old contents").unwrap();
    let (w, tensors) = sample_writer();
    w.write_atomic(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.bytes(), &w.to_bytes().unwrap()[..]);
    assert_eq!(file.tensors().len(), tensors.len());
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["model.gguf"]);

    // A failing write (the directory is missing) reports the path and creates nothing.
    let missing = dir.join("no/such/dir/model.gguf");
    let err = w.write_atomic(&missing).unwrap_err();
    assert!(matches!(err, FormatError::Io { .. }), "{err}");
    assert!(!missing.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn open_reports_missing_and_empty_files() {
    let err = GgufFile::open("/nonexistent/x.gguf")
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/x.gguf"), "{err}");
    let dir = temp_dir("empty");
    let path = dir.join("empty.gguf");
    std::fs::write(&path, b"").unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(
        matches!(err, FormatError::Truncated { offset: 0, .. }),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hand_made_infos_with_absurd_dims_are_refused_not_overflowed() {
    let info = info_for("t", &[32], GgmlType::Q8_0);
    let mut huge = info.clone();
    huge.dims = vec![1 << 40, 1 << 40, 1 << 40];
    assert_eq!(huge.n_elements(), u64::MAX);
    assert!(matches!(
        tinygpt_formats::load_matrix(&huge, &[0; 34]),
        Err(FormatError::TensorShape { .. })
    ));
    assert!(matches!(
        tinygpt_formats::load_matrix(&info, &[0; 33]),
        Err(FormatError::DataSize {
            expected: 34,
            found: 33,
            ..
        })
    ));
}

fn arb_array(depth: u32) -> BoxedStrategy<MetadataArray> {
    use MetadataArray as A;
    let leaf = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..5).prop_map(A::U8),
        prop::collection::vec(any::<i8>(), 0..5).prop_map(A::I8),
        prop::collection::vec(any::<u16>(), 0..5).prop_map(A::U16),
        prop::collection::vec(any::<i16>(), 0..5).prop_map(A::I16),
        prop::collection::vec(any::<u32>(), 0..5).prop_map(A::U32),
        prop::collection::vec(any::<i32>(), 0..5).prop_map(A::I32),
        prop::collection::vec(any::<u64>(), 0..5).prop_map(A::U64),
        prop::collection::vec(any::<i64>(), 0..5).prop_map(A::I64),
        // Compared by value after the round trip, so keep NaN out (its payload is preserved, but NaN != NaN).
        prop::collection::vec(
            prop::num::f32::ANY.prop_filter("not NaN", |v| !v.is_nan()),
            0..5
        )
        .prop_map(A::F32),
        prop::collection::vec(prop::num::f64::NORMAL, 0..5).prop_map(A::F64),
        prop::collection::vec(any::<bool>(), 0..5).prop_map(A::Bool),
        prop::collection::vec(".{0,6}", 0..5).prop_map(A::String),
    ];
    if depth == 0 {
        leaf.boxed()
    } else {
        prop_oneof![3 => leaf, 1 => prop::collection::vec(arb_array(depth - 1), 0..3).prop_map(A::Array)]
            .boxed()
    }
}

fn arb_value() -> impl Strategy<Value = MetadataValue> {
    use MetadataValue as V;
    prop_oneof![
        any::<u8>().prop_map(V::U8),
        any::<i8>().prop_map(V::I8),
        any::<u16>().prop_map(V::U16),
        any::<i16>().prop_map(V::I16),
        any::<u32>().prop_map(V::U32),
        any::<i32>().prop_map(V::I32),
        any::<u64>().prop_map(V::U64),
        any::<i64>().prop_map(V::I64),
        prop::num::f32::ANY
            .prop_filter("not NaN", |v| !v.is_nan())
            .prop_map(V::F32),
        prop::num::f64::ANY
            .prop_filter("not NaN", |v| !v.is_nan())
            .prop_map(V::F64),
        any::<bool>().prop_map(V::Bool),
        ".{0,12}".prop_map(V::String),
        arb_array(2).prop_map(V::Array),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_files_round_trip(
        entries in prop::collection::btree_map("[a-z.]{1,10}", arb_value(), 0..12),
        tensors in prop::collection::vec((0usize..4, 1u64..4, 1u64..3), 0..5),
        alignment_log2 in 0u32..8,
    ) {
        let mut w = GgufWriter::new();
        w.set_alignment(1 << alignment_log2).unwrap();
        for (k, v) in &entries {
            w.add_metadata(k.clone(), v.clone()).unwrap();
        }
        let types = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K];
        let mut expected = Vec::new();
        for (i, &(t, blocks, rows)) in tensors.iter().enumerate() {
            let ty = types[t];
            let cols = blocks * ty.block_size() as u64;
            let values = sample_values((cols * rows) as usize, i as u32);
            w.add_tensor_f32(format!("t{i}"), &[cols, rows], ty, &values).unwrap();
            expected.push((ty, values));
        }
        let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        prop_assert_eq!(file.metadata(), w.metadata());
        prop_assert_eq!(file.tensors().len(), expected.len());
        for (info, (ty, values)) in file.tensors().iter().zip(&expected) {
            let got = dequantize_tensor(info, file.tensor_data(info).unwrap()).unwrap();
            let direct = dequantize_tensor(info, &quantize(*ty, values).unwrap()).unwrap();
            prop_assert_eq!(f32_bits(&got), f32_bits(&direct));
        }
    }
}
