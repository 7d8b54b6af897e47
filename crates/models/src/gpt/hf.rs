//! Hugging Face's GPT-2 layout, both ways: a TinyGPT checkpoint as the files transformers'
//! `GPT2LMHeadModel` and `AutoTokenizer` load, and such a directory back as a TinyGPT model (to sample
//! from, or to continue training).
//!
//! ```text
//!   DIR/config.json            GPT2Config (model_type "gpt2", tanh GELU, tied head, no BOS/EOS)
//!   DIR/model.safetensors      transformer.* tensors, f32; Conv1D weights are [in, out] (the
//!                              transpose of TinyGPT's [out, in]); zero biases
//!   DIR/tokenizer.json         a `tokenizers` BPE model whose vocabulary is the characters and which
//!                              has no merges and no pre-tokenizer: one token per character
//!   DIR/tokenizer_config.json  PreTrainedTokenizerFast, the context length
//! ```
//!
//! Importing accepts exactly what TinyGPT's model can compute: tanh GELU, LayerNorm epsilon 1e-5, a
//! tied head, all-zero biases (a GPT-2 trained with biases would compute something else without them,
//! so it is refused, naming the tensor), and a vocabulary of single characters in code-point order.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde_json::{Value, json};

use super::block::EPS;
use super::checkpoint::{CheckpointConfig, CheckpointError, Loaded, read};
use super::config::GptConfig;
use super::data::CharVocab;
use super::layout::Layout;

/// The files of a Hugging Face directory, as bytes.
pub struct HfFiles {
    pub config: Vec<u8>,
    pub model: Vec<u8>,
    pub tokenizer: Vec<u8>,
    pub tokenizer_config: Vec<u8>,
}

