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
// gemv_rotary: the QKV product with the rotary embedding and the KV-cache write of
// rotary.cu in its epilogue (see there).
// Needs k % 8 == 0 and 16-byte aligned rows (the launcher checks). A chain kernel (chain.cuh).
#include "chain.cuh"
#include "convert.cuh"
#include "rotate.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int UNROLL = 2;  // 16-byte chunks of k per thread per step

template <typename T>
__device__ __forceinline__ float dot8(uint4 a_raw, uint4 b_raw) {
    const T* a = reinterpret_cast<const T*>(&a_raw);
    const T* b = reinterpret_cast<const T*>(&b_raw);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += to_f32(a[i]) * to_f32(b[i]);
    return s;
}

// Σ_k x[k] · w[rows[r], k] for the CTA's W_ROWS weight rows, into `partial` (a sum per warp
// and row; row_sum adds them up in every thread after it returns). Every thread issues
// UNROLL · W_ROWS 16-byte loads before it uses any. The caller has released the chain.
template <typename T, int W_ROWS>
__device__ void dot_rows(const T* x, const T* __restrict__ w, const int (&rows)[W_ROWS], int k,
                         float (&partial)[THREADS / 32][W_ROWS]) {
    const int chunks = k / 8;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wv[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) wv[r] = reinterpret_cast<const uint4*>(w + (long)rows[r] * k);

    float acc[W_ROWS] = {};
    uint4 ws[UNROLL][W_ROWS];
    const auto load_weights = [&](int c0) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) ws[u][r] = __ldcs(wv[r] + c);  // streamed: read once
            }
        }
    };
    // In a chain, the first weight loads fly while the kernel before still writes x.
    load_weights(threadIdx.x);
    chain_wait();
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * UNROLL) {
        // The weight loads go out first; the input while they fly.
        if (c0 != threadIdx.x) load_weights(c0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
                // A plain load: x may have been written by a kernel that ran beside this one.
                const uint4 xs = xv[c];
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) acc[r] += dot8<T>(ws[u][r], xs);
            }
        }
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
        if (lane == 0) partial[warp][r] = acc[r];
    }
    __syncthreads();
}

template <int W_ROWS>
__device__ __forceinline__ float row_sum(const float (&partial)[THREADS / 32][W_ROWS], int r) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) s += partial[i][r];
    return s;
}

// ROWS outputs per CTA; with GATE_UP each output reads two weight rows (gate_i and up_i).
template <typename T, int ROWS, bool GATE_UP>
__device__ void gemv(const T* x, const T* __restrict__ w, T* __restrict__ y, int n, int k) {
    constexpr int W_ROWS = GATE_UP ? 2 * ROWS : ROWS;
    const int row0 = blockIdx.x * ROWS;
    int rows[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) rows[r] = min(row0 + r % ROWS, n - 1) + (r < ROWS ? 0 : n);
    __shared__ float partial[THREADS / 32][W_ROWS];
    chain_release();
    dot_rows<T, W_ROWS>(x, w, rows, k, partial);
    if (threadIdx.x < ROWS && row0 + threadIdx.x < n) {
        const float s = row_sum(partial, threadIdx.x);
        if (GATE_UP) {
            const float u = row_sum(partial, ROWS + threadIdx.x);
            const float g = to_f32(from_f32<T>(s));
            y[row0 + threadIdx.x] = from_f32<T>(g / (1.f + expf(-g)) * to_f32(from_f32<T>(u)));
        } else {
            y[row0 + threadIdx.x] = from_f32<T>(s);
        }
    }
}

// A fused QKV product of one row, `w` `[(q_heads + 2 · kv_heads) · d, k]`, with rotary.cu's
// rotation and cache write after it: CTA b computes the rows j and j + d/2 of head slot
// b / (d/2) (query heads, then key heads, then value heads) — the two values that rotate
// together — rounds them to T as the plain product does, and writes the query head rotated
// into `queries`, the key head rotated and the value head as it is into `cache` `[2, kv_heads,
// capacity, d]` at slot *position. The bits of gemv followed by rotary_qkv; one kernel and no
// round trip of the product through memory. A position past the table or the cache is
// skipped (the host checks it before it launches).
template <typename T>
__device__ void gemv_rotary(const T* x, const T* __restrict__ w, const T* __restrict__ table, T* __restrict__ queries,
                            T* __restrict__ cache, int q_heads, int kv_heads, int d, int k,
                            const unsigned* __restrict__ position, int positions, int capacity) {
    chain_release();
    const int half = d / 2, slot = blockIdx.x / half, j = blockIdx.x % half;
    const int rows[2] = {slot * d + j, slot * d + j + half};
    const bool query = slot < q_heads, value = slot >= q_heads + kv_heads;
    // Only a copy before the chain writes the position, and nothing writes the table: both
    // are read before the wait, while the first weight loads fly.
    const long at = *position;
    const bool skip = at >= positions || (!query && at >= capacity);
    float c = 1.f, s = 0.f;
    if (!value && !skip && threadIdx.x < 2) {
        c = to_f32(table[at * half + j]);
        s = to_f32(table[((long)positions + at) * half + j]);
    }
    __shared__ float partial[THREADS / 32][2];
    dot_rows<T, 2>(x, w, rows, k, partial);
    if (threadIdx.x >= 2 || skip) return;
    // Thread 0 writes column j, thread 1 column j + half.
    const bool second = threadIdx.x == 1;
    const float x1 = to_f32(from_f32<T>(row_sum(partial, 0))), x2 = to_f32(from_f32<T>(row_sum(partial, 1)));
    const float y = value ? (second ? x2 : x1) : rotate(x1, x2, c, s, second);
    // Key head h and value head h are cache rows h and kv_heads + h: slot - q_heads either way.
    T* to = query ? queries + (long)slot * d : cache + ((long)(slot - q_heads) * capacity + at) * d;
    to[j + (second ? half : 0)] = from_f32<T>(y);
}

}  // namespace

#define GEMV(SUFFIX, T, ROWS)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_##SUFFIX##_r##ROWS(const T* x, const T* w,      \
                                                                                   T* y, int n, int k CHAIN_TRACE_PARAM) { \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv<T, ROWS, false>(x, w, y, n, k);                                                                   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        gemv_gate_up_silu_##SUFFIX##_r##ROWS(const T* x, const T* w, T* y, int n, int k CHAIN_TRACE_PARAM) { \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv<T, ROWS, true>(x, w, y, n, k);                                                                    \
    }

#define GEMV_ROTARY(SUFFIX, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        gemv_rotary_##SUFFIX(const T* x, const T* w, const T* table, T* queries, T* cache, int q_heads,         \
                             int kv_heads, int d, int k, const unsigned* position, int positions, int capacity CHAIN_TRACE_PARAM) { \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv_rotary<T>(x, w, table, queries, cache, q_heads, kv_heads, d, k, position, positions, capacity);  \
    }

GEMV_ROTARY(bf16, __nv_bfloat16)
GEMV_ROTARY(f16, __half)
GEMV(bf16, __nv_bfloat16, 2)
GEMV(bf16, __nv_bfloat16, 4)
GEMV(bf16, __nv_bfloat16, 8)
GEMV(f16, __half, 2)
GEMV(f16, __half, 4)
GEMV(f16, __half, 8)
