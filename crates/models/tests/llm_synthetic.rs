//! The runner on tiny random GGUF models written here: quantized and dense weights of the same values
//! agree (whatever fusion their layouts allow), a prompt in one pass agrees with the same tokens in
//! chunks and one by one (sliding window included), the GPU agrees with the CPU, and bad files and
//! bad inputs give errors — never a panic.

use tinygpt_formats::{GgmlType, GgufFile, GgufWriter, MetadataValue};
use tinygpt_kernels::Backend;
use tinygpt_kernels::testing::{
    SeedRng, assert_nmse, cpu_backend, gpu_backend, gpu_backend_with_checks,
};
use tinygpt_kernels::{PathId, PathSet};
use tinygpt_models::llm::{Llm, LlmError, LoadOptions};

/// A tiny model of either architecture.
#[derive(Clone, Copy)]
struct Shape {
    arch: &'static str,
    layers: usize,
    d: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ff: usize,
    vocab: usize,
    context: usize,
}

const LLAMA: Shape = Shape {
    arch: "llama",
    layers: 2,
    d: 64,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    ff: 96,
    vocab: 80,
    context: 64,
};

/// Seven layers: five local (window 4), one global (layer 5), one local again.
const GEMMA3: Shape = Shape {
    arch: "gemma3",
    layers: 7,
    d: 64,
    heads: 2,
    kv_heads: 1,
    head_dim: 32,
    ff: 96,
    vocab: 80,
    context: 64,
};

/// Every tensor of `s`: (name, cols, rows, is a norm).
fn tensors(s: &Shape) -> Vec<(String, usize, usize, bool)> {
    let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut v = vec![
        ("token_embd.weight".to_string(), s.d, s.vocab, false),
        ("output_norm.weight".to_string(), s.d, 1, true),
    ];
    for i in 0..s.layers {
        let n = |t: &str| format!("blk.{i}.{t}.weight");
        v.extend([
            (n("attn_norm"), s.d, 1, true),
            (n("attn_q"), s.d, qd, false),
            (n("attn_k"), s.d, kvd, false),
            (n("attn_v"), s.d, kvd, false),
            (n("attn_output"), qd, s.d, false),
            (n("ffn_norm"), s.d, 1, true),
            (n("ffn_gate"), s.d, s.ff, false),
            (n("ffn_up"), s.d, s.ff, false),
            (n("ffn_down"), s.ff, s.d, false),
        ]);
        if s.arch == "gemma3" {
            v.extend([
                (n("attn_q_norm"), s.head_dim, 1, true),
                (n("attn_k_norm"), s.head_dim, 1, true),
                (n("post_attention_norm"), s.d, 1, true),
                (n("post_ffw_norm"), s.d, 1, true),
            ]);
        }
    }
    v
}

/// GGUF bytes of `s` with each matrix's type from `ty` and its values from `values`.
fn write(
    s: &Shape,
    ty: &dyn Fn(&str) -> GgmlType,
    values: &dyn Fn(&str, usize) -> Vec<f32>,
) -> Vec<u8> {
    write_with(s, ty, values, &[])
}

/// [`write`] with some metadata values replaced (`key` without the architecture prefix).
fn write_with(
    s: &Shape,
    ty: &dyn Fn(&str) -> GgmlType,
    values: &dyn Fn(&str, usize) -> Vec<f32>,
    replace: &[(&str, MetadataValue)],
) -> Vec<u8> {
    let mut w = GgufWriter::new();
    let k = |key: &str| format!("{}.{key}", s.arch);
    let mut md: Vec<(String, MetadataValue)> = vec![
        ("general.architecture".into(), s.arch.into()),
        (k("block_count"), (s.layers as u32).into()),
        (k("embedding_length"), (s.d as u32).into()),
        (k("feed_forward_length"), (s.ff as u32).into()),
        (k("attention.head_count"), (s.heads as u32).into()),
        (k("attention.head_count_kv"), (s.kv_heads as u32).into()),
        (k("attention.key_length"), (s.head_dim as u32).into()),
        (k("context_length"), (s.context as u32).into()),
        (k("attention.layer_norm_rms_epsilon"), 1e-5f32.into()),
        (k("rope.freq_base"), 10000.0f32.into()),
    ];
    for (key, v) in replace {
        if let Some(e) = md.iter_mut().find(|e| e.0 == k(key)) {
            e.1 = v.clone();
        }
    }
    for (key, v) in md {
        w.add_metadata(key, v).expect("metadata");
    }
    if s.arch == "gemma3" {
        w.add_metadata(k("attention.sliding_window"), 4u32)
            .expect("metadata");
    }
    for (name, cols, rows, norm) in tensors(s) {
        let t = if norm { GgmlType::F32 } else { ty(&name) };
        let dims = [cols as u64, rows as u64];
        let dims = &dims[..if rows == 1 { 1 } else { 2 }];
        if t.can_dequantize() {
            w.add_tensor_f32(&name, dims, t, &values(&name, cols * rows))
                .expect("tensor");
        } else {
            // A type the formats crate cannot encode: zero bytes of the right size.
            let n = t.bytes_for((cols * rows) as u64).expect("whole blocks") as usize;
            w.add_tensor_bytes(&name, dims, t, vec![0; n])
                .expect("tensor");
        }
    }
    w.to_bytes().expect("bytes")
}

