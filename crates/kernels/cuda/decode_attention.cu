// Attention of one query position (a decode step) over a KV cache, split along the keys. CTA
// (split, kv_head) takes a slice of at least MIN_SLICE keys (on Hopper, up to CLUSTER ·
// CLUSTER_SLICE keys, one cluster's share) for all query heads of its GQA group at once (each K
// and V row read once, in 16-byte pieces); how many slices hold keys follows the filled
// length at run time, so short caches use few CTAs and a small merge. The last CTA of each
// KV head to finish merges the slices' softmax partials (a counter per KV head, which that CTA
// sets back to zero: no second launch).
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
// memory, fence or counter. Only when more than one cluster holds keys (more than CLUSTER
// slices' worth) do the clusters' merged partials meet in global memory.
#include "chain.cuh"
#include "convert.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DECODE_CLUSTERS 1
#include <cooperative_groups.h>
#endif

namespace {

constexpr int MIN_SLICE = 64;  // the fewest keys a slice takes (the launcher's splits assume it)
constexpr int MAX_GROUP = 8;  // query heads per KV head (the largest G)
constexpr int MAX_SPLITS = 128;
constexpr int MERGE_BATCH = 8;  // slices whose partial outputs are loaded before any is used
#ifdef DECODE_CLUSTERS
constexpr int CLUSTER = 8;  // slices per cluster (the launcher's splits are a multiple)
constexpr int CLUSTER_SLICE = 128;  // the longest slice of a cache that one cluster takes
#endif

#ifdef DECODE_CLUSTERS
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// An mbarrier that CTAs of the cluster arrive on; made known to them by the release of the
// cluster barrier that follows.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
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
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(bar)), "r"(rank));
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
        "}" ::"r"(shared_address(bar)),
        "r"(parity)
        : "memory");
}
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

// How a CTA of D threads covers keys of D columns (see split_pass).
template <int D, int G>
struct KeyLayout {
    static constexpr int LANES_PER_KEY = D / 8;  // 16-byte pieces of a row
    static constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
    static constexpr int WARPS = D / 32;
    // Keys a lane loads before it uses any: one memory latency per pass. Fewer for groups of 8,
    // whose queries and outputs take twice the registers.
    static constexpr int STEPS = G >= 8 ? 4 : 8;
    static constexpr int PASS = STEPS * WARPS * KEYS_PER_WARP;  // keys per pass of the CTA
};

// One pass of a CTA's warps over PASS keys from pass0 (see split_pass), folded into the lane's
// softmax state m, l, o. TAIL: the pass may reach past the slice's end; its steps wholly past
// it are skipped (alike in the whole warp), not computed and masked, so a slice shorter than a
// pass costs its keys, not a pass. Full passes carry no such checks: branches between the
// steps would cut the interleaving of their independent shuffle and FMA chains.
template <typename T, int D, int G, bool TAIL, bool PAGED>
__device__ __forceinline__ void key_pass(int pass0, int end, bool first_pass, const T* kp, const T* vp, long k_row,
                                         long v_row, const unsigned* __restrict__ blocks, int block_shift, int warp,
                                         int slot, int group, float scale_log2, const float (&qf)[G][8],
                                         float (&m)[G], float (&l)[G], float (&o)[G][8]) {
    using L = KeyLayout<D, G>;
    constexpr int LANES_PER_KEY = L::LANES_PER_KEY, KEYS_PER_WARP = L::KEYS_PER_WARP;
    constexpr int WARPS = L::WARPS, STEPS = L::STEPS;
    // Each step's row first (a paged pool's table reads in flight together), then its K and V.
    long row[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const int j = pass0 + (i * WARPS + warp) * KEYS_PER_WARP + slot;
        const int mask = (1 << block_shift) - 1;
        row[i] = !PAGED ? j : (!TAIL || j < end) ? (long)blocks[j >> block_shift] << block_shift | (j & mask) : 0;
    }
    uint4 kr[STEPS], vr[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const int j = pass0 + (i * WARPS + warp) * KEYS_PER_WARP + slot;
        const bool filled = !TAIL || j < end;
        kr[i] = filled ? *reinterpret_cast<const uint4*>(kp + row[i] * k_row) : make_uint4(0, 0, 0, 0);
        vr[i] = filled ? *reinterpret_cast<const uint4*>(vp + row[i] * v_row) : make_uint4(0, 0, 0, 0);
    }
    if (first_pass) chain_release();
    bool live[STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) live[i] = !TAIL || pass0 + (i * WARPS + warp) * KEYS_PER_WARP < end;
    // Scores in base 2; the pieces' partial dot products summed across the key's lanes.
    float s[G][STEPS];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const bool filled = !TAIL || pass0 + (i * WARPS + warp) * KEYS_PER_WARP + slot < end;
        if (!live[i]) {
#pragma unroll
            for (int g = 0; g < G; ++g) s[g][i] = -INFINITY;
            continue;
        }
        float kf[8];
        unpack8<T>(kr[i], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= group) break;
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) dot = fmaf(qf[g][e], kf[e], dot);
#pragma unroll
            for (int w = LANES_PER_KEY / 2; w > 0; w /= 2) dot += __shfl_xor_sync(0xffffffff, dot, w);
            s[g][i] = filled ? dot * scale_log2 : -INFINITY;
        }
    }
    float vf[STEPS][8];
