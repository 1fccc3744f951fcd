#!/usr/bin/env bash
# The Wan DiT on CUDA ranks against diffusers on the same host (issue #5): one velocity of a
# random-weight 1.3B-shaped DiT (weights rounded to bf16) in f32 and bf16 at TP 1 and 2,
# against diffusers in f32; timings of both. Needs 2 GPUs (TP=1: one), torch + diffusers and
# .dist/.
LOG=wan.log
. "$(dirname "$0")/wan-env.sh"
$PY -c "import diffusers, torch; print('diffusers', diffusers.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$OUT/wan.log"
run $REF make --shape 1.3b --out "$W/wan13" || exit 1
run $REF inputs --frames ${FRAMES:-21} --size 832x480 --out "$W/in.st"
run $REF forward --model "$W/wan13" --inputs "$W/in.st" --dtype f32 --out "$W/ref_f32.st"
run $REF forward --model "$W/wan13" --inputs "$W/in.st" --dtype bf16 --out "$W/ref_bf16.st"
for dtype in f32 bf16; do
  run "$BIN/tpinfer-bench" dit --model "$W/wan13" --inputs "$W/in.st" --cuda --dtype $dtype --tp "${TP:-1,2}" --out "$W/t_$dtype" ${PROFILE:+--profile}
done
runs=()
for tp in $(echo "${TP:-1,2}" | tr , " "); do
  runs+=("tp${tp}_f32=$W/t_f32_tp$tp.safetensors" "tp${tp}_bf16=$W/t_bf16_tp$tp.safetensors")
done
run $REF compare --ref "$W/ref_f32.st" --out-json "$OUT/wan_numerics.json" diffusers_bf16="$W/ref_bf16.st" "${runs[@]}"
log done
