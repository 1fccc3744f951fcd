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
# Sum each kernel's time over its launches (ncu's CSV: one row per kernel and metric).
$PY - "$OUT/vae-profile.csv" <<'PY' | tee -a "$OUT/$LOG"
import csv, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
total = collections.Counter()
count = collections.Counter()
for r in rows:
    if r.get("Metric Name") == "gpu__time_duration.sum":
        value = float(r["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(r.get("Metric Unit", ""), 1e-6)
        total[r["Kernel Name"][:80]] += value * scale
        count[r["Kernel Name"][:80]] += 1
all_ms = sum(total.values())
print(f"{len(rows)} kernel launches, {all_ms:.1f} ms of kernel time")
for name, ms in total.most_common(25):
    print(f"{ms:10.2f} ms {100 * ms / all_ms:5.1f}% {count[name]:7d}x  {name}")
PY
log done
