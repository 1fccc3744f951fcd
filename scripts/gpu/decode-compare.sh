#!/usr/bin/env bash
# Llama-3-8B-shaped decode for several builds side by side (issue #3): each NAME=DIR in $BINS
# (DIR holding that build's tpinfer and tpinfer-bench) runs `tpinfer doctor` (NCCL and peer
# all-reduce sums with rank-dependent values; with TP 2), then decode speed at the widths of
# $TPS (default 1,2) after prompts of $PROMPTS tokens (default 128) and `decode-profile` at the
# widest (at TP 1 it also checks decode attention against f32 from 1 to 4,096 keys), the builds
# alternating, $ROUNDS times. Needs torch (for the random-weight model), the builds' binaries
# and as many GPUs as the widest width. Results: $OUT/compare.log.
# Examples: BINS="main=.dist/main next=.dist/next" bash scripts/gpu/decode-compare.sh
#           TPS=1 PROMPTS="128 2000" BINS="main=.dist/main spread=.dist/spread" bash scripts/gpu/decode-compare.sh
. "$(dirname "$0")/env.sh"
TOK=${TOK:-.dist/llama3-tokenizer}
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/compare.log"; }
run() { log "$*"; timeout "${LIMIT:-150}" "$@" 2>&1 | grep -v " WARN \| INFO " | tee -a "$OUT/compare.log"; }
[ -f "$W/m8b/config.json" ] || run $PY "$SCRIPTS/reference/reference_llama.py" make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer "$TOK"
TPS=${TPS:-1,2}
widest=${TPS##*,}
: "${BINS:?set BINS=\"NAME=DIR ...\"}"
if [ "$widest" -gt 1 ]; then
  for bin in $BINS; do
    LIMIT=120 run "${bin#*=}/tpinfer" doctor --timeout 60
  done
  # The same all-reduce table with every size on NCCL (builds with the peer all-reduce).
  TPINFER_PEER_ALL_REDUCE=0 LIMIT=120 run "${bin#*=}/tpinfer" doctor --timeout 60
fi
for round in $(seq "${ROUNDS:-2}"); do
  for bin in $BINS; do
    log "round $round: ${bin%%=*}"
    for prompt in ${PROMPTS:-128}; do
      run "${bin#*=}/tpinfer-bench" speed --model "$W/m8b" --cuda --tp "$TPS" --prompt-tokens "$prompt" --new-tokens 256 --repeats 2
    done
    run "${bin#*=}/tpinfer-bench" decode-profile --model "$W/m8b" --cuda --steps 64 --tp "$widest"
  done
done
log done
