#!/usr/bin/env bash
# FP8 weights on one GPU (issue #34), in parts chosen by $PARTS (default "kernels numerics head speed"):
# - kernels: `tpinfer-bench fp8`, each product with FP8 weights (the W8A8 GEMM, the FP8 GEMV for
#   one row) beside the same product with the dequantized weight in bf16, at the Llama-3-8B and
#   Wan-14B shapes; then a few in f32, whose error against the host's f32 reference of the same
#   quantization is the kernels' own.
# - numerics: a random Llama (SHAPE, default 1b) with --weights fp8, in f32 and bf16, against
#   transformers with the same quantization (reference_llama.py logits --fp8) and against the
#   unquantized model.
# - head: --weights fp8-lm-head on the untied 8b-half shape against transformers with the same
#   quantization (reference_llama.py logits --fp8 --fp8-lm-head) after a one-token prompt, where
#   every product is one row (W8A16) and both models are continuous, in f32 and bf16.
# - speed: the 8B shape, bf16, --weights fp8 and fp8-lm-head (the LM head too) in the same run:
#   decode after a 128-token prompt, and a 2,048-token prefill.
# Binaries of scripts/build/build-cuda.sh in $BIN; the tokenizer in $TOK. Results in $OUT/fp8.log.
. "$(dirname "$0")/env.sh"
TOK=${TOK:-.dist/llama3-tokenizer} SHAPE=${SHAPE:-1b}
REF="$PY $SCRIPTS/reference/reference_llama.py" B="$BIN/tpinfer-bench"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/fp8.log"; }
run() { log "$*"; timeout "${LIMIT:-150}" "$@" 2>&1 | grep -vE "Loading|it/s\]" | tee -a "$OUT/fp8.log"; return "${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee -a "$OUT/fp8.log"
for part in ${PARTS:-kernels numerics head speed}; do
  case $part in
  kernels)
    # 8B: QKV, O, gate|up, down; one row, a batch of 32, a 2,048-token prefill. Wan-14B: the
    # self-attention's QKV and output, the FFN's two, 32,760 tokens.
    run "$B" fp8 --dtype bf16 --cases 1:4096:6144,1:4096:4096,1:4096:28672,1:14336:4096,\
32:4096:6144,32:4096:28672,2048:4096:6144,2048:4096:4096,2048:4096:28672,2048:14336:4096,\
32760:5120:15360:bias,32760:5120:5120:bias,32760:5120:13824:bias:gelu,32760:13824:5120:bias
    run "$B" fp8 --dtype f32 --repeats 3 --cases 1:4096:6144,1:14336:4096,64:4096:6144:bias:gelu,512:4096:4096
    ;;
  numerics)
    M="$W/m$SHAPE"
    [ -f "$M/config.json" ] || run $REF make --shape "$SHAPE" --dtype bf16 --out "$M" --tokenizer "$TOK" || exit 1
    for d in f32 bf16; do
      run "$B" logits --cuda --steps 8 --model "$M" --dtype $d --weights fp8 --out "$W/fp8_$d.st"
      run "$B" logits --cuda --steps 8 --model "$M" --dtype $d --out "$W/plain_$d.st"
    done
    run $REF logits --model "$M" --dtype f32 --fp8 --steps 8 --out "$W/ref_fp8_f32.st"
    run $REF logits --model "$M" --dtype f32 --steps 8 --out "$W/ref_f32.st"
    # W8A8 is not continuous (a value's E4M3 rounding flips with a change far below f32's
    # precision), so the same quantization computed two ways drifts apart over the layers: the
    # reference against itself with its prompt's embeddings perturbed by 1e-6 shows how far.
    run $REF logits --model "$M" --dtype f32 --fp8 --perturb 1e-6 --steps 8 --out "$W/ref_fp8_f32_perturbed.st"
    run $REF logits --model "$M" --dtype f32 --perturb 1e-6 --steps 8 --out "$W/ref_f32_perturbed.st"
    run $REF compare --ref "$W/ref_fp8_f32.st" --out-json "$OUT/fp8_perturbed.json" \
      ref_fp8_perturbed="$W/ref_fp8_f32_perturbed.st"
    run $REF compare --ref "$W/ref_f32.st" --out-json "$OUT/f32_perturbed.json" ref_f32_perturbed="$W/ref_f32_perturbed.st"
    run $REF compare --ref "$W/ref_fp8_f32.st" --out-json "$OUT/fp8_vs_same_quantization.json" \
      fp8_f32="$W/fp8_f32.st" fp8_bf16="$W/fp8_bf16.st"
    run $REF compare --ref "$W/ref_f32.st" --out-json "$OUT/vs_unquantized_f32.json" \
      fp8_f32="$W/fp8_f32.st" fp8_bf16="$W/fp8_bf16.st" bf16="$W/plain_bf16.st" f32="$W/plain_f32.st" \
      ref_fp8_f32="$W/ref_fp8_f32.st"
    run $REF compare --ref "$W/plain_bf16.st" --out-json "$OUT/fp8_vs_bf16.json" fp8_bf16="$W/fp8_bf16.st"
    ;;
  head)
    M="$W/m8b-half"
    [ -f "$M/config.json" ] || run $REF make --shape 8b-half --dtype bf16 --out "$M" --tokenizer "$TOK" || exit 1
    for d in f32 bf16; do
      run "$B" logits --cuda --steps 8 --prompt-tokens 1 --model "$M" --dtype $d --weights fp8-lm-head --out "$W/head_$d.st"
    done
    run $REF logits --model "$M" --dtype f32 --fp8 --fp8-lm-head --prompt-tokens 1 --steps 8 --out "$W/ref_head.st"
    run $REF compare --ref "$W/ref_head.st" --out-json "$OUT/fp8_lm_head_vs_same_quantization.json" \
      head_f32="$W/head_f32.st" head_bf16="$W/head_bf16.st"
    ;;
  speed)
    M="$W/m8b"
    [ -f "$M/config.json" ] || run $REF make --shape 8b --dtype bf16 --out "$M" --tokenizer "$TOK" || exit 1
    for weights in as-stored fp8 fp8-lm-head; do
      run "$B" speed --cuda --tp 1 --model "$M" --weights $weights --prompt-tokens 128 --new-tokens 256 --repeats 2
      run "$B" speed --cuda --tp 1 --model "$M" --weights $weights --prompt-tokens 2048 --new-tokens 8 --repeats 3
    done
    ;;
  *) log "unknown part $part"; exit 1 ;;
  esac
done
log done
