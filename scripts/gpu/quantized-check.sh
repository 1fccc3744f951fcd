#!/usr/bin/env bash
# Quantized weights on one GPU (issue #34): a random bf16 Llama (SHAPE, default 1b) written as
# a Q4_K_M GGUF by tpinfer-bench and kept in its blocks (candle's MMVQ/MMQ), and the same
# checkpoint quantized to FP8 at load; logits against tpinfer's f32 run of the same weights,
# a short prompt through the captured Q4_K_M step against the eager one, then decode speed
# beside bf16 in the same run. Binaries of scripts/build/build-cuda.sh in
# .dist/ (tpinfer-bench alone suffices); the tokenizer in $TOK. Results go to $OUT.
. "$(dirname "$0")/env.sh"
SHAPE=${SHAPE:-1b} TOK=${TOK:-.dist/llama3-tokenizer}
REF="$PY $SCRIPTS/reference/reference_llama.py" B="$BIN/tpinfer-bench" M="$W/m$SHAPE"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log"; }
run() { log "$*"; timeout "${LIMIT:-120}" "$@" 2>&1 | tee -a "$OUT/log"; return "${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee -a "$OUT/log"
run $REF make --shape "$SHAPE" --dtype bf16 --out "$M" --tokenizer "$TOK" || exit 1
run "$B" gguf --model "$M" --out "$M/q4_k_m.gguf" || exit 1
logits() { run "$B" logits --cuda --steps 8 "$@"; }
logits --model "$M/q4_k_m.gguf" --dtype bf16 --out "$W/q4km.st"
logits --model "$M/q4_k_m.gguf" --dtype f32 --weights dequantized --out "$W/q4km_f32.st"
logits --model "$M" --dtype bf16 --weights fp8 --out "$W/fp8.st"
logits --model "$M" --dtype f32 --out "$W/f32.st"
logits --model "$M" --dtype bf16 --out "$W/bf16.st"
run $REF compare --ref "$W/q4km_f32.st" --out-json "$OUT/q4km_vs_its_f32.json" q4km_bf16="$W/q4km.st"
run $REF compare --ref "$W/f32.st" --out-json "$OUT/vs_f32.json" bf16="$W/bf16.st" fp8="$W/fp8.st" \
  q4km_bf16="$W/q4km.st"
# A prompt of 5 tokens after the start-up warm-up captured the Q4_K_M step (2 tokens): the
# captured step against the eager one. The capture holds candle's MMVQ scratch, which a
# longer few-row product would replace were it not reserved first (628a6cd).
for mode in graph eager; do
  run "$B" logits --cuda --steps 16 --prompt-tokens 5 --model "$M/q4_k_m.gguf" --dtype bf16 \
    --out "$W/q4km_short_$mode.st" $([ $mode = eager ] && echo --enforce-eager)
done
run $REF compare --ref "$W/q4km_short_eager.st" --out-json "$OUT/q4km_short_graph_vs_eager.json" \
  graph="$W/q4km_short_graph.st"
speed() { run "$B" speed --cuda --tp 1 --prompt-tokens 128 --new-tokens 128 --repeats 2 "$@"; }
speed --model "$M"
speed --model "$M/q4_k_m.gguf"
speed --model "$M" --weights fp8
log done
