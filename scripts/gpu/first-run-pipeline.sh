#!/usr/bin/env bash
# The Wan pipeline's first run against the next (issues #30 and #32): `tpinfer generate` on a
# random pipeline in the published shapes (umT5-XXL, the 1.3B DiT, Wan2.1's VAE), bf16, one
# step of 5 frames at 832x480, twice per build: the first with an empty driver JIT cache
# (CUDA_CACHE_PATH: what a fresh machine has), the second with what the first left there. The
# log holds each stage's time (the summary line), each prompt's encode, and the JIT cache's
# size after each run. BINS="NAME=DIR ..." (DIR holding that build's tpinfer). Needs torch,
# transformers and diffusers (see pipeline-check.sh). Results: $OUT/first-run-pipeline.log.
# Example: BINS="new=.dist" bash scripts/gpu/first-run-pipeline.sh
LOG=first-run-pipeline.log
. "$(dirname "$0")/wan-env.sh"
: "${BINS:?set BINS=\"NAME=DIR ...\"}"
P=$W/pipe13
make_pipeline "$P" 1.3b || exit 1
# The weights into the page cache, so that no run waits on the disk.
cat "$P"/*/*.safetensors > /dev/null
for bin in $BINS; do
  name=${bin%%=*} dir=${bin#*=}
  export CUDA_CACHE_PATH
  CUDA_CACHE_PATH=$(mktemp -d)
  for n in 1 2; do
    log "$name run $n"
    RUST_LOG=info,tpinfer_engine=debug run "$dir/tpinfer" generate --model "$P" --prompt "a red fox in the snow" \
      --frames 5 --size 832x480 --steps 1 --device cuda --tp 1 --dtype bf16 --out "$W/first-run.mp4"
    log "$name run $n: JIT cache $(du -sk "$CUDA_CACHE_PATH" | cut -f1) KiB"
  done
  rm -rf "$CUDA_CACHE_PATH"
done
log done
