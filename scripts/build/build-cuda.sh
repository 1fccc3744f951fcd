#!/usr/bin/env bash
# Builds the CUDA + NCCL release binaries (tpinfer, tpinfer-bench) on a host without CUDA,
# with the pinned toolchain of scripts/build/cuda-toolchain.sh, into target/cuda, and copies them to
# .dist/ (git-ignored) for a GPU host. CUDA_COMPUTE_CAP: 90 for H100/H200 (default), 89 for
# RTX 4090. On a host with CUDA installed, plain `cargo build --release --features cuda,nccl`
# with CUDA_COMPUTE_CAP set does the same.
# The kernels carry SASS for the RTX 4090 and the H100/H200 whatever CUDA_COMPUTE_CAP says
# (TPINFER_CUDA_SASS, crates/kernels/build.rs).
# Usage: scripts/build/build-cuda.sh [check|timeline]   (check: `cargo clippy -D warnings`, also of
# the timeline build, as CI does; timeline: tpinfer-bench with the `timeline` feature into
# .dist/timeline/, for `tpinfer-bench timeline`)
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/build/cuda-toolchain.sh)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
if [ "${1:-}" = check ]; then
  # Also the timeline build, whose kernels take an argument more (cuda/chain.cuh). Either
  # build has nvcc assemble every kernel for the RTX 4090 and the H100/H200 (the fatbin's
  # SASS, crates/kernels/build.rs), so an error in the PTX (inline PTX, an instruction a target
  # lacks) fails here instead of on a user's GPU.
  features=tpinfer/nccl,tpinfer-benches/nccl
  cargo clippy --workspace --all-targets --features $features -- -D warnings
  cargo clippy --workspace --all-targets --features $features,tpinfer-benches/timeline -- -D warnings
  exit
fi
if [ "${1:-}" = timeline ]; then
  CARGO_TARGET_DIR="$CARGO_TARGET_DIR/timeline" cargo build --release -p tpinfer-benches --features nccl,timeline
  mkdir -p .dist/timeline
  cp "$CARGO_TARGET_DIR/timeline/release/tpinfer-bench" .dist/timeline/
  exit
fi
cargo build --release -p tpinfer -p tpinfer-benches --features tpinfer/nccl,tpinfer-benches/nccl
mkdir -p .dist
cp "$CARGO_TARGET_DIR/release/tpinfer" "$CARGO_TARGET_DIR/release/tpinfer-bench" .dist/
ls -la .dist
