#!/usr/bin/env bash
# Builds the CUDA + NCCL release binaries (tpinfer, tpinfer-bench) on a host without CUDA,
# with the pinned toolchain of scripts/build/cuda-toolchain.sh, into target/cuda, and copies them to
# .dist/ (git-ignored) for a GPU host. CUDA_COMPUTE_CAP: 90 for H100/H200 (default), 89 for
# RTX 4090. On a host with CUDA installed, plain `cargo build --release --features cuda,nccl`
# with CUDA_COMPUTE_CAP set does the same.
# Usage: scripts/build/build-cuda.sh [check|timeline]   (check: `cargo clippy -D warnings`, also of
# the timeline build, and every kernel's PTX assembled by ptxas for CUDA_COMPUTE_CAP and the
# RTX 4090, as CI does; timeline: tpinfer-bench with the `timeline` feature into
# .dist/timeline/, for `tpinfer-bench timeline`)
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/build/cuda-toolchain.sh)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
if [ "${1:-}" = check ]; then
  # With the kernels' PTX also for the RTX 4090 (sm_89: the pre-Hopper paths), which the
  # build compiles beside the CUDA_COMPUTE_CAP one.
  export TPINFER_PTX_CHECK_CAPS=${TPINFER_PTX_CHECK_CAPS:-89}
  features=tpinfer/nccl,tpinfer-benches/nccl
  cargo clippy --workspace --all-targets --features $features -- -D warnings
  # The driver assembles the PTX on the user's GPU when a kernel is first loaded; assembling it
  # here too makes an error in it (inline PTX, an instruction the target lacks) fail the check
  # instead of a user's first run.
  # The build that clippy ran is the newest with the check folders: builds with other
  # features (a plain `cargo check` in the same target dir) leave out folders without them.
  builds="$CARGO_TARGET_DIR"/debug/build/tpinfer-kernels-*/out
  first=${TPINFER_PTX_CHECK_CAPS%% *}
  if [ -n "$first" ]; then
    out=$(ls -td $builds/check-sm"$first" | head -n 1)
    out=${out%/check-sm*}
  else
    out=$(ls -td $builds | head -n 1)
  fi
  # The timeline build's kernels take an argument more (cuda/chain.cuh): lint it too, and
  # assemble its PTX for CUDA_COMPUTE_CAP (its build leaves out the check folders).
  TPINFER_PTX_CHECK_CAPS= cargo clippy --workspace --all-targets --features $features,tpinfer-benches/timeline \
    -- -D warnings
  timeline=$(ls -td $(grep -l globaltimer $builds/gemv.ptx) | head -n 1)
  assemble() { # cap dir
    local ptx arch
    for ptx in "$2"/*.ptx; do
      arch=sm_$1
      case $ptx in *_sm90.ptx) arch=sm_90a ;; esac
      ptxas -arch="$arch" "$ptx" -o /dev/null || { echo "ptxas -arch=$arch failed on $ptx" >&2; exit 1; }
    done
    echo "ptxas -arch=sm_$1: $(ls "$2"/*.ptx | wc -l) PTX files assemble"
  }
  assemble "$CUDA_COMPUTE_CAP" "$out"
  for cap in $TPINFER_PTX_CHECK_CAPS; do assemble "$cap" "$out/check-sm$cap"; done
  assemble "$CUDA_COMPUTE_CAP" "${timeline%/gemv.ptx}"
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