/// Random values: norms near 1, matrices in ±0.3 (embeddings ±1), the same for a name every time.
fn random(name: &str, n: usize) -> Vec<f32> {
    let seed = name.bytes().fold(1469598103934665603u64, |h, b| {
        (h ^ b as u64).wrapping_mul(1099511628211)
    });
    let mut rng = SeedRng::new(seed);
    if name.contains("norm") {
        rng.vec(n, 0.8, 1.2)
    } else if name.starts_with("token_embd") {
        rng.vec(n, -1.0, 1.0)
    } else {
        rng.vec(n, -0.3, 0.3)
    }
}

/// A quantized model and its dense twin holding exactly the dequantized values.
fn quantized_and_dense(s: &Shape, ty: &dyn Fn(&str) -> GgmlType) -> (GgufFile, GgufFile) {
    let q = GgufFile::from_bytes(write(s, ty, &random)).expect("quantized file");
    let dense = write(s, &|_| GgmlType::F32, &|name, _| {
        q.dequantize(name).expect("dequantize")
    });
    (q, GgufFile::from_bytes(dense).expect("dense file"))
}

fn load(be: &Backend, f: &GgufFile, batch: usize) -> Llm {
    load_with(be, f, batch, PathSet::F32)
}

fn load_with(be: &Backend, f: &GgufFile, batch: usize, paths: PathSet) -> Llm {
    Llm::from_gguf(
        be,
        f,
        &LoadOptions {
            context: None,
            batch,
            paths,
            ..LoadOptions::default()
        },
        &mut |_| {},
    )
    .expect("loads")
}

const PROMPT: [u32; 12] = [3, 17, 42, 5, 79, 0, 23, 23, 61, 8, 30, 11];

/// The prompt's last logits, then those of three decoded tokens, concatenated.
fn run(be: &Backend, llm: &mut Llm) -> Vec<f32> {
    llm.reset();
    let mut out = llm.prefill(be, &PROMPT).expect("prefill");
    for t in [7, 70, 1] {
        out.extend(llm.decode(be, t).expect("decode"));
    }
    out
}

fn mixed_types(name: &str) -> GgmlType {
    match name.rsplit('.').nth(1).unwrap_or("") {
        "attn_q" => GgmlType::Q4_1,
        "attn_k" => GgmlType::Q4_0,
        "attn_v" | "ffn_down" | "token_embd" => GgmlType::Q8_0,
        "ffn_gate" => GgmlType::Q5_0,
        _ => GgmlType::Q4_1,
    }
}

#[test]
fn quantized_and_dense_weights_give_the_same_logits() {
    let be = cpu_backend();
    for s in [LLAMA, GEMMA3] {
        for (label, ty, qkv_groups) in [
            (
                "all Q8_0",
                (&|_: &str| GgmlType::Q8_0) as &dyn Fn(&str) -> GgmlType,
                "in 1",
            ),
            ("mixed", &mixed_types, "3 in 2"),
        ] {
            let (q, d) = quantized_and_dense(&s, ty);
            let mut lq = load(&be, &q, 512);
            let mut ld = load(&be, &d, 512);
            // Fusion follows the kernel layouts: Q4_0 and Q4_1 share the 4-bit layout, Q8_0 has its own.
            let paths = lq.layouts();
            assert!(
                paths[0].1.contains(qkv_groups),
                "{} {label}: qkv fused as {}",
                s.arch,
                paths[0].1
            );
            assert_nmse(
                &format!("{} {label}", s.arch),
                &run(&be, &mut ld),
                &run(&be, &mut lq),
                1e-10,
            );
        }
    }
}

#[test]
fn one_pass_chunks_and_single_tokens_agree() {
    let be = cpu_backend();
    for s in [LLAMA, GEMMA3] {
        let (q, _) = quantized_and_dense(&s, &mixed_types);
        let whole = run(&be, &mut load(&be, &q, 512));
        let chunks = run(&be, &mut load(&be, &q, 5));
        let single = run(&be, &mut load(&be, &q, 1));
        assert!(whole.iter().all(|x| x.is_finite()));
        assert_nmse(&format!("{} chunks of 5", s.arch), &whole, &chunks, 1e-10);
        assert_nmse(
            &format!("{} one token per pass", s.arch),
            &whole,
            &single,
            1e-10,
        );
    }
}

#[test]
fn the_sliding_window_limits_what_local_layers_see() {
    // A one-layer Gemma 3 model is one local layer: the last position's logits depend on the tokens
    // inside its window only.
    let be = cpu_backend();
    let one_local = Shape {
        layers: 1,
        ..GEMMA3
    };
    let f = GgufFile::from_bytes(write(&one_local, &|_| GgmlType::Q8_0, &random)).expect("file");
    let mut llm = load(&be, &f, 512);
    let mut last = |ids: [u32; 6]| {
        llm.reset();
        llm.prefill(&be, &ids).expect("prefill")
    };
    let a = last([1, 2, 3, 4, 5, 6]);
    // The query at position 5 sees keys 2..=5 (k > q - window).
    assert_eq!(
        a,
        last([9, 2, 3, 4, 5, 6]),
        "position 0 is outside the window"
    );
    assert_eq!(
        a,
        last([1, 9, 3, 4, 5, 6]),
        "position 1 is outside the window"
    );
    assert_ne!(
        a,
        last([1, 2, 9, 4, 5, 6]),
        "position 2 is inside the window"
    );
}

