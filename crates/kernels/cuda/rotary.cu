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
        const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
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
}

}  // namespace

#define ROTARY(SUFFIX, T)                                                                                      \
    extern "C" __global__ void rotary_qkv_##SUFFIX(const T* qkv, const T* table, T* out, T* cache, int rows,   \
                                                    int q_heads, int kv_heads, int d, const unsigned* position, \
                                                    int positions, int capacity CHAIN_TRACE_PARAM) {           \
        CHAIN_TRACE_SCOPE                                                                                      \
        rotary_qkv<T>(qkv, table, out, cache, rows, q_heads, kv_heads, d, position, positions, capacity);      \
    }

ROTARY(f32, float)
ROTARY(bf16, __nv_bfloat16)
ROTARY(f16, __half)
