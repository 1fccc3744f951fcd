// Attention of one query position (a decode step) over a KV cache, split along the keys. CTA
// (split, kv_head) takes a slice of the keys for all query heads of its GQA group at once, on
// tensor cores: the group's queries are the rows of an mma.sync m16n8k16 A operand (rows past
// the group are zeros), so each K and V row is read once, by cp.async into shared memory. How
// many slices hold keys follows the filled length at run time, so short caches use few CTAs
// and a small merge. The last CTA of each KV head to finish merges the slices' softmax
// partials (a counter per KV head, which that CTA sets back to zero: no second launch).
//
// Each warp of a CTA takes every WARPS-th tile of 16 keys of the slice through a ring of its
// own in dynamic shared memory, `stages` tiles deep (2 or 4: the launcher picks what the
// device's shared memory holds), `stages - 1` tiles' copies in flight while one is used. A
// warp reads only what its own lanes copied, so the ring needs no CTA barrier.
//
// q `[heads, D]` contiguous; k, v: element (row, kv_head, d) at ptr[row * row_stride +
// kv_head * head_stride + d]; the filled length is *position + 1, read at run time (a captured
// graph replays at every position). Query head h reads KV head h / group. Key j is in row j of
// a sequence's own cache; in a paged pool (the PAGED kernels), in row blocks[j >> block_shift]
// << block_shift | j % block_size, the sequence's block table read at run time too.
//
// On Hopper and newer the CTAs run in clusters of CLUSTER slices. Each CTA but the first
// pushes its partial into the first CTA's shared memory (distributed shared memory), arrives
// on its mbarrier and exits; only the first waits, and merges: no round trip through global
// memory, fence or counter. Only when more than one cluster holds keys do the clusters'
// merged partials meet in global memory.
#include "chain.cuh"
#include "decode_tile.cuh"
#include "convert.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DECODE_CLUSTERS 1
#include <cooperative_groups.h>
#endif