#[test]
fn gpu_agrees_with_cpu_quantized_and_dequantized() {
    let cpu = cpu_backend();
    let Some(gpu) = gpu_backend(None) else { return };
    for s in [LLAMA, GEMMA3] {
        let (q, _) = quantized_and_dense(&s, &mixed_types);
        let want = run(&cpu, &mut load(&cpu, &q, 5));
        // Both ways the GPU may hold the weights: as blocks (the gated quantized kernels) and
        // dequantized (the f32 path used when that gate fails).
        for active in [true, false] {
            let paths = if active {
                PathSet::of(&[PathId::QuantMatmul])
            } else {
                PathSet::F32
            };
            let got = run(&gpu, &mut load_with(&gpu, &q, 5, paths));
            assert_nmse(
                &format!("{} gpu, quantized kernels {active}", s.arch),
                &want,
                &got,
                1e-9,
            );
        }
    }
}

/// The kernels run compiled without naga's runtime checks (indices clamped, loops bounded): a prompt
/// and three decoded tokens of both architectures give the logits of the same kernels compiled with
/// them, bit for bit, on the quantized kernels and on the f32 path.
#[test]
fn decoding_gives_the_same_bits_with_and_without_shader_runtime_checks() {
    let (Some(plain), Some(checked)) = (
        gpu_backend_with_checks(false),
        gpu_backend_with_checks(true),
    ) else {
        return;
    };
    for s in [LLAMA, GEMMA3] {
        let (q, _) = quantized_and_dense(&s, &mixed_types);
        for paths in [PathSet::of(&[PathId::QuantMatmul]), PathSet::F32] {
            let a = run(&plain, &mut load_with(&plain, &q, 5, paths));
            let c = run(&checked, &mut load_with(&checked, &q, 5, paths));
            let same =
                a.len() == c.len() && a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{} logits differ ({paths:?})", s.arch);
        }
    }
}

fn load_err(bytes: Vec<u8>, opts: &LoadOptions) -> LlmError {
    let f = GgufFile::from_bytes(bytes).expect("a valid container");
    match Llm::from_gguf(&cpu_backend(), &f, opts, &mut |_| {}) {
        Ok(_) => panic!("loaded a model that should have been refused"),
        Err(e) => e,
    }
}

