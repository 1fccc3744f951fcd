// One input row through a linear layer, y[n] = Σ_k x[k] · w[n, k], with w `[n, k]` row-major
// (the layout of a checkpoint's weight) in bf16 or f16 and f32 accumulation: the shape of
// every weight product of a decode step. It is bound by reading w once, and cuBLAS's kernels
// for it reach 1.4–3.3 TB/s on an H200 (benches/RESULTS.md); this one keeps more loads in
// flight: each CTA owns ROWS outputs and its 256 threads split k between them, every thread
// issuing UNROLL · ROWS 16-byte loads before it uses any.
// GATE_UP: w is a gated MLP's merged `[gate (n) | up (n)]` weight `[2n, k]` and output i is
// silu(gate_i) · up_i, each product rounded to T first and the SiLU product rounded as the
// silu_mul kernel rounds it: the bits of this kernel without GATE_UP followed by silu_mul,
// in one pass that writes n values instead of 2n (and leaves the down projection a plain
// product, where it had to recompute the SiLU product of its input in every CTA).
// NEXT: the weight of the product that follows this one. Between the two a decode step runs
// small kernels (attention, the all-reduce, a norm) that leave HBM idle; the last
// PREFETCH_CTAS CTAs, as they finish, start pulling next's first next_bytes into L2 so that
// those bytes stream in during that gap instead of after it. A hint only: no value changes.
// Needs k % 8 == 0 and 16-byte aligned rows, next 16-byte aligned and next_bytes % 16 == 0
// (the launcher checks).
#include "convert.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int UNROLL = 2;  // 16-byte chunks of k per thread per step
// One per SM or so: enough to issue the prefetch at the rate HBM can serve it.
constexpr int PREFETCH_CTAS = 128;
constexpr unsigned PREFETCH_CHUNK = 4096;  // bytes per prefetch instruction

// This CTA's share of prefetching next[0, bytes) into L2, if it is one of the last
// PREFETCH_CTAS (the last to be scheduled, so the last to finish).
__device__ __forceinline__ void prefetch_share(const char* next, unsigned long long bytes) {
    const int ctas = min((int)gridDim.x, PREFETCH_CTAS);
    const int share = (int)blockIdx.x - ((int)gridDim.x - ctas);
    if (bytes == 0 || share < 0) return;
    const unsigned long long per_cta = (bytes / ctas + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK * PREFETCH_CHUNK;
    const unsigned long long end = min(bytes, (share + 1) * per_cta);
    for (unsigned long long at = share * per_cta + threadIdx.x * (unsigned long long)PREFETCH_CHUNK; at < end;
         at += THREADS * (unsigned long long)PREFETCH_CHUNK) {
        const unsigned size = (unsigned)min((unsigned long long)PREFETCH_CHUNK, end - at);
#if __CUDA_ARCH__ >= 900
        // One bulk request per chunk, served by the copy engine of the SM without holding it.
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(next + at), "r"(size) : "memory");
#else
        for (unsigned line = 0; line < size; line += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(next + at + line));
#endif
    }
}

template <typename T>
__device__ __forceinline__ float dot8(uint4 a_raw, uint4 b_raw) {
    const T* a = reinterpret_cast<const T*>(&a_raw);
    const T* b = reinterpret_cast<const T*>(&b_raw);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += to_f32(a[i]) * to_f32(b[i]);
    return s;
}

// ROWS outputs per CTA; with GATE_UP each output reads two weight rows (gate_i and up_i).
template <typename T, int ROWS, bool GATE_UP>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int n, int k,
                     const char* next, unsigned long long next_bytes) {
    constexpr int W_ROWS = GATE_UP ? 2 * ROWS : ROWS;
    const int chunks = k / 8;
    const int row0 = blockIdx.x * ROWS;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wv[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) {
        const int row = min(row0 + r % ROWS, n - 1) + (r < ROWS ? 0 : n);
        wv[r] = reinterpret_cast<const uint4*>(w + (long)row * k);
    }

    float acc[W_ROWS] = {};
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * UNROLL) {
        uint4 ws[UNROLL][W_ROWS];
        // The weight loads go out first; the input while they fly.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) ws[u][r] = __ldcs(wv[r] + c);  // streamed: read once
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
                const uint4 xs = __ldg(xv + c);
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) acc[r] += dot8<T>(ws[u][r], xs);
            }
        }
    }

    __shared__ float partial[THREADS / 32][W_ROWS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
        if (lane == 0) partial[warp][r] = acc[r];
    }
    __syncthreads();
    if (threadIdx.x < ROWS && row0 + threadIdx.x < n) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < THREADS / 32; ++i) s += partial[i][threadIdx.x];
        if (GATE_UP) {
            float u = 0.f;
#pragma unroll
            for (int i = 0; i < THREADS / 32; ++i) u += partial[i][ROWS + threadIdx.x];
            const float g = to_f32(from_f32<T>(s));
            y[row0 + threadIdx.x] = from_f32<T>(g / (1.f + expf(-g)) * to_f32(from_f32<T>(u)));
        } else {
            y[row0 + threadIdx.x] = from_f32<T>(s);
        }
    }
    prefetch_share(next, next_bytes);
}

}  // namespace

#define GEMV(SUFFIX, T, ROWS)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        gemv_##SUFFIX##_r##ROWS(const T* x, const T* w, T* y, int n, int k, const char* next,                  \
                                unsigned long long next_bytes) {                                               \
        gemv<T, ROWS, false>(x, w, y, n, k, next, next_bytes);                                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        gemv_gate_up_silu_##SUFFIX##_r##ROWS(const T* x, const T* w, T* y, int n, int k, const char* next,     \
                                             unsigned long long next_bytes) {                                  \
        gemv<T, ROWS, true>(x, w, y, n, k, next, next_bytes);                                                  \
    }

GEMV(bf16, __nv_bfloat16, 2)
GEMV(bf16, __nv_bfloat16, 4)
GEMV(bf16, __nv_bfloat16, 8)
GEMV(f16, __half, 2)
GEMV(f16, __half, 4)
GEMV(f16, __half, 8)
