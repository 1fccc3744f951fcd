// Rotary position embedding (the Hugging Face layout: each head's halves rotate together) on
// the output of a fused QKV projection, `[rows, (q_heads + 2 · kv_heads) · d]`, where row `r`
// is position `*position + r`: read from device memory, so that a captured CUDA graph replays
// at every decode position. Two kernels replace candle's seven launches per layer (copies of
// each head slice, two rotations, two cache writes): the queries come out rotated and
// contiguous, and the keys (rotated) and values go straight into the KV cache.
// `table` is `[2, positions, d / 2]`: cos, then sin. f32 arithmetic, one rounding. Rows past
// the table or the cache are skipped (the host checks the position before it launches).
#include "convert.cuh"

namespace {

struct Rotation {
    float c, s;
};

template <typename T>
__device__ __forceinline__ Rotation rotation(const T* table, int positions, int half, int position, int j) {
    const long at = (long)position * half + j;
    return {to_f32(table[at]), to_f32(table[(long)positions * half + at])};
}

// `out[r, h, :]` = the rotated query head `h` of row `r`; one thread per (row, head, j < d/2).
template <typename T>
__device__ void rotary_queries(const T* qkv, const T* table, T* out, int rows, int q_heads, int kv_heads, int d,
                               const unsigned* position, int positions) {
    const int half = d / 2, width = (q_heads + 2 * kv_heads) * d;
    const long offset = *position;
    const long n = (long)rows * q_heads * half;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const int j = i % half, h = (i / half) % q_heads;
        const long r = i / half / q_heads;
        if (offset + r >= positions) continue;
        const T* x = qkv + r * width + h * d;
        const Rotation t = rotation(table, positions, half, offset + r, j);
        const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
        T* o = out + (r * q_heads + h) * d;
        o[j] = from_f32<T>(x1 * t.c - x2 * t.s);
        o[j + half] = from_f32<T>(x2 * t.c + x1 * t.s);
    }
}

// Rotated keys and the values of each row into `cache` `[2, kv_heads, capacity, d]` at slot
// `*position + r`; one thread per (row, KV head, j < d/2).
template <typename T>
__device__ void append_rotated_kv(const T* qkv, const T* table, T* cache, int rows, int q_heads, int kv_heads, int d,
                                  const unsigned* position, int positions, int capacity) {
    const int half = d / 2, width = (q_heads + 2 * kv_heads) * d;
    const long offset = *position;
    const long n = (long)rows * kv_heads * half;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const int j = i % half, h = (i / half) % kv_heads;
        const long r = i / half / kv_heads;
        if (offset + r >= positions || offset + r >= capacity) continue;
        const T* k = qkv + r * width + (q_heads + h) * d;
        const T* v = k + kv_heads * d;
        const Rotation t = rotation(table, positions, half, offset + r, j);
        const float k1 = to_f32(k[j]), k2 = to_f32(k[j + half]);
        T* kc = cache + ((long)h * capacity + offset + r) * d;
        T* vc = cache + ((long)(kv_heads + h) * capacity + offset + r) * d;
        kc[j] = from_f32<T>(k1 * t.c - k2 * t.s);
        kc[j + half] = from_f32<T>(k2 * t.c + k1 * t.s);
        vc[j] = v[j];
        vc[j + half] = v[j + half];
    }
}

}  // namespace

#define ROTARY(SUFFIX, T)                                                                                      \
    extern "C" __global__ void rotary_queries_##SUFFIX(const T* qkv, const T* table, T* out, int rows,         \
                                                        int q_heads, int kv_heads, int d,                      \
                                                        const unsigned* position, int positions) {             \
        rotary_queries<T>(qkv, table, out, rows, q_heads, kv_heads, d, position, positions);                   \
    }                                                                                                          \
    extern "C" __global__ void append_rotated_kv_##SUFFIX(const T* qkv, const T* table, T* cache, int rows,    \
                                                           int q_heads, int kv_heads, int d,                   \
                                                           const unsigned* position, int positions,            \
                                                           int capacity) {                                     \
        append_rotated_kv<T>(qkv, table, cache, rows, q_heads, kv_heads, d, position, positions, capacity);    \
    }

ROTARY(f32, float)
ROTARY(bf16, __nv_bfloat16)
ROTARY(f16, __half)
