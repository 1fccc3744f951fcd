#!/usr/bin/env bash
# Builds the CUDA + NCCL release binaries (tpinfer, tpinfer-bench) on a host without CUDA,
# with the pinned toolchain of scripts/cuda-toolchain.sh, into target/cuda, and copies them to
# .dist/ (git-ignored) for a GPU host. CUDA_COMPUTE_CAP: 90 for H100/H200 (default), 89 for
# RTX 4090. On a host with CUDA installed, plain `cargo build --release --features cuda,nccl`
# with CUDA_COMPUTE_CAP set does the same.
# Usage: scripts/build-cuda.sh [check]   (check: only `cargo clippy -D warnings`, as CI does)
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolchain.sh)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
if [ "${1:-}" = check ]; then
  cargo clippy --workspace --all-targets --features tpinfer/nccl,tpinfer-benches/nccl -- -D warnings
  exit
fi
cargo build --release -p tpinfer -p tpinfer-benches --features tpinfer/nccl,tpinfer-benches/nccl
mkdir -p .dist
cp "$CARGO_TARGET_DIR/release/tpinfer" "$CARGO_TARGET_DIR/release/tpinfer-bench" .dist/
ls -la .dist
