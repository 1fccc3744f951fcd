// Rotary position embedding (the Hugging Face layout: each head's halves rotate together) on
// the output of a fused QKV projection, `[rows, (q_heads + 2 · kv_heads) · d]`, where row `r`
// is position `*position + r`: read from device memory, so that a captured CUDA graph replays
// at every decode position. One kernel replaces candle's seven launches per layer (copies of
// each head slice, two rotations, two cache writes): the queries come out rotated and
// contiguous, and the keys (rotated) and values go straight into the KV cache.
// `table` is `[2, positions, d / 2]`: cos, then sin. f32 arithmetic, one rounding. Rows past
// the table or the cache are skipped (the host checks the position before it launches).
// A chain kernel (chain.cuh).
#include "chain.cuh"
#include "convert.cuh"
#include "rotate.cuh"

namespace {

struct Rotation {
    float c, s;
};

template <typename T>
__device__ __forceinline__ Rotation rotation(const T* table, int positions, int half, int position, int j) {
    const long at = (long)position * half + j;
    return {to_f32(table[at]), to_f32(table[(long)positions * half + at])};
}

// Writes the pair (x1, x2) of head h of row r, columns j and j + d/2, rotated by t: a query
// head into out `[rows, q_heads, d]`; a key head into the cache at slot offset + r, with the
// same pair of its value head (x: the key head's row in qkv) copied beside it.
template <typename T>
__device__ __forceinline__ void write_rotated(const T* x, float x1, float x2, Rotation t, bool query, int h, int j,
                                              long r, T* out, T* cache, int q_heads, int kv_heads, int d,
                                              int capacity, long offset) {
    const int half = d / 2;
    T* o = query ? out + (r * q_heads + h) * d : cache + ((long)h * capacity + offset + r) * d;
    o[j] = from_f32<T>(rotate(x1, x2, t.c, t.s, false));
    o[j + half] = from_f32<T>(rotate(x1, x2, t.c, t.s, true));
    if (!query) {
        const T* v = x + kv_heads * d;
        T* vc = cache + ((long)(kv_heads + h) * capacity + offset + r) * d;
        vc[j] = v[j];
        vc[j + half] = v[j + half];
    }
}

// Thread i < rows · q_heads · d/2 writes `out[r, h, j]` and `out[r, h, j + d/2]`: the rotated
// query head h of row r. The threads after it write the rotated key head h and the value
// head h of row r into `cache` `[2, kv_heads, capacity, d]` at slot `*position + r`. Rows past
// the table or the cache are skipped.
template <typename T>
__device__ void rotary_qkv(const T* qkv, const T* table, T* out, T* cache, int rows, int q_heads, int kv_heads,
                           int d, const unsigned* position, int positions, int capacity) {
    chain_release();
    // The position (written by a copy before the chain) and the table are read before the
    // wait: a decode step's thread has one element, whose rotation is then already loaded.
    const int half = d / 2, width = (q_heads + 2 * kv_heads) * d;
    const long offset = *position;
    const long queries = (long)rows * q_heads * half;
    const long n = queries + (long)rows * kv_heads * half;
    const long first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    // Element i: row r, head h of its kind, column j; whether it is written at all.
    struct Element {
        bool query, skip;
        int h, j;
        long r;
    };
    const auto element = [&](long i) {
        Element e;
        e.query = i < queries;
        const long at = e.query ? i : i - queries;
        const int heads = e.query ? q_heads : kv_heads;
        e.j = at % half, e.h = (at / half) % heads, e.r = at / half / heads;
        e.skip = offset + e.r >= positions || (!e.query && offset + e.r >= capacity);
        return e;
    };
    Rotation prefetched = {};
    if (first < n) {
        const Element e = element(first);
        if (!e.skip) prefetched = rotation(table, positions, half, offset + e.r, e.j);
    }
    chain_wait();
    for (long i = first; i < n; i += (long)gridDim.x * blockDim.x) {
        const auto [query, skip, h, j, r] = element(i);
        if (skip) continue;
        const Rotation t = i == first ? prefetched : rotation(table, positions, half, offset + r, j);
        const T* x = qkv + r * width + (query ? h : q_heads + h) * d;
        write_rotated(x, to_f32(x[j]), to_f32(x[j + half]), t, query, h, j, r, out, cache, q_heads, kv_heads, d,
                      capacity, offset);
    }
}

// The sum of v over the CTA's threads (a whole number of warps, at most 32), alike in every
// thread.
__device__ __forceinline__ float cta_sum(float v) {
    __shared__ float warp_sums[32];
#pragma unroll
    for (int w = 16; w > 0; w /= 2) v += __shfl_xor_sync(0xffffffff, v, w);
    const int warps = blockDim.x / 32;
    if (warps == 1) return v;
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += warp_sums[w];
    return sum;
}

// rotary_qkv with Qwen3's RMSNorm of each query and key head first: head x becomes
// T(x · rsqrt(mean(x²) + eps) · w), w being q_norm or k_norm `[d]`, rounded as an RMSNorm's
// output is, and is then rotated. CTA (row r, slot) of d/2 threads rounded up to whole warps:
// slot < q_heads is query head slot; the rest key head slot - q_heads, whose value head the
// CTA copies too. Thread j < d/2 holds the pair (j, j + d/2).
template <typename T>
__device__ void rotary_qkv_normed(const T* qkv, const T* q_norm, const T* k_norm, float eps, const T* table, T* out,
                                  T* cache, int q_heads, int kv_heads, int d, const unsigned* position,
                                  int positions, int capacity) {
    chain_release();
    const int half = d / 2, width = (q_heads + 2 * kv_heads) * d, j = threadIdx.x;
    const long offset = *position, r = blockIdx.x / (q_heads + kv_heads);
    const int slot = blockIdx.x % (q_heads + kv_heads);
    const bool query = slot < q_heads, pair = j < half;
    const int h = query ? slot : slot - q_heads;
    // Alike in the whole CTA: its exit skips no barrier.
    if (offset + r >= positions || (!query && offset + r >= capacity)) return;
    // The weights and the rotation are read before the wait (no chain kernel writes them).
    const T* w = query ? q_norm : k_norm;
    const float w1 = pair ? to_f32(w[j]) : 0.f, w2 = pair ? to_f32(w[j + half]) : 0.f;
    const Rotation t = pair ? rotation(table, positions, half, offset + r, j) : Rotation{};
    chain_wait();
    const T* x = qkv + r * width + (query ? h : q_heads + h) * d;
    const float x1 = pair ? to_f32(x[j]) : 0.f, x2 = pair ? to_f32(x[j + half]) : 0.f;
    const float rstd = rsqrtf(cta_sum(x1 * x1 + x2 * x2) / d + eps);
    if (!pair) return;
    const float n1 = to_f32(from_f32<T>(x1 * rstd * w1)), n2 = to_f32(from_f32<T>(x2 * rstd * w2));
    write_rotated(x, n1, n2, t, query, h, j, r, out, cache, q_heads, kv_heads, d, capacity, offset);
}

}  // namespace

#define ROTARY(SUFFIX, T)                                                                                      \
    extern "C" __global__ void rotary_qkv_##SUFFIX(const T* qkv, const T* table, T* out, T* cache, int rows,   \
                                                    int q_heads, int kv_heads, int d, const unsigned* position, \
                                                    int positions, int capacity CHAIN_TRACE_PARAM) {           \
        CHAIN_TRACE_SCOPE                                                                                      \
        rotary_qkv<T>(qkv, table, out, cache, rows, q_heads, kv_heads, d, position, positions, capacity);      \
    }                                                                                                          \
    extern "C" __global__ void rotary_qkv_normed_##SUFFIX(                                                     \
        const T* qkv, const T* q_norm, const T* k_norm, float eps, const T* table, T* out, T* cache, int q_heads, \
        int kv_heads, int d, const unsigned* position, int positions, int capacity CHAIN_TRACE_PARAM) {        \
        CHAIN_TRACE_SCOPE                                                                                      \
        rotary_qkv_normed<T>(qkv, q_norm, k_norm, eps, table, out, cache, q_heads, kv_heads, d, position,       \
                             positions, capacity);                                                             \
    }

ROTARY(f32, float)
ROTARY(bf16, __nv_bfloat16)
ROTARY(f16, __half)
