//! The two real model files: SmolLM2-135M-Instruct (Q4_1 + Q8_0) and Gemma-3-270M (Q4_K_M: Q4_K, Q5_0,
//! Q6_K, Q8_0), checked against numbers computed independently with the `gguf` Python package
//! (tests/data/real_models.json, made by tests/data/make_reference.py).
//!
//! The files are not in the repository: `scripts/fetch-models.sh` puts them in `.cache/models` (or set
//! TINYGPT_MODELS_DIR). A missing file fails these tests rather than skipping them.

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::*;
use serde_json::Value;
use tinygpt_formats::{GgmlType, GgufFile, KernelWeights, MetadataValue};

fn check_model(file_name: &str, architecture: &str) {
    let refs = reference("real_models.json");
    let r = &refs[file_name];
    let path = model_path(file_name);

    let t0 = Instant::now();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let m = file.metadata();

    // Header facts.
    assert_eq!(m.architecture().unwrap(), architecture);
    assert_eq!(
        file.tensors().len() as u64,
        r["tensor_count"].as_u64().unwrap()
    );
    assert_eq!(m.len() as u64, r["kv_count"].as_u64().unwrap());
    let mut counts = BTreeMap::new();
    for t in file.tensors() {
        *counts.entry(t.ggml_type.name().to_string()).or_insert(0u64) += 1;
    }
    let want_counts: BTreeMap<String, u64> = r["type_counts"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect();
    assert_eq!(counts, want_counts);

    // Metadata values, through the typed accessors model code uses.
    for (key, want) in r["metadata"]["scalars"].as_object().unwrap() {
        let got = m.value(key).unwrap();
        match want {
            Value::String(s) => assert_eq!(m.get_str(key).unwrap(), s, "{key}"),
            Value::Bool(b) => assert_eq!(m.get_bool(key).unwrap(), *b, "{key}"),
            Value::Number(n) => assert_eq!(m.get_u64(key).unwrap(), n.as_u64().unwrap(), "{key}"),
            Value::Object(o) => {
                let bits = o["f32_bits"].as_u64().unwrap() as u32;
                assert_eq!(m.get_f32(key).unwrap().to_bits(), bits, "{key}: {got:?}");
            }
            other => panic!("unexpected reference value {other} for {key}"),
        }
    }
    for (key, want) in r["metadata"]["array_lengths"].as_object().unwrap() {
        assert_eq!(
            m.get_array(key).unwrap().len() as u64,
            want.as_u64().unwrap(),
            "{key}"
        );
    }
    let tokens = m.get_str_array("tokenizer.ggml.tokens").unwrap();
    for (i, want) in r["metadata"]["first_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        assert_eq!(tokens[i], want.as_str().unwrap(), "token {i}");
    }

    // Every tensor is of a supported type and repacks; the repack dequantizes bit for bit like the twin
    // (compared row by row for the big embedding tables).
    let (mut load_s, mut twin_s, mut kernel_bytes) = (0.0, 0.0, 0usize);
    for info in file.tensors() {
        assert!(
            info.ggml_type.can_dequantize(),
            "{}: {}",
            info.name,
            info.ggml_type
        );
        let t = Instant::now();
        let weights = file
            .load_matrix(&info.name)
            .unwrap_or_else(|e| panic!("{e}"));
        load_s += t.elapsed().as_secs_f64();
        kernel_bytes += weights.size_bytes();
        let expected_layout = match info.ggml_type {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => "f32",
            GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q6_K => "q8",
            _ => "q4",
        };
        assert_eq!(weights.layout_name(), expected_layout, "{}", info.name);
        if info.n_elements() > 50_000_000 {
            let cols = info.cols() as usize;
            let (mut twin, mut kernel) = (vec![0.0; cols], vec![0.0; cols]);
            for row in (0..info.rows()).step_by(997).chain([info.rows() - 1]) {
                file.dequantize_row(&info.name, row, &mut twin).unwrap();
                match &weights {
                    KernelWeights::Q8(q) => q.dequantize_row(row as usize, &mut kernel),
                    KernelWeights::Q4(q) => q.dequantize_row(row as usize, &mut kernel),
                    KernelWeights::F32(v) => {
                        kernel.copy_from_slice(&v[row as usize * cols..][..cols])
                    }
                }
                assert_same_bits(&kernel, &twin, false, &format!("{} row {row}", info.name));
            }
        } else {
            let t = Instant::now();
            let twin = file.dequantize(&info.name).unwrap();
            twin_s += t.elapsed().as_secs_f64();
            assert_same_bits(&weights.dequantize(), &twin, false, &info.name);
        }
    }
    eprintln!(
        "{file_name}: {} MB; open+parse {open_ms:.1} ms; load_matrix of all {} tensors {load_s:.2} s \
         ({} MB in kernel layouts); twin dequantization of the non-embedding tensors {twin_s:.2} s",
        file.bytes().len() / 1_000_000,
        file.tensors().len(),
        kernel_bytes / 1_000_000,
    );

    // Values against gguf.quants.dequantize.
    for want in r["tensors"].as_array().unwrap() {
        let name = want["name"].as_str().unwrap();
        let info = file.tensor_info(name).unwrap();
        assert_eq!(
            info.ggml_type.name(),
            want["type"].as_str().unwrap(),
            "{name}"
        );
        assert_eq!(
            info.ggml_type as u64,
            want["type_id"].as_u64().unwrap(),
            "{name}"
        );
        let dims: Vec<u64> = want["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(info.dims, dims, "{name}");
        if let Some(rows) = want["rows"].as_array() {
            let mut row = vec![0.0; info.cols() as usize];
            for r in rows {
                let index = r["row"].as_u64().unwrap();
                file.dequantize_row(name, index, &mut row).unwrap();
                check_sum(
                    &row,
                    r["sum"].as_f64().unwrap(),
                    None,
                    &format!("{name} row {index}"),
                );
                assert_eq!(
                    f32_bits(&row[..16]),
                    u32_list(&r["first_f32_bits"]),
                    "{name} row {index}"
                );
            }
        } else {
            let values = file.dequantize(name).unwrap();
            check_sum(
                &values,
                want["sum"].as_f64().unwrap(),
                want["sum_abs"].as_f64(),
                name,
            );
            assert_eq!(
                f32_bits(&values[..16]),
                u32_list(&want["first_f32_bits"]),
                "{name}"
            );
            assert_eq!(
                f32_bits(&values[values.len() - 4..]),
                u32_list(&want["last_f32_bits"]),
                "{name}"
            );
        }
    }
}

/// Sums agree to rounding: the reference summed in numpy's pairwise order, we sum sequentially.
fn check_sum(values: &[f32], want_sum: f64, want_sum_abs: Option<f64>, context: &str) {
    let sum: f64 = values.iter().map(|&v| f64::from(v)).sum();
    let sum_abs: f64 = values.iter().map(|&v| f64::from(v).abs()).sum();
    let tolerance = 1e-9 * sum_abs.max(1.0);
    assert!(
        (sum - want_sum).abs() <= tolerance,
        "{context}: sum {sum} vs reference {want_sum}"
    );
    if let Some(want) = want_sum_abs {
        assert!(
            (sum_abs - want).abs() <= tolerance,
            "{context}: sum |x| {sum_abs} vs reference {want}"
        );
    }
}

#[test]
fn smollm2_135m_q4_1() {
    check_model(SMOLLM2, "llama");
    let file = GgufFile::open(model_path(SMOLLM2)).unwrap();
    let m = file.metadata();
    // Keys the llama model code needs, with the types it reads them as.
    assert_eq!(m.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(m.get_u32("llama.rope.dimension_count").unwrap(), 64);
    assert_eq!(m.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(
        m.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(
        m.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49152
    );
    assert!(
        m.get_str("tokenizer.chat_template")
            .unwrap()
            .contains("<|im_start|>")
    );
    // No separate output matrix: the head is tied to the token embedding.
    assert!(file.tensor("output.weight").is_none());
    let embd = file.tensor_info("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ggml_type, embd.cols(), embd.rows()),
        (GgmlType::Q8_0, 576, 49152)
    );
}

#[test]
fn gemma3_270m_q4_k_m() {
    check_model(GEMMA3, "gemma3");
    let file = GgufFile::open(model_path(GEMMA3)).unwrap();
    let m = file.metadata();
    assert_eq!(m.get_u32("gemma3.attention.sliding_window").unwrap(), 512);
    assert_eq!(m.get_u32("gemma3.attention.key_length").unwrap(), 256);
    assert_eq!(
        m.get_f32_array("tokenizer.ggml.scores").unwrap().len(),
        262144
    );
    assert!(matches!(
        m.get("tokenizer.ggml.add_bos_token"),
        Some(MetadataValue::Bool(true))
    ));
    assert!(file.tensor("output.weight").is_none());
    // Every block type of Q4_K_M is present, so each mapping is exercised on real data.
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_0,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::F32,
    ] {
        assert!(
            file.tensors().iter().any(|t| t.ggml_type == ty),
            "no {ty} tensor"
        );
    }
}
