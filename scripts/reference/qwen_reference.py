#!/usr/bin/env python3
"""Tiny random-weight Qwen2 and Qwen3 models, converted to GGUF by llama.cpp's own converter, and what
transformers computes with them: the reference for the qwen2 / qwen3 architectures of TinyGPT's GGUF
runner (crates/models/tests/llm_qwen.rs). No real Qwen file can be fetched here.

    .cache/venv-hf/bin/python scripts/reference/qwen_reference.py

Per architecture: a byte-level BPE tokenizer (400 tokens trained with `tokenizers` on the first 20,000
characters of data/shakespeare.txt, Qwen2's pre-tokenizer expression, <|endoftext|> added), and a
seeded Qwen2ForCausalLM (biases on Q/K/V, tied embeddings) or Qwen3ForCausalLM (Q/K norms, separate
head): 2 layers, 64 wide, 4 heads of 16 with 2 KV heads, FFN 128, context 256, weights with std 0.3
(so greedy steps are no near-ties) and random norm weights and biases. The model is saved with
save_pretrained and converted by convert_hf_to_gguf.py from the llama-cpp-python 0.3.36 source package
(llama.cpp 0c1e570, extracted into .cache/llama-convert) to F32 and Q8_0. The converter identifies a
BPE pre-tokenizer by hashing how the tokenizer splits a test text and knows only published
tokenizers, so this tiny one is declared "qwen2" to it (the only change; the tensors go through its
Qwen2 / Qwen3 code as they would for a real model).

Writes crates/models/tests/data/qwen/{qwen2,qwen3}.{f32,q8_0}.gguf and, beside each, its
.transformers.json: per prompt the ids, the logits at every position, 32 greedy tokens and their top-2
gaps, computed by transformers on the model itself (F32) or on the Q8_0 file's weights as transformers
dequantizes them (`from_pretrained(gguf_file=...)`), the exact-math reference for that file.
"""
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SDIST = os.path.join(ROOT, ".cache", "pypi-sdist", "llama_cpp_python-0.3.36.tar.gz")
CONVERT = os.path.join(ROOT, ".cache", "llama-convert")
WORK = os.path.join(ROOT, ".cache", "qwen-reference")
OUT = os.path.join(ROOT, "crates", "models", "tests", "data", "qwen")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak 123."]
N_GREEDY = 32


def extract_converter():
    if os.path.exists(os.path.join(CONVERT, "convert_hf_to_gguf.py")):
        return
    prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    with tarfile.open(SDIST) as t:
        members = [m for m in t.getmembers() if m.name.startswith(prefix) and (
            m.name == prefix + "convert_hf_to_gguf.py" or m.name.startswith(prefix + "conversion/")
            or m.name.startswith(prefix + "gguf-py/"))]
        for m in members:
            m.name = m.name[len(prefix):]
        t.extractall(CONVERT, members=members)


def tokenizer(dst):
    text = open(os.path.join(ROOT, "data", "shakespeare.txt"), encoding="utf-8").read()[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "model_max_length": 256}, f)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(dst, "tokenizer.json"))


def model(arch, vocab):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        m = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=16, **common)
        m = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return m.eval()


def convert(hf_dir, arch, outtype):
    dst = os.path.join(OUT, f"{arch}.{outtype}.gguf")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import convert_hf_to_gguf as c; from conversion import base;"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2';"
        "sys.argv = ['convert_hf_to_gguf.py', sys.argv[2], '--outfile', sys.argv[3], '--outtype', sys.argv[4]];"
        "c.main()"
    )
    subprocess.run([sys.executable, "-c", code, CONVERT, hf_dir, dst, outtype], check=True,
                   stdout=subprocess.DEVNULL)
    return dst


def main():
    torch.manual_seed(2026)
    torch.set_num_threads(2)
    extract_converter()
    os.makedirs(OUT, exist_ok=True)
    for arch in ["qwen2", "qwen3"]:
        hf_dir = os.path.join(WORK, arch)
        os.makedirs(hf_dir, exist_ok=True)
        tok = tokenizer(hf_dir)
        m = model(arch, tok.vocab_size)
        m.save_pretrained(hf_dir)
        for outtype in ["f32", "q8_0"]:
            convert(hf_dir, arch, outtype)
        # The F32 file against the model itself; the Q8_0 file against transformers on that file's
        # own (dequantized) weights, the exact-math reference for it. The config is the model's:
        # transformers' GGUF loader does not read qwen3.attention.key_length (the head size).
        q8 = transformers.AutoModelForCausalLM.from_pretrained(
            OUT, gguf_file=f"{arch}.q8_0.gguf", config=m.config, dtype=torch.float32,
            attn_implementation="eager").eval()
        for outtype, ref_model in [("f32", m), ("q8_0", q8)]:
            rec = {"tool": f"transformers {transformers.__version__}, torch {torch.__version__}, CPU f32, eager",
                   "weights": "the model" if outtype == "f32" else f"{arch}.q8_0.gguf, dequantized by transformers",
                   "prompts": []}
            for text in PROMPTS:
                ids = tok(text)["input_ids"]
                x = torch.tensor([ids])
                with torch.no_grad():
                    logits = ref_model(x).logits[0].numpy().astype(np.float32)
                    gen = ref_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_GREEDY,
                                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                                             eos_token_id=None, pad_token_id=0)
                greedy = gen.sequences[0, len(ids):].tolist()
                gaps = [float(torch.topk(s[0], 2).values[0] - torch.topk(s[0], 2).values[1])
                        for s in gen.scores]
                rec["prompts"].append({"text": text, "ids": ids,
                                       "logits": [[float(v) for v in row] for row in logits],
                                       "greedy_ids": greedy, "greedy_top2_gap": gaps})
                print(arch, outtype, repr(text[:12]), len(ids), "tokens, min gap", round(min(gaps), 4),
                      flush=True)
            with open(os.path.join(OUT, f"{arch}.{outtype}.transformers.json"), "w", encoding="utf-8") as f:
                json.dump(rec, f, ensure_ascii=False, separators=(",", ":"))
                f.write("\n")


if __name__ == "__main__":
    main()
