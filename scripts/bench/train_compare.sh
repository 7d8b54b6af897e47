#!/usr/bin/env bash
# GPU training speed of two tinygpt builds side by side, and of PyTorch on the same card: ROUNDS
# interleaved rounds of
#
#   tinygpt bench train --iters ITERS              (the fast paths that pass their gates: tensor cores)
#   tinygpt bench train --iters ITERS --f32-only   (the canonical f32 path)
#
# for the build before and the build after (each with a gate cache of its own, so a kernel version
# one build knows and the other does not never meets the other's results), then one `--profile` step
# of the build after (each kernel timed alone), then PyTorch's fp32 eager and bf16 + torch.compile runs
# of the same recipe (TORCH_SCRIPT, ../shared/bench/torch_char_gpt.py, when PYTHON has torch).
#
#   bash scripts/bench/train_compare.sh TINYGPT_BEFORE TINYGPT_AFTER [ROUNDS]
#
# Environment: ITERS (30), TRAIN_ARGS (more `bench train` options, e.g. "--batch 4 --n-layer 2" for a
# quick check on a software adapter), BACKEND (gpu), TORCH_SCRIPT, PYTHON (python3), TEXT (the
# training text, default data/shakespeare.txt), CACHE (where the gate caches go: a temporary folder).
set -euo pipefail
A=$1 B=$2 ROUNDS=${3:-2}
ITERS=${ITERS:-30}
BACKEND=${BACKEND:-gpu}
TRAIN_ARGS=${TRAIN_ARGS:-}
TORCH_SCRIPT=${TORCH_SCRIPT:-../shared/bench/torch_char_gpt.py}
PYTHON=${PYTHON:-python3}
TEXT=${TEXT:-data/shakespeare.txt}
CACHE=${CACHE:-$(mktemp -d)}

train() { # WHICH TINYGPT ARGS...: the bench's result lines on one line
  local which=$1 tg=$2
  shift 2
  # shellcheck disable=SC2086 # TRAIN_ARGS is a list of options
  TINYGPT_CACHE_DIR="$CACHE/$which" "$tg" --backend "$BACKEND" bench train --iters "$ITERS" \
    $TRAIN_ARGS "$@" 2>&1 | grep -E '^gates:|ms/iter|submits' | tr '\n' ' '
  echo
}

for r in $(seq 1 "$ROUNDS"); do
  for which in before after; do
    tg=$A
    [ "$which" = after ] && tg=$B
    printf 'round %s %-6s fast paths: ' "$r" "$which"
    train "$which" "$tg"
    printf 'round %s %-6s f32 only:   ' "$r" "$which"
    train "$which" "$tg" --f32-only
  done
done
echo "== after: one step, each kernel timed alone"
# shellcheck disable=SC2086
TINYGPT_CACHE_DIR="$CACHE/after" "$B" --backend "$BACKEND" bench train --iters 10 $TRAIN_ARGS \
  --profile 2>&1 | grep -v '^\[ops\]'
if [ -f "$TORCH_SCRIPT" ] && "$PYTHON" -c 'import torch' 2>/dev/null; then
  for mode in fp32 bf16compile; do
    echo "== PyTorch $mode, $ITERS iterations"
    "$PYTHON" "$TORCH_SCRIPT" "$TEXT" "$mode" "$ITERS" 2>&1 | tail -1
  done
else
  echo "== PyTorch: not run (no $TORCH_SCRIPT, or $PYTHON without torch)"
fi
