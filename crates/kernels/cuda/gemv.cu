// One input row through a linear layer, y[n] = Σ_k x[k] · w[n, k], with w `[n, k]` row-major
// (the layout of a checkpoint's weight) in bf16 or f16 and f32 accumulation: the shape of
// every weight product of a decode step. It is bound by reading w once, and cuBLAS's kernels
// for it reach 1.4–3.3 TB/s on an H200 (benches/RESULTS.md); this one keeps more loads in
// flight: each CTA owns ROWS outputs and its 256 threads split k between them, every thread
// issuing UNROLL · ROWS 16-byte loads before it uses any.
// GATED: the input is a gated MLP's fused gate/up output `[gate (k) | up (k)]` and the row
// multiplied is silu(gate) · up, rounded to T element by element exactly as the unfused
// silu_mul kernel rounds it, so fused and unfused give the same bits.
// Needs k % 8 == 0 and 16-byte aligned rows (the launcher checks).
#include "convert.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int ROWS = 4;    // outputs per CTA
constexpr int UNROLL = 2;  // 16-byte chunks of k per thread per step

template <typename T>
struct Vec8 {
    uint4 raw;
    __device__ __forceinline__ float dot(const Vec8& other) const {
        const T* a = reinterpret_cast<const T*>(&raw);
        const T* b = reinterpret_cast<const T*>(&other.raw);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s += to_f32(a[i]) * to_f32(b[i]);
        return s;
    }
};

// Chunk c (8 values) of the row that multiplies w.
template <typename T, bool GATED>
__device__ __forceinline__ Vec8<T> input(const uint4* x, int c, int chunks) {
    Vec8<T> v;
    v.raw = __ldg(x + c);
    if (GATED) {
        Vec8<T> up;
        up.raw = __ldg(x + chunks + c);
        T* g = reinterpret_cast<T*>(&v.raw);
        const T* u = reinterpret_cast<const T*>(&up.raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float gf = to_f32(g[i]);
            g[i] = from_f32<T>(gf / (1.f + expf(-gf)) * to_f32(u[i]));
        }
    }
    return v;
}

template <typename T, bool GATED>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int n, int k) {
    const int chunks = k / 8;
    const int row0 = blockIdx.x * ROWS;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wv[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wv[r] = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, n - 1) * k);

    float acc[ROWS] = {};
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * UNROLL) {
        Vec8<T> xs[UNROLL], ws[UNROLL][ROWS];
        // The weight loads go out first; the input (and, gated, its SiLU) while they fly.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) ws[u][r].raw = __ldcs(wv[r] + c);  // streamed: read once
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
                xs[u] = input<T, GATED>(xv, c, chunks);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r] += ws[u][r].dot(xs[u]);
            }
        }
    }

    __shared__ float partial[THREADS / 32][ROWS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
        if (lane == 0) partial[warp][r] = acc[r];
    }
    __syncthreads();
    if (threadIdx.x < ROWS && row0 + threadIdx.x < n) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < THREADS / 32; ++i) s += partial[i][threadIdx.x];
        y[row0 + threadIdx.x] = from_f32<T>(s);
    }
}

}  // namespace

#define GEMV(SUFFIX, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_##SUFFIX(const T* x, const T* w, T* y, int n, \
                                                                         int k) {                           \
        gemv<T, false>(x, w, y, n, k);                                                                       \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                    \
        gemv_silu_mul_##SUFFIX(const T* gate_up, const T* w, T* y, int n, int k) {                            \
        gemv<T, true>(gate_up, w, y, n, k);                                                                  \
    }

GEMV(bf16, __nv_bfloat16)
GEMV(f16, __half)
