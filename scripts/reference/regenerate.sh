#!/usr/bin/env bash
# Regenerates crates/models/tests/data/ from llama.cpp (llama-cpp-python) and transformers.
#
# Two virtual environments under .cache/ (git-ignored), created on first use with pip from PyPI:
#   .cache/venv-ref  llama-cpp-python 0.3.36, built from its source package (llama.cpp 0c1e570);
#                    with 2 cores the build takes ~15 minutes
#   .cache/venv-hf   transformers, torch (CPU use only), gguf, accelerate
# Then runs, in order: llamacpp_reference.py, hf_reference.py, chat_template_reference.py (both
# modes), compare.py, and export_reference.py (both modes) on the bundled model as `tinygpt export`
# writes it into .cache/export/. About 5 minutes once the environments exist.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV_REF="$ROOT/.cache/venv-ref"
VENV_HF="$ROOT/.cache/venv-hf"
PYTHON="${PYTHON:-python3}"

log() { printf '[reference] %s\n' "$*" >&2; }

"$ROOT/scripts/fetch-models.sh"
"$ROOT/scripts/fetch-vocab-suite.sh"

if ! "$VENV_REF/bin/python" -c "import llama_cpp, numpy" 2>/dev/null; then
    log "creating $VENV_REF (builds llama.cpp from the llama-cpp-python source package)"
    "$PYTHON" -m venv "$VENV_REF"
    # Only the shared libraries the Python bindings load; no server, tools, tests or multimodal.
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV_REF/bin/pip" install "llama-cpp-python==0.3.36" "numpy"
fi

if ! "$VENV_HF/bin/python" -c "import torch, transformers, gguf, accelerate" 2>/dev/null; then
    log "creating $VENV_HF"
    "$PYTHON" -m venv "$VENV_HF"
    "$VENV_HF/bin/pip" install "torch==2.15.0" "transformers==5.24.0" "gguf==0.19.0" "sentencepiece" \
        "accelerate==1.15.0" "numpy"
fi

cd "$HERE"
log "llama.cpp: tokenizations, logits, greedy continuations"
"$VENV_REF/bin/python" llamacpp_reference.py
log "transformers: f32 logits and greedy continuations on the same ids"
"$VENV_HF/bin/python" hf_reference.py
log "chat templates"
"$VENV_HF/bin/python" chat_template_reference.py transformers
"$VENV_REF/bin/python" chat_template_reference.py llamacpp
log "agreement"
"$VENV_REF/bin/python" compare.py
log "the bundled model exported to GGUF and Hugging Face, run by llama.cpp and transformers"
EXPORT="$ROOT/.cache/export"
rm -rf "$EXPORT" && mkdir -p "$EXPORT"
(cd "$ROOT" && cargo build --release --quiet)
TINYGPT="$ROOT/target/release/tinygpt"
"$TINYGPT" export --gguf "$EXPORT/shakespeare.f32.gguf" --hf "$EXPORT/hf"
"$TINYGPT" export --gguf "$EXPORT/shakespeare.f16.gguf" --type f16
"$TINYGPT" export --gguf "$EXPORT/shakespeare.q8_0.gguf" --type q8_0
"$VENV_REF/bin/python" export_reference.py llamacpp
"$VENV_HF/bin/python" export_reference.py transformers
log "tokenizer cases where llama.cpp departs from a plain reading of the vocabulary"
"$VENV_REF/bin/python" vocab_reference.py
log "llama.cpp's undefined code points"
python3 llama_unicode.py
log "a GPT-2 with biases, written by gguf-py, and transformers on it"
"$VENV_HF/bin/python" gpt2_reference.py
log "tiny Qwen2 / Qwen3 models converted by llama.cpp's convert_hf_to_gguf.py, and transformers on them"
"$VENV_HF/bin/python" qwen_reference.py
