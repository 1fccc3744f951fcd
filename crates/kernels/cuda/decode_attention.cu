// Attention of one query position (a decode step) over a KV cache, split along the keys: the
// flash kernel gives each query head one CTA that walks every key, 32 CTAs for Llama-3-8B, so
// at long context a decode step waited on a few SMs. Here CTA (split, kv_head) takes a slice
// of the keys for all query heads of its GQA group at once (each K and V row read once), and
// the last CTA of each KV head to finish merges the slices' softmax partials (a counter per
// KV head, which that CTA sets back to zero: no second launch).
//
// The kernel does nothing while at most `min_keys` keys are filled: below that the flash
// kernel, launched beside it, is faster, and a captured graph cannot choose on the host.
//
// q `[heads, D]` contiguous; k, v: element (row, kv_head, d) at ptr[row * row_stride +
// kv_head * head_stride + d]; the filled length is *position + 1, read at run time (a captured
// graph replays at every position). Query head h reads KV head h / group.
#include "convert.cuh"

namespace {

constexpr int TILE = 64;      // keys scored per pass
constexpr int MAX_GROUP = 8;  // query heads per KV head
constexpr int MAX_SPLITS = 128;

template <typename T>
__device__ __forceinline__ void unpack8(uint4 raw, float (&out)[8]) {
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_f32(v[i]);
}

// The sum (or max) of `x` over a CTA of D threads.
template <int D, bool MAX>
__device__ __forceinline__ float block_reduce(float x) {
    __shared__ float warps[D / 32];
#pragma unroll
    for (int w = 16; w > 0; w /= 2) {
        const float y = __shfl_xor_sync(0xffffffff, x, w);
        x = MAX ? fmaxf(x, y) : x + y;
    }
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = x;
    __syncthreads();
    x = warps[0];
#pragma unroll
    for (int w = 1; w < D / 32; ++w) x = MAX ? fmaxf(x, warps[w]) : x + warps[w];
    __syncthreads();  // `warps` is reused by the next call
    return x;
}

// Merges query head h's partials; thread t its column. The slices' weights are found once, in
// parallel, and the column sum issues its loads back to back. The partials were written by
// other CTAs: read through L2 (__ldcg), not a stale L1.
template <typename T, int D>
__device__ void merge(const float* part_o, const float* part_ml, T* __restrict__ out, int h, int splits) {
    __shared__ float weight[MAX_SPLITS];
    const int t = threadIdx.x;
    const float* ml = part_ml + 2L * h * splits;
    float mx = -INFINITY;
    for (int s = t; s < splits; s += D) mx = fmaxf(mx, __ldcg(ml + 2 * s));
    mx = block_reduce<D, true>(mx);
    // An empty slice has m = -inf and l = 0: weight 0.
    float sum = 0.f;
    for (int s = t; s < splits; s += D) {
        weight[s] = exp2f(__ldcg(ml + 2 * s) - mx);
        sum += weight[s] * __ldcg(ml + 2 * s + 1);
    }
    sum = block_reduce<D, false>(sum);  // its barrier also publishes `weight`
    float acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) acc += weight[s] * __ldcg(part_o + ((long)h * splits + s) * D + t);
    out[(long)h * D + t] = from_f32<T>(sum > 0.f ? acc / sum : 0.f);
    __syncthreads();  // `weight` is reused by the next head's merge
}