#[test]
fn unsupported_models_are_refused_with_one_clear_error() {
    let opts = LoadOptions::default();
    let q8 = |_: &str| GgmlType::Q8_0;

    let phi = Shape {
        arch: "phi3",
        ..LLAMA
    };
    let e = load_err(write(&phi, &q8, &random), &opts);
    assert!(
        matches!(e, LlmError::UnsupportedArch(ref a) if a == "phi3"),
        "{e}"
    );
    assert!(
        e.to_string().contains("phi3")
            && e.to_string().contains("llama, gemma3, qwen2, qwen3, gpt2"),
        "{e}"
    );

    let e = load_err(
        write(
            &LLAMA,
            &|n| {
                if n == "blk.1.ffn_up.weight" {
                    GgmlType::Q5_1
                } else {
                    GgmlType::Q8_0
                }
            },
            &random,
        ),
        &opts,
    );
    assert!(
        matches!(e, LlmError::UnsupportedTensorType { ref tensor, ggml_type: GgmlType::Q5_1 } if tensor == "blk.1.ffn_up.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("Q5_1"), "{e}");

    // An extra tensor means a feature the runner would silently drop (here, a bias).
    let mut w = GgufWriter::new();
    let base = GgufFile::from_bytes(write(&LLAMA, &q8, &random)).expect("file");
    for (k, v) in base.metadata().iter() {
        w.add_metadata(k, v.clone()).expect("metadata");
    }
    for t in base.tensors() {
        w.add_tensor_bytes(
            &t.name,
            &t.dims,
            t.ggml_type,
            base.tensor_data(t).expect("data").to_vec(),
        )
        .expect("tensor");
    }
    w.add_tensor_f32("blk.0.attn_q.bias", &[64], GgmlType::F32, &[0.0; 64])
        .expect("bias");
    let e = load_err(w.to_bytes().expect("bytes"), &opts);
    assert!(e.to_string().contains("blk.0.attn_q.bias"), "{e}");

    // Hyperparameters that contradict the tensors.
    let e = load_err(
        write_with(
            &LLAMA,
            &q8,
            &random,
            &[("feed_forward_length", 128u32.into())],
        ),
        &opts,
    );
    assert!(
        matches!(e, LlmError::Invalid(_)) && e.to_string().contains("ffn_gate"),
        "{e}"
    );
    let e = load_err(
        write_with(
            &LLAMA,
            &q8,
            &random,
            &[("attention.head_count", 3u32.into())],
        ),
        &opts,
    );
    assert!(matches!(e, LlmError::Invalid(_)), "{e}");
    let e = load_err(
        write_with(
            &LLAMA,
            &q8,
            &random,
            &[("attention.head_count", u32::MAX.into())],
        ),
        &opts,
    );
    assert!(matches!(e, LlmError::Invalid(_)), "{e}");

    let e = load_err(
        write(&LLAMA, &q8, &random),
        &LoadOptions {
            context: Some(65),
            batch: 8,
            ..LoadOptions::default()
        },
    );
    assert!(
        e.to_string().contains("65") && e.to_string().contains("64"),
        "{e}"
    );
}

/// `bytes` (a GGUF file) with `patch` written over tensor `name`'s data from byte `at`.
fn patched(bytes: Vec<u8>, name: &str, at: usize, patch: &[u8]) -> Vec<u8> {
    let base = GgufFile::from_bytes(bytes).expect("file");
    let mut w = GgufWriter::new();
    for (k, v) in base.metadata().iter() {
        w.add_metadata(k, v.clone()).expect("metadata");
    }
    for t in base.tensors() {
        let mut data = base.tensor_data(t).expect("data").to_vec();
        if t.name == name {
            data[at..at + patch.len()].copy_from_slice(patch);
        }
        w.add_tensor_bytes(&t.name, &t.dims, t.ggml_type, data)
            .expect("tensor");
    }
    w.to_bytes().expect("bytes")
}

/// A matrix whose values, block scales or block minimums are not finite (a damaged file) is refused
/// at load, naming the tensor, rather than run into NaN logits.
#[test]
fn non_finite_weights_or_block_scales_are_refused_at_load() {
    let opts = LoadOptions::default();
    let (nan, inf) = (0x7e00u16.to_le_bytes(), 0x7c00u16.to_le_bytes());
    let refused = |bytes: Vec<u8>, tensor: &str, what: &str| {
        let e = load_err(bytes, &opts);
        assert!(matches!(e, LlmError::Invalid(_)), "{e}");
        let m = e.to_string();
        assert!(m.contains(tensor) && m.contains(what), "{m}");
    };
    // Q8_0 blocks: an f16 scale, then 32 quants (34 bytes); block 3's scale made NaN.
    let q8 = write(&LLAMA, &|_| GgmlType::Q8_0, &random);
    refused(
        patched(q8.clone(), "blk.0.attn_k.weight", 3 * 34, &nan),
        "blk.0.attn_k.weight",
        "non-finite block scale (NaN)",
    );
    refused(
        patched(q8, "token_embd.weight", 0, &inf),
        "token_embd.weight",
        "non-finite block scale (inf)",
    );
    // Q4_1 blocks: an f16 scale, an f16 minimum, 16 bytes of quants (20 bytes); a minimum made inf.
    let q4 = write(&LLAMA, &|_| GgmlType::Q4_1, &random);
    refused(
        patched(q4, "blk.1.ffn_down.weight", 20 + 2, &inf),
        "blk.1.ffn_down.weight",
        "non-finite block minimum (inf)",
    );
    // A dense matrix holding a NaN.
    let dense = write(&LLAMA, &|_| GgmlType::F32, &|name: &str, n| {
        let mut v = random(name, n);
        if name == "blk.0.attn_v.weight" {
            v[n / 2] = f32::NAN;
        }
        v
    });
    refused(dense, "blk.0.attn_v.weight", "non-finite value (NaN)");
}

#[test]
fn inputs_past_the_context_or_the_vocabulary_are_refused() {
    let be = cpu_backend();
    let f = GgufFile::from_bytes(write(&LLAMA, &|_| GgmlType::Q8_0, &random)).expect("file");
    let mut llm = Llm::from_gguf(
        &be,
        &f,
        &LoadOptions {
            context: Some(16),
            batch: 4,
            ..LoadOptions::default()
        },
        &mut |_| {},
    )
    .expect("loads");
    let e = llm
        .prefill(&be, &[1; 17])
        .expect_err("17 tokens in a context of 16");
    assert!(
        matches!(
            e,
            LlmError::ContextFull {
                tokens: 17,
                used: 0,
                limit: 16
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("16"), "{e}");
    llm.prefill(&be, &[1; 16]).expect("16 tokens fit");
    assert!(matches!(
        llm.decode(&be, 1),
        Err(LlmError::ContextFull { used: 16, .. })
    ));
    llm.reset();
    let e = llm
        .prefill(&be, &[1, 80])
        .expect_err("id 80 in a vocabulary of 80");
    assert!(
        matches!(e, LlmError::TokenOutOfRange { id: 80, vocab: 80 }),
        "{e}"
    );
    assert_eq!(
        llm.position(),
        0,
        "a refused input leaves the cache as it was"
    );
    assert!(llm.prefill(&be, &[]).is_err());
}

#[test]
fn corrupted_files_never_panic() {
    let be = cpu_backend();
    for s in [LLAMA, GEMMA3] {
        let good = write(&s, &mixed_types, &random);
        let mut rng = SeedRng::new(99);
        let mut ran = 0;
        let header_end = GgufFile::from_bytes(good.clone())
            .expect("file")
            .tensors()
            .iter()
            .map(|t| t.data_start)
            .min()
            .unwrap_or(0) as usize;
        for case in 0..300 {
            let mut bytes = good.clone();
            match case % 3 {
                // Truncated anywhere.
                0 => bytes.truncate(rng.below(good.len())),
                // A few bytes flipped in the header (metadata and tensor records)...
                1 => (0..1 + rng.below(4)).for_each(|_| {
                    bytes[rng.below(header_end.min(good.len()))] ^= 1 << rng.below(8)
                }),
                // ...or anywhere (weights and scales included: NaN and Inf must not crash either).
                _ => (0..1 + rng.below(8)).for_each(|_| {
                    let i = rng.below(bytes.len());
                    bytes[i] = rng.next_u64() as u8
                }),
            }
            let Ok(f) = GgufFile::from_bytes(bytes) else {
                continue;
            };
            let Ok(mut llm) = Llm::from_gguf(
                &be,
                &f,
                &LoadOptions {
                    context: Some(32),
                    batch: 8,
                    ..LoadOptions::default()
                },
                &mut |_| {},
            ) else {
                continue;
            };
            let _ = llm.prefill(&be, &PROMPT).and_then(|_| llm.decode(&be, 3));
            ran += 1;
        }
        // Damaged weights load and run (to whatever numbers); the rest must have been refused.
        assert!(ran >= 30, "{}: only {ran} of 300 damaged files ran", s.arch);
    }
}

/// Sequences decoded together in one pass get exactly the logits each gets decoded alone (a server's
/// batch must not change anyone's text), on the CPU and on the GPU with either weight layout.
#[test]
fn batched_decoding_matches_each_sequence_alone() {
    let mut backends = vec![(cpu_backend(), PathSet::F32)];
    if let Some(g) = gpu_backend(None) {
        backends.push((gpu_backend(None).expect("gpu"), PathSet::F32));
        backends.push((g, PathSet::of(&[PathId::QuantMatmul])));
    }
    // Different prompt lengths, so the sequences sit at different positions; 11 of them exceed the
    // GPU's 8-row decode kernel.
    let prompts: Vec<Vec<u32>> = (0..11)
        .map(|i| PROMPT[..1 + i % PROMPT.len()].to_vec())
        .collect();
    for s in [LLAMA, GEMMA3] {
        let (q, _) = quantized_and_dense(&s, &mixed_types);
        for (be, paths) in &backends {
            let opts = LoadOptions {
                context: Some(32),
                batch: 16,
                paths: *paths,
                parallel: 16,
                sequences: 16,
            };
            let mut llm = Llm::from_gguf(be, &q, &opts, &mut |_| {}).expect("loads");
            // A lone row folds Gemma's post-norms into the next product (on lavapipe too, where it is
            // off by default), a batch's rows run them as ops: the two must give the same bits.
            llm.set_fold_post_norms(true);
            // Alone: each prompt, then two tokens, one sequence at a time.
            let mut alone = Vec::new();
            for p in &prompts {
                llm.reset();
                llm.feed(be, p).unwrap();
                let mut out = Vec::new();
                for t in [7, 70] {
                    out.push(llm.decode(be, t).unwrap());
                }
                alone.push(out);
            }
            // Together: the same prompts in their own sequences, then both tokens in batched passes.
            let mut seqs: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let mut sq = llm.new_sequence().unwrap();
                    llm.feed_sequence(be, &mut sq, p).unwrap();
                    sq
                })
                .collect();
            for (step, t) in [7u32, 70].into_iter().enumerate() {
                let mut steps: Vec<_> = seqs.iter_mut().map(|sq| (sq, t)).collect();
                llm.decode_batch(be, &mut steps).unwrap();
                let rows = pollster::block_on(llm.read_logits_batch(be, prompts.len())).unwrap();
                for (i, row) in rows.iter().enumerate() {
                    assert!(
                        row == &alone[i][step],
                        "{} on {} ({paths:?}): sequence {i} step {step} differs when batched",
                        s.arch,
                        be.kind()
                    );
                }
            }
            assert!(seqs.iter().all(|sq| sq.position() >= 3));
        }
    }
}

/// Generation as `run` does it — on a GPU with the quantized path, greedy picks stay on the device and
/// each pass is recorded before the host sees the token before — gives the tokens of the plain loop
/// (decode, read the logits, argmax on the host) and leaves the sequence at the same position, whether
/// it stops at the token limit, on an end-of-generation token or because the caller says so.
#[test]
fn generation_on_the_device_matches_the_host_loop() {
    use tinygpt_models::llm::{Finish, generate};
    use tinygpt_models::sampler::{Sampler, SamplerConfig, argmax};
    let mut backends = vec![(cpu_backend(), PathSet::F32)];
    if let Some(g) = gpu_backend(None) {
        backends.push((g, PathSet::of(&[PathId::QuantMatmul])));
    }
    for s in [LLAMA, GEMMA3] {
        let (q, _) = quantized_and_dense(&s, &mixed_types);
        for (be, paths) in &backends {
            let mut llm = load_with(be, &q, 512, *paths);
            // The plain loop: 12 tokens.
            llm.reset();
            let mut logits = llm.prefill(be, &PROMPT).unwrap();
            let mut want = Vec::new();
            for _ in 0..12 {
                let id = argmax(&logits);
                want.push(id);
                logits = llm.decode(be, id).unwrap();
            }
            let greedy = || {
                Sampler::new(SamplerConfig {
                    temperature: 0.0,
                    ..Default::default()
                })
            };
            // (max tokens, end-of-generation id, stop after) -> tokens handed over, finish, position.
            let eog = want[6];
            let first_eog = want.iter().position(|&t| t == eog).unwrap();
            for (max_new, eog, stop_after, finish, n) in [
                (10, None, None, Finish::MaxTokens, 10),
                (12, Some(eog), None, Finish::EndOfGeneration, first_eog),
                (12, None, Some(4), Finish::Stopped, 4),
                (1, None, None, Finish::MaxTokens, 1),
            ] {
                llm.reset();
                llm.feed(be, &PROMPT).unwrap();
                let mut got = Vec::new();
                let g = pollster::block_on(generate(
                    be,
                    &mut llm,
                    &mut greedy(),
                    max_new,
                    |id| Some(id) == eog,
                    async |id| -> Result<bool, LlmError> {
                        got.push(id);
                        Ok(Some(got.len()) != stop_after)
                    },
                ))
                .unwrap();
                let what = format!(
                    "{} on {} ({max_new}, {eog:?}, {stop_after:?})",
                    s.arch,
                    be.kind()
                );
                assert_eq!(got, want[..n], "{what}: tokens");
                assert_eq!((g.finish, g.tokens), (finish, n), "{what}");
                // Fed: the prompt and every token but the last (an end-of-generation token never).
                let fed = if finish == Finish::EndOfGeneration {
                    n
                } else {
                    n - 1
                };
                assert_eq!(llm.position(), PROMPT.len() + fed, "{what}: position");
                assert_eq!(g.passes, fed, "{what}: passes");
                // The sequence goes on from there exactly as the plain loop's.
                let next = llm.decode(be, want[fed]).unwrap();
                llm.reset();
                let mut l2 = llm.prefill(be, &PROMPT).unwrap();
                for &t in &want[..=fed] {
                    l2 = llm.decode(be, t).unwrap();
                }
                assert!(next == l2, "{what}: the sequence continues differently");
            }
        }
    }
}

/// A GPU lost in the middle of generation (here destroyed, as a driver reset loses it) ends generation
/// with an error that says so, promptly: no hang, no panic, no tokens made up.
#[test]
fn a_lost_device_stops_generation_with_a_clear_error() {
    use tinygpt_models::llm::generate;
    use tinygpt_models::sampler::{Sampler, SamplerConfig};
    if tinygpt_kernels::testing::skip_gpu() {
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let be = gpu_backend(None).expect("a GPU");
        let (q, _) = quantized_and_dense(&LLAMA, &mixed_types);
        let mut llm = load_with(&be, &q, 512, PathSet::of(&[PathId::QuantMatmul]));
        llm.feed(&be, &PROMPT).unwrap();
        let mut made = 0;
        let mut greedy = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        });
        let r = pollster::block_on(generate(
            &be,
            &mut llm,
            &mut greedy,
            40,
            |_| false,
            async |_| -> Result<bool, LlmError> {
                made += 1;
                if made == 5 {
                    be.as_gpu().unwrap().destroy_device();
                }
                Ok(true)
            },
        ));
        let _ = tx.send((r.map(|g| g.tokens), made));
    });
    let (r, made) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("generation on a lost device hangs");
    let e = r.expect_err("generation on a lost device succeeded");
    assert!(made < 40, "tokens kept coming after the device was lost");
    let msg = e.to_string();
    assert!(msg.to_lowercase().contains("lost"), "unclear error: {msg}");
}

