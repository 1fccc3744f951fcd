#!/usr/bin/env bash
# Qwen2, Qwen3 and Mistral on one GPU against transformers' own classes on the same random
# weights (reference_llama.py make --shape qwen2-7b | qwen3-8b | mistral-7b): the prefill and greedy decode
# logits in f32 and bf16, against transformers in f32 (and transformers' bf16 beside them),
# then decode speed. Needs torch + transformers and the binaries of
# scripts/build/build-cuda.sh in .dist/. Results go to $OUT.
# SHAPES="qwen2-7b mistral-7b qwen2-1.5b-yarn qwen3-8b" picks the models (qwen2-1.5b-yarn with
# YaRN); SKIP_SPEED=1: numerics only.
. "$(dirname "$0")/env.sh"
SHAPES=${SHAPES:-qwen2-7b mistral-7b qwen2-1.5b-yarn qwen3-8b} TOK=.dist/llama3-tokenizer
REF="$PY $SCRIPTS/reference/reference_llama.py"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log"; }
run() { log "$*"; timeout "${LIMIT:-200}" "$@" 2>&1 | tee -a "$OUT/log"; return "${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee -a "$OUT/log"

for shape in $SHAPES; do
  M="$W/$shape"
  [ -d "$M" ] || run $REF make --shape "$shape" --dtype bf16 --out "$M" --tokenizer $TOK || continue
  for dtype in f32 bf16; do
    run "$BIN/tpinfer-bench" logits --model "$M" --cuda --dtype $dtype --tp 1 --steps 8 --out "$W/${shape}_$dtype.st"
  done
  run "$BIN/tpinfer-bench" logits --model "$M" --cuda --dtype bf16 --tp 1 --steps 8 --max-seqs 4 \
    --out "$W/${shape}_bf16_paged.st"
  run $REF logits --model "$M" --dtype f32 --steps 8 --out "$W/${shape}_ref_f32.st"
  run $REF logits --model "$M" --dtype bf16 --steps 8 --out "$W/${shape}_ref_bf16.st"
  run $REF compare --ref "$W/${shape}_ref_f32.st" --out-json "$OUT/$shape.json" \
    tpinfer_f32="$W/${shape}_f32.st" tpinfer_bf16="$W/${shape}_bf16.st" \
    tpinfer_bf16_paged="$W/${shape}_bf16_paged.st" transformers_bf16="$W/${shape}_ref_bf16.st"
  # A lone request in the batched engine runs the one-sequence step's kernels (Qwen2's biased
  # QKV in the fused GEMV too): the same bits, or the check fails. Qwen3's per-head norms keep
  # it on the batched step (its rows are compared with the reference above instead).
  case $shape in
    qwen3*) ;;
    *) run $REF same "$W/${shape}_bf16.st" "$W/${shape}_bf16_paged.st" || log "FAILED: $shape's lone batched request differs" ;;
  esac
  [ -n "${SKIP_SPEED:-}" ] || run "$BIN/tpinfer-bench" speed --model "$M" --cuda --tp 1 --prompt-tokens 128 \
    --new-tokens 256 --repeats 2
done
log done