impl HfFiles {
    /// (file name, bytes) of every file.
    pub fn named(&self) -> [(&'static str, &[u8]); 4] {
        [
            ("config.json", &self.config),
            ("model.safetensors", &self.model),
            ("tokenizer.json", &self.tokenizer),
            ("tokenizer_config.json", &self.tokenizer_config),
        ]
    }
}

/// Whether the `config.json` bytes are a Hugging Face GPT-2 config (rather than TinyGPT's own).
pub fn is_hf_config(config_json: &[u8]) -> bool {
    serde_json::from_slice::<Value>(config_json)
        .ok()
        .and_then(|v| {
            v.get("model_type")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .is_some()
}

/// Per block: (HF name, TinyGPT offset, TinyGPT [out, in] shape) of each weight matrix.
fn block_matrices(layout: &Layout, l: usize, c: usize) -> [(String, usize, [usize; 2]); 4] {
    let b = layout.block(l);
    let h = format!("transformer.h.{l}");
    [
        (format!("{h}.attn.c_attn"), b.c_attn, [3 * c, c]),
        (format!("{h}.attn.c_proj"), b.attn_proj, [c, c]),
        (format!("{h}.mlp.c_fc"), b.c_fc, [4 * c, c]),
        (format!("{h}.mlp.c_proj"), b.mlp_proj, [c, 4 * c]),
    ]
}

/// [rows, cols] row-major → [cols, rows].
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for (k, &x) in v[r * cols..(r + 1) * cols].iter().enumerate() {
            out[k * rows + r] = x;
        }
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The Hugging Face files of `params` (in [`Layout`] order) for `config`.
pub fn to_hf(config: &CheckpointConfig, params: &[f32]) -> Result<HfFiles, CheckpointError> {
    let cfg = &config.model;
    let layout = Layout::new(cfg);
    let c = cfg.n_embd;
    let get = |off: usize, n: usize| &params[off..off + n];
    // Sorted names: the same model always gives the same bytes.
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>, v: &[f32]| {
        tensors.insert(name, (shape, f32_bytes(v)));
    };
    let (v, t) = (cfg.vocab_size, cfg.block_size);
    put(
        "transformer.wte.weight".into(),
        vec![v, c],
        get(layout.wte(), v * c),
    );
    put(
        "transformer.wpe.weight".into(),
        vec![t, c],
        get(layout.wpe(), t * c),
    );
    let zeros = vec![0.0f32; 4 * c];
    for l in 0..cfg.n_layer {
        let b = layout.block(l);
        let h = format!("transformer.h.{l}");
        for (ln, off) in [("ln_1", b.ln_1), ("ln_2", b.ln_2)] {
            put(format!("{h}.{ln}.weight"), vec![c], get(off, c));
            put(format!("{h}.{ln}.bias"), vec![c], &zeros[..c]);
        }
        for (name, off, [out, inp]) in block_matrices(&layout, l, c) {
            let w = transpose(get(off, out * inp), out, inp);
            put(format!("{name}.weight"), vec![inp, out], &w);
            put(format!("{name}.bias"), vec![out], &zeros[..out]);
        }
    }
    put(
        "transformer.ln_f.weight".into(),
        vec![c],
        get(layout.ln_f(), c),
    );
    put("transformer.ln_f.bias".into(), vec![c], &zeros[..c]);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (shape, b))| {
            TensorView::new(Dtype::F32, shape.clone(), b)
                .map(|view| (n.clone(), view))
                .map_err(|e| invalid(Path::new("model.safetensors"), e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let meta = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    let model = safetensors::serialize(views, meta)
        .map_err(|e| invalid(Path::new("model.safetensors"), e.to_string()))?;

    let hf_config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": v,
        "n_positions": t,
        "n_ctx": t,
        "n_embd": c,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": Value::Null,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "use_cache": true,
        "bos_token_id": Value::Null,
        "eos_token_id": Value::Null,
        "pad_token_id": Value::Null,
        "torch_dtype": "float32",
        "tinygpt": {
            "exported_by": "tinygpt export",
            "provenance": config.provenance,
        },
    });
    let vocab: serde_json::Map<String, Value> = config
        .vocab
        .chars
        .iter()
        .enumerate()
        .map(|(i, ch)| (ch.to_string(), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": Value::Null,
        "padding": Value::Null,
        "added_tokens": [],
        "normalizer": Value::Null,
        "pre_tokenizer": Value::Null,
        "post_processor": Value::Null,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": Value::Null,
            "unk_token": Value::Null,
            "continuing_subword_prefix": Value::Null,
            "end_of_word_suffix": Value::Null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    });
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": t,
        "clean_up_tokenization_spaces": false,
        "add_prefix_space": false,
    });
    let pretty = |v: &Value| {
        let mut b = serde_json::to_vec_pretty(v).expect("JSON values serialize");
        b.push(b'\n');
        b
    };
    Ok(HfFiles {
        config: pretty(&hf_config),
        model,
        tokenizer: pretty(&tokenizer),
        tokenizer_config: pretty(&tokenizer_config),
    })
}

fn invalid(path: &Path, msg: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// Loads a Hugging Face GPT-2 directory (as [`to_hf`] writes it) as a TinyGPT model.
pub fn load_hf(dir: &Path) -> Result<Loaded, CheckpointError> {
    let cp = dir.join("config.json");
    let hf: Value = serde_json::from_slice(&read(&cp)?).map_err(|e| invalid(&cp, e.to_string()))?;
    let model_type = hf.get("model_type").and_then(Value::as_str).unwrap_or("");
    if model_type != "gpt2" {
        return Err(invalid(
            &cp,
            format!(
                "model_type is {model_type:?}: TinyGPT imports Hugging Face GPT-2 models (\"gpt2\")"
            ),
        ));
    }
    let usize_key = |names: &[&str]| -> Result<usize, CheckpointError> {
        names
            .iter()
            .find_map(|n| hf.get(*n).and_then(Value::as_u64))
            .map(|v| v as usize)
            .ok_or_else(|| invalid(&cp, format!("{} is missing", names[0])))
    };
    let c = usize_key(&["n_embd"])?;
    let model = GptConfig {
        vocab_size: usize_key(&["vocab_size"])?,
        block_size: usize_key(&["n_positions", "n_ctx"])?,
        n_layer: usize_key(&["n_layer"])?,
        n_head: usize_key(&["n_head"])?,
        n_embd: c,
        dropout: hf.get("resid_pdrop").and_then(Value::as_f64).unwrap_or(0.0) as f32,
    };
    model.validate().map_err(|m| invalid(&cp, m))?;
    // What TinyGPT's GPT computes; anything else would run silently differently.
    let act = hf
        .get("activation_function")
        .and_then(Value::as_str)
        .unwrap_or("gelu_new");
    if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
        return Err(invalid(
            &cp,
            format!("activation_function {act:?}: TinyGPT's GPT uses the tanh GELU (\"gelu_new\")"),
        ));
    }
    if let Some(n) = hf.get("n_inner").and_then(Value::as_u64)
        && n as usize != 4 * c
    {
        return Err(invalid(
            &cp,
            format!("n_inner {n}: TinyGPT's MLP is 4 x n_embd = {} wide", 4 * c),
        ));
    }
    let eps = hf
        .get("layer_norm_epsilon")
        .and_then(Value::as_f64)
        .unwrap_or(1e-5);
    if (eps - EPS as f64).abs() > 1e-12 {
        return Err(invalid(
            &cp,
            format!("layer_norm_epsilon {eps}: TinyGPT's LayerNorm uses {EPS}"),
        ));
    }
    for (key, want) in [
        ("tie_word_embeddings", true),
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
    ] {
        if let Some(got) = hf.get(key).and_then(Value::as_bool)
            && got != want
        {
            return Err(invalid(
                &cp,
                format!("{key} is {got}: TinyGPT's GPT needs {want}"),
            ));
        }
    }
    let vocab = read_vocab(&dir.join("tokenizer.json"), model.vocab_size)?;

    let mp = dir.join("model.safetensors");
    let bytes = read(&mp)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| invalid(&mp, e.to_string()))?;
    let layout = Layout::new(&model);
    let mut params = vec![0.0f32; layout.total];
    let mut r = Tensors {
        st: &st,
        path: &mp,
        used: std::collections::HashSet::new(),
    };
    let place = |params: &mut Vec<f32>, off: usize, v: &[f32]| {
        params[off..off + v.len()].copy_from_slice(v);
    };
    let (v, t) = (model.vocab_size, model.block_size);
    let wte = r.tensor("transformer.wte.weight", &[v, c])?;
    place(&mut params, layout.wte(), &wte);
    place(
        &mut params,
        layout.wpe(),
        &r.tensor("transformer.wpe.weight", &[t, c])?,
    );
    for l in 0..model.n_layer {
        let b = layout.block(l);
        let h = format!("transformer.h.{l}");
        for (ln, off) in [("ln_1", b.ln_1), ("ln_2", b.ln_2)] {
            place(
                &mut params,
                off,
                &r.tensor(&format!("{h}.{ln}.weight"), &[c])?,
            );
            r.zero_bias(format!("{h}.{ln}.bias"), c)?;
        }
        for (name, off, [out, inp]) in block_matrices(&layout, l, c) {
            let w = r.tensor(&format!("{name}.weight"), &[inp, out])?;
            place(&mut params, off, &transpose(&w, inp, out));
            r.zero_bias(format!("{name}.bias"), out)?;
        }
    }
    place(
        &mut params,
        layout.ln_f(),
        &r.tensor("transformer.ln_f.weight", &[c])?,
    );
    r.zero_bias("transformer.ln_f.bias".into(), c)?;
    if st.names().contains(&"lm_head.weight") {
        let head = r.tensor("lm_head.weight", &[v, c])?;
        if head != wte {
            return Err(invalid(
                &mp,
                "lm_head.weight differs from transformer.wte.weight: TinyGPT's head is tied to the \
                 token embedding",
            ));
        }
    }
    // The attention masks older transformers versions saved as buffers carry no weights.
    let used = r.used;
    let mut extra: Vec<&str> = st
        .names()
        .into_iter()
        .filter(|n| {
            !used.contains(*n) && !n.ends_with(".attn.bias") && !n.ends_with(".attn.masked_bias")
        })
        .collect();
    extra.sort();
    if !extra.is_empty() {
        return Err(invalid(
            &mp,
            format!(
                "it holds tensors a GPT-2 of this config does not have: {}",
                extra.join(", ")
            ),
        ));
    }
    let provenance = hf
        .get("tinygpt")
        .and_then(|t| t.get("provenance"))
        .cloned()
        .unwrap_or_else(|| json!({ "imported_from": dir.display().to_string() }));
    Ok(Loaded {
        config: CheckpointConfig {
            model,
            vocab,
            provenance,
        },
        params,
        optimizer: None,
        state: None,
    })
}

