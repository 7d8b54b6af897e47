#!/usr/bin/env python3
"""Aggregate decode throughput of an OpenAI-compatible server at several concurrency levels.

Sends C concurrent /v1/completions requests (each `--tokens` tokens long, `ignore_eos` so every
request decodes its full length), waits for all of them, and reports the completion tokens per second
of wall time, summed over the streams. Works against `tinygpt serve` and `llama-server` alike.

    python3 scripts/bench/serve_load.py http://127.0.0.1:8080 --streams 1,4,16,64 --tokens 128

Needs httpx (the `openai` package's dependency): PYTHONPATH=.cache/pypi-openai-3.57.0 works.
"""
import argparse
import asyncio
import json
import time

import httpx

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "In the beginning",
    "Here is a list of fruits:",
]


async def one(client, url, i, tokens, model):
    body = {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": tokens,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": False,
    }
    if model:
        body["model"] = model
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def level(url, streams, tokens, model):
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        # Warm up (first-request costs: pipelines, caches).
        await one(client, url, 0, 8, model)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(client, url, i, tokens, model) for i in range(streams)))
        secs = time.perf_counter() - t0
    total = sum(done)
    return {"streams": streams, "tokens": total, "seconds": round(secs, 3), "tok_per_s": round(total / secs, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="the model id to send (default: none, the server's own)")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    rows = []
    for s in [int(x) for x in a.streams.split(",")]:
        r = asyncio.run(level(a.url.rstrip("/"), s, a.tokens, a.model))
        r["label"] = a.label
        rows.append(r)
        print(json.dumps(r), flush=True)
    # The ratio only where this run measured one stream first.
    base = rows[0]["tok_per_s"] if rows[0]["streams"] == 1 else None
    for r in rows:
        ratio = f" ({r['tok_per_s'] / base:.2f}x one stream)" if base and len(rows) > 1 else ""
        print(f"{a.label:>14} {r['streams']:>3} streams: {r['tok_per_s']:>8.1f} tok/s{ratio}")


if __name__ == "__main__":
    main()
