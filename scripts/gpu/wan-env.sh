# Sourced by the Wan GPU scripts: CUDA/NCCL libraries of the host's torch, a work folder,
# log()/run() writing to $OUT/$LOG, and diffusers (with ftfy) from carried wheels when the host
# has none (it has no internet).
. "$(dirname "$0")/env.sh"
REF="$PY $SCRIPTS/reference/reference_wan.py"
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/$LOG"; }
run() { log "$*"; timeout "${LIMIT:-200}" "$@" 2>&1 | tee -a "$OUT/$LOG"; return "${PIPESTATUS[0]}"; }
# Each carried wheel (diffusers; ftfy and wcwidth, which WanPipeline's prompt cleaning needs; einops,
# which the wan22 wheel's S2V model needs)
# whose module the host lacks.
for pkg in diffusers ftfy wcwidth einops; do
  if ! $PY -c "import $pkg" 2>/dev/null && ls .carry/$pkg-*.whl >/dev/null 2>&1; then
    $PY -m zipfile -e .carry/$pkg-*.whl "$W/pydeps" && export PYTHONPATH="$W/pydeps${PYTHONPATH:+:$PYTHONPATH}"
  fi
done
# A pipeline directory at $1 with random weights in the published shapes: umT5-XXL, the DiT
# of shape $2 (1.3b or 14b; further arguments go to its `make`), Wan2.1's VAE, and the tiny
# pipeline's tokenizer and model_index.json from .carry/pipeline-skel (see pipeline-check.sh).
make_pipeline() {
  local dir=$1 shape=$2 ref=$SCRIPTS/reference
  shift 2
  [ -f .carry/pipeline-skel/model_index.json ] || { log "no .carry/pipeline-skel (see scripts/gpu/pipeline-check.sh)"; return 1; }
  mkdir -p "$dir" && cp -r .carry/pipeline-skel/. "$dir/"
  [ -f "$dir/text_encoder/config.json" ] || run $PY "$ref/reference_umt5.py" make --out "$dir/text_encoder" || return 1
  [ -f "$dir/transformer/config.json" ] || run $PY "$ref/reference_wan.py" make --shape "$shape" "$@" --out "$dir/transformer" || return 1
  [ -f "$dir/vae/config.json" ] || run $PY "$ref/reference_vae.py" make --out "$dir/vae" || return 1
}
