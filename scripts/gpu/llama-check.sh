#!/usr/bin/env bash
# Llama on CUDA ranks against PyTorch/transformers on the same host (issue #3): f32 and bf16
# numerics at TP 1 and 2, then decode/prefill speed side by side. Needs 2 GPUs (TPS="1" runs
# TP 1 alone on one), torch + transformers, and the binaries of scripts/build/build-cuda.sh in .dist/.
# Results go to $OUT.
# SKIP_NUMERICS=1: speed only; SKIP_SPEED=1: numerics only; SKIP_8B=1: the small f32 model's
# numerics alone; SKIP_TORCH=1: no torch speed run;
# SKIP_EAGER=1: no --enforce-eager speed run; MIXING=1: also TP 2 with NCCL_GRAPH_MIXING_SUPPORT=0
# (safe here: every rank waits for its graph before the step's eager broadcast).
. "$(dirname "$0")/env.sh"
TPS=${TPS:-1 2} TOK=.dist/llama3-tokenizer
REF="$PY $SCRIPTS/reference/reference_llama.py"
TPL=$(echo $TPS | tr " " ,)
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log"; }
run() { log "$*"; timeout "${LIMIT:-150}" "$@" 2>&1 | tee -a "$OUT/log"; return "${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee -a "$OUT/log"
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 250 > "$OUT/gpu_mem.csv" &
SMI=$!

if [ -z "${SKIP_NUMERICS:-}" ]; then
run $REF make --shape 1b --dtype f32 --out "$W/m1b" --tokenizer $TOK || exit 1
# name=file pairs of the runs at every width in $TPS, for `compare`.
runs() { for tp in $TPS; do printf '%s ' "$1$tp${3:-}=$W/$2$tp${3:-}.st"; done; }
for tp in $TPS; do
  run "$BIN/tpinfer-bench" logits --model "$W/m1b" --cuda --dtype f32 --tp $tp --steps 32 --out "$W/t1b_tp$tp.st"
  # Through the continuous-batching engine: its paged KV cache and kernels.
  run "$BIN/tpinfer-bench" logits --model "$W/m1b" --cuda --dtype f32 --tp $tp --steps 32 --max-seqs 4 \
    --out "$W/t1b_tp${tp}_paged.st"
done
run $REF logits --model "$W/m1b" --dtype f32 --steps 32 --out "$W/r1b.st"
run $REF compare --ref "$W/r1b.st" --out-json "$OUT/f32_1b.json" $(runs tp t1b_tp) $(runs tp t1b_tp _paged)
for tp in $TPS; do
  [ -f "$W/t1b_tp$tp.st" ] || { log "TP $tp failed on the small model: stopping"; kill $SMI; exit 1; }
done

[ -n "${SKIP_8B:-}" ] && { kill $SMI; log done; exit 0; }
[ -d "$W/m8b" ] || run $REF make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer $TOK || exit 1
# Decode steps 2.. replay a captured CUDA graph; --enforce-eager runs them kernel by kernel.
for tp in $TPS; do
  run "$BIN/tpinfer-bench" logits --model "$W/m8b" --cuda --dtype bf16 --tp $tp --steps 8 --out "$W/t8b_tp$tp.st"
  run "$BIN/tpinfer-bench" logits --model "$W/m8b" --cuda --dtype bf16 --tp $tp --steps 8 --enforce-eager \
    --out "$W/t8b_tp${tp}_eager.st"
  run "$BIN/tpinfer-bench" logits --model "$W/m8b" --cuda --dtype bf16 --tp $tp --steps 8 --max-seqs 4 \
    --out "$W/t8b_tp${tp}_paged.st"
done
run $REF logits --model "$W/m8b" --dtype f32 --steps 8 --out "$W/r8b_f32.st"
run $REF logits --model "$W/m8b" --dtype bf16 --steps 8 --out "$W/r8b_bf16.st"
run $REF compare --ref "$W/r8b_f32.st" --out-json "$OUT/bf16_8b.json" \
  $(runs tp t8b_tp) $(runs tp t8b_tp _eager) $(runs tp t8b_tp _paged) transformers_bf16="$W/r8b_bf16.st"
run $REF compare --ref "$W/t8b_tp1_eager.st" --out-json "$OUT/graph_vs_eager.json" $(runs tp t8b_tp)
# A lone request in the batched engine runs the one-sequence step's kernels over the paged
# cache: the same bits as the one-sequence path, or the check fails.
lone=0
for tp in $TPS; do run $REF same "$W/t8b_tp$tp.st" "$W/t8b_tp${tp}_paged.st" || lone=1; done
[ $lone = 0 ] || log "FAILED: a lone batched request differs from the one-sequence path"
fi
[ -d "$W/m8b" ] || run $REF make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer $TOK || exit 1

[ -n "${SKIP_SPEED:-}" ] && { kill $SMI; log done; exit 0; }
LIMIT=200 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp "$TPL" --prompt-tokens 128 --new-tokens 256 --repeats 2
[ -n "${SKIP_EAGER:-}" ] || LIMIT=200 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp "$TPL" --prompt-tokens 128 \
  --new-tokens 256 --repeats 2 --enforce-eager
[ -z "${MIXING:-}" ] || NCCL_GRAPH_MIXING_SUPPORT=0 LIMIT=150 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 2 \
  --prompt-tokens 128 --new-tokens 256 --repeats 2
LIMIT=120 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp "$TPL" --prompt-tokens 2048 --new-tokens 2 --repeats 3
LIMIT=120 run "$BIN/tpinfer-bench" decode-profile --model "$W/m8b" --cuda --steps 64
[ "$TPL" = 1 ] || LIMIT=120 run "$BIN/tpinfer-bench" decode-profile --model "$W/m8b" --cuda --steps 64 --tp 2
[ -n "${SKIP_TORCH:-}" ] || LIMIT=120 run $REF speed --model "$W/m8b" --out-json "$OUT/torch_speed.json"
kill $SMI
log done
