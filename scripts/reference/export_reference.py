#!/usr/bin/env python3
"""Records what llama.cpp and transformers compute for the bundled Shakespeare model as
`tinygpt export` writes it, for the export tests (crates/models/tests/export_interop.rs).

    python3 scripts/reference/export_reference.py llamacpp     # in .cache/venv-ref (llama_cpp)
    python3 scripts/reference/export_reference.py transformers # in .cache/venv-hf (transformers)

Both read the files `tinygpt export` wrote into .cache/export/ (regenerate.sh makes them:
shakespeare.f32.gguf, shakespeare.f16.gguf, shakespeare.q8_0.gguf and the Hugging Face directory hf/)
and write crates/models/tests/data/export/<tool>.json with, per file: its sha256 (the tests export the
model again and check they get these very bytes, so the results below are about the files they check),
and per prompt the token ids, the logits at every prompt position, the greedy continuation of 100
tokens (ids and text) and the logits at each of those steps' argmax (its top-2 gap shows near-ties).

llama.cpp runs with its defaults (f16 KV cache, flash attention "auto"), 2 CPU threads, as a user's
`llama-cli -m FILE` would; transformers in f32 on the CPU, eager attention.
"""
import json
import os
import sys

from common import sha256, top2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPORT = os.path.join(ROOT, ".cache", "export")
OUT = os.path.join(ROOT, "crates", "models", "tests", "data", "export")
PROMPTS = [
    "ROMEO:",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
]
N_GREEDY = 100
GGUF = ["shakespeare.f32.gguf", "shakespeare.f16.gguf", "shakespeare.q8_0.gguf"]
HF_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def llamacpp():
    import numpy as np
    import llama_cpp

    out = {"tool": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, CPU, 2 threads, defaults", "files": {}}
    for name in GGUF:
        path = os.path.join(EXPORT, name)
        llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=256, n_threads=2, logits_all=True,
                              verbose=False)
        rec = {"sha256": sha256(path), "n_vocab": llm.n_vocab(), "prompts": []}
        for text in PROMPTS:
            ids = llm.tokenize(text.encode(), add_bos=True, special=False)
            llm.reset()
            llm.eval(ids)
            logits = [np.array(llm.scores[i], dtype=np.float32) for i in range(len(ids))]
            greedy, steps = [], []
            for _ in range(N_GREEDY):
                row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                t = int(np.argmax(row))
                steps.append(top2(row))
                greedy.append(t)
                llm.eval([t])
            rec["prompts"].append({
                "text": text,
                "ids": ids,
                "logits": [[float(x) for x in row] for row in logits],
                "greedy_ids": greedy,
                "greedy_top2": steps,
                "greedy_text": llm.detokenize(greedy).decode("utf-8", errors="replace"),
            })
        out["files"][name] = rec
        print(name, repr(rec["prompts"][0]["greedy_text"][:40]), flush=True)
        del llm
    write("llamacpp.json", out)


def transformers_():
    import numpy as np
    import torch
    import transformers
    from transformers import AutoTokenizer, GPT2LMHeadModel

    torch.set_num_threads(2)
    d = os.path.join(EXPORT, "hf")
    tok = AutoTokenizer.from_pretrained(d)
    model = GPT2LMHeadModel.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    rec = {"sha256": {f: sha256(os.path.join(d, f)) for f in HF_FILES}, "n_vocab": model.config.vocab_size,
           "prompts": []}
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
            # The attention mask is given: generate() would otherwise mask every token equal to the pad
            # id it falls back to, and the model has no pad token (every id is a character).
            x = torch.tensor([ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_GREEDY,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        greedy = gen.sequences[0, len(ids):].tolist()
        steps = [top2(s[0].numpy().astype(np.float32)) for s in gen.scores]
        rec["prompts"].append({
            "text": text,
            "ids": ids,
            "logits": [[float(x) for x in row] for row in logits],
            "greedy_ids": greedy,
            "greedy_top2": steps,
            "greedy_text": tok.decode(greedy),
        })
        print("hf", repr(rec["prompts"][-1]["greedy_text"][:40]), flush=True)
    out = {"tool": f"transformers {transformers.__version__}, torch {torch.__version__}, CPU f32, eager attention",
           "files": {"hf": rec}}
    write("transformers.json", out)


def write(name, obj):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    {"llamacpp": llamacpp, "transformers": transformers_}[sys.argv[1]]()
