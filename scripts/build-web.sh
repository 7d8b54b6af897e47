#!/usr/bin/env bash
# Builds the browser playground into web/dist/: the Rust crates compiled to wasm32 (crates/web, with
# wasm-bindgen), the page, the bundled Shakespeare model and text. `tinygpt serve` serves web/dist at /;
# any static host can serve it too (it needs no server logic).
#
# Toolchain: rustup cannot fetch the wasm32 standard library here, so the standard library is built from
# source with Debian's rustc-web (1.96, with rust-web-src) and `-Zbuild-std`; installed with apt-get when
# missing. wasm-bindgen-cli must equal the wasm-bindgen crate's version; it is built once into
# ${TINYGPT_TOOLS:-~/.cache/tinygpt-ci/tools}.
set -euo pipefail
cd "$(dirname "$0")/.."

WASM_BINDGEN_VERSION=0.2.130
TOOLS="${TINYGPT_TOOLS:-$HOME/.cache/tinygpt-ci/tools}"
WEB_RUSTC="${WEB_RUSTC:-/usr/bin/rustc}"

sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# rustc-web links wasm with rust-lld, a symlink to lld-22 that Debian installs separately.
if ! "$WEB_RUSTC" --version 2>/dev/null | grep -q "^rustc 1\.9[6-9]" || [ ! -d /usr/lib/rustlib/src/rust/library ] \
   || [ ! -e "$(readlink -f /usr/bin/rust-lld)" ]; then
  echo "build-web: installing Debian's rustc-web toolchain (rustc-web, cargo-web, rust-web-src, lld-22)"
  sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_ apt-get install -y -qq rustc-web cargo-web rust-web-src lld-22
fi

if [ "$("$TOOLS/bin/wasm-bindgen" --version 2>/dev/null | awk '{print $2}')" != "$WASM_BINDGEN_VERSION" ]; then
  echo "build-web: building wasm-bindgen-cli $WASM_BINDGEN_VERSION into $TOOLS (once)"
  # With the versions its lock file names, unless one of them has since been withdrawn from crates.io
  # (webpki-roots 1.0.11 was, in 2026-12): then with the newest compatible ones.
  cargo install -q --locked wasm-bindgen-cli --version "$WASM_BINDGEN_VERSION" --root "$TOOLS" \
    || cargo install -q wasm-bindgen-cli --version "$WASM_BINDGEN_VERSION" --root "$TOOLS"
fi

echo "build-web: compiling crates/web for wasm32"
# No debug info in the page's wasm (the release profile keeps line tables for native backtraces).
# wasm SIMD (simd128: every current browser has it) lets the CPU twins' loops vectorize.
RUSTFLAGS="-C target-feature=+simd128" \
RUSTC="$WEB_RUSTC" RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR=target/wasm CARGO_PROFILE_RELEASE_DEBUG=false \
  cargo build -q --release --target wasm32-unknown-unknown -Zbuild-std=std,panic_abort -p tinygpt-web

rm -rf web/dist.tmp
mkdir -p web/dist.tmp/pkg web/dist.tmp/models/shakespeare-char web/dist.tmp/data
"$TOOLS/bin/wasm-bindgen" --target web --no-typescript --out-dir web/dist.tmp/pkg \
  target/wasm/wasm32-unknown-unknown/release/tinygpt_web.wasm
cp web/index.html web/app.js web/worker.js web/style.css web/dist.tmp/
cp models/shakespeare-char/config.json models/shakespeare-char/model.safetensors web/dist.tmp/models/shakespeare-char/
cp data/shakespeare.txt web/dist.tmp/data/
# Replace the old build as a whole, so a failed build never leaves half a page.
rm -rf web/dist
mv web/dist.tmp web/dist
echo "build-web: web/dist ($(du -sh web/dist | cut -f1)); serve it with: tinygpt serve (then open http://127.0.0.1:8080/)"