/// LLAMA with room for long generations (the drift guard's checks reach position 511).
const LONG: Shape = Shape {
    context: 1024,
    ..LLAMA
};

/// Generation of `n` tokens after the prompt, watched by a guard checking every 128 tokens (each
/// check's step against the CPU's f32 path, in line or on the shadow's thread); returns the tokens,
/// the guard's events and what it measured.
fn guarded_run(
    be: &Backend,
    llm: &mut Llm,
    bytes: &[u8],
    n: usize,
    temperature: f32,
    background: bool,
) -> (
    Vec<u32>,
    Vec<tinygpt_models::llm::DriftEvent>,
    tinygpt_models::llm::drift::DriftStats,
) {
    use tinygpt_models::llm::{DriftGuard, generate_guarded};
    use tinygpt_models::sampler::{Sampler, SamplerConfig};
    let file = GgufFile::from_bytes(bytes.to_vec()).unwrap();
    let mut guard = DriftGuard::new(file, llm.context(), 128, Some(1), background);
    llm.reset();
    llm.feed(be, &PROMPT).unwrap();
    let mut sampler = Sampler::new(SamplerConfig {
        temperature,
        seed: 7,
        ..Default::default()
    });
    let (mut got, mut events) = (Vec::new(), Vec::new());
    let g = pollster::block_on(generate_guarded(
        be,
        llm,
        &mut sampler,
        n,
        |_| false,
        async |id| -> Result<bool, LlmError> {
            got.push(id);
            Ok(true)
        },
        Some(&mut guard),
        |e| events.push(e.clone()),
    ))
    .unwrap();
    assert_eq!(g.tokens, n);
    (got, events, guard.stats())
}

