"""llama.cpp reference: tokenizations, greedy continuations, top-2 and last-position logits.

Runs llama.cpp through the llama-cpp-python package (see README.md for the environment). Writes:
  tests/data/tokenizer/<model>.json             token ids / pieces for TOKENIZER_CASES
  tests/data/reference/<model>/llamacpp.json    prompt ids, greedy ids, per-position top-2 logits
  tests/data/reference/<model>/llamacpp_<prompt>_last_logits.f32.bin
"""

import ctypes
import sys

import numpy as np

import llama_cpp
from llama_cpp import Llama

from common import (
    DATA,
    LOGIT_PROMPTS,
    MODELS,
    N_GREEDY,
    SCRATCH,
    TOKENIZER_CASES,
    check_model,
    top2,
    write_f32,
    write_json,
)

LLAMA_CPP_COMMIT = "0c1e570"  # vendored by llama-cpp-python 0.3.36
N_THREADS = 2
N_CTX = 512

# llama.cpp token attribute bits (llama_token_attr), for the vocabulary summary.
ATTRS = {1: "unknown", 2: "unused", 4: "normal", 8: "control", 16: "user_defined", 32: "byte"}


def tokenize(vocab, text: bytes, add_special: bool, parse_special: bool):
    n_max = len(text) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, n_max, add_special, parse_special)
    if n < 0:
        raise RuntimeError(f"tokenize needs {-n} tokens")
    return list(buf[:n])


def piece(vocab, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        raise RuntimeError("piece too long")
    return buf.raw[:n]


def detokenize(vocab, ids, remove_special: bool, unparse_special: bool) -> bytes:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    cap = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n]


def tokenizer_record(key: str, llm: Llama) -> dict:
    vocab = llm._model.vocab
    cases = []
    for name, text in TOKENIZER_CASES:
        raw = text.encode("utf-8")
        ids = tokenize(vocab, raw, add_special=True, parse_special=False)
        decoded = detokenize(vocab, ids, remove_special=False, unparse_special=False)
        cases.append(
            {
                "name": name,
                "text": text,
                # llama.cpp's default for a prompt: add_special=true (BOS if the model asks for
                # it), parse_special=false.
                "ids": ids,
                "ids_no_special": tokenize(vocab, raw, add_special=False, parse_special=False),
                "ids_parse_special": tokenize(vocab, raw, add_special=True, parse_special=True),
                # token_to_piece(special=false) of each id of "ids", hex-encoded bytes (a piece may
                # be part of a UTF-8 character).
                "pieces_hex": [piece(vocab, t, False).hex() for t in ids],
                # llama_detokenize(ids, remove_special=false, unparse_special=false)
                "decoded_hex": decoded.hex(),
                "round_trips": decoded == raw,
            }
        )
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    attr_counts = {}
    for t in range(n_vocab):
        a = llama_cpp.llama_vocab_get_attr(vocab, t)
        label = "+".join(v for k, v in ATTRS.items() if a & k) or "undefined"
        attr_counts[label] = attr_counts.get(label, 0) + 1
    eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    return {
        "tool": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
        "model_file": MODELS[key]["file"],
        "model_sha256": MODELS[key]["sha256"],
        "n_vocab": n_vocab,
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "bos_id": llama_cpp.llama_vocab_bos(vocab),
        "eos_id": llama_cpp.llama_vocab_eos(vocab),
        "eot_id": llama_cpp.llama_vocab_eot(vocab),
        "pad_id": llama_cpp.llama_vocab_pad(vocab),
        "eog_ids": eog,
        "attr_counts": attr_counts,
        "cases": cases,
    }


def logits_record(key: str, llm: Llama, out_dir) -> dict:
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()
    prompts = []
    for spec in LOGIT_PROMPTS[key]:
        ids = tokenize(vocab, spec["text"].encode(), add_special=True, parse_special=True)
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: llm.n_tokens], dtype=np.float32)
        assert scores.shape == (len(ids), n_vocab)
        prompt_top2 = [top2(row) for row in scores]
        last = scores[-1].copy()
        entry = {
            "name": spec["name"],
            "text": spec["text"],
            "ids": ids,
            "prompt_top2": prompt_top2,
        }
        fname = f"llamacpp_{spec['name']}_last_logits.f32.bin"
        write_f32(SCRATCH / key / fname, last.tolist())
        if spec["full_logits"]:
            write_f32(out_dir / fname, last.tolist())
            entry["last_logits_file"] = fname
        # Greedy continuation, one token at a time through the KV cache.
        gen, gen_top2 = [], []
        row = last
        for _ in range(N_GREEDY):
            t2 = top2(row)
            gen_top2.append(t2)
            gen.append(t2[0])
            llm.eval([t2[0]])
            row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        entry["greedy_ids"] = gen
        entry["greedy_top2"] = gen_top2
        entry["greedy_text"] = detokenize(vocab, gen, False, False).decode("utf-8", "replace")
        prompts.append(entry)
        print(f"[llama.cpp] {key}/{spec['name']}: {entry['greedy_text']!r}", file=sys.stderr)
    return {
        "tool": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT})",
        "settings": {
            "backend": "CPU",
            "n_threads": N_THREADS,
            "n_ctx": N_CTX,
            "n_batch": 512,
            "logits_all": True,
            "note": "prompt evaluated in one batch, then one token per eval through the KV cache",
        },
        "model_file": MODELS[key]["file"],
        "n_vocab": n_vocab,
        "prompts": prompts,
    }


def main():
    for key in MODELS:
        path = check_model(key)
        llm = Llama(
            model_path=str(path),
            n_ctx=N_CTX,
            n_batch=512,
            n_threads=N_THREADS,
            logits_all=True,
            verbose=False,
        )
        write_json(DATA / "tokenizer" / f"{key}.json", tokenizer_record(key, llm))
        out_dir = DATA / "reference" / key
        write_json(out_dir / "llamacpp.json", logits_record(key, llm, out_dir))
        chat_template = llama_cpp.llama_model_chat_template(llm._model.model, None)
        print(f"[llama.cpp] {key}: chat template present: {chat_template is not None}", file=sys.stderr)
        del llm


if __name__ == "__main__":
    main()
