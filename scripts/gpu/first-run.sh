#!/usr/bin/env bash
# A first run against the runs after it (issue #32): `tpinfer generate --json` of the
# Llama-3-8B shape (random bf16 weights), three times per build, the first with an empty
# driver JIT cache (CUDA_CACHE_PATH: what a fresh machine has), the next two with what the
# first left there. Each run's decode and prefill speed, its wall time, and the size of the
# JIT cache after it (the PTX the driver compiled). BINS="NAME=DIR ..." (DIR holding that
# build's tpinfer). Needs torch (for the random-weight model) and one GPU.
# Results: $OUT/first-run.log, which ends with the table.
# Example: BINS="new=.dist/new base=.dist/base" bash scripts/gpu/first-run.sh
. "$(dirname "$0")/env.sh"
TOK=${TOK:-.dist/llama3-tokenizer}
: "${BINS:?set BINS=\"NAME=DIR ...\"}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/first-run.log"; }
[ -f "$W/m8b/config.json" ] || $PY "$SCRIPTS/reference/reference_llama.py" make --shape 8b --dtype bf16 \
  --out "$W/m8b" --tokenizer "$TOK" >> "$OUT/first-run.log" 2>&1 || { log "making the model failed"; exit 1; }
# The weights into the page cache, so that no run pays for the disk.
cat "$W"/m8b/*.safetensors > /dev/null
TABLE=$W/first-run.tsv
printf 'build\trun\twall_s\tprefill_s\tdecode_tok_s\tgenerated\tjit_cache_kib\n' > "$TABLE"
for bin in $BINS; do
  name=${bin%%=*} dir=${bin#*=}
  cache=$(mktemp -d)
  for run in 1 2 3; do
    log "$name run $run"
    start=$(date +%s.%N)
    CUDA_CACHE_PATH=$cache timeout 300 "$dir/tpinfer" generate --model "$W/m8b" --prompt "The history of the" \
      --max-new-tokens 256 --json > "$W/$name-$run.json" 2>> "$OUT/first-run.log"
    rc=$?
    wall=$(awk "BEGIN { print $(date +%s.%N) - $start }")
    [ $rc -eq 0 ] || log "$name run $run failed ($rc)"
    jit=$(du -sk "$cache" | cut -f1)
    $PY - "$W/$name-$run.json" "$name" "$run" "$wall" "$jit" >> "$TABLE" <<'EOF'
import json, sys
path, name, run, wall, jit = sys.argv[1:]
try:
    r = json.load(open(path))
    cols = [f"{r['prefill_seconds']:.3f}", f"{r['decode_tokens_per_second']:.1f}", str(r["generated_tokens"])]
except Exception as e:
    cols = ["-", "-", f"no report ({e})"]
print("\t".join([name, run, f"{float(wall):.2f}"] + cols + [jit]))
EOF
  done
  rm -rf "$cache"
done
tee -a "$OUT/first-run.log" < "$TABLE"
