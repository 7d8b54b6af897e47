#!/usr/bin/env bash
# What the drift guard costs `tinygpt serve`: aggregate decode of S concurrent streams (and of one
# stream) with the guard at its default interval (--drift-check 128) and off (0), interleaved, the
# server restarted for each run and given PAUSE seconds after /health answers 200 (the guard's shadow
# loads its f32 model in that time, off the requests' clock). The first run only gates the adapter's
# fast paths (cached after) and is left out. /metrics' drift counters follow each run.
#
#   bash scripts/bench/drift_guard_cost.sh MODEL.gguf TINYGPT [ROUNDS]
#
# Environment: STREAMS (16), TOKENS (256 a stream), CTX (512 a slot), PAUSE (2), PORT (18090), BACKEND
# (gpu: the guard watches fast paths only). Needs python3 with httpx (PYTHONPATH may point at a pip
# --target folder).
set -euo pipefail
MODEL=$1 TG=$2 ROUNDS=${3:-3}
STREAMS=${STREAMS:-16} TOKENS=${TOKENS:-256} CTX=${CTX:-512} PAUSE=${PAUSE:-2}
PORT=${PORT:-18090} BACKEND=${BACKEND:-gpu}
HERE="$(cd "$(dirname "$0")" && pwd)"
URL="http://127.0.0.1:$PORT"

# shellcheck source=common.sh
source "$HERE/common.sh"

one() { # N: a server with --drift-check N, S streams then one
  local n=$1 log
  log=$(mktemp)
  "$TG" --backend "$BACKEND" --drift-check "$n" serve "$MODEL" --port "$PORT" --parallel "$STREAMS" \
    --ctx "$CTX" >"$log" 2>&1 &
  local pid=$!
  wait_ready "$URL"
  sleep "$PAUSE"
  grep -m1 '^ready' "$log" || true
  for s in "$STREAMS" 1; do
    python3 "$HERE/serve_load.py" "$URL" --streams "$s" --tokens "$TOKENS" --label "drift-check=$n"
  done
  python3 -c "import httpx; print(' '.join(l for l in httpx.get('$URL/metrics').text.splitlines() if l.startswith('tinygpt_drift')))"
  kill -INT $pid
  wait $pid 2>/dev/null || true
  rm -f "$log"
}

echo "== gating run (left out)"
one 128 >/dev/null
# The order alternates from round to round: the first server of a pair is often the slower one.
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r"
  if [ $((r % 2)) = 1 ]; then
    one 128
    one 0
  else
    one 0
    one 128
  fi
done
