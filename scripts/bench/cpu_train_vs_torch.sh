#!/usr/bin/env bash
# Training and evaluation throughput of the CPU backend beside PyTorch on the same cores, one run
# after the other (the figures in docs/perf.md). PyTorch comes from PyPI into a virtual environment
# outside the clone (~/.cache/tinygpt-bench/torch, made on first use).
# usage: scripts/bench/cpu_train_vs_torch.sh [TRAIN_ITERS] [EVAL_BATCHES]
set -euo pipefail
cd "$(dirname "$0")/../.."
iters=${1:-3}
batches=${2:-10}
venv=${TINYGPT_TORCH_VENV:-$HOME/.cache/tinygpt-bench/torch}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch numpy
fi
threads=$(nproc)
shared=${TINYGPT_SHARED:-../shared}
cargo build --release -q -p tinygpt
bin=target/release/tinygpt
echo "== tinygpt --backend cpu bench train --iters $iters ($threads threads)"
$bin --backend cpu bench train --iters "$iters"
echo "== PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), fp32 eager, CPU, $((iters + 3)) iterations (the first 3 untimed)"
DEVICE=cpu EVAL_ITERS=1 TORCH_THREADS=$threads "$venv/bin/python" "$shared/bench/torch_char_gpt.py" \
  "$shared/data/shakespeare.txt" fp32 $((iters + 3)) | tail -1
echo "== tinygpt --backend cpu eval --eval-iters $batches (the bundled model, wall time from start)"
/usr/bin/time -f "wall %e s" $bin --backend cpu eval --eval-iters "$batches" 2>&1 | grep -v '^note'
echo "== PyTorch eval, $batches batches (after one untimed warm-up batch)"
DEVICE=cpu "$venv/bin/python" scripts/bench/torch_char_eval.py "$batches"
