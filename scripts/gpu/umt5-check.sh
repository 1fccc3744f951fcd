#!/usr/bin/env bash
# The umT5 text encoder against transformers' UMT5EncoderModel on the same host (issue #30):
# random weights in umt5-xxl's shape (LAYERS, default 24), one prompt of TOKENS (default 512);
# tpinfer in f32 and bf16 at the widths in $TP (default 1) against transformers-f32, beside
# transformers-bf16's own error, and the encode time of both. Needs torch + transformers and
# .dist/ from scripts/build/build-cuda.sh.
LOG=umt5.log
. "$(dirname "$0")/wan-env.sh"
REF="$PY $SCRIPTS/reference/reference_umt5.py"
[ -f "$W/umt5/config.json" ] || run $REF make --layers "${LAYERS:-24}" --out "$W/umt5" || exit 1
run $REF ids --tokens "${TOKENS:-512}" --out "$W/ids.st"
run $REF encode --model "$W/umt5" --ids "$W/ids.st" --dtype f32 --out "$W/ref_f32.st"
run $REF encode --model "$W/umt5" --ids "$W/ids.st" --dtype bf16 --out "$W/ref_bf16.st"
for dtype in f32 bf16; do
  run "$BIN/tpinfer-bench" encode --model "$W/umt5" --ids "$W/ids.st" --cuda --dtype $dtype --tp "${TP:-1}" \
    --repeats 5 --out "$W/t_$dtype"
done
runs=()
for tp in $(echo "${TP:-1}" | tr , " "); do
  runs+=("tp${tp}_f32=$W/t_f32_tp$tp.safetensors" "tp${tp}_bf16=$W/t_bf16_tp$tp.safetensors")
done
run $REF compare --ref "$W/ref_f32.st" --out-json "$OUT/umt5_numerics.json" transformers_bf16="$W/ref_bf16.st" "${runs[@]}"
log done
