# Sourced by every GPU script. The host's Python is $PY (default: python3, which on the H200
# hosts holds torch and transformers); the CUDA and NCCL libraries of its NVIDIA wheels go on
# the library path, with its cuDNN for the VAE's convolutions ($NVIDIA_LIBS overrides where
# they are). Results go to $OUT, binaries come
# from $BIN (scripts/build/build-cuda.sh's .dist), models are made in $WORK.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PY=${PY:-python3}
NV=${NVIDIA_LIBS:-$($PY -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)}
[ -n "$NV" ] && [ -d "$NV" ] && export LD_LIBRARY_PATH=$NV/cu13/lib:$NV/nccl/lib:$NV/cudnn/lib:${LD_LIBRARY_PATH:-}
BIN=${BIN:-.dist} W=${WORK:-/tmp/tpinfer-gpu}
SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$W"
