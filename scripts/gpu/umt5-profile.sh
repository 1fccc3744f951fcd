#!/usr/bin/env bash
# Where the umT5 encoder's GPU time goes (issue #30): one bf16 encode of TOKENS (default 512)
# by a random umT5 of LAYERS (default 4) in umt5-xxl's shape, under Nsight Compute, every
# kernel's duration summed by kernel name, largest first; beside it the wall time per encode
# of the same model (tpinfer-bench encode). Needs torch + transformers and .dist/ from
# scripts/build/build-cuda.sh. Results: $OUT/umt5-profile.csv, $OUT/umt5-profile.log.
LOG=umt5-profile.log LIMIT=${LIMIT:-300}
. "$(dirname "$0")/wan-env.sh"
R="$PY $SCRIPTS/reference/reference_umt5.py"
m="$W/umt5_l${LAYERS:-4}"
[ -f "$m/config.json" ] || run $R make --layers "${LAYERS:-4}" --out "$m" || exit 1
run $R ids --tokens "${TOKENS:-512}" --out "$W/ids_profile.st"
run $R encode --model "$m" --ids "$W/ids_profile.st" --dtype bf16 --repeats 5 --out "$W/ref_profile.st"
run "$BIN/tpinfer-bench" encode --model "$m" --ids "$W/ids_profile.st" --cuda --dtype bf16 --tp 1 --repeats 5 \
  --out "$W/t_profile"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { log "no ncu on this host"; exit 1; }
run "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/umt5-profile.csv" \
  "$BIN/tpinfer-bench" encode --model "$m" --ids "$W/ids_profile.st" --cuda --dtype bf16 --tp 1 --repeats 0 \
  --out "$W/t_profile_ncu"
$PY "$SCRIPTS/gpu/kernel-sum.py" "$OUT/umt5-profile.csv" | tee -a "$OUT/$LOG"
log done
