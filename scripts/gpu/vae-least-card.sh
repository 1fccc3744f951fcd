#!/usr/bin/env bash
# The least card the Wan VAE decode runs on, against its plan (issue #30): for each video of
# $CASES ("SIZE DTYPE" pairs, default 480p and 720p in bf16, 480p in f32), `tpinfer-bench vae
# --limit-to-plan EXTRA` takes the device memory past the plan plus EXTRA MiB before two
# decodes of 81 frames, EXTRA rising by $STEP (default 25) MiB from $FROM (default 0) until
# they run; then the unlimited decode, for its peak beside. Random weights in Wan2.1's VAE
# shape. Results: $OUT/vae-least-card.log.
# Example: BIN=.dist bash scripts/gpu/vae-least-card.sh
LOG=vae-least-card.log LIMIT=${LIMIT:-200}
. "$(dirname "$0")/wan-env.sh"
R="$PY $SCRIPTS/reference/reference_vae.py"
[ -f "$W/vae/config.json" ] || run $R make --out "$W/vae" || exit 1
step=${STEP:-25}
while read -r size dtype; do
  [ -n "$size" ] || continue
  case $size in 480) h=60 w=104 ;; 720) h=90 w=160 ;; *) log "unknown size $size"; exit 1 ;; esac
  lat="$W/lat$size.st"
  [ -f "$lat" ] || run $R latents --frames 21 --height $h --width $w --out "$lat" || exit 1
  bench=("$BIN/tpinfer-bench" vae --model "$W/vae" --latents "$lat" --cuda --dtype "$dtype" --tp 1 --repeats 1)
  for ((extra = ${FROM:-0}; extra <= 2000; extra += step)); do
    if timeout "$LIMIT" "${bench[@]}" --limit-to-plan $extra > "$W/least.txt" 2>&1; then
      grep -E "^\| 1|rank 0|limited" "$W/least.txt" | tee -a "$OUT/$LOG"
      below=$([ "$extra" -gt "${FROM:-0}" ] && echo ", not at + $((extra - step))")
      log "${size}p $dtype: runs at the plan + $extra MiB$below"
      break
    fi
    log "${size}p $dtype + $extra MiB: $(grep -m1 -E '^Error' "$W/least.txt")"
  done
  run "${bench[@]}"
done <<< "${CASES:-480 bf16
720 bf16
480 f32}"
log done
