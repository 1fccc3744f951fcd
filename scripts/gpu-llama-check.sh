#!/usr/bin/env bash
# Llama on CUDA ranks against PyTorch/transformers on the same host (issue #3): f32 and bf16
# numerics at TP 1 and 2, then decode/prefill speed side by side. Needs 2 GPUs, torch +
# transformers, and the binaries of scripts/build-cuda.sh in .dist/. Results go to $OUT.
# SKIP_NUMERICS=1: speed only; SKIP_SPEED=1: numerics only; SKIP_TORCH=1: no torch speed run;
# SKIP_EAGER=1: no --enforce-eager speed run; MIXING=1: also TP 2 with NCCL_GRAPH_MIXING_SUPPORT=0
# (safe here: every rank waits for its graph before the step's eager broadcast).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
[ -d "$NV" ] && export LD_LIBRARY_PATH=$NV/cu13/lib:$NV/nccl/lib:${LD_LIBRARY_PATH:-}
BIN=${BIN:-.dist} W=${WORK:-/tmp/tpinfer-gpu} PY=${PY:-python3} TOK=.dist/llama3-tokenizer
REF="$PY scripts/reference_llama.py"
mkdir -p "$W"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log"; }
run() { log "$*"; timeout "${LIMIT:-150}" "$@" 2>&1 | tee -a "$OUT/log"; return "${PIPESTATUS[0]}"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee -a "$OUT/log"
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 250 > "$OUT/gpu_mem.csv" &
SMI=$!

if [ -z "${SKIP_NUMERICS:-}" ]; then
run $REF make --shape 1b --dtype f32 --out "$W/m1b" --tokenizer $TOK || exit 1
for tp in 1 2; do
  run "$BIN/tpinfer-bench" logits --model "$W/m1b" --cuda --dtype f32 --tp $tp --steps 32 --out "$W/t1b_tp$tp.st"
done
run $REF logits --model "$W/m1b" --dtype f32 --steps 32 --out "$W/r1b.st"
run $REF compare --ref "$W/r1b.st" --out-json "$OUT/f32_1b.json" tp1="$W/t1b_tp1.st" tp2="$W/t1b_tp2.st"
[ -f "$W/t1b_tp2.st" ] || { log "TP 2 failed on the small model: stopping"; kill $SMI; exit 1; }

[ -d "$W/m8b" ] || run $REF make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer $TOK || exit 1
# Decode steps 2.. replay a captured CUDA graph; --enforce-eager runs them kernel by kernel.
for tp in 1 2; do
  run "$BIN/tpinfer-bench" logits --model "$W/m8b" --cuda --dtype bf16 --tp $tp --steps 8 --out "$W/t8b_tp$tp.st"
  run "$BIN/tpinfer-bench" logits --model "$W/m8b" --cuda --dtype bf16 --tp $tp --steps 8 --enforce-eager \
    --out "$W/t8b_tp${tp}_eager.st"
done
run $REF logits --model "$W/m8b" --dtype f32 --steps 8 --out "$W/r8b_f32.st"
run $REF logits --model "$W/m8b" --dtype bf16 --steps 8 --out "$W/r8b_bf16.st"
run $REF compare --ref "$W/r8b_f32.st" --out-json "$OUT/bf16_8b.json" \
  tp1="$W/t8b_tp1.st" tp2="$W/t8b_tp2.st" tp1_eager="$W/t8b_tp1_eager.st" tp2_eager="$W/t8b_tp2_eager.st" \
  transformers_bf16="$W/r8b_bf16.st"
run $REF compare --ref "$W/t8b_tp1_eager.st" --out-json "$OUT/graph_vs_eager.json" \
  tp1="$W/t8b_tp1.st" tp2="$W/t8b_tp2.st" tp2_eager="$W/t8b_tp2_eager.st"
fi
[ -d "$W/m8b" ] || run $REF make --shape 8b --dtype bf16 --out "$W/m8b" --tokenizer $TOK || exit 1

[ -n "${SKIP_SPEED:-}" ] && { kill $SMI; log done; exit 0; }
LIMIT=200 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 1,2 --prompt-tokens 128 --new-tokens 256 --repeats 2
[ -n "${SKIP_EAGER:-}" ] || LIMIT=200 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 1,2 --prompt-tokens 128 \
  --new-tokens 256 --repeats 2 --enforce-eager
[ -z "${MIXING:-}" ] || NCCL_GRAPH_MIXING_SUPPORT=0 LIMIT=150 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 2 \
  --prompt-tokens 128 --new-tokens 256 --repeats 2
LIMIT=120 run "$BIN/tpinfer-bench" speed --model "$W/m8b" --cuda --tp 1,2 --prompt-tokens 2048 --new-tokens 2 --repeats 3
LIMIT=120 run "$BIN/tpinfer-bench" decode-profile --model "$W/m8b" --cuda --steps 64
LIMIT=120 run "$BIN/tpinfer-bench" decode-profile --model "$W/m8b" --cuda --steps 64 --tp 2
[ -n "${SKIP_TORCH:-}" ] || LIMIT=120 run $REF speed --model "$W/m8b" --out-json "$OUT/torch_speed.json"
kill $SMI
log done
