#!/usr/bin/env python3
"""Cold start-up of `tinygpt run` as a user sees it: seconds from launch to the first generated
character on stdout, and to the moment the fast paths' gates finish (stderr's "gated in" line), with
an empty gate cache (a fresh TINYGPT_CACHE_DIR) and then a warm one (the same directory again).

    scripts/cold-start.py [--tinygpt target/release/tinygpt] MODEL.gguf [extra tinygpt flags...]

Extra flags go before `run` (for example `--backend gpu --adapter llvmpipe`). Prints one line per
start and a JSON summary; docs/perf.md records the figures.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

PROMPT = "The capital of France is"


def one_start(tinygpt, model, flags, cache_dir, tokens):
    env = dict(os.environ, TINYGPT_CACHE_DIR=cache_dir)
    cmd = [tinygpt, *flags, "run", model, "-p", PROMPT, "-n", str(tokens), "--temperature", "0"]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    marks = {}
    err_lines = []

    def read_stderr():
        for line in iter(p.stderr.readline, b""):
            text = line.decode("utf-8", "replace").rstrip()
            err_lines.append(text)
            now = time.monotonic() - t0
            if "ready." in text:
                marks.setdefault("ready_s", now)
            if text.startswith("[ops] gated in") or text.startswith("[ops] fast paths gated in"):
                marks.setdefault("gated_s", now)
            if "token gate:" in text and "PASS" in text:
                marks.setdefault("token_gate_pass_s", now)

    reader = threading.Thread(target=read_stderr)
    reader.start()
    seen = b""
    while True:
        b = p.stdout.read(1)
        if not b:
            break
        seen += b
        if len(seen) > len(PROMPT.encode()) and "first_token_s" not in marks:
            marks["first_token_s"] = time.monotonic() - t0
    p.wait()
    reader.join()
    marks["exit_s"] = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"tinygpt failed ({p.returncode}):\n" + "\n".join(err_lines))
    return marks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tinygpt", default="target/release/tinygpt")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("model")
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tinygpt-cold-") as cache:
        cold = one_start(a.tinygpt, a.model, a.flags, cache, a.tokens)
        warm = one_start(a.tinygpt, a.model, a.flags, cache, a.tokens)
    for name, m in (("cold", cold), ("warm", warm)):
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    print(json.dumps({"model": os.path.basename(a.model), "flags": a.flags, "cold": cold, "warm": warm}))


if __name__ == "__main__":
    main()
