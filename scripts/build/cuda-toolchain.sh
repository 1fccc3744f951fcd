#!/usr/bin/env bash
# Lays out a CUDA 13.0 toolkit from pinned PyPI wheels on an x86_64 host with no GPU and no
# CUDA, so that `cargo build --features cuda,nccl` can compile the kernels and link.
# Usage: scripts/build/cuda-toolchain.sh [DIR]   (default: ~/.cache/tpinfer-cuda). Prints the exports.
# The versions equal the CUDA 13.0 libraries of the H200 test host (driver 580 loads PTX up to
# CUDA 13.0; a newer nvcc would emit PTX it cannot load). On a machine with CUDA installed,
# skip this script: set CUDA_COMPUTE_CAP and build.
set -euo pipefail
ROOT=${1:-$HOME/.cache/tpinfer-cuda}
W=$ROOT/wheels            # pip --target dir (raw wheels)
H=$ROOT/home              # the CUDA_HOME layout
if [ ! -x "$W/nvidia/cu13/bin/nvcc" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$W" \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-nvrtc==13.0.88" \
    "nvidia-cublas==13.1.0.3" "nvidia-curand==10.4.0.35" "nvidia-nccl-cu13==2.28.9"
fi
C=$W/nvidia/cu13
N=$W/nvidia/nccl
rm -rf "$H"; mkdir -p "$H/lib64/stubs" "$H/include"
[ -e "$C/lib64" ] || ln -s lib "$C/lib64"   # nvcc.profile looks in $(TOP)/lib64 when linking
ln -s "$C/bin"  "$H/bin"
ln -s "$C/nvvm" "$H/nvvm"                   # cicc and libdevice live in the nvvm wheel
for f in "$C"/include/* "$N"/include/*; do ln -s "$f" "$H/include/$(basename "$f")"; done
for f in "$C"/lib/*.so.* "$C"/lib/*.a "$N"/lib/*.so.*; do ln -s "$f" "$H/lib64/$(basename "$f")"; done
for l in cublas cublasLt cudart nvrtc nvblas; do ln -s "lib$l.so.13" "$H/lib64/lib$l.so"; done
ln -s libcurand.so.10 "$H/lib64/libcurand.so"
ln -s libnccl.so.2    "$H/lib64/libnccl.so"
ln -s lib64 "$H/lib"
# No wheel ships the driver library: link against a stub exporting every cu* symbol of
# cudarc's driver bindings under the driver's SONAME; the real libcuda.so.1 binds at run time.
if ! ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys >/dev/null 2>&1; then
  (cd "$(dirname "$0")/../.." && cargo fetch -q)
fi
R=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys | sort | tail -1)
grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$R/mod.rs" | awk '{print $4}' | sort -u > "$ROOT/libcuda_syms.txt"
awk '{printf "void %s(void){}\n",$1}' "$ROOT/libcuda_syms.txt" > "$ROOT/libcuda_stub.c"
gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$H/lib64/stubs/libcuda.so" "$ROOT/libcuda_stub.c"
ln -s stubs/libcuda.so "$H/lib64/libcuda.so"
cat <<OUT
export CUDA_HOME=$H CUDA_PATH=$H PATH=$H/bin:\$PATH
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}   # 90: H100/H200 (sm_90a); 89: RTX 4090; 80: A100
OUT
