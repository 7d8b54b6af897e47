#!/usr/bin/env bash
# Aggregate decode throughput of `tinygpt serve` beside `llama-server -np N`, at N = 1, 4, 16, 64
# concurrent streams of 128 tokens (each server restarted with N slots for each N), on one machine.
#
#   bash scripts/bench/serve_compare.sh MODEL.gguf TINYGPT LLAMA_SERVER [cpu|gpu]
#
# cpu: tinygpt's CPU backend and llama-server without offload; gpu: tinygpt's GPU backend and
# llama-server -ngl 99. Needs python3 with httpx (PYTHONPATH may point at a pip --target folder).
set -euo pipefail
MODEL=$1 TG=$2 LS=$3 MODE=${4:-cpu}
LEVELS=${LEVELS:-1 4 16 64}
TOKENS=${TOKENS:-128}
HERE="$(cd "$(dirname "$0")" && pwd)"
PORT=${PORT:-18080}

# shellcheck source=common.sh
source "$HERE/common.sh"

for n in $LEVELS; do
  if [ "$MODE" = gpu ]; then be=gpu; ngl=99; else be=cpu; ngl=0; fi
  "$TG" --backend "$be" serve "$MODEL" --port "$PORT" --parallel "$n" --ctx 256 >/tmp/tinygpt-serve.log 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$PORT"
  python3 "$HERE/serve_load.py" "http://127.0.0.1:$PORT" --streams "$n" --tokens "$TOKENS" --label "tinygpt-$be"
  kill $pid; wait $pid 2>/dev/null || true

  "$LS" -m "$MODEL" -ngl "$ngl" -np "$n" -c $((n * 256)) --port "$PORT" >/tmp/llama-server.log 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$PORT"
  python3 "$HERE/serve_load.py" "http://127.0.0.1:$PORT" --streams "$n" --tokens "$TOKENS" --label "llama-server"
  kill $pid; wait $pid 2>/dev/null || true
done