#pragma unroll
    for (int i = 0; i < STEPS; ++i) unpack8<T>(vr[i], vf[i]);
    // Online softmax per warp: the max over the warp's keys of this pass (its slots meet by
    // shuffle), the earlier sums rescaled by alpha. A warp with no filled key yet keeps
    // m = -inf, and its exponentials are taken from 0 (all 0) instead of -inf - -inf.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= group) break;
        float mx = m[g];
#pragma unroll
        for (int i = 0; i < STEPS; ++i) mx = fmaxf(mx, s[g][i]);
#pragma unroll
        for (int w = LANES_PER_KEY; w < 32; w *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
        const float base = mx == -INFINITY ? 0.f : mx;
        const float alpha = exp2f(m[g] - base);
        float sum = 0.f, acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = o[g][e] * alpha;
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            if (!live[i]) continue;  // p = 0
            const float p = exp2f(s[g][i] - base);  // 0 past the end
            sum += p;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, vf[i][e], acc[e]);
        }
        m[g] = mx;
        l[g] = l[g] * alpha + sum;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[g][e] = acc[e];
    }
}

// blockDim.x == D. A key's row is read by LANES_PER_KEY lanes, 8 elements (16 bytes) each, of
// K and of V alike: lane (slot, piece) of a warp scores its key against every query head of the
// group (the pieces' dot products summed across the lanes) and adds the key's weighted V piece
// into its own 8 output columns. Each warp keeps its own softmax state, so a pass over the keys
// needs no CTA barrier; the warps meet once, at the end of the slice, where thread t takes
// output column t. At most G (a power of two ≥ group) query heads: the kernel is instantiated
// per G so that its arrays are as small as the group.
template <typename T, int D, int G, bool PAGED>
__device__ void split_pass(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const unsigned* __restrict__ position, const unsigned* __restrict__ blocks,
                           int block_shift, float* part_o, float* part_ml, unsigned* __restrict__ counters,
                           T* __restrict__ out, int group, long k_row, long k_head, long v_row, long v_head,
                           float scale_log2) {
    using L = KeyLayout<D, G>;
    constexpr int LANES_PER_KEY = L::LANES_PER_KEY, WARPS = L::WARPS, PASS = L::PASS;

    // The chain is released only once this CTA's first keys are requested (below): a GEMV
    // after it, launched early, fills the memory system with its weight loads, and the keys'
    // loads queued behind them (measured: the o_proj GEMV's early CTAs made this kernel's
    // first pass ≈ 1 µs longer).
    // Only a copy before the chain writes the position: it may be read before the wait.
    const int kv_len = (int)*position + 1;
    chain_wait();
    const int splits = gridDim.x, split = blockIdx.x, kv_head = blockIdx.y;
    // Slices of at least MIN_SLICE keys: only the first `active` CTAs have any, and only they
    // (with the rest of their cluster) take part in the merge. On Hopper up to CLUSTER ·
    // CLUSTER_SLICE keys are spread over one cluster's slices (at least 8 keys each, at most
    // CLUSTER_SLICE): a short cache's pass then has fewer live steps per warp, and the merge
    // stays in the cluster, where a second cluster's partials would meet in global memory (a
    // fence, a counter and one more merge: 8.1 µs at 512 keys, 11.3 at 513, Llama-3-8B's
    // shape on an H200). Longer caches take MIN_SLICE keys a slice over as many clusters.
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
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int piece = lane % LANES_PER_KEY, slot = lane / LANES_PER_KEY;
    const T* kp = k + kv_head * k_head + piece * 8;
    const T* vp = v + kv_head * v_head + piece * 8;

    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
        if (g < group) unpack8<T>(*reinterpret_cast<const uint4*>(q + (long)(kv_head * group + g) * D + piece * 8), qf[g]);

    // Head g's softmax state in this lane: the warp's running max m (every lane alike), and the
    // sum l and output columns o (piece's 8) over the keys of this lane's slot alone.
    float m[G], l[G], o[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[g][e] = 0.f;
    }

    // Full passes have every step's keys inside the slice; only the last may be partial.
    int pass0 = start;
    for (; pass0 + PASS <= end; pass0 += PASS)
        key_pass<T, D, G, false, PAGED>(pass0, end, pass0 == start, kp, vp, k_row, v_row, blocks, block_shift, warp,
                                        slot, group, scale_log2, qf, m, l, o);
    if (pass0 < end)
        key_pass<T, D, G, true, PAGED>(pass0, end, pass0 == start, kp, vp, k_row, v_row, blocks, block_shift, warp,
                                       slot, group, scale_log2, qf, m, l, o);
    if (end <= start) chain_release();  // a CTA without keys
    trace_mark(0);  // the keys
    // The slots of a warp share its max: their sums add, and slot 0's lanes hold the warp's.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= group) break;
#pragma unroll
        for (int w = LANES_PER_KEY; w < 32; w *= 2) {
            l[g] += __shfl_xor_sync(0xffffffff, l[g], w);
#pragma unroll
            for (int e = 0; e < 8; ++e) o[g][e] += __shfl_xor_sync(0xffffffff, o[g][e], w);
        }
    }
    // The warps meet in shared memory; thread t merges column t of every head. A CTA without
    // keys ends with m = -inf, l = 0, o = 0.
    __shared__ __align__(16) float warp_o[WARPS][G][D];
    __shared__ float warp_ml[WARPS][G][2];
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= group) break;
            float4* to = reinterpret_cast<float4*>(&warp_o[warp][g][piece * 8]);
            to[0] = make_float4(o[g][0], o[g][1], o[g][2], o[g][3]);
            to[1] = make_float4(o[g][4], o[g][5], o[g][6], o[g][7]);
            if (piece == 0) warp_ml[warp][g][0] = m[g], warp_ml[warp][g][1] = l[g];
        }
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
// unread otherwise).
#define DECODE(NAME, PAGED, SUFFIX, T, D, G)                                                                   \
    extern "C" __global__ void __launch_bounds__(D) DECODE_CLUSTER_DIMS NAME##_##SUFFIX##_d##D##_g##G(          \
        const T* q, const T* k, const T* v, const unsigned* position, const unsigned* blocks, int block_shift,  \
        float* part_o, float* part_ml, unsigned* counters, T* out, int group, long k_row, long k_head,          \
        long v_row, long v_head, float scale_log2 CHAIN_TRACE_PARAM) {                                        \
        CHAIN_TRACE_SCOPE                                                                                      \
        split_pass<T, D, G, PAGED>(q, k, v, position, blocks, block_shift, part_o, part_ml, counters, out,      \
                                   group, k_row, k_head, v_row, v_head, scale_log2);                          \
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
