// The continuous-batching step's kernels over a paged KV cache, `pool` `[2, slots, kv_heads, d]`
// (keys, then values; one token-major row per slot). Each row of the batch carries its own
// position and slot (read from device memory), so that many sequences at different lengths
// run in one launch, whatever blocks their tables hold.
#include "convert.cuh"
#include "rotate.cuh"

namespace {

// Rotary embedding on a fused QKV projection `[rows, (q_heads + 2 · kv_heads) · d]`, row r at
// position positions[r]: thread i < rows · q_heads · d/2 writes the rotated query pair (r, h,
// j) into `out` `[rows, q_heads, d]`; the threads after it write the rotated key head h and
// the value head h of row r into the pool at slot slots[r]. `table` `[2, table_positions,
// d / 2]`: cos, then sin. Rows past the table or the pool are skipped (the host checks them).
template <typename T>
__device__ void rotary_qkv_paged(const T* qkv, const T* table, T* out, T* pool, const unsigned* positions,
                                 const unsigned* slots, int rows, int q_heads, int kv_heads, int d,
                                 int table_positions, long pool_slots) {
    const int half = d / 2, width = (q_heads + 2 * kv_heads) * d;
    const long queries = (long)rows * q_heads * half;
    const long n = queries + (long)rows * kv_heads * half;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const bool query = i < queries;
        const long at = query ? i : i - queries;
        const int heads = query ? q_heads : kv_heads;
        const int j = at % half, h = (at / half) % heads;
        const long r = at / half / heads;
        const long position = positions[r], slot = slots[r];
        if (position >= table_positions || (!query && slot >= pool_slots)) continue;
        const float c = to_f32(table[position * half + j]);
        const float s = to_f32(table[((long)table_positions + position) * half + j]);
        const T* x = qkv + r * width + (query ? h : q_heads + h) * d;
        const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
        T* o = query ? out + (r * q_heads + h) * d : pool + (slot * kv_heads + h) * d;
        o[j] = from_f32<T>(rotate(x1, x2, c, s, false));
        o[j + half] = from_f32<T>(rotate(x1, x2, c, s, true));
        if (!query) {
            const T* v = x + kv_heads * d;
            T* vo = pool + ((pool_slots + slot) * kv_heads + h) * d;
            vo[j] = v[j];
            vo[j + half] = v[j + half];
        }
    }
}

constexpr int WARPS = 8;  // warps per CTA, each over its own share of the sequence's keys
constexpr int KEYS = 8;   // keys a warp loads before it uses any: one memory latency per 8 keys

// E consecutive elements, loaded in one (or two) vector loads.
template <typename T, int E>
struct alignas(sizeof(T) * E) Pack {
    T v[E];
};

// One query row per sequence over that sequence's cached keys. CTA (h, s) computes query head
// h of sequence s, whose query is row q_rows[s] of `q` `[rows, q_heads, D]` and whose keys are
// positions 0 .. lens[s] - 1, position p in slot tables[s][p / block_size] · block_size +
// p % block_size, KV head kv_of_q[h]. Warp w takes keys w·KEYS .. w·KEYS + KEYS - 1, then
// WARPS·KEYS further on, and so on, each lane D/32 columns of every key, with an online
// softmax in base 2; the warps' partials meet in shared memory. Slots past a sequence's
// length are never read (they may hold anything, NaN included). Writes `out` `[n, q_heads, D]`.
template <typename T, int D>
__device__ void paged_decode_attention(const T* q, const unsigned* q_rows, const T* pool, const unsigned* tables,
                                       const unsigned* lens, const unsigned* kv_of_q, T* out, int q_heads,
                                       int kv_heads, int max_blocks, int block_size, long pool_slots,
                                       float scale_log2) {
    constexpr int E = D / 32;
    using P = Pack<T, E>;
    const int h = blockIdx.x, s = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int len = lens[s];
    const unsigned* table = tables + (long)s * max_blocks;
    const long row = (long)kv_heads * D;
    const T* keys = pool + (long)kv_of_q[h] * D + lane * E;
    const T* values = keys + pool_slots * row;
    float qf[E];
    {
        const P p = *reinterpret_cast<const P*>(q + ((long)q_rows[s] * q_heads + h) * D + lane * E);
#pragma unroll
        for (int e = 0; e < E; ++e) qf[e] = to_f32(p.v[e]) * scale_log2;
    }
    float m = -INFINITY, l = 0.f, o[E] = {};
    for (int k0 = warp * KEYS; k0 < len; k0 += WARPS * KEYS) {
        P kr[KEYS], vr[KEYS];
#pragma unroll
        for (int i = 0; i < KEYS; ++i) {
            const int j = k0 + i;
            if (j < len) {
                const long at = ((long)table[j / block_size] * block_size + j % block_size) * row;
                kr[i] = *reinterpret_cast<const P*>(keys + at);
                vr[i] = *reinterpret_cast<const P*>(values + at);
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) kr[i].v[e] = vr[i].v[e] = from_f32<T>(0.f);
            }
        }
        float score[KEYS];
#pragma unroll
        for (int i = 0; i < KEYS; ++i) {
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) dot = fmaf(qf[e], to_f32(kr[i].v[e]), dot);
            score[i] = dot;
        }
