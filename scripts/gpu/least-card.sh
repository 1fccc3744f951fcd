#!/usr/bin/env bash
# The least card a Wan stage runs on, against its plan (issues #30, #34). Each line of $CASES
# is "vae SIZE DTYPE" (the VAE decoding 81 frames at 480 or 720p) or "dit13|dit14 FRAMES DTYPE
# [FLAGS]" (the 1.3B DiT, or the 14B shape cut to 10 layers, whose forward's temporaries are
# the whole one's: one forward and its repeat at 832 × 480, then two guided UniPC steps, which
# hold the sampler's state and both prompts as the plan counts them; FLAGS such as
# `--weights fp8` passed on) or "speech SECONDS DTYPE" (wav2vec2-large-xlsr-53 encoding that
# much audio). `tpinfer-bench … --limit-to-plan EXTRA`
# takes the device memory past the plan plus EXTRA MiB before the run, as a card of that
# size would hold it; EXTRA is bisected between $LO and $HI (default −400 and 100 MiB) to
# $STEP (25) MiB. Then the run unlimited, for its peak beside. Random weights in the published
# shapes. Results: $OUT/least-card.log.
# Example: BIN=.dist CASES="dit13 81 bf16" bash scripts/gpu/least-card.sh
LOG=least-card.log LIMIT=${LIMIT:-200}
. "$(dirname "$0")/wan-env.sh"
VAE="$PY $SCRIPTS/reference/reference_vae.py"
step=${STEP:-25}

# Runs "${bench[@]}" limited to the plan + $1 MiB: 0 when it runs, 1 when the device's memory
# ran out, 2 on any other failure.
attempt() {
  if timeout "$LIMIT" "${bench[@]}" --limit-to-plan="$1" > "$W/least.txt" 2>&1; then
    grep -E "^\| 1|rank 0|limited" "$W/least.txt" | tee -a "$OUT/$LOG"
    log "$name: runs at the plan $(printf %+d "$1") MiB"
    return 0
  fi
  log "$name: not at the plan $(printf %+d "$1") MiB: $(grep -m1 -E '^Error|panicked' "$W/least.txt")"
  # At the margin the first launch of a kernel loaded lazily finds no memory for its code:
  # cuBLAS(Lt) reports that as a failed execution.
  grep -qiE "out of (device )?memory|OUT_OF_MEMORY|CUBLAS_STATUS_(EXECUTION|ALLOC)_FAILED" "$W/least.txt" && return 1
  tail -5 "$W/least.txt" | tee -a "$OUT/$LOG"
  return 2
}

while read -r stage arg dtype flags; do
  [ -n "$stage" ] || continue
  name="$stage $arg $dtype${flags:+ $flags}"
  case $stage in
    vae)
      case $arg in 480) h=60 w=104 ;; 720) h=90 w=160 ;; *) log "unknown size $arg"; exit 1 ;; esac
      [ -f "$W/vae/config.json" ] || run $VAE make --out "$W/vae" || exit 1
      [ -f "$W/lat$arg.st" ] || run $VAE latents --frames 21 --height $h --width $w --out "$W/lat$arg.st" || exit 1
      bench=("$BIN/tpinfer-bench" vae --model "$W/vae" --latents "$W/lat$arg.st") ;;
    dit13 | dit14)
      shape=${stage#dit}
      case $shape in 13) make=(--shape 1.3b) ;; 14) make=(--shape 14b --layers 10 --save bf16) ;; esac
      [ -f "$W/wan$shape/config.json" ] || run $REF make "${make[@]}" --out "$W/wan$shape" || exit 1
      [ -f "$W/in$arg.st" ] || run $REF inputs --frames "$arg" --size 832x480 --out "$W/in$arg.st" || exit 1
      bench=("$BIN/tpinfer-bench" dit --model "$W/wan$shape" --inputs "$W/in$arg.st" --guided-steps 2) ;;
    speech)
      V="$PY $SCRIPTS/reference/reference_wav2vec2.py"
      [ -f "$W/xlsr/config.json" ] || run $V make --shape xlsr-53 --seed 5 --out "$W/xlsr" || exit 1
      [ -f "$W/w$arg.st" ] || run $V run --model "$W/xlsr" --seconds "$arg" --seed 6 --out "$W/w$arg.st" || exit 1
      bench=("$BIN/tpinfer-bench" speech --model "$W/xlsr" --audio "$W/w$arg.st") ;;
    *) log "unknown stage $stage"; exit 1 ;;
  esac
  # shellcheck disable=SC2206 # FLAGS are words
  bench+=(--cuda --dtype "$dtype" --tp 1 --repeats 1 $flags)
  lo=${LO:--400} hi=${HI:-100}
  # The bracket: $hi runs, $lo does not.
  until attempt "$hi"; do
    [ $? -eq 1 ] && [ "$hi" -lt 2000 ] || { log "$name: no run at the plan $(printf %+d "$hi") MiB"; continue 2; }
    lo=$hi hi=$((hi + 200))
  done
  if attempt "$lo"; then
    log "$name: the least card is at most the plan $(printf %+d "$lo") MiB"
  else
    [ $? -eq 1 ] || continue
    while ((hi - lo > step)); do
      mid=$((lo + (hi - lo) / 2 / step * step))
      if attempt "$mid"; then hi=$mid; else [ $? -eq 1 ] || continue 2; lo=$mid; fi
    done
    log "$name: the least card is the plan $(printf %+d "$hi") MiB (not the plan $(printf %+d "$lo"))"
  fi
  run "${bench[@]}"
done <<< "${CASES:-dit13 21 bf16
dit13 81 bf16
dit13 21 f32
vae 480 bf16
vae 720 bf16
vae 480 f32}"
log done
