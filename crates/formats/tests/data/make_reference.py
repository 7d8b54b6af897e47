#!/usr/bin/env python3
"""Independent reference numbers for the tinygpt-formats tests, computed with the `gguf` PyPI package.

Writes two small JSON files next to this script:

  block_vectors.json  random blocks of every block type the crate decodes, with gguf's dequantization of
                      them (f32 bit patterns), and f32 inputs with gguf's Q8_0/Q4_0/Q4_1/Q5_0 encodings.
  real_models.json    facts about the two real model files (metadata values, tensor types and shapes) and
                      dequantized sums / leading values / selected rows of a few tensors of each type.

Usage (only PyPI tools; `pip install gguf numpy`):

  python3 make_reference.py [MODELS_DIR]

MODELS_DIR defaults to $TINYGPT_MODELS_DIR, then <workspace>/.cache/models, and must hold
SmolLM2-135M-Instruct.Q4_1.gguf and gemma-3-270m-Q4_K_M.gguf (see scripts/fetch-models.sh).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

HERE = Path(__file__).resolve().parent
SEED = 20240611

# Byte offsets of the f16 fields in each block (they are set to finite halves: random bytes there would
# often be inf/NaN, which JSON cannot carry and which no real file contains).
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q6_K: [208],
}
BLOCKS_PER_TYPE = {T.Q4_0: 6, T.Q4_1: 6, T.Q5_0: 6, T.Q8_0: 4, T.Q4_K: 2, T.Q6_K: 2}
SPECIAL_HALVES = [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF]


def bits(values):
    return [int(b) for b in np.asarray(values, dtype=np.float32).reshape(-1).view(np.uint32)]


def random_half(rng):
    if rng.random() < 0.3:
        return SPECIAL_HALVES[rng.integers(len(SPECIAL_HALVES))]
    while True:
        h = int(rng.integers(0, 1 << 16))
        if h & 0x7C00 != 0x7C00:
            return h


def block_vectors():
    rng = np.random.default_rng(SEED)
    dequant = []
    for qtype, n_blocks in BLOCKS_PER_TYPE.items():
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for b in range(n_blocks):
            for off in F16_FIELDS[qtype]:
                raw[b, off : off + 2] = np.frombuffer(np.uint16(random_half(rng)).tobytes(), dtype=np.uint8)
        values = dequantize(raw.reshape(-1), qtype)
        dequant.append({"type": qtype.name, "bytes": raw.tobytes().hex(), "f32_bits": bits(values)})
    for qtype in (T.F16, T.BF16):
        raw = rng.integers(0, 256, size=64, dtype=np.uint8)
        for i in range(0, 64, 2):
            if qtype == T.F16 and raw[i + 1] & 0x7C == 0x7C:
                raw[i + 1] &= 0xBF  # keep halves finite
            if qtype == T.BF16 and raw[i + 1] & 0x7F == 0x7F and raw[i] & 0x80:
                raw[i + 1] &= 0xBF  # keep bfloat16 finite
        values = dequantize(raw, qtype)
        dequant.append({"type": qtype.name, "bytes": raw.tobytes().hex(), "f32_bits": bits(values)})

    encode = []
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0):
        x = rng.standard_normal(32 * 8).astype(np.float32)
        x[:32] *= 1e-3
        x[32:64] = 0.0
        x[64 + 5] = 40.0
        x[96:128] = np.abs(x[96:128])
        encoded = quantize(x.reshape(-1, 32), qtype)
        encode.append({"type": qtype.name, "input_f32_bits": bits(x), "bytes": encoded.tobytes().hex()})
    return {"dequantize": dequant, "quantize": encode}


def tensor_facts(reader, names, rows_of=()):
    by_name = {t.name: t for t in reader.tensors}
    out = []
    for name in names:
        t = by_name[name]
        entry = {
            "name": name,
            "type": t.tensor_type.name,
            "type_id": int(t.tensor_type),
            "dims": [int(d) for d in t.shape],
        }
        data = np.asarray(t.data)
        if name in rows_of:
            # Whole-tensor sums of the big embeddings are not needed; check selected rows instead.
            rows = data.reshape(int(np.prod(t.shape[1:])), -1)
            picked = []
            for r in rows_of[name]:
                v = dequantize(rows[r : r + 1].reshape(-1), t.tensor_type).astype(np.float32).reshape(-1)
                picked.append({"row": r, "sum": float(v.astype(np.float64).sum()), "first_f32_bits": bits(v[:16])})
            entry["rows"] = picked
        else:
            v = dequantize(data.reshape(-1), t.tensor_type).astype(np.float32).reshape(-1)
            v64 = v.astype(np.float64)
            entry["sum"] = float(v64.sum())
            entry["sum_abs"] = float(np.abs(v64).sum())
            entry["first_f32_bits"] = bits(v[:16])
            entry["last_f32_bits"] = bits(v[-4:])
        out.append(entry)
    return out


def metadata_facts(reader, scalar_keys, array_keys):
    facts = {"scalars": {}, "array_lengths": {}, "first_tokens": []}
    for key in scalar_keys:
        field = reader.fields[key]
        value = field.contents()
        if isinstance(value, float):
            value = {"f32_bits": bits([value])[0]}
        facts["scalars"][key] = value
    for key in array_keys:
        facts["array_lengths"][key] = len(reader.fields[key].data)
    facts["first_tokens"] = reader.fields["tokenizer.ggml.tokens"].contents()[:8]
    return facts


def real_models(models_dir):
    out = {}
    smol = GGUFReader(models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf")
    out["SmolLM2-135M-Instruct.Q4_1.gguf"] = {
        "tensor_count": len(smol.tensors),
        "kv_count": len(smol.fields) - 3,  # GGUFReader also lists the version and the two counts
        "type_counts": type_counts(smol),
        "metadata": metadata_facts(
            smol,
            [
                "general.architecture",
                "llama.block_count",
                "llama.context_length",
                "llama.embedding_length",
                "llama.feed_forward_length",
                "llama.attention.head_count",
                "llama.attention.head_count_kv",
                "llama.rope.freq_base",
                "llama.attention.layer_norm_rms_epsilon",
                "llama.vocab_size",
                "tokenizer.ggml.model",
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token",
            ],
            ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"],
        ),
        "tensors": tensor_facts(
            smol,
            [
                "token_embd.weight",
                "output_norm.weight",
                "blk.0.attn_q.weight",
                "blk.0.ffn_down.weight",
                "blk.29.attn_v.weight",
            ],
            rows_of={"token_embd.weight": [0, 1, 2, 100, 49151]},
        ),
    }
    gemma = GGUFReader(models_dir / "gemma-3-270m-Q4_K_M.gguf")
    out["gemma-3-270m-Q4_K_M.gguf"] = {
        "tensor_count": len(gemma.tensors),
        "kv_count": len(gemma.fields) - 3,
        "type_counts": type_counts(gemma),
        "metadata": metadata_facts(
            gemma,
            [
                "general.architecture",
                "gemma3.block_count",
                "gemma3.context_length",
                "gemma3.embedding_length",
                "gemma3.feed_forward_length",
                "gemma3.attention.head_count",
                "gemma3.attention.head_count_kv",
                "gemma3.attention.key_length",
                "gemma3.attention.value_length",
                "gemma3.attention.sliding_window",
                "gemma3.rope.freq_base",
                "gemma3.attention.layer_norm_rms_epsilon",
                "tokenizer.ggml.model",
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token",
            ],
            ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"],
        ),
        "tensors": tensor_facts(
            gemma,
            [
                "token_embd.weight",
                "output_norm.weight",
                "blk.0.attn_q.weight",
                "blk.0.attn_v.weight",
                "blk.0.attn_output.weight",
                "blk.0.ffn_down.weight",
                "blk.2.ffn_down.weight",
                "blk.17.ffn_up.weight",
                "blk.0.attn_k_norm.weight",
            ],
            rows_of={"token_embd.weight": [0, 2, 1000, 262143]},
        ),
    }
    return out


def type_counts(reader):
    counts = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def main():
    if len(sys.argv) > 1:
        models_dir = Path(sys.argv[1])
    elif os.environ.get("TINYGPT_MODELS_DIR"):
        models_dir = Path(os.environ["TINYGPT_MODELS_DIR"])
    else:
        models_dir = HERE.parents[3] / ".cache" / "models"
    with open(HERE / "block_vectors.json", "w") as f:
        json.dump(block_vectors(), f, separators=(",", ":"))
        f.write("\n")
    with open(HERE / "real_models.json", "w") as f:
        json.dump(real_models(models_dir), f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
