#!/usr/bin/env bash
# Speech-to-video clips at the published sizes on one GPU (issue #35): the official layout with
# random weights (the S2V-14B DiT from reference_s2v_speed.py, umT5-XXL and Wan2.1's VAE as
# Wan's .pth files, wav2vec2-large-xlsr-53's shape; reference_s2v_pipeline.py full), then
# SECONDS_OF_SPEECH (6) of speech and an 832x480 image: two clips of 80 frames at 832x448,
# STEPS (4) guided steps each, every stage timed. WHO (default tpinfer) picks the runs:
# `tpinfer` (`tpinfer generate`, the plan's memory checked after the first step), `wheel` (the
# wan22 wheel's `generate` loop with its own modules in bf16, reference_s2v_pipeline.py run),
# or both. Needs the unpacked wan22 wheel at $WAN22 (default .carry/wan22), diffusers,
# einops, and .dist/.
LOG=s2v-clip.log
. "$(dirname "$0")/wan-env.sh"
WAN22=${WAN22:-.carry/wan22}
M=$W/s2v14b P=$W/s2v14b_inputs
[ -f "$M/config.json" ] || LIMIT=400 run $PY "$SCRIPTS/reference/reference_s2v_speed.py" make --wan22 "$WAN22" \
  --out "$M" --inputs "$W/s2v14b_in.st" || exit 1
[ -f "$M/Wan2.1_VAE.pth" ] || LIMIT=300 run $PY "$SCRIPTS/reference/reference_s2v_pipeline.py" full --wan22 "$WAN22" \
  --out "$M" --inputs "$P" --seconds "${SECONDS_OF_SPEECH:-6}" || exit 1
for who in ${WHO:-tpinfer}; do
  case $who in
    tpinfer)
      RUST_LOG=${RUST_LOG:-tpinfer_runtime=info} LIMIT=500 run "$BIN/tpinfer" generate --model "$M" \
        --audio "$P/speech.wav" --image "$P/face.png" --prompt "a person talks" --size 832x480 \
        --steps "${STEPS:-4}" --device cuda --tp 1 --out "$W/talk.mp4" ;;
    wheel)
      LIMIT=500 run $PY "$SCRIPTS/reference/reference_s2v_pipeline.py" run --wan22 "$WAN22" --model "$M" \
        --inputs "$P" --device cuda --dtype bf16 --size 832x448 --frames 80 --steps "${STEPS:-4}" ;;
    *) log "unknown WHO $who"; exit 1 ;;
  esac
done
log done
