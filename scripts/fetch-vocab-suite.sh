#!/usr/bin/env bash
# Fetch llama.cpp's tokenizer test suite: the vocabulary-only GGUF files models/ggml-vocab-*.gguf with
# their test inputs (.inp) and llama.cpp's token ids for them (.out), from the copy of llama.cpp
# (commit 0c1e570, MIT licence) inside the llama-cpp-python 0.3.36 source package on PyPI.
#
# Idempotent: an extracted suite is left alone. The source package is downloaded once into
# .cache/pypi-sdist (verified against its pinned sha256) and only the suite's files are extracted.
#
# Destination: $TINYGPT_VOCAB_DIR, or <repo>/.cache/llama-vocab.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${TINYGPT_VOCAB_DIR:-$ROOT/.cache/llama-vocab}"
SDIST_DIR="$ROOT/.cache/pypi-sdist"
SDIST="$SDIST_DIR/llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256="$(cat "$ROOT/scripts/llama-cpp-python-0.3.36.sha256")"
PYTHON="${PYTHON:-python3}"

log() { printf '[fetch-vocab-suite] %s\n' "$*" >&2; }

if [ -f "$DEST/.complete" ]; then
    log "ok  $DEST"
    exit 0
fi
mkdir -p "$SDIST_DIR"
if [ ! -f "$SDIST" ] || [ "$(sha256sum "$SDIST" | cut -d' ' -f1)" != "$SDIST_SHA256" ]; then
    log "downloading llama-cpp-python 0.3.36's source package from PyPI (77 MB; nothing is built)"
    rm -rf "$SDIST_DIR/download" && mkdir -p "$SDIST_DIR/download"
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip download --disable-pip-version-check --quiet --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -d "$SDIST_DIR/download"
    got="$(sha256sum "$SDIST_DIR/download/$(basename "$SDIST")" | cut -d' ' -f1)"
    if [ "$got" != "$SDIST_SHA256" ]; then
        rm -rf "$SDIST_DIR/download"
        log "error: the download's sha256 $got differs from the pinned $SDIST_SHA256"
        exit 1
    fi
    mv -f "$SDIST_DIR/download/$(basename "$SDIST")" "$SDIST"
    rm -rf "$SDIST_DIR/download"
fi
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
tar -xzf "$SDIST" -C "$DEST.tmp" --strip-components=4 --wildcards \
    'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-*'
tar -xzf "$SDIST" -C "$DEST.tmp" --strip-components=3 'llama_cpp_python-0.3.36/vendor/llama.cpp/LICENSE'
touch "$DEST.tmp/.complete"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
log "placed $(ls "$DEST"/*.gguf | wc -l) vocabularies in $DEST"