/// The drift guard on a healthy fast path: every check agrees with the f32 path (far inside the bound),
/// the run stays on its fast path and its tokens are those of an unguarded run — greedy on the device
/// and sampled on the host alike.
#[test]
fn the_drift_guard_leaves_a_healthy_fast_path_alone() {
    use tinygpt_models::llm::generate;
    use tinygpt_models::sampler::{Sampler, SamplerConfig};
    let Some(be) = gpu_backend(None) else { return };
    let bytes = write(&LONG, &|_| GgmlType::Q8_0, &random);
    let q = GgufFile::from_bytes(bytes.clone()).unwrap();
    let fast = PathSet::of(&[PathId::QuantMatmul]);
    let mut llm = load_with(&be, &q, 512, fast);
    for (temperature, background) in [(0.0, true), (0.8, false)] {
        let (got, events, stats) = guarded_run(&be, &mut llm, &bytes, 560, temperature, background);
        assert!(events.is_empty(), "{events:?}");
        assert_eq!(stats.checks, 4, "checks at positions 127, 255, 383 and 511");
        assert!(stats.worst_ratio < 0.01, "{stats:?}");
        assert_eq!(llm.paths(), fast);
        // The same run without the guard.
        llm.reset();
        llm.feed(&be, &PROMPT).unwrap();
        let mut plain = Vec::new();
        let mut sampler = Sampler::new(SamplerConfig {
            temperature,
            seed: 7,
            ..Default::default()
        });
        pollster::block_on(generate(
            &be,
            &mut llm,
            &mut sampler,
            560,
            |_| false,
            async |id| -> Result<bool, LlmError> {
                plain.push(id);
                Ok(true)
            },
        ))
        .unwrap();
        assert_eq!(got, plain, "temperature {temperature}");
    }
}

