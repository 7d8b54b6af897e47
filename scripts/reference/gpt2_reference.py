#!/usr/bin/env python3
"""A small GPT-2 with non-zero biases everywhere, as a GGUF file written by llama.cpp's own Python
library (gguf-py), and what transformers computes with it: the reference for TinyGPT's `gpt2` GGUF
runner on models that are not TinyGPT exports (crates/models/tests/llm_gpt2.rs).

    .cache/venv-hf/bin/python scripts/reference/gpt2_reference.py

The model: transformers' GPT2LMHeadModel, 2 layers, 4 heads, 64 wide, context 128, seeded random
weights (std 0.3, so the logits spread over several units and greedy steps are no near-ties) and
random biases on every norm and projection; its vocabulary is the bundled model's characters as
`tinygpt export` writes them (read from .cache/export/shakespeare.f32.gguf, which regenerate.sh
makes), without the end-of-text token, plus three multi-byte characters and their merges. The tensors are written as llama.cpp's converter
(conversion/gpt2.py) writes a GPT-2: Conv1D weights transposed, gguf-py's tensor names, F32.

Writes crates/models/tests/data/gpt2/tiny-biased.gguf (about 0.5 MB) and transformers.json: per
prompt the ids, the logits at every position and 32 greedy tokens (transformers' KV cache).
"""
import json
import os

import gguf
import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "crates", "models", "tests", "data", "gpt2")
EXPORTED = os.path.join(ROOT, ".cache", "export", "shakespeare.f32.gguf")
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, café — 😀 hear me speak."]
N_GREEDY = 32


def main():
    torch.manual_seed(1234)
    torch.set_num_threads(2)
    reader = gguf.GGUFReader(EXPORTED)
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    tokens = tokens[:-1]  # the characters, without <|endoftext|>
    # Three characters of two, three and four UTF-8 bytes, so the vocabulary has merges (gguf-py
    # leaves out an empty merges array, and llama.cpp refuses a gpt2 vocabulary without one).
    byte_level = bytes_to_unicode()
    merges = []
    for ch in "é—😀":
        parts = [byte_level[b] for b in ch.encode()]
        for i in range(1, len(parts)):
            merges.append("".join(parts[:i]) + " " + parts[i])
        tokens.append("".join(parts))

    cfg = GPT2Config(vocab_size=len(tokens), n_positions=128, n_embd=64, n_layer=2, n_head=4,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))

    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "tiny-biased.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_name("tiny biased GPT-2 (random weights)")
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_positions)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_add_bos_token(False)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, cfg.n_layer)
    for name, t in model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        data = t.detach().numpy().astype(np.float32)
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = data.T.copy()
        base, suffix = name.rsplit(".", 1)
        new = tmap.get_name(base)
        if new is None:
            raise SystemExit(f"no GGUF name for {name}")
        w.add_tensor(f"{new}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    char_id = {t: i for i, t in enumerate(tokens)}
    out = {"tool": f"transformers {transformers.__version__}, torch {torch.__version__}, CPU f32, eager",
           "prompts": []}
    for text in PROMPTS:
        ids = [char_id["".join(byte_level[b] for b in ch.encode())] for ch in text]
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0].numpy().astype(np.float32)
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_GREEDY,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        greedy = gen.sequences[0, len(ids):].tolist()
        gaps = [float(torch.topk(s[0], 2).values[0] - torch.topk(s[0], 2).values[1]) for s in gen.scores]
        out["prompts"].append({"text": text, "ids": ids,
                               "logits": [[float(v) for v in row] for row in logits],
                               "greedy_ids": greedy, "greedy_top2_gap": gaps})
        print(repr(text[:20]), greedy[:8], "min gap", min(gaps), flush=True)
    with open(os.path.join(OUT, "transformers.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def bytes_to_unicode():
    """GPT-2's byte alphabet (as in its encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


if __name__ == "__main__":
    main()
