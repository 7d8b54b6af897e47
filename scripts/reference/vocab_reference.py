#!/usr/bin/env python3
"""Records llama.cpp's token ids for texts where a plain reading of a vocabulary differs from what
llama.cpp does, for crates/models/tests/vocab_suite.rs:

- Phi-3's special tokens drop the whitespace after them (llama.cpp sets RSTRIP on them by model name);
- characters added in Unicode 16 are undefined to llama.cpp's Unicode tables (no category), so the
  letter/number alternatives of the pre-tokenizer regexes do not take them.

    .cache/venv-ref/bin/python scripts/reference/vocab_reference.py

Reads the vocabularies of llama.cpp's tokenizer suite (scripts/fetch-vocab-suite.sh puts them in
.cache/llama-vocab) and SmolLM2 (scripts/fetch-models.sh); writes
crates/models/tests/data/tokenizer/llamacpp_vocab_extra.json.
"""
import json
import os

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.environ.get("TINYGPT_VOCAB_DIR", os.path.join(ROOT, ".cache", "llama-vocab"))
MODELS = os.environ.get("TINYGPT_MODELS_DIR", os.path.join(ROOT, ".cache", "models"))
OUT = os.path.join(ROOT, "crates", "models", "tests", "data", "tokenizer", "llamacpp_vocab_extra.json")

PHI3 = [
    "<|user|>\n Hello there<|end|>\n<|assistant|>\n",
    "<|system|>  You are a helpful assistant.<|end|>\n\t<|user|> \n Hi</s>  x<s> y<unk> z<|endoftext|> w",
]
# Garay letters and digits, Kirat Rai digits, Tulu-Tigalari letters, outlined digits (Unicode 16).
UNICODE16 = [
    "Garay \U00010D4A\U00010D4B\U00010D4C, digits \U00010D40\U00010D41 and x\U00016D70\U00016D71y",
    "abc\U00011380\U00011381def 12\U0001CCF0\U0001CCF13 word\U00010D4Aword",
]
CASES = [
    ("vocab", "ggml-vocab-phi-3.gguf", PHI3, True),
    ("vocab", "ggml-vocab-phi-3.gguf", PHI3, False),
    ("vocab", "ggml-vocab-gpt-2.gguf", UNICODE16, False),
    ("vocab", "ggml-vocab-llama-bpe.gguf", UNICODE16, False),
    ("vocab", "ggml-vocab-qwen2.gguf", UNICODE16, False),
    ("models", "SmolLM2-135M-Instruct.Q4_1.gguf", UNICODE16, False),
]


def main():
    out = {"tool": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}", "cases": []}
    for where, name, texts, special in CASES:
        path = os.path.join(VOCAB if where == "vocab" else MODELS, name)
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        for text in texts:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            out["cases"].append({"dir": where, "file": name, "text": text, "parse_special": special,
                                 "ids": ids})
        del llm
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(OUT, len(out["cases"]))


if __name__ == "__main__":
    main()
