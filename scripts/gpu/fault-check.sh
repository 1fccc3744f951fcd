#!/usr/bin/env bash
# Failures on CUDA + NCCL ranks (issues #3 and #6): a rank that runs out of memory, errors,
# panics or dies mid-request must end the run within seconds, naming that rank, never as an
# NCCL error and never as a hang. Also a plain `tpinfer generate --device cuda --tp 2`.
# Needs 2 GPUs, torch + transformers (to make the model) and .dist/ from scripts/build/build-cuda.sh.
. "$(dirname "$0")/env.sh"
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/faults.log"; }
[ -d "$W/m1b" ] || $PY "$SCRIPTS/reference/reference_llama.py" make --shape 1b --dtype f32 --out "$W/m1b" --tokenizer .dist/llama3-tokenizer > /dev/null 2>&1
[ -n "${SKIP_GENERATE:-}" ] || { log "generate --device cuda --tp 2"; timeout 120 "$BIN/tpinfer" generate --model "$W/m1b" --device cuda --tp 2 --dtype bf16 --prompt "Hello" --max-new-tokens 16 2>&1 | tail -2 | tee -a "$OUT/faults.log"; }
for fault in oom:1:2 error:1:2 panic:0:2 exit:1:2; do
  log "fault $fault"
  start=$EPOCHREALTIME
  RUST_BACKTRACE=0 timeout 40 "$BIN/tpinfer-bench" logits --model "$W/m1b" --cuda --dtype f32 --tp 2 --steps 8 \
    --comm-timeout 10 --fault "$fault" --out "$W/fault.st" > "$W/fault.txt" 2>&1
  rc=$?
  end=$EPOCHREALTIME
  grep -v '^ \|^Stack\|^$' "$W/fault.txt" | head -4 | tee -a "$OUT/faults.log"
  echo "exit $rc after $(awk "BEGIN{printf \"%.1f\", $end - $start}") s (124 = hung until killed)" | tee -a "$OUT/faults.log"
done
log done
