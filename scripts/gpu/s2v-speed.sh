#!/usr/bin/env bash
# S2V-14B's guided denoising step (issue #35): the wan22 wheel's WanModel_S2V (bf16 under
# autocast as its `generate` runs it, SDPA attention) against tpinfer at TP 1 in bf16, on the
# same random weights in the published shape and the same clip: FRAMES (80) frames at SIZE
# (832x480) with its motion frames, reference, pose and audio. Also tpinfer's forward time, its
# stages, and the DiT's measured against planned peak. Needs the unpacked wan22 2.2.11 wheel at
# $WAN22 (default .carry/wan22), diffusers and einops (carried wheels where the host lacks
# them), and .dist/ from scripts/build/build-cuda.sh. WEIGHTS=fp8 and ATTENTION=fp8 add a
# tpinfer run with FP8 weights and/or FP8 self-attention (Hopper) after the bf16 one (issue #34).
LOG=s2v-speed.log
. "$(dirname "$0")/wan-env.sh"
WAN22=${WAN22:-.carry/wan22}
REF="$PY $SCRIPTS/reference/reference_s2v_speed.py"
M=$W/s2v14b IN=$W/s2v14b_in.st STEPS=${STEPS:-3}
[ -f "$M/config.json" ] || LIMIT=400 run $REF make --wan22 "$WAN22" --out "$M" --inputs "$IN" \
  --frames "${FRAMES:-80}" --size "${SIZE:-832x480}" || exit 1
[ -n "${SKIP_WHEEL:-}" ] || LIMIT=300 run $REF time --wan22 "$WAN22" --model "$M" --inputs "$IN" --steps "$STEPS"
LIMIT=400 run "$BIN/tpinfer-bench" dit --cuda --dtype bf16 --model "$M" --inputs "$IN" --repeats 2 \
  --guided-steps "$STEPS" --profile
[ -z "${WEIGHTS:-}${ATTENTION:-}" ] || LIMIT=400 run "$BIN/tpinfer-bench" dit --cuda --dtype bf16 --model "$M" \
  --inputs "$IN" --repeats 2 --guided-steps "$STEPS" --profile ${WEIGHTS:+--weights "$WEIGHTS"} \
  ${ATTENTION:+--attention-fp8}
log done
