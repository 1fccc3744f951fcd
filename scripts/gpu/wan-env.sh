# Sourced by the Wan GPU scripts: CUDA/NCCL libraries of the host's torch, a work folder,
# log()/run() writing to $OUT/$LOG, and diffusers from a carried wheel when the host has none
# (it has no internet).
. "$(dirname "$0")/env.sh"
REF="$PY $SCRIPTS/reference/reference_wan.py"
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/$LOG"; }
run() { log "$*"; timeout "${LIMIT:-200}" "$@" 2>&1 | tee -a "$OUT/$LOG"; return "${PIPESTATUS[0]}"; }
if ! $PY -c "import diffusers" 2>/dev/null && ls .carry/diffusers-*.whl >/dev/null 2>&1; then
  $PY -m zipfile -e .carry/diffusers-*.whl "$W/pydeps" && export PYTHONPATH="$W/pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi
