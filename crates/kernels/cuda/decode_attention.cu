// Attention of one query position (a decode step) over a KV cache, split along the keys. CTA
// (split, kv_head) takes a slice of at least TILE keys for all query heads of its GQA group at
// once (each K and V row read once); how many slices hold keys follows the filled length at
// run time, so short caches use few CTAs and a small merge. The last CTA of each KV head to
// finish merges the slices' softmax partials (a counter per KV head, which that CTA sets back
// to zero: no second launch). Per tile of keys, each head's softmax runs in one warp and
// every thread then sums its output column: the statistics are not recomputed by every thread.
//
// q `[heads, D]` contiguous; k, v: element (row, kv_head, d) at ptr[row * row_stride +
// kv_head * head_stride + d]; the filled length is *position + 1, read at run time (a captured
// graph replays at every position). Query head h reads KV head h / group.
//
// On Hopper and newer the CTAs run in clusters of CLUSTER slices, which merge their partials
// through distributed shared memory: a cluster barrier instead of the partials' round trips
// through global memory, a fence and a counter. Only when more than one cluster holds keys
// (more than CLUSTER slices' worth) do the clusters' merged partials meet in global memory.
#include "chain.cuh"
#include "convert.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DECODE_CLUSTERS 1
#include <cooperative_groups.h>
#endif

namespace {

constexpr int TILE = 64;      // keys scored per pass, and the fewest a slice takes
constexpr int MAX_GROUP = 8;  // query heads per KV head
constexpr int MAX_SPLITS = 128;
constexpr int MERGE_BATCH = 8;  // slices whose partial outputs are loaded before any is used
#ifdef DECODE_CLUSTERS
constexpr int CLUSTER = 8;  // slices per cluster (the launcher's splits are a multiple)
#endif

template <typename T>
__device__ __forceinline__ void unpack8(uint4 raw, float (&out)[8]) {
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_f32(v[i]);
}

// Merges the `active` slices' partials of the group's query heads h0 .. h0 + group - 1; thread
// t writes column t of each. Warp w finds the softmax weights of heads w, w + D/32, ... (lanes
// over slices) into shared memory; then every thread sums its columns, the partial outputs of
// MERGE_BATCH slices of every head loaded before any is used. The partials were written by
// other CTAs: read through L2 (__ldcg), not a stale L1.
template <typename T, int D>
__device__ void merge(const float* part_o, const float* part_ml, T* __restrict__ out, int h0, int group,
                      int splits, int active) {
    __shared__ float weight[MAX_GROUP][MAX_SPLITS];
    __shared__ float total[MAX_GROUP];
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    for (int g = warp; g < group; g += D / 32) {
        const float* ml = part_ml + 2L * (h0 + g) * splits;
        float mx = -INFINITY;
        for (int s = lane; s < active; s += 32) mx = fmaxf(mx, __ldcg(ml + 2 * s));
#pragma unroll
        for (int w = 16; w > 0; w /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
        float sum = 0.f;
        for (int s = lane; s < active; s += 32) {
            const float wgt = exp2f(__ldcg(ml + 2 * s) - mx);
            weight[g][s] = wgt;
            sum += wgt * __ldcg(ml + 2 * s + 1);
        }
#pragma unroll
        for (int w = 16; w > 0; w /= 2) sum += __shfl_xor_sync(0xffffffff, sum, w);
        if (lane == 0) total[g] = sum;
    }
    __syncthreads();
    float acc[MAX_GROUP] = {};
    for (int s0 = 0; s0 < active; s0 += MERGE_BATCH) {
        float o[MAX_GROUP][MERGE_BATCH];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
#pragma unroll
            for (int i = 0; i < MERGE_BATCH; ++i)
                o[g][i] = s0 + i < active ? __ldcg(part_o + ((long)(h0 + g) * splits + s0 + i) * D + t) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
#pragma unroll
            for (int i = 0; i < MERGE_BATCH; ++i)
                if (s0 + i < active) acc[g] += weight[g][s0 + i] * o[g][i];
        }
    }
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= group) break;
        out[(long)(h0 + g) * D + t] = from_f32<T>(total[g] > 0.f ? acc[g] / total[g] : 0.f);
    }
}