/// A planted fault whose error appears only from position 500 on passes the start-up token gate (100
/// greedy tokens, fast paths against the f32 path) and is caught by the drift guard at its first
/// check past 500; generation goes on, on the f32 path, whose state is then exactly that of a model
/// loaded on the f32 path and fed the same tokens.
#[test]
fn the_drift_guard_catches_a_fault_the_start_up_gates_pass() {
    use tinygpt_kernels::path::Fault;
    use tinygpt_models::sampler::argmax;
    let Some(be) = gpu_backend(None) else { return };
    let bytes = write(&LONG, &|_| GgmlType::Q8_0, &random);
    let q = GgufFile::from_bytes(bytes.clone()).unwrap();
    let faulty = PathSet::of(&[PathId::QuantMatmul]).with_fault(Some(Fault::RopePast500));
    let mut reference = load_with(&be, &q, 512, PathSet::F32);
    // The token gate's comparison: 100 greedy tokens from the prompt agree.
    let greedy = |llm: &mut Llm, n: usize| -> Vec<u32> {
        llm.reset();
        let mut logits = llm.prefill(&be, &PROMPT).unwrap();
        let mut out = Vec::new();
        for _ in 0..n {
            let id = argmax(&logits);
            out.push(id);
            logits = llm.decode(&be, id).unwrap();
        }
        out
    };
    let mut llm = load_with(&be, &q, 512, faulty);
    assert_eq!(greedy(&mut llm, 100), greedy(&mut reference, 100));
    for (temperature, background) in [(0.0, true), (0.0, false), (0.8, true), (0.8, false)] {
        let mut llm = load_with(&be, &q, 512, faulty);
        let (got, events, stats) = guarded_run(&be, &mut llm, &bytes, 560, temperature, background);
        assert_eq!(
            events.len(),
            1,
            "temperature {temperature}: {events:?} {stats:?}"
        );
        let e = &events[0];
        eprintln!("temperature {temperature}: {e:?}");
        assert_eq!(e.position, 511, "{e:?}");
        assert!(e.kl > e.bound, "{e:?}");
        assert_eq!(e.paths, faulty);
        assert_eq!((e.checks, stats.checks), (4, 4));
        assert_eq!(
            llm.paths(),
            PathSet::F32,
            "the fast paths are off for the rest of the run"
        );
        assert_eq!(got.len(), 560);
        // The model now holds the prompt and every token but the last, computed on the f32 path.
        let history = llm.history().to_vec();
        assert_eq!(history.len(), PROMPT.len() + 559);
        assert_eq!(history[PROMPT.len()..], got[..559]);
        let last = llm.decode(&be, got[559]).unwrap();
        reference.reset();
        reference.feed(&be, &history).unwrap();
        let want = reference.decode(&be, got[559]).unwrap();
        assert_nmse("after the switch", &want, &last, 1e-10);
    }
}

/// A server's sequences decoded side by side, watched by one guard (`tinygpt serve`): the planted fault
/// that appears from position 500 on trips it at the first check past 500 of whichever sequence gets
/// there; the model and every sequence then move to the f32 path, each sequence's cache recomputed
/// from its tokens, so each one's next logits are those of the f32 model fed the same tokens.
#[test]
fn the_drift_guard_watches_a_servers_sequences() {
    use tinygpt_kernels::path::Fault;
    use tinygpt_models::llm::{DriftGuard, Sequence};
    use tinygpt_models::sampler::argmax;
    let Some(be) = gpu_backend(None) else { return };
    let bytes = write(&LONG, &|_| GgmlType::Q8_0, &random);
    let q = GgufFile::from_bytes(bytes.clone()).unwrap();
    let faulty = PathSet::of(&[PathId::QuantMatmul]).with_fault(Some(Fault::RopePast500));
    let load = |paths| {
        Llm::from_gguf(
            &be,
            &q,
            &LoadOptions {
                context: Some(600),
                batch: 64,
                paths,
                parallel: 3,
                sequences: 3,
            },
            &mut |_| {},
        )
        .expect("loads")
    };
    let mut llm = load(faulty);
    let mut guard = DriftGuard::new(
        GgufFile::from_bytes(bytes.clone()).unwrap(),
        600,
        128,
        Some(1),
        true,
    );
    // Three prompts of different lengths: the sequences reach their checks at different steps.
    let mut seqs: Vec<Sequence> = (0..3).map(|_| llm.new_sequence().unwrap()).collect();
    let mut hist: Vec<Vec<u32>> = Vec::new();
    for (i, s) in seqs.iter_mut().enumerate() {
        let prompt = &PROMPT[..PROMPT.len() - 3 * i];
        llm.feed_sequence(&be, s, prompt).unwrap();
        hist.push(prompt.to_vec());
    }
    let mut next: Vec<u32> = vec![1, 2, 3];
    let mut event = None;
    let mut checks_before_trip = 0;
    for _ in 0..520 {
        let ids = next.clone();
        {
            let mut steps: Vec<(&mut Sequence, u32)> = seqs.iter_mut().zip(ids.clone()).collect();
            llm.decode_batch(&be, &mut steps).unwrap();
        }
        for (h, id) in hist.iter_mut().zip(&ids) {
            h.push(*id);
        }
        let rows = pollster::block_on(llm.read_logits_batch(&be, 3)).unwrap();
        next = rows.iter().map(|r| argmax(r)).collect();
        if event.is_none() {
            event = guard.poll_sequences(&be, &mut llm).unwrap();
        }
        for i in 0..3 {
            if event.is_none() && guard.due(seqs[i].position() - 1) {
                checks_before_trip += 1;
                event =
                    pollster::block_on(guard.check_sequence(&be, &mut llm, &seqs[i], &hist[i], i))
                        .unwrap();
            }
        }
        if event.is_some() {
            break;
        }
    }
    let e = event.expect("the guard trips");
    eprintln!("{e:?} after {checks_before_trip} checks");
    assert!(e.position >= 500 && e.position < 512 + 128, "{e:?}");
    assert!(e.kl > e.bound, "{e:?}");
    assert_eq!(e.paths, faulty);
    assert!(!guard.due(639), "a tripped guard checks no more");
    // The caller moves the model and every sequence.
    {
        let mut all: Vec<(&mut Sequence, &[u32])> = seqs
            .iter_mut()
            .zip(&hist)
            .map(|(s, h)| (s, h.as_slice()))
            .collect();
        llm.switch_paths_with(&be, guard.file(), PathSet::F32, &mut all)
            .unwrap();
    }
    assert_eq!(llm.paths(), PathSet::F32);
    let mut steps: Vec<(&mut Sequence, u32)> = seqs.iter_mut().zip(next.clone()).collect();
    llm.decode_batch(&be, &mut steps).unwrap();
    let rows = pollster::block_on(llm.read_logits_batch(&be, 3)).unwrap();
    let mut reference = load_with(&be, &q, 64, PathSet::F32);
    for i in 0..3 {
        reference.reset();
        reference.feed(&be, &hist[i]).unwrap();
        let want = reference.decode(&be, next[i]).unwrap();
        assert_nmse(
            &format!("sequence {i} after the switch"),
            &want,
            &rows[i],
            1e-10,
        );
    }
}

