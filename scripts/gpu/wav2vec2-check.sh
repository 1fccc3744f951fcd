#!/usr/bin/env bash
# The wav2vec2 speech encoder of S2V against transformers' Wav2Vec2ForCTC on the same host
# (issue #35): random weights in wav2vec2-large-xlsr-53's shape, SECONDS (default 20) of
# synthetic speech; tpinfer in f32 and bf16 at the widths in $TP (default 1) against
# transformers-f32, beside transformers-bf16's own error, and the encode time of tpinfer.
# Needs torch + transformers and .dist/ from scripts/build/build-cuda.sh.
LOG=wav2vec2.log
. "$(dirname "$0")/wan-env.sh"
REF="$PY $SCRIPTS/reference/reference_wav2vec2.py"
[ -f "$W/xlsr/config.json" ] || run $REF make --shape xlsr-53 --seed 5 --out "$W/xlsr" || exit 1
run $REF run --model "$W/xlsr" --seconds "${SECONDS_OF_AUDIO:-20}" --seed 6 --out "$W/w2v_ref_f32.st"
run $REF run --model "$W/xlsr" --seconds "${SECONDS_OF_AUDIO:-20}" --seed 6 --dtype bf16 --out "$W/w2v_ref_bf16.st"
for dtype in f32 bf16; do
  run "$BIN/tpinfer-bench" speech --model "$W/xlsr" --audio "$W/w2v_ref_f32.st" --cuda --dtype $dtype \
    --tp "${TP:-1}" --repeats 5 --out "$W/w2v_$dtype"
done
runs=()
for tp in $(echo "${TP:-1}" | tr , " "); do
  runs+=("tp${tp}_f32=$W/w2v_f32_tp$tp.safetensors" "tp${tp}_bf16=$W/w2v_bf16_tp$tp.safetensors")
done
run $REF compare --ref "$W/w2v_ref_f32.st" transformers_bf16="$W/w2v_ref_bf16.st" "${runs[@]}"
log done
