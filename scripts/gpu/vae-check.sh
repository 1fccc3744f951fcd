#!/usr/bin/env bash
# The Wan VAE decoder against diffusers' AutoencoderKLWan on the same host (issue #30): random
# weights in Wan2.1's VAE shape; latents of 81 frames at 480p (and 720p with SIZES="480 720");
# diffusers in f32 and bf16 (untiled, and tiled with TILED=1) against tpinfer at the widths in
# $TP (default 1), in $DTYPES (default "f32 bf16"; the errors need f32): error against
# diffusers-f32, seconds per decode, and peak memory against the plan. Needs torch + diffusers
# (a carried wheel) and .dist/ from scripts/build/build-cuda.sh.
LOG=vae.log LIMIT=${LIMIT:-400}
. "$(dirname "$0")/wan-env.sh"
R="$PY $SCRIPTS/reference/reference_vae.py"
[ -f "$W/vae/config.json" ] || run $R make --out "$W/vae" || exit 1
for size in ${SIZES:-480}; do
  case $size in 480) h=60 w=104 ;; 720) h=90 w=160 ;; *) log "unknown size $size"; exit 1 ;; esac
  lat="$W/lat$size.st"
  [ -f "$lat" ] || run $R latents --frames 21 --height $h --width $w --out "$lat"
  for dtype in ${DTYPES:-f32 bf16}; do
    run $R decode --model "$W/vae" --latents "$lat" --dtype $dtype --repeats 1 --out "$W/ref${size}_$dtype.st"
    [ -n "${TILED:-}" ] && run $R decode --model "$W/vae" --latents "$lat" --dtype $dtype --tiled --repeats 1 \
      --out "$W/ref${size}_${dtype}_tiled.st"
    run "$BIN/tpinfer-bench" vae --model "$W/vae" --latents "$lat" --cuda --dtype $dtype --tp "${TP:-1}" \
      --repeats 2 --out "$W/t${size}_$dtype"
  done
  runs=("diffusers_bf16=$W/ref${size}_bf16.st")
  for tp in $(echo "${TP:-1}" | tr , " "); do
    runs+=("tp${tp}_f32=$W/t${size}_f32_tp$tp.safetensors" "tp${tp}_bf16=$W/t${size}_bf16_tp$tp.safetensors")
  done
  run $R compare --ref "$W/ref${size}_f32.st" --out-json "$OUT/vae${size}_numerics.json" "${runs[@]}"
done
log done
