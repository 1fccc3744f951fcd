#!/usr/bin/env bash
# One denoising step of the Wan-14B-shaped DiT (random weights, bf16) at 480p × 21/41/81
# frames: diffusers (SDPA) and tpinfer at the TP widths in $TP (default 1,2), in the same run
# on the same host; tpinfer's peak device memory per rank against its plan. Issue #5.
# PROFILE=1 adds a per-stage profile of tpinfer at TP 1; WEIGHTS=fp8 a run with FP8 weights;
# ATTENTION=fp8 a run with FP8 self-attention (Hopper; with $WEIGHTS's weights when set).
# Needs torch + diffusers and .dist/.
LOG=wan-speed.log LIMIT=${LIMIT:-400}
. "$(dirname "$0")/wan-env.sh"
[ -f "$W/wan14/config.json" ] || run $REF make --shape 14b --save bf16 --out "$W/wan14" || exit 1
INPUTS=""
for frames in ${FRAMES:-21 41 81}; do
  [ -f "$W/in$frames.st" ] || run $REF inputs --frames "$frames" --size 832x480 --out "$W/in$frames.st"
  INPUTS="$INPUTS${INPUTS:+,}$W/in$frames.st"
done
[ -n "${SKIP_DIFFUSERS:-}" ] || run $REF forward --model "$W/wan14" --inputs "$INPUTS" --dtype bf16 --repeats 2 --out "$W/ref14.st"
run "$BIN/tpinfer-bench" dit --model "$W/wan14" --inputs "$INPUTS" --cuda --dtype bf16 --tp "${TP:-1,2}" \
  --repeats 2 ${PROFILE:+--profile}
# WEIGHTS=fp8: the same with the blocks' weights quantized at load (issue #34), after the bf16 run.
[ -z "${WEIGHTS:-}" ] || run "$BIN/tpinfer-bench" dit --model "$W/wan14" --inputs "$INPUTS" --cuda --dtype bf16 \
  --tp "${TP:-1,2}" --repeats 2 --weights "$WEIGHTS" ${PROFILE:+--profile}
# ATTENTION=fp8: the same with self-attention on E4M3 operands, after the runs above.
[ -z "${ATTENTION:-}" ] || run "$BIN/tpinfer-bench" dit --model "$W/wan14" --inputs "$INPUTS" --cuda --dtype bf16 \
  --tp "${TP:-1,2}" --repeats 2 ${WEIGHTS:+--weights "$WEIGHTS"} --attention-fp8 ${PROFILE:+--profile}
log done
