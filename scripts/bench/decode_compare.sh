#!/usr/bin/env bash
# GPU decode and prompt speed of two tinygpt builds side by side, and of llama.cpp's llama-bench on the
# same files: random-weight GGUF files of SmolLM2-135M's and Gemma-3-270M's shapes (speed does not
# depend on the values), written by the first build. For each file: the greedy ids of both builds after
# a 300-token prompt (they should agree), then ROUNDS interleaved rounds of
#
#   tinygpt bench llm F --prompt 128 -n 128 --reps 3 --parallel 16   (prompt 128, decode after it, 16 sequences)
#   tinygpt bench llm F --prompt 512 -n 128 --reps 3                 (prompt 512, decode after it)
#   llama-bench -m F -ngl 99 -p 512 -n 128 -d 0,512 -r 3             (when LLAMA_BENCH is given)
#
#   bash scripts/bench/decode_compare.sh TINYGPT_BEFORE TINYGPT_AFTER [ROUNDS]
#
# Environment: LLAMA_BENCH (a llama-bench built with -DGGML_CUDA=ON, docs/perf.md says how), DIR (where
# the model files go: a temporary folder), BACKEND (gpu), FILES (shape:block-format pairs, default
# "smollm2-135m:q8_0 gemma3-270m:q8_0"; "smollm2-135m:q4_1 gemma3-270m:q4_k_m" are the real files'
# layouts).
set -euo pipefail
A=$1 B=$2 ROUNDS=${3:-2}
BACKEND=${BACKEND:-gpu}
DIR=${DIR:-$(mktemp -d)}
FILES=${FILES:-smollm2-135m:q8_0 gemma3-270m:q8_0}
mkdir -p "$DIR"

names=()
for spec in $FILES; do
  shape=${spec%%:*} quant=${spec##*:}
  names+=("$shape-$quant")
  [ -f "$DIR/$shape-$quant.gguf" ] || "$A" --backend "$BACKEND" bench llm --synthetic "$shape" \
    --synthetic-quant "$quant" --save "$DIR/$shape-$quant.gguf" 2>&1 | tail -1
done

ids() { # TINYGPT FILE: the greedy ids' count and digest
  "$1" --backend "$BACKEND" run "$2" -p "$(python3 -c "print(' '.join(['the quick brown fox'] * 75))")" \
    -n 120 --temperature 0 --format json 2>/dev/null |
    python3 -c "import hashlib, json, sys; i = json.load(sys.stdin)['generated_ids']; print(len(i), hashlib.md5(str(i).encode()).hexdigest())"
}

bench() { # TINYGPT FILE ARGS...: the bench's result lines on one line
  local tg=$1 f=$2
  shift 2
  "$tg" --backend "$BACKEND" bench llm "$f" "$@" 2>&1 | grep -E '^prompt|^batched' |
    sed 's/ · +.*//; s/batched rows equal to the sequence decoded alone/equal alone/' | tr '\n' ' '
  echo
}

for shape in "${names[@]}"; do
  f="$DIR/$shape.gguf"
  echo "== $shape: greedy ids, before / after"
  ids "$A" "$f"
  ids "$B" "$f"
done
for r in $(seq 1 "$ROUNDS"); do
  for shape in "${names[@]}"; do
    f="$DIR/$shape.gguf"
    for which in before after; do
      tg=$A
      [ "$which" = after ] && tg=$B
      printf 'round %s %s %-6s p128: ' "$r" "$shape" "$which"
      bench "$tg" "$f" --prompt 128 -n 128 --reps 3 --parallel 16
      printf 'round %s %s %-6s p512: ' "$r" "$shape" "$which"
      bench "$tg" "$f" --prompt 512 -n 128 --reps 3
    done
    if [ -n "${LLAMA_BENCH:-}" ]; then
      echo "round $r $shape llama.cpp:"
      "$LLAMA_BENCH" -m "$f" -ngl 99 -p 512 -n 128 -d 0,512 -r 3 2>&1 | grep -E 'pp|tg'
    fi
  done
done
