#!/usr/bin/env bash
# The whole Wan text-to-video pipeline against diffusers' WanPipeline on the same host (issue
# #30): a pipeline directory of the published shapes with random weights (umT5-XXL, a
# 1.3B-shaped DiT, Wan2.1's VAE) and the tiny pipeline's Unigram tokenizer; STEPS (default 4)
# UniPC steps with guidance 5 and shift 5 from the same starting latents, FRAMES (default 81)
# at 832x480, both in f32; the largest difference of tpinfer's frames from the reference's,
# in 8-bit steps (issue: within 2/255). Needs torch + transformers, diffusers, ftfy and wcwidth
# (carried wheels), .dist/ from scripts/build/build-cuda.sh, and the directory skeleton in
# .carry/pipeline-skel, written where Rust is:
#   cargo run -p tpinfer-tests --example tiny_wan_pipeline -- target/tiny-pipe
#   mkdir -p .carry/pipeline-skel && cp -r target/tiny-pipe/{model_index.json,tokenizer} .carry/pipeline-skel/
# Run on one H200 (2026-12-02, FRAMES=21): largest difference 1/255; benches/RESULTS.md.
LOG=pipeline.log LIMIT=${LIMIT:-300}
. "$(dirname "$0")/wan-env.sh"
R=$SCRIPTS/reference
P=$W/pipe13 F=${FRAMES:-81} N=${STEPS:-4} PROMPT=${PROMPT:-"a red fox in the snow"}
make_pipeline "$P" 1.3b || exit 1
run $PY $R/reference_pipeline.py latents --frames "$F" --height 480 --width 832 --out "$W/init.st" || exit 1
run $PY $R/reference_pipeline.py run --model "$P" --init "$W/init.st" --prompt "$PROMPT" --frames "$F" \
  --size 832x480 --steps "$N" --guide-scale 5 --shift 5 --out "$W/pipe_ref.st"
rm -rf "$W/pipe_frames"
run "$BIN/tpinfer" generate --model "$P" --prompt "$PROMPT" --frames "$F" --size 832x480 --steps "$N" \
  --guide-scale 5 --shift 5 --init-latents "$W/init.st" --device cuda --tp 1 --dtype f32 \
  --save-frames "$W/pipe_frames" --out "$OUT/pipeline.mp4"
run $PY $R/reference_pipeline.py compare --ref "$W/pipe_ref.st" --frames "$W/pipe_frames"
log done
