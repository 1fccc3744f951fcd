#!/usr/bin/env bash
# Where the Wan VAE decoder's GPU time goes (issue #30): one decode of a short video (FRAMES
# latent frames, default 2, at 480p, bf16) under Nsight Compute, every kernel's duration summed
# by kernel name, largest first. Needs .dist/ from scripts/build/build-cuda.sh and ncu (on the
# H200 hosts; `--clock-control none` leaves the clocks alone). Results: $OUT/vae-profile.csv
# and the top of it in $OUT/vae-profile.log.
LOG=vae-profile.log LIMIT=${LIMIT:-500}
. "$(dirname "$0")/wan-env.sh"
R="$PY $SCRIPTS/reference/reference_vae.py"
[ -f "$W/vae/config.json" ] || run $R make --out "$W/vae" || exit 1
lat="$W/lat480_${FRAMES:-2}.st"
[ -f "$lat" ] || run $R latents --frames "${FRAMES:-2}" --height 60 --width 104 --out "$lat"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { log "no ncu on this host"; exit 1; }
run "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/vae-profile.csv" \
  "$BIN/tpinfer-bench" vae --model "$W/vae" --latents "$lat" --cuda --dtype bf16 --tp 1 --repeats 0
$PY "$SCRIPTS/gpu/kernel-sum.py" "$OUT/vae-profile.csv" | tee -a "$OUT/$LOG"
log done
