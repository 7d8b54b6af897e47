//! The dequantization twins, the kernel repacks and the simple quantizers checked against an independent
//! implementation: vectors produced by the `gguf` Python package (tests/data/make_reference.py).

mod common;

use common::*;
use tinygpt_formats::{GgmlType, KernelWeights, dequantize_tensor, load_matrix, quantize};

#[test]
fn twins_match_gguf_python_dequantization_bit_for_bit() {
    let refs = reference("block_vectors.json");
    let cases = refs["dequantize"].as_array().expect("dequantize cases");
    let mut seen = Vec::new();
    for case in cases {
        let ty = ggml_type_named(case["type"].as_str().expect("type"));
        let bytes = hex_bytes(case["bytes"].as_str().expect("bytes"));
        let want = u32_list(&case["f32_bits"]);
        let info = info_for("vector", &[want.len() as u64], ty);
        let want_f32: Vec<f32> = want.iter().map(|&b| f32::from_bits(b)).collect();
        let got = dequantize_tensor(&info, &bytes).expect("dequantize");
        assert_same_bits(
            &got,
            &want_f32,
            false,
            &format!("{ty}: twin vs gguf.quants.dequantize"),
        );

        // The kernel layout too, one block per row (zero signs excepted for Q4_0, see blocks::q4_0).
        let per_row = ty.block_size() as u64;
        let rows = want.len() as u64 / per_row;
        let info = info_for("vector", &[per_row, rows], ty);
        let weights = load_matrix(&info, &bytes).expect("load_matrix");
        assert_same_bits(
            &weights.dequantize(),
            &want_f32,
            ty == GgmlType::Q4_0,
            &format!("{ty} kernel layout"),
        );
        seen.push(ty);
    }
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::F16,
        GgmlType::BF16,
    ] {
        assert!(seen.contains(&ty), "no reference vector for {ty}");
    }
}

#[test]
fn simple_quantizers_match_gguf_python_byte_for_byte() {
    let refs = reference("block_vectors.json");
    let cases = refs["quantize"].as_array().expect("quantize cases");
    assert_eq!(cases.len(), 4);
    for case in cases {
        let ty = ggml_type_named(case["type"].as_str().expect("type"));
        let x: Vec<f32> = u32_list(&case["input_f32_bits"])
            .into_iter()
            .map(f32::from_bits)
            .collect();
        let want = hex_bytes(case["bytes"].as_str().expect("bytes"));
        let got = quantize(ty, &x).expect("quantize");
        assert_eq!(
            got, want,
            "{ty}: encoding differs from gguf.quants.quantize"
        );
    }
}

#[test]
fn layouts_are_the_documented_ones() {
    let x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin()).collect();
    for (ty, layout) in [
        (GgmlType::F32, "f32"),
        (GgmlType::F16, "f32"),
        (GgmlType::BF16, "f32"),
        (GgmlType::Q8_0, "q8"),
        (GgmlType::Q5_0, "q8"),
        (GgmlType::Q6_K, "q8"),
        (GgmlType::Q4_0, "q4"),
        (GgmlType::Q4_1, "q4"),
        (GgmlType::Q4_K, "q4"),
    ] {
        let bytes = quantize(ty, &x).expect("quantize");
        let info = info_for("t", &[256, 2], ty);
        let w = load_matrix(&info, &bytes).expect("load");
        assert_eq!(w.layout_name(), layout, "{ty}");
        match (&w, ty) {
            (KernelWeights::Q8(m), GgmlType::Q6_K) => {
                assert_eq!((m.rows, m.cols, m.block), (2, 256, 16))
            }
            (KernelWeights::Q8(m), _) => assert_eq!((m.rows, m.cols, m.block), (2, 256, 32)),
            (KernelWeights::Q4(m), _) => assert_eq!((m.rows, m.cols, m.scales.len()), (2, 256, 16)),
            (KernelWeights::F32(v), _) => assert_eq!(v.len(), 512),
        }
    }
}