// blockDim.x == D: thread t owns output column t for every head of the group.
template <typename T, int D>
__device__ void split_pass(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const unsigned* __restrict__ position, float* part_o, float* part_ml,
                           unsigned* __restrict__ counters, T* __restrict__ out, int group, long k_row, long k_head,
                           long v_row, long v_head, float scale_log2, int min_keys) {
    constexpr int LANES_PER_KEY = D / 8;  // 16-byte pieces of a row
    constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
    constexpr int WARPS = D / 32;
    __shared__ float scores[MAX_GROUP][TILE];

    const int splits = gridDim.x, split = blockIdx.x, kv_head = blockIdx.y;
    const int kv_len = (int)*position + 1;
    if (kv_len <= min_keys) return;
    // At least a warp's worth of keys per CTA: for short caches the last CTAs have no keys and
    // leave empty partials (weight 0 in the merge).
    const int chunk = max((kv_len + splits - 1) / splits, 32);
    const int start = split * chunk, end = min(kv_len, start + chunk);
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int piece = lane % LANES_PER_KEY, slot = lane / LANES_PER_KEY;
    const T* kh = k + kv_head * k_head;
    const T* vh = v + kv_head * v_head;

    float qf[MAX_GROUP][8];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g)
        if (g < group) unpack8<T>(*reinterpret_cast<const uint4*>(q + (long)(kv_head * group + g) * D + piece * 8), qf[g]);

    float m[MAX_GROUP], l[MAX_GROUP], o[MAX_GROUP];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) m[g] = -INFINITY, l[g] = 0.f, o[g] = 0.f;

    for (int tile0 = start; tile0 < end; tile0 += TILE) {
        const int n = min(TILE, end - tile0);
        // Scores: LANES_PER_KEY lanes per key, KEYS_PER_WARP keys per warp at a time; all of
        // this thread's K pieces are loaded before any is used, so their latencies overlap.
        constexpr int STEPS = TILE / (WARPS * KEYS_PER_WARP);
        uint4 raw[STEPS];
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int j = (i * WARPS + warp) * KEYS_PER_WARP + slot;
            raw[i] = j < n ? *reinterpret_cast<const uint4*>(kh + (long)(tile0 + j) * k_row + piece * 8)
                           : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int j = (i * WARPS + warp) * KEYS_PER_WARP + slot;
            float kf[8];
            unpack8<T>(raw[i], kf);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g >= group) break;
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) s += qf[g][e] * kf[e];
#pragma unroll
                for (int w = LANES_PER_KEY / 2; w > 0; w /= 2) s += __shfl_xor_sync(0xffffffff, s, w);
                if (piece == 0) scores[g][j] = j < n ? s * scale_log2 : -INFINITY;
            }
        }
        __syncthreads();
        // Online softmax in base 2 over this tile; every thread keeps the (identical) row
        // statistics and its own output column.
        float tile_m[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
            float mx = m[g];
            for (int j = 0; j < n; ++j) mx = fmaxf(mx, scores[g][j]);
            const float alpha = exp2f(m[g] - mx);
            o[g] *= alpha;
            l[g] *= alpha;
            tile_m[g] = m[g] = mx;
        }
#pragma unroll 8
        for (int j = 0; j < n; ++j) {
            const float x = to_f32(vh[(long)(tile0 + j) * v_row + t]);
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g >= group) break;
                const float p = exp2f(scores[g][j] - tile_m[g]);
                l[g] += p;
                o[g] += p * x;
            }
        }
        __syncthreads();  // before the next tile's scores overwrite these
    }
    // Partials of query head h: o at part_o[(h * splits + split) * D], (m, l) at part_ml.
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= group) break;
        const long at = (long)(kv_head * group + g) * splits + split;
        part_o[at * D + t] = o[g];
        if (t == 0) {
            part_ml[2 * at] = m[g];
            part_ml[2 * at + 1] = l[g];
        }
    }
    // The last of the KV head's CTAs merges (each CTA's partials fenced before it counts).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(counters + kv_head, 1) == (unsigned)splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int g = 0; g < group; ++g) merge<T, D>(part_o, part_ml, out, kv_head * group + g, splits);
    if (t == 0) counters[kv_head] = 0;  // ready for the next launch
}

}  // namespace

#define DECODE(SUFFIX, T, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(D) decode_split_##SUFFIX##_d##D(                              \
        const T* q, const T* k, const T* v, const unsigned* position, float* part_o, float* part_ml,           \
        unsigned* counters, T* out, int group, long k_row, long k_head, long v_row, long v_head,               \
        float scale_log2, int min_keys) {                                                                      \
        split_pass<T, D>(q, k, v, position, part_o, part_ml, counters, out, group, k_row, k_head, v_row, v_head, \
                         scale_log2, min_keys);                                                                \
    }

DECODE(bf16, __nv_bfloat16, 64)
DECODE(bf16, __nv_bfloat16, 128)
DECODE(f16, __half, 64)
DECODE(f16, __half, 128)
