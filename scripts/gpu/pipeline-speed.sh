#!/usr/bin/env bash
# The whole Wan-14B-shaped text-to-video pipeline against diffusers' WanPipeline, timed from
# prompt to frames with the weights loaded (issue #30): random weights in the published shapes
# (umT5-XXL, the 14B DiT in bf16, Wan2.1's VAE), FRAMES (default 81) at 832x480, STEPS (default
# 50) UniPC steps with guidance 5 and shift 5, from the same starting latents. tpinfer runs
# bf16 at TP 1; diffusers runs the transformer and umT5 in bf16 and the VAE in f32, as its Wan
# examples load them. WHO="tpinfer diffusers" (default both) picks the runs: at 50 steps each
# takes about five minutes, so one call runs one (tpinfer first: the weights are made then, and
# a second call on the still-warm host finds them). Needs torch + transformers, diffusers,
# ftfy and wcwidth (carried wheels), .dist/ from scripts/build/build-cuda.sh and
# .carry/pipeline-skel (see scripts/gpu/pipeline-check.sh). JIT=warm (the default) first runs
# tpinfer once on the tiny pipeline at $TINY (default .carry/tiny-pipe, from the
# `tiny_wan_pipeline` example), as a user's machine has run it before: the driver compiles
# candle's PTX kernels on a machine's first run and keeps them (~/.nv/ComputeCache); JIT=cold
# times a fresh machine's first run. Results: $OUT/pipeline-speed.log.
LOG=pipeline-speed.log LIMIT=${LIMIT:-580}
. "$(dirname "$0")/wan-env.sh"
R=$SCRIPTS/reference
P=$W/pipe14 F=${FRAMES:-81} N=${STEPS:-50} PROMPT=${PROMPT:-"a red fox in the snow"}
make_pipeline "$P" 14b --save bf16 || exit 1
[ -f "$W/init14.st" ] || run $PY $R/reference_pipeline.py latents --frames "$F" --height 480 --width 832 --out "$W/init14.st" || exit 1
# The weights into the page cache, so that neither run's load waits on the disk.
cat "$P"/*/*.safetensors > /dev/null
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 500 > "$OUT/gpu_mem.csv" &
SMI=$!
for who in ${WHO:-tpinfer diffusers}; do
  case $who in
  tpinfer)
    if [ "${JIT:-warm}" = warm ]; then
      run "$BIN/tpinfer" generate --model "${TINY:-.carry/tiny-pipe}" --prompt "$PROMPT" --frames 5 --size 64x48 \
        --steps 1 --device cuda --tp 1 --dtype bf16 --out "$W/tiny.mp4" || exit 1
    fi
    start=$(date +%s.%N)
    # Debug events of the engine: each prompt's encode.
    RUST_LOG=info,tpinfer_engine=debug run "$BIN/tpinfer" generate --model "$P" --prompt "$PROMPT" --frames "$F" \
      --size 832x480 --steps "$N" --guide-scale 5 --shift 5 --init-latents "$W/init14.st" --device cuda --tp 1 --dtype bf16 \
      --out "$OUT/pipeline14.mp4"
    log "tpinfer: $(awk "BEGIN { print $(date +%s.%N) - $start }") s in all, load included" ;;
  diffusers)
    run $PY $R/reference_pipeline.py run --model "$P" --init "$W/init14.st" --prompt "$PROMPT" --frames "$F" \
      --size 832x480 --steps "$N" --guide-scale 5 --shift 5 --dtype bf16 --out "$W/pipe14_ref.st" ;;
  esac
done
kill $SMI
log done