#pragma unroll
        for (int w = 16; w > 0; w /= 2) {
#pragma unroll
            for (int i = 0; i < KEYS; ++i) score[i] += __shfl_xor_sync(0xffffffff, score[i], w);
        }
        // Key k0 is filled, so the new maximum is finite; exp2(−∞) = 0 drops the first pass's
        // (empty) earlier state.
        float top = m;
#pragma unroll
        for (int i = 0; i < KEYS; ++i) {
            if (k0 + i >= len) score[i] = -INFINITY;
            top = fmaxf(top, score[i]);
        }
        const float alpha = exp2f(m - top);
        l *= alpha;
#pragma unroll
        for (int e = 0; e < E; ++e) o[e] *= alpha;
#pragma unroll
        for (int i = 0; i < KEYS; ++i) {
            const float p = exp2f(score[i] - top);
            l += p;
#pragma unroll
            for (int e = 0; e < E; ++e) o[e] = fmaf(p, to_f32(vr[i].v[e]), o[e]);
        }
        m = top;
    }
    __shared__ float part_o[WARPS][D];
    __shared__ float part_m[WARPS], part_l[WARPS];
#pragma unroll
    for (int e = 0; e < E; ++e) part_o[warp][lane * E + e] = o[e];
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < D; t += blockDim.x) {
        float top = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, part_m[w]);
        float sum = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            // A warp with no keys (a sequence shorter than its first share) has m = −∞.
            if (part_m[w] == -INFINITY) continue;
            const float weight = exp2f(part_m[w] - top);
            sum += weight * part_l[w];
            acc += weight * part_o[w][t];
        }
        out[((long)s * q_heads + h) * D + t] = from_f32<T>(sum > 0.f ? acc / sum : 0.f);
    }
}

}  // namespace

#define ROTARY_PAGED(SUFFIX, T)                                                                                 \
    extern "C" __global__ void rotary_qkv_paged_##SUFFIX(                                                        \
        const T* qkv, const T* table, T* out, T* pool, const unsigned* positions, const unsigned* slots,        \
        int rows, int q_heads, int kv_heads, int d, int table_positions, long pool_slots) {                      \
        rotary_qkv_paged<T>(qkv, table, out, pool, positions, slots, rows, q_heads, kv_heads, d, table_positions, \
                            pool_slots);                                                                         \
    }

#define PAGED_ATTENTION(SUFFIX, T, D)                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) paged_decode_attention_##SUFFIX##_d##D(            \
        const T* q, const unsigned* q_rows, const T* pool, const unsigned* tables, const unsigned* lens,        \
        const unsigned* kv_of_q, T* out, int q_heads, int kv_heads, int max_blocks, int block_size,             \
        long pool_slots, float scale_log2) {                                                                    \
        paged_decode_attention<T, D>(q, q_rows, pool, tables, lens, kv_of_q, out, q_heads, kv_heads, max_blocks, \
                                     block_size, pool_slots, scale_log2);                                       \
    }

#define PAGED(SUFFIX, T)           \
    ROTARY_PAGED(SUFFIX, T)        \
    PAGED_ATTENTION(SUFFIX, T, 64) \
    PAGED_ATTENTION(SUFFIX, T, 128) \
    PAGED_ATTENTION(SUFFIX, T, 256)

PAGED(f32, float)
PAGED(bf16, __nv_bfloat16)
PAGED(f16, __half)