namespace {

constexpr int MIN_SLICE = 128;  // the fewest keys a slice takes (on Hopper, past one cluster's share)
constexpr int MAX_GROUP = 8;  // query heads per KV head (the largest G)
constexpr int MAX_SPLITS = 128;
constexpr int MERGE_BATCH = 8;  // slices whose partial outputs are loaded before any is used
#ifdef DECODE_CLUSTERS
constexpr int CLUSTER = 8;  // slices per cluster (the launcher's splits are a multiple)
constexpr int CLUSTER_SLICE = 256;  // the longest slice of a cache that one cluster takes
#endif

#ifdef DECODE_CLUSTERS
// An mbarrier that CTAs of the cluster arrive on; made known to them by the release of the
// cluster barrier that follows.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// Arrives on the mbarrier at `bar` in the shared memory of the cluster's CTA `rank`, releasing
// this thread's earlier stores (into that CTA's shared memory too) at cluster scope.
__device__ __forceinline__ void mbarrier_arrive_remote(uint64_t* bar, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Waits for phase `parity` of this CTA's mbarrier, acquiring what its arrivals released.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait;\n"
        "}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
#endif

// Merges the `active` slices' partials of the group's query heads h0 .. h0 + group - 1; thread
// t writes column t of each. Warp w finds the softmax weights of heads w, w + D/32, ... (lanes
// over slices) into shared memory; then every thread sums its columns, the partial outputs of
// MERGE_BATCH slices of every head loaded before any is used. The partials were written by
// other CTAs: read through L2 (__ldcg), not a stale L1.
template <typename T, int D, int MAX_PARTIALS>
__device__ void merge(const float* part_o, const float* part_ml, T* __restrict__ out, int h0, int group,
                      int splits, int active) {
    __shared__ float weight[MAX_GROUP][MAX_PARTIALS];
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

// blockDim.x == D: D / 32 warps fold the slice's tiles (see fold_slice) and meet once, at the
// end of the slice, where thread t takes output column t. At most G (a power of two ≥ group)
// query heads: the kernel is instantiated per G so that its merge arrays are as small as the
// group.
template <typename T, int D, int G, bool PAGED>
__device__ void split_pass(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const unsigned* __restrict__ position, const unsigned* __restrict__ blocks,
                           int block_shift, float* part_o, float* part_ml, unsigned* __restrict__ counters,
                           T* __restrict__ out, int group, long k_row, long k_head, long v_row, long v_head,
                           float scale_log2, int stages) {
    // Only a copy before the chain writes the position: it may be read before the wait.
    const int kv_len = (int)*position + 1;
    chain_wait();
    const int splits = gridDim.x, split = blockIdx.x, kv_head = blockIdx.y;
    // Only the first `active` CTAs have keys, and only they (with the rest of their cluster)
    // take part in the merge. On Hopper up to CLUSTER · CLUSTER_SLICE keys are spread over one
    // cluster's slices, and so is any length when the launch has one cluster per KV head: the
    // merge then stays in the cluster, where a second cluster's partials would meet in global
    // memory (a fence, a counter and one more merge, about 3 µs on an H100). Longer caches
    // over more clusters take at least MIN_SLICE keys a slice.
#ifdef DECODE_CLUSTERS
    const int chunk = kv_len <= CLUSTER * CLUSTER_SLICE ? max((kv_len + CLUSTER - 1) / CLUSTER, 8)
                                                       : max((kv_len + splits - 1) / splits, MIN_SLICE);
#else
    const int chunk = max((kv_len + splits - 1) / splits, MIN_SLICE);
#endif
    const int active = (kv_len + chunk - 1) / chunk;
#ifdef DECODE_CLUSTERS
    const int clusters = (active + CLUSTER - 1) / CLUSTER;
    if (split / CLUSTER >= clusters) return;  // the whole cluster alike (an exit releases the chain)
    // The first CTA's inbox for the others' partials, and the mbarrier they arrive on (one
    // arrival per thread of the CLUSTER - 1 others). The cluster barrier that makes it known
    // is arrived at here and waited for after the keys: by then every CTA has long arrived.
    __shared__ float inbox_o[CLUSTER - 1][G][D];
    __shared__ float inbox_ml[CLUSTER - 1][G][2];
    __shared__ uint64_t arrivals;
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const bool first = cluster.block_rank() == 0;
    if (first && threadIdx.x == 0) mbarrier_init(&arrivals, (CLUSTER - 1) * D);
    cluster_arrive_relaxed();
#else
    if (split >= active) return;  // an exit releases the chain
#endif
    const int start = split * chunk, end = min(kv_len, start + chunk);
    constexpr int WARPS = D / 32;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int fg = lane / 4, ft = lane % 4;  // mma fragment row (query head) and column pair
    const T* kh = k + kv_head * k_head;
    const T* vh = v + kv_head * v_head;

    uint32_t qf[D / 16][4];
    group_queries<T, D>(qf, q + (long)kv_head * group * D, group, lane);

    float o[D / 8][4] = {};
    OnlineSoftmax softmax;
    const Slice slice{start, end, warp, lane};
    fold_slice_ring<T, D, WARPS, PAGED>(stages, slice, qf, kh, vh, k_row, v_row, blocks, block_shift, scale_log2, o,
                                        softmax);
    trace_mark(0);  // the keys
    // Row fg's sum over the keys of its four lanes.
#pragma unroll
    for (int w = 1; w < 4; w *= 2) softmax.sum_a += __shfl_xor_sync(0xffffffff, softmax.sum_a, w);
    // The warps meet in shared memory; thread t merges column t of every head. A warp without
    // keys ends with m = -inf, l = 0, o = 0.
    __shared__ __align__(16) float warp_o[WARPS][G][D];
    __shared__ float warp_ml[WARPS][G][2];
    if (fg < group) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            *reinterpret_cast<float2*>(&warp_o[warp][fg][i * 8 + 2 * ft]) = make_float2(o[i][0], o[i][1]);
        if (ft == 0) warp_ml[warp][fg][0] = softmax.max_a, warp_ml[warp][fg][1] = softmax.sum_a;
    }
    __syncthreads();
    // Head g's merged state for this CTA: max cm, sum cl (alike in every thread), column t co.
    float cm[G], cl[G], co[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= group) break;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, warp_ml[w][g][0]);
        const float base = mx == -INFINITY ? 0.f : mx;
        float sum = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float weight = exp2f(warp_ml[w][g][0] - base);
            sum += weight * warp_ml[w][g][1];
            acc += weight * warp_o[w][g][t];
        }
        cm[g] = mx, cl[g] = sum, co[g] = acc;
    }
