#!/usr/bin/env python3
"""Records llama.cpp's perplexity of the real models on a fixed slice of the bundled text, for
`tinygpt perplexity`'s tests: characters 1,000,000-1,020,000 of data/shakespeare.txt, -c 256, 2 threads.

    python3 scripts/reference/llamacpp_perplexity.py PATH/TO/llama-perplexity

llama-perplexity is built from the llama-cpp-python 0.3.36 source package (vendor/llama.cpp, commit
0c1e570): `cmake -G Ninja -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF`
then `ninja -C build llama-perplexity`. Writes crates/tinygpt/tests/data/perplexity_llamacpp.json with
the running perplexity after each chunk (what llama-perplexity prints as [1]x,[2]y,...) and the final one.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.environ.get("TINYGPT_MODELS_DIR", os.path.join(ROOT, ".cache/models"))
FILES = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-Q4_K_M.gguf"]
START, END, CTX = 1_000_000, 1_020_000, 256


def main():
    exe = sys.argv[1]
    text = open(os.path.join(ROOT, "data/shakespeare.txt"), encoding="utf-8").read()[START:END]
    out = {
        "tool": "llama-perplexity, llama.cpp 0c1e570 (llama-cpp-python 0.3.36 sdist), CPU, -t 2",
        "text": f"data/shakespeare.txt characters {START}..{END}",
        "ctx": CTX,
        "models": {},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        path = f.name
    for name in FILES:
        r = subprocess.run([exe, "-m", os.path.join(MODELS, name), "-f", path, "-c", str(CTX), "-t", "2"],
                           capture_output=True, text=True, check=True)
        log = r.stdout + r.stderr
        running = [float(x) for x in re.findall(r"\[\d+\]([\d.]+),", log)]
        final = float(re.search(r"Final estimate: PPL = ([\d.]+)", log).group(1))
        out["models"][name] = {"running": running, "final": final}
        print(name, final, flush=True)
    os.unlink(path)
    dst = os.path.join(ROOT, "crates/tinygpt/tests/data/perplexity_llamacpp.json")
    with open(dst, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
