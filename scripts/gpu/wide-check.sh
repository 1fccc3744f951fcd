#!/usr/bin/env bash
# Issue #8 on a host with 4 or 8 GPUs, one PHASE per call (each fits a 10-minute call):
#   PHASE=llama70       Llama-3-70B shape (random bf16 weights, written tensor by tensor):
#                       bf16 logits at TP 4 (and 8) against tpinfer in f32 at the widest TP on
#                       the same weights, and TP 4 against TP 8.
#   PHASE=llama70-speed decode tok/s and 2,048-token prefill at TP 4 (and 8), memory per rank.
#   PHASE=uneven        Llama-3-8B shape at TP 3 (4 GPUs) or 5, 6, 7 (8 GPUs): logits against
#                       transformers in f32, and tok/s.
#   PHASE=wan           Wan-14B shape, 480p × 81 frames: step time at TP 1, 2, 4 (and 5, 8),
#                       with rank 0's stage profile at each width.
# Needs torch + transformers (+ diffusers for wan) and .dist/ from scripts/build/build-cuda.sh.
LOG=wide.log LIMIT=${LIMIT:-560}
. "$(dirname "$0")/wan-env.sh"
GPUS=$(nvidia-smi -L | wc -l)
log "$GPUS GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tr -s ' ')"
[ "$GPUS" -ge 4 ] || { log "issue #8 needs 4 or more GPUs"; exit 2; }
LLAMA="$PY $SCRIPTS/reference/reference_llama.py" TOK=.dist/llama3-tokenizer
WIDE=4; [ "$GPUS" -ge 8 ] && WIDE=8
case "${PHASE:-}" in
  llama70)
    [ -f "$W/m70b/config.json" ] || run $LLAMA make --shape 70b --dtype bf16 --out "$W/m70b" --tokenizer $TOK || exit 1
    run "$BIN/tpinfer-bench" logits --model "$W/m70b" --cuda --dtype f32 --tp $WIDE --steps 8 --out "$W/t70_f32.st"
    RUNS=""
    for tp in 4 $([ "$WIDE" = 8 ] && echo 8); do
      run "$BIN/tpinfer-bench" logits --model "$W/m70b" --cuda --dtype bf16 --tp $tp --steps 8 --out "$W/t70_tp$tp.st"
      RUNS="$RUNS tp$tp=$W/t70_tp$tp.st"
    done
    run $LLAMA compare --ref "$W/t70_f32.st" --out-json "$OUT/llama70_vs_f32.json" $RUNS
    [ "$WIDE" = 8 ] && run $LLAMA compare --ref "$W/t70_tp4.st" --out-json "$OUT/llama70_tp8_vs_tp4.json" tp8="$W/t70_tp8.st"
    ;;
  llama70-speed)
    [ -f "$W/m70b/config.json" ] || run $LLAMA make --shape 70b --dtype bf16 --out "$W/m70b" --tokenizer $TOK || exit 1
    TPS=4; [ "$WIDE" = 8 ] && TPS=4,8
    run "$BIN/tpinfer-bench" speed --model "$W/m70b" --cuda --tp $TPS --prompt-tokens 128 --new-tokens 128 --repeats 2
    run "$BIN/tpinfer-bench" speed --model "$W/m70b" --cuda --tp $TPS --prompt-tokens 2048 --new-tokens 2 --repeats 2
    ;;
  uneven)
    [ -d "$W/m8b" ] || run $LLAMA make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer $TOK || exit 1
    run $LLAMA logits --model "$W/m8b" --dtype f32 --steps 8 --out "$W/r8b_f32.st"
    WIDTHS="1 3"; [ "$WIDE" = 8 ] && WIDTHS="1 3 5 6 7"
    RUNS=""
    for tp in $WIDTHS; do
      run "$BIN/tpinfer-bench" logits --model "$W/m8b" --cuda --dtype bf16 --tp $tp --steps 8 --out "$W/t8b_tp$tp.st"
      RUNS="$RUNS tp$tp=$W/t8b_tp$tp.st"
    done
    run $LLAMA compare --ref "$W/r8b_f32.st" --out-json "$OUT/llama8_uneven.json" $RUNS
    run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp "$(echo $WIDTHS | tr ' ' ,)" --prompt-tokens 128 \
      --new-tokens 128 --repeats 2
    ;;
  wan)
    TP_WAN=1,2,4; [ "$WIDE" = 8 ] && TP_WAN=1,2,4,5,8
    LOG=wide.log TP=$TP_WAN FRAMES=81 SKIP_DIFFUSERS=1 PROFILE=1 bash "$(dirname "$0")/gpu-wan-speed.sh"
    ;;
  *) echo "PHASE=llama70, llama70-speed, uneven or wan" >&2; exit 2 ;;
esac
log done
