#!/usr/bin/env bash
# The Wan VAE decoder of several builds beside diffusers, in one call (issue #30): each
# NAME=DIR in $BINS (DIR holding that build's tpinfer-bench) decodes 81 frames at each size of
# $SIZES (default "480 720") in $DTYPE (default bf16), then diffusers' AutoencoderKLWan decodes
# the same latents in the same dtype. Seconds per decode (median of 2 after a warm-up) and
# peak memory (tpinfer: measured against the plan). Random weights in Wan2.1's VAE shape.
# Needs torch + diffusers (a carried wheel). Results: $OUT/vae-speed.log.
# Example: BINS="new=.dist base=.dist/base" bash scripts/gpu/vae-speed.sh
LOG=vae-speed.log LIMIT=${LIMIT:-300}
. "$(dirname "$0")/wan-env.sh"
R="$PY $SCRIPTS/reference/reference_vae.py"
: "${BINS:?set BINS=\"NAME=DIR ...\"}"
[ -f "$W/vae/config.json" ] || run $R make --out "$W/vae" || exit 1
dtype=${DTYPE:-bf16}
for size in ${SIZES:-480 720}; do
  case $size in 480) h=60 w=104 ;; 720) h=90 w=160 ;; *) log "unknown size $size"; exit 1 ;; esac
  lat="$W/lat$size.st"
  [ -f "$lat" ] || run $R latents --frames 21 --height $h --width $w --out "$lat"
  for bin in $BINS; do
    log "${bin%%=*}: ${size}p $dtype"
    run "${bin#*=}/tpinfer-bench" vae --model "$W/vae" --latents "$lat" --cuda --dtype "$dtype" --tp 1 --repeats 2
  done
  run $R decode --model "$W/vae" --latents "$lat" --dtype "$dtype" --repeats 2 --out "$W/ref${size}_${dtype}_speed.st"
done
log done
