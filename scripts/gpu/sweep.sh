#!/usr/bin/env bash
# The published sweep (issue #7) on the GPU host: random-weight Llama-3-8B and Wan-14B shapes,
# TP 1 and 2 (TP_LIST="1, 2, 4" for others), with transformers / diffusers baselines in the
# same run. SWEEP=llama or dit picks one grid (each fits one 10-minute call at TP 1 and 2);
# results under $OUT/sweep-$SWEEP.
LOG=sweep.log LIMIT=${LIMIT:-560}
. "$(dirname "$0")/wan-env.sh"
case "${SWEEP:-llama}" in
  llama)
    [ -d "$W/m8b" ] || run $PY "$SCRIPTS/reference/reference_llama.py" make --shape 8b --dtype bf16 --out "$W/m8b" \
      --tokenizer .dist/llama3-tokenizer || exit 1
    cat > "$W/sweep-llama.toml" <<TOML
[llama]
model = "$W/m8b"
tp = [${TP_LIST:-1, 2}]
prompt = [128, 2048]
new = [256]
cuda = true
dtype = "bf16"
repeats = 2
baseline = true
python = "$PY"
TOML
    ;;
  dit)
    [ -f "$W/wan14/config.json" ] || run $REF make --shape 14b --save bf16 --out "$W/wan14" || exit 1
    cat > "$W/sweep-dit.toml" <<TOML
[dit]
model = "$W/wan14"
tp = [${TP_LIST:-1, 2}]
frames = [21, 41, 81]
size = ["832x480"]
steps = [1]
cuda = true
dtype = "bf16"
repeats = 1
baseline = true
python = "$PY"
TOML
    ;;
  *) echo "SWEEP=llama or SWEEP=dit" >&2; exit 2 ;;
esac
run "$BIN/tpinfer-bench" sweep --config "$W/sweep-${SWEEP:-llama}.toml" --out "$OUT/sweep-${SWEEP:-llama}"
log done
