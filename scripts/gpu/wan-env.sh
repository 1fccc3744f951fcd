# Sourced by the Wan GPU scripts: CUDA/NCCL libraries of the host's torch, a work folder,
# log()/run() writing to $OUT/$LOG, and diffusers (with ftfy) from carried wheels when the host
# has none (it has no internet).
. "$(dirname "$0")/env.sh"
REF="$PY $SCRIPTS/reference/reference_wan.py"
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/$LOG"; }
run() { log "$*"; timeout "${LIMIT:-200}" "$@" 2>&1 | tee -a "$OUT/$LOG"; return "${PIPESTATUS[0]}"; }
# Each carried wheel (diffusers; ftfy and wcwidth, which WanPipeline's prompt cleaning needs)
# whose module the host lacks.
for pkg in diffusers ftfy wcwidth; do
  if ! $PY -c "import $pkg" 2>/dev/null && ls .carry/$pkg-*.whl >/dev/null 2>&1; then
    $PY -m zipfile -e .carry/$pkg-*.whl "$W/pydeps" && export PYTHONPATH="$W/pydeps${PYTHONPATH:+:$PYTHONPATH}"
  fi
done
