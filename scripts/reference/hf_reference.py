"""Exact-math reference: Hugging Face transformers on CPU in f32, from the same GGUF files.

transformers dequantizes the GGUF tensors (with the gguf package) and runs its own PyTorch model code
in f32, so its logits are the "true" output of the quantized weights, free of llama.cpp's activation
quantization. Token ids are taken from llamacpp.json (fed as ids, never re-tokenized), so run
llamacpp_reference.py first. Writes:
  tests/data/reference/<model>/hf.json          config check, greedy ids, per-position top-2 logits
  tests/data/reference/<model>/hf_<prompt>_last_logits.f32.bin
"""

import json
import sys

import numpy as np
import torch
import transformers
from gguf import GGUFReader
from transformers import AutoConfig, AutoModelForCausalLM

from common import (
    DATA,
    MODELS,
    N_GREEDY,
    SCRATCH,
    check_model,
    top2,
    write_f32,
    write_json,
)

N_THREADS = 2


def gguf_metadata(path):
    reader = GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "scores", "token_type", "merges")):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - metadata we do not need
            pass
    return meta


def rope_theta(config, layer_type=None):
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def config_check(key, config, meta):
    """transformers' config next to the GGUF metadata and llama.cpp's built-in defaults."""
    arch = meta["general.architecture"]
    rows = [
        ("hidden_size", f"{arch}.embedding_length", config.hidden_size),
        ("num_hidden_layers", f"{arch}.block_count", config.num_hidden_layers),
        ("intermediate_size", f"{arch}.feed_forward_length", config.intermediate_size),
        ("num_attention_heads", f"{arch}.attention.head_count", config.num_attention_heads),
        ("num_key_value_heads", f"{arch}.attention.head_count_kv", config.num_key_value_heads),
        ("rms_norm_eps", f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps),
        ("max_position_embeddings", f"{arch}.context_length", config.max_position_embeddings),
        ("vocab_size", None, config.vocab_size),
    ]
    if key == "gemma3":
        rows += [
            ("head_dim", f"{arch}.attention.key_length", config.head_dim),
            ("rope_theta (full_attention)", f"{arch}.rope.freq_base", rope_theta(config, "full_attention")),
            ("sliding_window", f"{arch}.attention.sliding_window", config.sliding_window),
            ("final_logit_softcapping", f"{arch}.final_logit_softcapping", config.final_logit_softcapping),
            ("attn_logit_softcapping", f"{arch}.attn_logit_softcapping", config.attn_logit_softcapping),
        ]
    else:
        rows += [
            ("head_dim", f"{arch}.rope.dimension_count", getattr(config, "head_dim", None)),
            ("rope_theta", f"{arch}.rope.freq_base", rope_theta(config)),
        ]
    out = []
    for name, gguf_key, hf_value in rows:
        gguf_value = meta.get(gguf_key) if gguf_key else None
        if gguf_key is None or gguf_key not in meta:
            match = None
        elif isinstance(hf_value, float) or isinstance(gguf_value, float):
            match = hf_value is not None and abs(float(hf_value) - float(gguf_value)) <= 1e-6 * abs(float(gguf_value))
        else:
            match = hf_value == gguf_value
        out.append({"transformers": name, "value": hf_value, "gguf_key": gguf_key, "gguf_value": gguf_value, "match": match})
    if key == "gemma3":
        # Not in the GGUF file: llama.cpp's gemma3 defaults (src/models/gemma3.cpp, llama-hparams.h).
        out += [
            {"transformers": "rope_theta (sliding_attention)", "value": rope_theta(config, "sliding_attention"),
             "llama_cpp_default": 10000.0, "match": rope_theta(config, "sliding_attention") == 10000.0},
            {"transformers": "layer_types", "value": config.layer_types,
             "llama_cpp_default": "sliding except il % 6 == 5",
             "match": config.layer_types == ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(config.num_hidden_layers)]},
            {"transformers": "query_pre_attn_scalar", "value": config.query_pre_attn_scalar,
             "llama_cpp_default": "attention scale 1/sqrt(key_length) for every size but 27B",
             "match": config.query_pre_attn_scalar == meta[f"{arch}.attention.key_length"]},
            {"transformers": "hidden_activation", "value": config.hidden_activation,
             "llama_cpp_default": "GELU, tanh approximation", "match": config.hidden_activation == "gelu_pytorch_tanh"},
        ]
    out.append({"transformers": "tie_word_embeddings", "value": config.tie_word_embeddings,
                "gguf": "output.weight absent: llama.cpp reuses token_embd", "match": None})
    return out


@torch.no_grad()
def logits_of(model, ids):
    out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def greedy(model, ids, n):
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    row = out.logits[0, -1].float().numpy()
    gen, gen_top2 = [], []
    for _ in range(n):
        t2 = top2(row)
        gen_top2.append(t2)
        gen.append(t2[0])
        out = model(torch.tensor([[t2[0]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        row = out.logits[0, -1].float().numpy()
    return gen, gen_top2


def main():
    torch.set_num_threads(N_THREADS)
    for key in MODELS:
        path = check_model(key)
        out_dir = DATA / "reference" / key
        llama = json.loads((out_dir / "llamacpp.json").read_text())
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        checks = config_check(key, config, gguf_metadata(path))
        bad = [c for c in checks if c["match"] is False]
        if bad:
            print(f"[transformers] {key}: config differs from GGUF: {bad}", file=sys.stderr)
        prompts = []
        for entry in llama["prompts"]:
            ids = entry["ids"]
            logits = logits_of(model, ids)
            last = logits[-1]
            fname = f"hf_{entry['name']}_last_logits.f32.bin"
            write_f32(SCRATCH / key / fname, last.tolist())
            record = {
                "name": entry["name"],
                "ids": ids,
                "prompt_top2": [top2(row) for row in logits],
            }
            if "last_logits_file" in entry:
                write_f32(out_dir / fname, last.tolist())
                record["last_logits_file"] = fname
            gen, gen_top2 = greedy(model, ids, N_GREEDY)
            record["greedy_ids"] = gen
            record["greedy_top2"] = gen_top2
            # The same positions as llama.cpp's greedy steps, on llama.cpp's own continuation
            # (teacher forcing), so each step can be compared even after the sequences diverge.
            forced = logits_of(model, ids + entry["greedy_ids"][:-1])
            record["llamacpp_continuation_top2"] = [top2(row) for row in forced[len(ids) - 1 :]]
            prompts.append(record)
            print(f"[transformers] {key}/{entry['name']}: greedy {gen[:12]}...", file=sys.stderr)
        write_json(
            out_dir / "hf.json",
            {
                "tool": f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32, eager attention",
                "loading": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=...): GGUF tensors dequantized to f32 by the gguf package",
                "model_file": MODELS[key]["file"],
                "model_class": type(model).__name__,
                "config": json.loads(config.to_json_string(use_diff=False)),
                "config_check": checks,
                "prompts": prompts,
            },
        )
        del model


if __name__ == "__main__":
    main()
