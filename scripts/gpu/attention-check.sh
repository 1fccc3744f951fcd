#!/usr/bin/env bash
# The fused flash-attention kernels on one GPU: relative error against an f32 reference on the
# same bf16 inputs (non-causal, causal, GQA, ragged lengths, head sizes 64 and 128), then
# their speed at video lengths (Wan-14B's self-attention: 40 heads × 128 at 480p × 81 frames).
# On an H100/H200 with a CUDA_COMPUTE_CAP=90 build, head size 128 with 64 or more queries runs
# the Hopper (wgmma, TMA) kernel, the rest the mma.sync one. `cached` cases read a KV cache
# whose unfilled slots hold NaN (prefill chunks; one query runs the split-KV decode kernel, from
# one key to 8,191). FP8=1 adds the FP8 kernels beside the bf16 one on the same inputs: N(0, 1),
# and rows and channels spread over 2⁴; on an H100/H200 both the Hopper kernel and the
# mma.sync one that `--attention fp8` runs on an RTX 4090 (sm_90 runs it from its own SASS).
. "$(dirname "$0")/env.sh"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/attention.log"; }
run() { log "$*"; timeout "${LIMIT:-300}" "$@" 2>&1 | tee -a "$OUT/attention.log"; return "${PIPESTATUS[0]}"; }
run "$BIN/tpinfer-bench" attention --repeats 3 --cases \
  1:1:1:1:128,63:63:2:2:128,64:64:2:2:64,100:77:3:3:128,1000:512:12:12:128,4096:4096:12:12:128,\
9360:9360:12:12:128,300:300:32:8:128:causal,2048:2048:32:8:128:causal,1:385:32:8:128:causal,130:1000:8:8:64:causal,\
64:40:2:2:128,64:100:2:2:128:cached,200:1000:32:8:128:cached,512:2048:32:8:128:cached,1:1:32:8:128:cached,1:64:8:8:128:cached,1:65:4:1:64:cached,1:130:28:4:128:cached,1:700:16:2:128:cached,\
1:385:32:8:128:cached,1:2048:32:8:128:cached,1:5000:16:2:64:cached,1:8191:32:8:128:cached
run "$BIN/tpinfer-bench" attention --repeats 5 --no-reference --cases \
  9360:9360:40:40:128,32760:32760:40:40:128,32760:32760:20:20:128,32760:512:40:40:128,2048:2048:32:8:128:causal
if [ -n "${FP8:-}" ]; then
  run "$BIN/tpinfer-bench" attention --repeats 5 --cases \
    1000:1000:12:12:128:fp8,16384:16384:4:4:128:fp8,1000:1000:12:12:128:fp8-spread,300:777:8:2:128:fp8-spread
  run "$BIN/tpinfer-bench" attention --repeats 5 --no-reference --cases 32760:32760:40:40:128:fp8
fi
log done
