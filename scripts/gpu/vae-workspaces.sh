#!/usr/bin/env bash
# The cuDNN algorithm and workspace chosen for each of the Wan VAE decoder's convolution
# shapes (issue #30), from tpinfer-kernels' debug log, for one 480p decode of 81 frames in
# each dtype of $DTYPES (default "bf16 f32"). Needs .dist/ from scripts/build/build-cuda.sh
# and torch + diffusers. Results: $OUT/vae-workspaces.log.
LOG=vae-workspaces.log LIMIT=${LIMIT:-300}
. "$(dirname "$0")/wan-env.sh"
R="$PY $SCRIPTS/reference/reference_vae.py"
[ -f "$W/vae/config.json" ] || run $R make --out "$W/vae" || exit 1
lat="$W/lat480.st"
[ -f "$lat" ] || run $R latents --frames 21 --height 60 --width 104 --out "$lat"
for dtype in ${DTYPES:-bf16 f32}; do
  RUST_LOG=tpinfer_kernels=debug NO_COLOR=1 run "$BIN/tpinfer-bench" vae --model "$W/vae" --latents "$lat" --cuda \
    --dtype "$dtype" --tp 1 --repeats 0
done
log done
