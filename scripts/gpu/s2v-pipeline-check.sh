#!/usr/bin/env bash
# Speech-to-video end to end on CUDA (issue #35): the tiny official-layout checkpoint of
# tests/fixtures/s2v-pipeline through `tpinfer generate` in f32 and bf16, against the wan22
# wheel's `generate` loop on the same weights, speech, image and per-clip noise (its frames,
# made on the CPU in f32 by scripts/reference/reference_s2v_pipeline.py), in 8 bits. Then the
# VAE encoder at S2V's size, its memory against the plan: 73 motion frames and the reference
# image at 832x480 in bf16 and f32 (random weights in Wan2.1's shape). Between them, the wheel's
# loop in bf16 against the same f32 frames. Needs .dist/ and the unpacked wan22 wheel at
# $WAN22 (default .carry/wan22).
LOG=s2v-pipeline.log
. "$(dirname "$0")/wan-env.sh"
F=tests/fixtures/s2v-pipeline
REF="$PY $SCRIPTS/reference/reference_s2v_pipeline.py"
for d in f32 bf16; do
  rm -rf "$W/s2v_frames_$d"
  run "$BIN/tpinfer" generate --model $F/model --audio $F/inputs/speech.wav --image $F/inputs/face.png \
    --prompt "a person talks" --size 64x64 --frames 16 --steps 2 --init-latents $F/inputs/init.safetensors \
    --device cuda --tp 1 --dtype $d --save-frames "$W/s2v_frames_$d" --out "$W/s2v_$d.mp4"
  run $REF compare --ref $F/reference.safetensors --frames "$W/s2v_frames_$d"
done
# The wheel's own loop in bf16 on the GPU (bf16 T5 and DiT under autocast, f32 VAE), for its
# own bf16 error beside tpinfer's.
run $REF run --wan22 "${WAN22:-.carry/wan22}" --model $F/model --inputs $F/inputs --device cuda --dtype bf16 \
  --out "$W/s2v_wheel_bf16.st"
run $REF compare --ref $F/reference.safetensors --frames "$W/s2v_wheel_bf16.st" --count 24
[ -f "$W/vae/config.json" ] || run $PY "$SCRIPTS/reference/reference_vae.py" make --out "$W/vae" || exit 1
$PY - "$W/s2v_pixels.st" <<'PY'
import sys, torch
from safetensors.torch import save_file
torch.manual_seed(0)
save_file({"image_pixels": 2 * torch.rand(3, 1, 480, 832) - 1, "motion_pixels": 2 * torch.rand(3, 73, 480, 832) - 1}, sys.argv[1])
PY
for d in bf16 f32; do
  run "$BIN/tpinfer-bench" vae-encode --model "$W/vae" --pixels "$W/s2v_pixels.st" --cuda --dtype $d --repeats 2
done
log done
