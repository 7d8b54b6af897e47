#!/usr/bin/env python3
"""Writes the fuzz targets' starting inputs into fuzz/corpus/TARGET/ (small, valid or nearly valid
inputs of each format; libFuzzer mutates from them). Run once before the first `cargo fuzz run`."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(os.path.dirname(HERE), "corpus")
ROOT = os.path.dirname(os.path.dirname(HERE))


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf(kvs, tensors):
    """kvs: (key, type id, packed value); tensors: (name, dims, ggml type, data bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += gguf_string(k) + struct.pack("<I", t) + v
    offset = 0
    infos, blobs = b"", b""
    for name, dims, ty, data in tensors:
        infos += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ty, offset)
        pad = (-len(data)) % 32
        blobs += data + b"\0" * pad
        offset += len(data) + pad
    out += infos
    out += b"\0" * ((-len(out)) % 32)
    return out + blobs


U32, F32, STR, ARR = 4, 6, 8, 9


def arr_str(items):
    return struct.pack("<IQ", STR, len(items)) + b"".join(gguf_string(s) for s in items)


def arr_f32(items):
    return struct.pack("<IQ", F32, len(items)) + b"".join(struct.pack("<f", x) for x in items)


def arr_i32(items):
    return struct.pack("<IQ", 5, len(items)) + b"".join(struct.pack("<i", x) for x in items)


llama_kvs = [
    ("general.architecture", STR, gguf_string("llama")),
    ("llama.block_count", U32, struct.pack("<I", 1)),
    ("llama.embedding_length", U32, struct.pack("<I", 8)),
    ("llama.feed_forward_length", U32, struct.pack("<I", 16)),
    ("llama.attention.head_count", U32, struct.pack("<I", 2)),
    ("llama.attention.head_count_kv", U32, struct.pack("<I", 1)),
    ("llama.context_length", U32, struct.pack("<I", 64)),
    ("llama.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", 1e-5)),
    ("tokenizer.ggml.model", STR, gguf_string("gpt2")),
    ("tokenizer.ggml.pre", STR, gguf_string("smollm")),
    ("tokenizer.ggml.tokens", ARR, arr_str(["<s>", "</s>", "a", "b", "\u0120a", "ab"])),
    ("tokenizer.ggml.token_type", ARR, arr_i32([3, 3, 1, 1, 1, 1])),
    ("tokenizer.ggml.merges", ARR, arr_str(["a b"])),
    ("tokenizer.ggml.bos_token_id", U32, struct.pack("<I", 0)),
    ("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 1)),
]
f32s = lambda n: b"".join(struct.pack("<f", 0.01 * i) for i in range(n))
# Q8_0 (type 8): blocks of 32 weights, an f16 scale and 32 int8.
q8 = lambda rows: b"".join(struct.pack("<e", 0.5) + bytes(range(32)) for _ in range(rows))
put("gguf", "llama_tiny.gguf", gguf(llama_kvs, [
    ("token_embd.weight", [8, 6], 0, f32s(48)),
    ("output_norm.weight", [8], 0, f32s(8)),
    ("blk.0.attn_q.weight", [32, 8], 8, q8(8)),
]))
put("gguf", "spm_tiny.gguf", gguf([
    ("general.architecture", STR, gguf_string("gemma3")),
    ("tokenizer.ggml.model", STR, gguf_string("llama")),
    ("tokenizer.ggml.tokens", ARR, arr_str(["<pad>", "<eos>", "<bos>", "\u2581a", "b", "<0x41>"])),
    ("tokenizer.ggml.scores", ARR, arr_f32([0, 0, 0, -1, -2, -3])),
    ("tokenizer.ggml.token_type", ARR, arr_i32([3, 3, 3, 1, 1, 6])),
], [("token_embd.weight", [4, 6], 1, b"\0" * 48)]))
put("gguf", "empty_table.gguf", gguf([], []))

for i, text in enumerate([
    "Hello, world! The capital of France is Paris.",
    "  leading spaces\n\n\tand tabs   ",
    "日本語のテキスト 🚀 emoji ça va? Ünïcödé",
    "<|im_start|>user\nHi<|im_end|>\n<start_of_turn>model\n",
    "don't we'll 123456789 3.14159 x=y+z; // code",
    "\u0000\u0001\ufffd\u200b\u00a0 mixed",
]):
    put("tokenizer", f"text{i}.txt", text)

templates = {
    "chatml.jinja": "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
    "namespace.jinja": "{%- set ns = namespace(system='') -%}{%- for m in messages -%}{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + (m['content'] | trim) -%}{%- else -%}{{ m['role'] }}: {{ m['content'] | trim }}\n{%- endif -%}{%- endfor -%}{{ ns.system }}",
    "loops.jinja": "{% for i in range(3) %}{{ loop.index }}{% if loop.last %}!{% endif %}{% endfor %}{{ messages | length }}{{ bos_token }}{{ messages[0].content | tojson }}",
    "raise.jinja": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ strftime_now('%Y-%m-%d') }}",
}
smol = os.path.join(ROOT, "crates/models/tests/data/chat_template/smollm2_transformers.json")
if os.path.exists(smol):
    templates["smollm2.jinja"] = json.load(open(smol))["template"]
for name, t in templates.items():
    put("chat_template", name, t)


def safetensors(tensors):
    header, data, off = {}, b"", 0
    for name, shape, values in tensors:
        b = b"".join(struct.pack("<f", v) for v in values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        data += b
        off += len(b)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


cfg = {"model": {"vocab_size": 3, "block_size": 4, "n_layer": 1, "n_head": 1, "n_embd": 4, "dropout": 0.0},
       "vocab": {"chars": ["a", "b", "c"]}, "provenance": {}}
c = 4
names = [("transformer.wte.weight", [3, c]), ("transformer.wpe.weight", [4, c]),
         ("transformer.h.0.ln_1.weight", [c]), ("transformer.h.0.attn.c_attn.weight", [3 * c, c]),
         ("transformer.h.0.attn.c_proj.weight", [c, c]), ("transformer.h.0.ln_2.weight", [c]),
         ("transformer.h.0.mlp.c_fc.weight", [4 * c, c]), ("transformer.h.0.mlp.c_proj.weight", [c, 4 * c]),
         ("transformer.ln_f.weight", [c])]
tensors = []
for n, shape in names:
    k = 1
    for d in shape:
        k *= d
    tensors.append((n, shape, [0.01 * i for i in range(k)]))
cj = json.dumps(cfg).encode()
put("checkpoint", "tiny", struct.pack("<H", len(cj)) + cj + safetensors(tensors))
put("checkpoint", "config_only", struct.pack("<H", len(cj)) + cj)