/// Reads tensors of a safetensors file by name, remembering which were read.
struct Tensors<'a> {
    st: &'a SafeTensors<'a>,
    path: &'a Path,
    used: std::collections::HashSet<String>,
}

impl Tensors<'_> {
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let view = self
            .st
            .tensor(name)
            .map_err(|_| invalid(self.path, format!("tensor {name} is missing")))?;
        if view.shape() != shape {
            return Err(CheckpointError::Shape {
                path: self.path.to_path_buf(),
                name: name.to_string(),
                found: view.shape().to_vec(),
                want: shape.to_vec(),
            });
        }
        self.used.insert(name.to_string());
        let v = super::checkpoint::tensor_f32(self.path, &view)?;
        if let Some(bad) = v.iter().find(|x| !x.is_finite()) {
            return Err(invalid(self.path, format!("tensor {name} holds {bad}")));
        }
        Ok(v)
    }

    /// Reads bias `name` of `n` values, which must be all zero.
    fn zero_bias(&mut self, name: String, n: usize) -> Result<(), CheckpointError> {
        let b = self.tensor(&name, &[n])?;
        let max = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        if max != 0.0 {
            return Err(invalid(
                self.path,
                format!(
                    "{name} is not zero (largest |value| {max}): TinyGPT's GPT has no biases, so this \
                     model would compute something else"
                ),
            ));
        }
        Ok(())
    }
}