// blockDim.x == D: thread t owns output column t for every head of the group.
template <typename T, int D>
__device__ void split_pass(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const unsigned* __restrict__ position, float* part_o, float* part_ml,
                           unsigned* __restrict__ counters, T* __restrict__ out, int group, long k_row, long k_head,
                           long v_row, long v_head, float scale_log2) {
    constexpr int LANES_PER_KEY = D / 8;  // 16-byte pieces of a row
    constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
    constexpr int WARPS = D / 32;
    // Aligned for the probabilities' float4 reads.
    __shared__ __align__(16) float scores[MAX_GROUP][TILE];

    chain_release();
    // Only a copy before the chain writes the position: it may be read before the wait.
    const int kv_len = (int)*position + 1;
    chain_wait();
    const int splits = gridDim.x, split = blockIdx.x, kv_head = blockIdx.y;
    // Slices of at least TILE keys: only the first `active` CTAs have any, and only they (with
    // the rest of their cluster) take part in the merge.
    const int chunk = max((kv_len + splits - 1) / splits, TILE);
    const int active = (kv_len + chunk - 1) / chunk;
#ifdef DECODE_CLUSTERS
    const int clusters = (active + CLUSTER - 1) / CLUSTER;
    if (split / CLUSTER >= clusters) return;  // the whole cluster alike
#else
    if (split >= active) return;
#endif
    const int start = split * chunk, end = min(kv_len, start + chunk);
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int piece = lane % LANES_PER_KEY, slot = lane / LANES_PER_KEY;
    const T* kh = k + kv_head * k_head;
    const T* vh = v + kv_head * v_head;

    float qf[MAX_GROUP][8];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g)
        if (g < group) unpack8<T>(*reinterpret_cast<const uint4*>(q + (long)(kv_head * group + g) * D + piece * 8), qf[g]);

    // Head g's running max and sum live in the lanes of warp g % WARPS (every lane the same
    // value); its output column t in thread t.
    float m[MAX_GROUP], l[MAX_GROUP], o[MAX_GROUP];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) m[g] = -INFINITY, l[g] = 0.f, o[g] = 0.f;
    __shared__ float alpha[MAX_GROUP];

    for (int tile0 = start; tile0 < end; tile0 += TILE) {
        const int n = min(TILE, end - tile0);
        // This thread's V column over the tile, and its K pieces, all loaded before any is
        // used: the tile costs one memory latency, not one per key.
        T vt[TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) vt[j] = j < n ? vh[(long)(tile0 + j) * v_row + t] : from_f32<T>(0.f);
        // Scores: LANES_PER_KEY lanes per key, KEYS_PER_WARP keys per warp at a time.
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
        // Online softmax in base 2, each head's by one warp (lanes over keys): the scores become
        // probabilities in place, and alpha rescales what the tiles before summed.
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
            if (g % WARPS != warp) continue;
            float mx = m[g];
#pragma unroll
            for (int j = lane; j < TILE; j += 32) mx = fmaxf(mx, scores[g][j]);
#pragma unroll
            for (int w = 16; w > 0; w /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
            float sum = 0.f;
#pragma unroll
            for (int j = lane; j < TILE; j += 32) {
                const float p = exp2f(scores[g][j] - mx);  // 0 for the masked tail
                scores[g][j] = p;
                sum += p;
            }
#pragma unroll
            for (int w = 16; w > 0; w /= 2) sum += __shfl_xor_sync(0xffffffff, sum, w);
            const float a = exp2f(m[g] - mx);
            l[g] = l[g] * a + sum;
            m[g] = mx;
            if (lane == 0) alpha[g] = a;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
            float acc = o[g] * alpha[g];
#pragma unroll
            for (int j = 0; j < TILE; j += 4) {
                const float4 p = *reinterpret_cast<const float4*>(&scores[g][j]);
                acc += p.x * to_f32(vt[j]) + p.y * to_f32(vt[j + 1]) + p.z * to_f32(vt[j + 2]) +
                       p.w * to_f32(vt[j + 3]);
            }
            o[g] = acc;
        }
        __syncthreads();  // before the next tile's scores overwrite these
    }