#ifdef DECODE_CLUSTERS
    // The cluster's slices merged by its first CTA: the others push their state into its
    // shared memory, arrive on its mbarrier and exit. A CTA without keys pushes m = -inf,
    // l = 0: weight 0. The first slice always has keys.
    trace_mark(1);  // the warps merged
    cluster_wait();  // the first CTA's mbarrier is initialized
    trace_mark(2);
    if (!first) {
        const int peer = cluster.block_rank() - 1;
        float* to_o = cluster.map_shared_rank(&inbox_o[0][0][0], 0);
        float* to_ml = cluster.map_shared_rank(&inbox_ml[0][0][0], 0);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= group) break;
            to_o[(peer * G + g) * D + t] = co[g];
            if (t == 0) to_ml[(peer * G + g) * 2] = cm[g], to_ml[(peer * G + g) * 2 + 1] = cl[g];
        }
        mbarrier_arrive_remote(&arrivals, 0);
        return;
    }
    mbarrier_wait(&arrivals, 0);
    trace_mark(3);  // the cluster's partials in
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= group) break;
        float mx = cm[g];
#pragma unroll
        for (int c = 0; c < CLUSTER - 1; ++c) mx = fmaxf(mx, inbox_ml[c][g][0]);
        const float own = exp2f(cm[g] - mx);
        float sum = own * cl[g], acc = own * co[g];
#pragma unroll
        for (int c = 0; c < CLUSTER - 1; ++c) {
            const float w = exp2f(inbox_ml[c][g][0] - mx);
            sum += w * inbox_ml[c][g][1];
            acc += w * inbox_o[c][g][t];
        }
        cm[g] = mx, cl[g] = sum, co[g] = acc;
    }
    if (clusters == 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= group) break;
            out[(long)(kv_head * group + g) * D + t] = from_f32<T>(cl[g] > 0.f ? co[g] / cl[g] : 0.f);
        }
        return;
    }
    // Several clusters: theirs meet as the slices' do without clusters, one partial each.
    const int partial = split / CLUSTER, partials = clusters;
    constexpr int MAX_PARTIALS = MAX_SPLITS / CLUSTER;
#else
    const int partial = split, partials = active;
    constexpr int MAX_PARTIALS = MAX_SPLITS;
#endif
    // Partials of query head h: o at part_o[(h * splits + partial) * D], (m, l) at part_ml.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= group) break;
        const long at = (long)(kv_head * group + g) * splits + partial;
        part_o[at * D + t] = co[g];
        if (t == 0) part_ml[2 * at] = cm[g], part_ml[2 * at + 1] = cl[g];
    }
    // The last of the KV head's active CTAs merges (each CTA's partials fenced before it counts).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(counters + kv_head, 1) == (unsigned)partials - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    merge<T, D, MAX_PARTIALS>(part_o, part_ml, out, kv_head * group, group, splits, partials);
    if (t == 0) counters[kv_head] = 0;  // ready for the next launch
}

}  // namespace

#ifdef DECODE_CLUSTERS
#define DECODE_CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
#else
#define DECODE_CLUSTER_DIMS
#endif

// NAME: decode_split, or decode_split_paged over a pool's block table (`blocks`; null and
// unread otherwise). `stages`: 4 or 2, each warp's ring of tiles that the dynamic shared
// memory holds (`D / 32 · stages · 2 · 16 · (D + 8)` elements of T).
#define DECODE(NAME, PAGED, SUFFIX, T, D, G)                                                                   \
    extern "C" __global__ void __launch_bounds__(D) DECODE_CLUSTER_DIMS NAME##_##SUFFIX##_d##D##_g##G(          \
        const T* q, const T* k, const T* v, const unsigned* position, const unsigned* blocks, int block_shift,  \
        float* part_o, float* part_ml, unsigned* counters, T* out, int group, long k_row, long k_head,          \
        long v_row, long v_head, float scale_log2, int stages CHAIN_TRACE_PARAM) {                            \
        CHAIN_TRACE_SCOPE                                                                                      \
        split_pass<T, D, G, PAGED>(q, k, v, position, blocks, block_shift, part_o, part_ml, counters, out,      \
                                   group, k_row, k_head, v_row, v_head, scale_log2, stages);                  \
    }

// One module per G (the build defines DECODE_GROUP): the driver JIT-compiles only the one a
// model uses. The extra step expands DECODE_GROUP before DECODE pastes it into the names.
#ifndef DECODE_GROUP
#error "compile with -DDECODE_GROUP=1, 2, 4 or 8"
#endif
#define DECODE_EXPANDED(SUFFIX, T, D, G)            \
    DECODE(decode_split, false, SUFFIX, T, D, G)    \
    DECODE(decode_split_paged, true, SUFFIX, T, D, G)
DECODE_EXPANDED(bf16, __nv_bfloat16, 64, DECODE_GROUP)
DECODE_EXPANDED(bf16, __nv_bfloat16, 128, DECODE_GROUP)
DECODE_EXPANDED(f16, __half, 64, DECODE_GROUP)
DECODE_EXPANDED(f16, __half, 128, DECODE_GROUP)
