#!/usr/bin/env bash
# `tpinfer doctor` and failure handling on real GPUs (issue #6): the doctor's report (text and
# JSON, with the NCCL_P2P_DISABLE=1 comparison), a plan that does not fit the free memory,
# injected faults at TP 2 (OOM on rank 1, error, panic, a rank that dies) and Ctrl-C during a
# TP 2 generation. Needs 2 GPUs, torch + transformers (to make the model) and .dist/ from
# scripts/build/build-cuda.sh. Results go to $OUT.
. "$(dirname "$0")/env.sh"
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/doctor.log"; }
{ nvidia-smi topo -m; echo "exit $?"; nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader; echo "exit $?"; } > "$OUT/topo.txt" 2>&1
log "tpinfer doctor --p2p-compare"
timeout 300 "$BIN/tpinfer" doctor --p2p-compare 2>&1 | tee -a "$OUT/doctor.log"; log "exit ${PIPESTATUS[0]}"
timeout 300 "$BIN/tpinfer" doctor --json > "$OUT/doctor.json" 2>> "$OUT/doctor.log"; log "json exit $?"
log "tpinfer doctor --model llama-3-70b --tp 1: the plan against one H200's free memory"
timeout 300 "$BIN/tpinfer" doctor --model llama-3-70b --tp 1 2>&1 | grep -v "NCCL INFO" | tail -24 | tee -a "$OUT/doctor.log"; log "exit ${PIPESTATUS[0]}"
[ -n "${DOCTOR_ONLY:-}" ] && { log done; exit 0; }

SKIP_GENERATE=1 bash scripts/gpu/fault-check.sh
cat "$OUT/faults.log" >> "$OUT/doctor.log"

log "Ctrl-C 15 s into a TP 2 generation"
"$BIN/tpinfer" generate --model "$W/m1b" --device cuda --tp 2 --dtype bf16 --prompt Hello --max-new-tokens 100000 \
  --max-context 131072 > "$W/ctrlc.out" 2> "$W/ctrlc.err" &
pid=$!
sleep 15
kill -INT $pid
start=$EPOCHREALTIME
for _ in $(seq 1 300); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
wait $pid; rc=$?
tail -3 "$W/ctrlc.err" | tee -a "$OUT/doctor.log"
log "exit $rc, $(awk "BEGIN{printf \"%.2f\", $EPOCHREALTIME - $start}") s after SIGINT; $(wc -c < "$W/ctrlc.out") bytes generated"
log done
