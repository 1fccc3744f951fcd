#!/usr/bin/env bash
# The memory plan on real GPUs (issue #4): planned against measured peak device memory per
# rank for the Llama-3-8B shape in bf16 at TP 1 and 2 with a full 8192-token context (the
# plan's worst case), the refusal of an over-budget placement before anything is loaded, and
# decode/prefill speed (issue #3). Needs 2 GPUs, torch + transformers (to make the model) and
# the binaries of scripts/build/build-cuda.sh in .dist/. Results go to $OUT.
. "$(dirname "$0")/env.sh"
TOK=.dist/llama3-tokenizer
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/memory.log"; }
run() { log "$*"; timeout "${LIMIT:-200}" "$@" 2>&1 | tee -a "$OUT/memory.log"; return "${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv | tee -a "$OUT/memory.log"

[ -d "$W/m8b" ] || run $PY "$SCRIPTS/reference/reference_llama.py" make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer $TOK || exit 1
export RUST_LOG=tpinfer_engine=info
# Every rank logs its memory after loading and after its first request against its plan.
# Three workloads: a full context (the plan's worst case), a 2048-token prompt, a short one.
for workload in "8128 64" "2048 2" "128 32"; do
  set -- $workload
  run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 1,2 --max-context 8192 --prompt-tokens $1 \
    --new-tokens $2 --repeats 1
done
unset RUST_LOG

log "refusal: TP 1 in an 8 GiB budget"
start=$EPOCHREALTIME
timeout 60 "$BIN/tpinfer" generate --model "$W/m8b" --device cuda --tp 1 --gpu-mem 8GiB --prompt Hello \
  --max-new-tokens 4 2>&1 | tee -a "$OUT/memory.log"
log "exit ${PIPESTATUS[0]} after $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $start}") s"
run "$BIN/tpinfer" plan --model "$W/m8b" --gpu-mem 8GiB

[ -n "${SKIP_SPEED:-}" ] && { log done; exit 0; }
LIMIT=240 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 1,2 --prompt-tokens 128 --new-tokens 256 --repeats 2
LIMIT=120 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 1,2 --prompt-tokens 2048 --new-tokens 2 --repeats 3
log done