/// A model that starts on the f32 path while its fast paths are gated elsewhere moves to them between
/// two tokens (`generate_watched`'s switch, as `run` and `chat` take a background gate's verdict):
/// generation goes on without a gap or a repeated token, on the fast paths from then on, and the
/// model's state is exactly that of a model loaded on them and fed the same tokens.
#[test]
fn a_model_moves_to_its_fast_paths_between_two_tokens() {
    use tinygpt_models::llm::generate_watched;
    use tinygpt_models::sampler::{Sampler, SamplerConfig};
    let Some(be) = gpu_backend(None) else { return };
    let bytes = write(&LONG, &|_| GgmlType::Q8_0, &random);
    let q = GgufFile::from_bytes(bytes.clone()).unwrap();
    let fast = PathSet::of(&[PathId::QuantMatmul]);
    for temperature in [0.0, 0.8] {
        let mut llm = load_with(&be, &q, 512, PathSet::F32);
        llm.feed(&be, &PROMPT).unwrap();
        let mut sampler = Sampler::new(SamplerConfig {
            temperature,
            seed: 7,
            ..Default::default()
        });
        let (mut got, mut calls, mut moved_at) = (Vec::new(), 0, None);
        let g = pollster::block_on(generate_watched(
            &be,
            &mut llm,
            &mut sampler,
            24,
            |_| false,
            async |id| -> Result<bool, LlmError> {
                got.push(id);
                Ok(true)
            },
            None,
            |_| {},
            |llm| {
                calls += 1;
                if calls != 6 {
                    return Ok(false);
                }
                moved_at = Some(llm.position());
                llm.switch_paths(&be, &q, fast)?;
                Ok(true)
            },
        ))
        .unwrap();
        let what = format!("temperature {temperature}");
        assert_eq!((g.tokens, got.len()), (24, 24), "{what}");
        assert_eq!(
            llm.paths(),
            fast,
            "{what}: on the fast paths after the switch"
        );
        let at = moved_at.expect("the switch was asked at the sixth step");
        assert!(at > PROMPT.len(), "{what}: switched at {at}");
        // The prompt and every token but the last, in order: nothing lost or fed twice.
        let history = llm.history().to_vec();
        assert_eq!(history.len(), PROMPT.len() + 23, "{what}");
        assert_eq!(history[PROMPT.len()..], got[..23], "{what}");
        // From the switch on, the model computed on the fast paths from the same tokens.
        let mut reference = load_with(&be, &q, 512, fast);
        reference.feed(&be, &history[..at]).unwrap();
        for &t in &history[at..] {
            reference.decode(&be, t).unwrap();
        }
        let want = reference.decode(&be, got[23]).unwrap();
        let last = llm.decode(&be, got[23]).unwrap();
        assert_nmse(&what, &want, &last, 1e-10);
    }
}

/// `score_nll` (the log-softmax on the backend, one number per row back) gives what the host computes
/// from `score`'s logit rows in f64, for every position from `from` to the last but one, across
/// passes split at the batch size, on the CPU and the GPU.
#[test]
fn per_token_nll_on_the_backend_matches_the_host() {
    let mut backends = vec![cpu_backend()];
    backends.extend(gpu_backend(None));
    for s in [LLAMA, GEMMA3] {
        let (q, _) = quantized_and_dense(&s, &mixed_types);
        // Batch 5: three passes; batch 16: one (score_nll_start and _finish).
        for (be, batch) in backends.iter().flat_map(|b| [(b, 5), (b, 16)]) {
            let mut llm = load(be, &q, batch);
            let v = llm.config().vocab;
            let from = 4;
            let rows = pollster::block_on(llm.score(be, &PROMPT, from)).unwrap();
            llm.reset();
            let got = pollster::block_on(llm.score_nll(be, &PROMPT, from)).unwrap();
            assert_eq!(got.len(), PROMPT.len() - from - 1);
            assert_eq!(llm.position(), PROMPT.len());
            for (i, &g) in got.iter().enumerate() {
                let row = &rows[i * v..(i + 1) * v];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max
                    + row
                        .iter()
                        .map(|&x| (x as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                let want = lse - row[PROMPT[from + i + 1] as usize] as f64;
                assert!(
                    (g as f64 - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{} on {}, batch {batch}: position {}: {g} against {want}",
                    s.arch,
                    be.kind(),
                    from + i
                );
            }
        }
    }
}