/// The character vocabulary of a `tokenizer.json`: every token one character, ids in code-point order.
fn read_vocab(path: &Path, vocab_size: usize) -> Result<CharVocab, CheckpointError> {
    let tok: Value =
        serde_json::from_slice(&read(path)?).map_err(|e| invalid(path, e.to_string()))?;
    let map = tok
        .get("model")
        .and_then(|m| m.get("vocab"))
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(path, "it has no model.vocab"))?;
    let mut chars = vec![None; map.len()];
    for (token, id) in map {
        let mut it = token.chars();
        let (Some(ch), None) = (it.next(), it.next()) else {
            return Err(invalid(
                path,
                format!(
                    "token {token:?} is not one character: TinyGPT's GPT has a character vocabulary"
                ),
            ));
        };
        let slot = id
            .as_u64()
            .and_then(|i| chars.get_mut(i as usize))
            .ok_or_else(|| invalid(path, format!("token {token:?} has id {id}, out of range")))?;
        *slot = Some(ch);
    }
    let chars: Vec<char> = chars
        .into_iter()
        .collect::<Option<_>>()
        .ok_or_else(|| invalid(path, "the token ids are not 0..n without gaps"))?;
    if chars.len() != vocab_size {
        return Err(invalid(
            path,
            format!(
                "{} tokens, but config.json says vocab_size {vocab_size}",
                chars.len()
            ),
        ));
    }
    if let Some(w) = chars.windows(2).find(|w| w[0] >= w[1]) {
        return Err(invalid(
            path,
            format!(
                "the characters are not in code-point order ({:?} before {:?}), as TinyGPT's vocabulary lists them",
                w[0], w[1]
            ),
        ));
    }
    Ok(CharVocab { chars })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_files_load_back_to_the_same_model() {
        let vocab = CharVocab::from_text("hello wörld\n");
        let config = CheckpointConfig {
            model: GptConfig {
                vocab_size: vocab.len(),
                block_size: 16,
                n_layer: 2,
                n_head: 2,
                n_embd: 8,
                dropout: 0.1,
            },
            vocab,
            provenance: json!({"text": "test"}),
        };
        let params = Layout::new(&config.model).init(&config.model, 5);
        let files = to_hf(&config, &params).unwrap();
        assert!(is_hf_config(&files.config));
        let dir = std::env::temp_dir().join(format!("tinygpt-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in files.named() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        let back = load_hf(&dir).unwrap();
        assert_eq!(back.config.model, config.model);
        assert_eq!(back.config.vocab, config.vocab);
        assert_eq!(back.config.provenance, config.provenance);
        assert_eq!(back.params, params);

        // A non-zero bias is refused, naming it.
        let st = SafeTensors::deserialize(&files.model).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
            .collect();
        let b = tensors
            .iter_mut()
            .find(|t| t.0 == "transformer.h.1.mlp.c_fc.bias")
            .unwrap();
        b.2[..4].copy_from_slice(&0.5f32.to_le_bytes());
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, d)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
                )
            })
            .collect();
        std::fs::write(
            dir.join("model.safetensors"),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        let err = load_hf(&dir).err().unwrap().to_string();
        assert!(
            err.contains("transformer.h.1.mlp.c_fc.bias is not zero"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
