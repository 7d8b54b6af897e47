"""Shared definitions for the reference scripts: models, prompts, output locations.

The scripts write into crates/models/tests/data/ (small, committed) and read the model files
placed by scripts/fetch-models.sh.
"""

import hashlib
import json
import os
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "crates" / "models" / "tests" / "data"
MODELS_DIR = Path(os.environ.get("TINYGPT_MODELS_DIR", ROOT / ".cache" / "models"))
# Full logits of every prompt (too large to commit; compare.py reads them).
SCRATCH = ROOT / ".cache" / "reference"

MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    "gemma3": {
        "file": "gemma-3-270m-Q4_K_M.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
}

# Texts whose tokenization is recorded for both models. Each exercises one thing a tokenizer can get
# wrong; the names are used by the Rust tests' failure messages.
TOKENIZER_CASES = [
    ("english", "The quick brown fox jumps over the lazy dog."),
    ("hello", "Hello world"),
    ("leading_spaces", "   leading spaces"),
    ("trailing_spaces", "trailing spaces   "),
    ("inner_spaces", "multiple    inner     spaces"),
    ("single_space", " "),
    ("many_spaces", " " * 40 + "x"),
    ("digits", "12345 3.14159 2026-11-29"),
    ("numbers", "1234567890 0.000001 -42 +7 1e10 $3,999.99"),
    ("code_rust", 'fn main() { println!("hi"); }'),
    ("code_python", "def f(x):\n    return x ** 2  # square\n"),
    ("non_ascii", "naïve café — 日本語 😀 Ελληνικά"),
    ("emoji_zwj", "👨\u200d👩\u200d👧\u200d👦 family, 🇫🇷 flag, ∑∫√ math, ½ ², Ⅻ"),
    ("scripts", "Привет мир, مرحبا بالعالم, नमस्ते दुनिया, 안녕하세요 세계"),
    ("newlines_tabs", "line1\nline2\n\nline4\r\n\ttabbed\t\tx\n\n\n"),
    ("empty", ""),
    ("contractions", "I'm sure you'll see it's they're we've I'd don't 'quoted'"),
    ("chatml_markup", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("gemma_markup", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"),
    ("html", "<b>bold</b> <table><tr><td>x</td></tr></table>"),
    ("rare_chars", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ \ue000 \U0001fae9 \x00\x01\x7f"),
    ("unicode_spaces", "a\u00a0b\u2003c\u3000d\u0085e"),
    ("repeated", "a" * 50 + " " + "ha" * 20),
    ("sentencepiece_marks", "a▁b ▁▁ <0x41> <unk> <pad> <eos> <bos> <unused0>"),
    ("mixed_case", "HELLO World hElLo WORLD's"),
]

# Prompts for which logits and greedy continuations are recorded (per model: logits files are
# large, so only a couple). `full_logits`: whether the last-position logits are stored.
LOGIT_PROMPTS = {
    "smollm2": [
        {"name": "capital", "text": "The capital of France is", "full_logits": True},
        {
            "name": "chat",
            "text": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            "full_logits": True,
        },
    ],
    "gemma3": [
        {"name": "capital", "text": "The capital of France is", "full_logits": True},
        {"name": "code", "text": "def fibonacci(n):\n", "full_logits": False},
    ],
}

N_GREEDY = 32

# The 2-turn conversation rendered with the chat template.
CHAT_MESSAGES = [
    {"role": "user", "content": "Hi! What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def model_path(key: str) -> Path:
    path = MODELS_DIR / MODELS[key]["file"]
    if not path.exists():
        raise SystemExit(f"{path} is missing: run scripts/fetch-models.sh")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_model(key: str) -> Path:
    path = model_path(key)
    got = sha256(path)
    if got != MODELS[key]["sha256"]:
        raise SystemExit(f"{path}: sha256 {got} differs from the pinned {MODELS[key]['sha256']}")
    return path


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def write_f32(path: Path, values) -> None:
    """Little-endian f32, no header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(values)}f", *values))


def read_f32(path: Path):
    data = path.read_bytes()
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def top2(row):
    """[id1, logit1, id2, logit2] of a logits row (numpy f32; ties: lowest id first, as argmax)."""
    import numpy as np

    first = int(np.argmax(row))
    rest = row.copy()
    rest[first] = -np.inf
    second = int(np.argmax(rest))
    return [first, float(row[first]), second, float(row[second])]