#ifdef DECODE_CLUSTERS
    // The cluster's slices merged by its first CTA, from the others' shared memory. A CTA
    // without keys shares m = -inf, l = 0: weight 0. The first slice always has keys.
    __shared__ float shared_o[MAX_GROUP][D];
    __shared__ float shared_ml[MAX_GROUP][2];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= group) break;
        shared_o[g][t] = o[g];
        if (g % WARPS == warp && lane == 0) shared_ml[g][0] = m[g], shared_ml[g][1] = l[g];
    }
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const bool first = cluster.block_rank() == 0;
    if (first) {
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
            float mc[CLUSTER], lc[CLUSTER], oc[CLUSTER];
#pragma unroll
            for (int c = 0; c < CLUSTER; ++c) {
                const float* ml = cluster.map_shared_rank(&shared_ml[g][0], c);
                mc[c] = ml[0], lc[c] = ml[1];
                oc[c] = cluster.map_shared_rank(&shared_o[g][0], c)[t];
            }
            float mx = mc[0];
#pragma unroll
            for (int c = 1; c < CLUSTER; ++c) mx = fmaxf(mx, mc[c]);
            float sum = 0.f, acc = 0.f;
#pragma unroll
            for (int c = 0; c < CLUSTER; ++c) {
                const float w = exp2f(mc[c] - mx);
                sum += w * lc[c];
                acc += w * oc[c];
            }
            m[g] = mx, l[g] = sum, o[g] = acc;
        }
    }
    cluster.sync();  // the others' shared memory outlives the first CTA's reads
    if (!first) return;
    if (clusters == 1) {
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
            out[(long)(kv_head * group + g) * D + t] = from_f32<T>(l[g] > 0.f ? o[g] / l[g] : 0.f);
        }
        return;
    }
    // Several clusters: theirs meet as the slices' do without clusters, one partial each.
    const int partial = split / CLUSTER, partials = clusters;
#else
    const int partial = split, partials = active;
#endif
    // Partials of query head h: o at part_o[(h * splits + partial) * D], (m, l) at part_ml (from
    // lane 0 of the warp that kept them, or, after a cluster's merge, every thread's alike).
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= group) break;
        const long at = (long)(kv_head * group + g) * splits + partial;
        part_o[at * D + t] = o[g];
        if (g % WARPS == warp && lane == 0) {
            part_ml[2 * at] = m[g];
            part_ml[2 * at + 1] = l[g];
        }
    }
    // The last of the KV head's active CTAs merges (each CTA's partials fenced before it counts).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(counters + kv_head, 1) == (unsigned)partials - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    merge<T, D>(part_o, part_ml, out, kv_head * group, group, splits, partials);
    if (t == 0) counters[kv_head] = 0;  // ready for the next launch
}

}  // namespace

#ifdef DECODE_CLUSTERS
#define DECODE_CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
#else
#define DECODE_CLUSTER_DIMS
#endif

#define DECODE(SUFFIX, T, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(D) DECODE_CLUSTER_DIMS decode_split_##SUFFIX##_d##D(                              \
        const T* q, const T* k, const T* v, const unsigned* position, float* part_o, float* part_ml,           \
        unsigned* counters, T* out, int group, long k_row, long k_head, long v_row, long v_head,               \
        float scale_log2) {                                                                                    \
        split_pass<T, D>(q, k, v, position, part_o, part_ml, counters, out, group, k_row, k_head, v_row, v_head, \
                         scale_log2);                                                                          \
    }

DECODE(bf16, __nv_bfloat16, 64)
DECODE(bf16, __nv_bfloat16, 128)
DECODE(f16, __half, 64)
DECODE(f16, __half, 128)
