#!/usr/bin/env bash
# The serving benchmark (issue #33) on one GPU: `tpinfer serve` of the Llama-3-8B shape
# (random bf16 weights) driven over HTTP by `tpinfer-bench load` at each concurrency of
# $LEVELS (default 1,8,32,64,128; prompt 512, output 256 tokens, greedy), then transformers'
# batched generate on the same checkpoint (scripts/reference/reference_serving.py) at $BATCHES
# (default 1,32,64; "none" skips it). Binaries from $BIN (scripts/build/build-cuda.sh's .dist). Needs torch.
# Results: $OUT/serve-speed.log (and the servers' own logs, $OUT/serve-*.log). First, a server
# with --max-seqs 1 (one request at a time, the captured decode step) at concurrency 1,
# greedy and at temperature 0.7 (SINGLE=0 skips it; SERVE_ARGS adds flags to every server,
# such as --quantize fp8); MAX_SEQS=none skips continuous batching; STEP_TOKENS="512 2048" runs it
# once per --step-tokens budget.
. "$(dirname "$0")/env.sh"
TOK=${TOK:-.dist/llama3-tokenizer}
LOG=$OUT/serve-speed.log
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
[ -f "$W/m8b/config.json" ] || $PY "$SCRIPTS/reference/reference_llama.py" make --shape 8b --dtype bf16 \
  --out "$W/m8b" --tokenizer "$TOK" >> "$LOG" 2>&1 || { log "making the model failed"; exit 1; }
cat "$W"/m8b/*.safetensors > /dev/null
# serve MAX_SEQS: starts the server, waits until it answers.
serve() {
  log "tpinfer serve --max-seqs $1"
  RUST_LOG=${RUST_LOG:-info,tpinfer_engine::batching=debug} "$BIN/tpinfer" serve --model "$W/m8b" --served-model-name m8b --tp 1 --device cuda --port 8123 \
    --max-seqs "$1" --max-context "${CONTEXT:-1024}" ${SERVE_ARGS:-} ${STEP_ARGS:-} > "$OUT/serve-$1.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do
    curl -sf localhost:8123/health > /dev/null && return 0
    kill -0 $server 2> /dev/null || { log "the server exited"; tail -n 5 "$OUT/serve-$1.log" | tee -a "$LOG"; return 1; }
    sleep 1
  done
}
# load LEVELS [EXTRA...]
load() {
  local levels=$1; shift
  log "load: levels $levels $*"
  timeout "${LIMIT:-300}" "$BIN/tpinfer-bench" load --url http://127.0.0.1:8123 --model m8b \
    --concurrency "$levels" --rounds "${ROUNDS:-1}" --vocab 128000 "$@" 2>&1 | tee -a "$LOG"
}
stop() {
  curl -s localhost:8123/metrics | grep -E "^tpinfer_(kv_blocks|requests_total|generation_tokens_total)" | tee -a "$LOG"
  kill -TERM $server; wait $server; log "server exit status $?"
}
# One request at a time through the captured decode step, greedy and sampled (SINGLE=0 skips it).
if [ "${SINGLE:-1}" = 1 ] && serve 1; then
  load 1
  load 1 --temperature 0.7
  stop
fi
# Continuous batching, once per new-token budget of STEP_TOKENS (e.g. "512 2048"; default:
# the server's own), each server's batched steps summarised after its load.
for st in ${STEP_TOKENS:-default}; do
  [ "${MAX_SEQS:-}" != none ] || break
  STEP_ARGS=$([ "$st" = default ] || echo "--step-tokens $st")
  serve "${MAX_SEQS:-128}" || continue
  log "step tokens: $st"
  load "${LEVELS:-1,8,32,64,128}"
  stop
  # Each batched step's times (the engine's debug events), by the sequences in it.
  log "batched steps: kind and sequences, steps, mean forward ms, mean step ms"
  grep "a batched step" "$OUT/serve-${MAX_SEQS:-128}.log" | sed 's/\x1b\[[0-9;]*m//g' | awk '
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      s = v["sequences"]; b = (v["tokens"] == s ? "decode " : "with a prompt chunk ")
      b = b (s >= 128 ? 128 : s >= 64 ? 64 : s >= 32 ? 32 : s >= 8 ? 8 : 1) "+"
      n[b]++; f[b] += v["forward_ms"]; t[b] += v["step_ms"] }
    END { for (b in n) printf "%s\t%d\t%.2f\t%.2f\n", b, n[b], f[b] / n[b], t[b] / n[b] }' | sort | tee -a "$LOG"
done
[ "${BATCHES:-}" = none ] && { log done; exit 0; }
log "transformers baseline"
timeout 240 $PY "$SCRIPTS/reference/reference_serving.py" --model "$W/m8b" --batch "${BATCHES:-1,32,64}" 2>&1 \
  | grep -v Warning | tee -a "$LOG"
log done
