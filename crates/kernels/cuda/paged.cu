// The continuous-batching step's kernels over a paged KV cache, `pool` `[2, slots, kv_heads, d]`
// (keys, then values; one token-major row per slot). Each row of the batch carries its own
// position and slot (read from device memory), so that many sequences at different lengths
// run in one launch, whatever blocks their tables hold.
#include "convert.cuh"
#include "rotate.cuh"
#include "decode_tile.cuh"

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

constexpr int WARPS = 4;       // warps per CTA of the attention kernel

// E consecutive elements, loaded in one (or two) 16-byte loads.
template <typename T, int E>
struct alignas(16) Pack {
    T v[E];
};

// How a warp covers keys of D columns: LANES lanes per key, E elements (at least 16 bytes)
// each, KEYS keys at once; STEPS keys per lane loaded before any is used (one memory latency
// per pass), fewer for groups of 8, whose queries and outputs take twice the registers.
// Sequence length `len` in at most `splits` slices of whole passes of 64 keys: the keys per
// slice, and how many slices hold keys. The grid does not depend on the lengths (a captured
// step replays at any), and long sequences split as finely as short ones.
__device__ __forceinline__ int2 slices_of(int len, int splits) {
    const int chunk = max((len + splits - 1) / splits + 63, 64) / 64 * 64;
    return make_int2(chunk, (len + chunk - 1) / chunk);
}

template <typename T, int D, int G>
struct KeyLayout {
    static constexpr int LANES = D * (int)sizeof(T) / 16 < 32 ? D * (int)sizeof(T) / 16 : 32;
    static constexpr int E = D / LANES;
    static constexpr int KEYS = 32 / LANES;
    static constexpr int STEPS = G >= 8 ? 4 : 8;
    static constexpr int PASS = STEPS * WARPS * KEYS;  // keys per pass of the CTA
};

// CTA (k, s, split) of a paged kernel: KV head k's query heads [h0, h0 + heads) of sequence s,
// and the split's slice [start, end) of its keys, one of the `slices` the sequence takes.
struct PagedCta {
    int k, s, split, splits, slices, h0, heads, start, end;
};

// This CTA's share, or false where it has no keys to fold. A sequence without keys (a padding
// row of a captured step) gets zeros from its first split, as attention over nothing.
template <typename T, int D>
__device__ __forceinline__ bool paged_cta(const unsigned* __restrict__ lens, T* __restrict__ out, int q_heads,
                                          int group, int offset, PagedCta& c) {
    c.k = blockIdx.x, c.s = blockIdx.y, c.split = blockIdx.z, c.splits = gridDim.z;
    const int len = lens[c.s];
    const int2 sl = slices_of(len, c.splits);
    c.slices = sl.y;
    c.h0 = max(0, c.k * group - offset), c.heads = min(q_heads, (c.k + 1) * group - offset) - c.h0;
    if (len == 0 && c.split == 0) {
        for (int i = threadIdx.x; i < c.heads * D; i += blockDim.x)
            out[((long)c.s * q_heads + c.h0) * D + i] = from_f32<T>(0.f);
    }
    if (c.split >= c.slices) return false;
    c.start = c.split * sl.x, c.end = min(len, c.start + sl.x);
    return true;
}

// Thread t of the CTA merges columns t, t + WARPS · 32, … of the group's first `heads` heads
// from the warps' states in shared memory (each warp's output columns, and its max and sum
// over its keys), weighted by exp2(max - the largest max): into `out` where the sequence's
// keys took one slice, else as this slice's partials. Heads from `head0` (sequence s's rows).
template <typename T, int D, int G>
__device__ __forceinline__ void merge_warps(const float (*warp_o)[G][D], const float (*warp_ml)[G][2], int heads,
                                           long head0, int split, int splits, int slices, T* __restrict__ out,
                                           float* __restrict__ part_o, float* __restrict__ part_ml) {
    const int t = threadIdx.x;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= heads) break;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, warp_ml[w][g][0]);
        float sum = 0.f;
        float weight[WARPS];
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            weight[w] = warp_ml[w][g][0] == -INFINITY ? 0.f : exp2f(warp_ml[w][g][0] - mx);
            sum += weight[w] * warp_ml[w][g][1];
        }
        const long head = head0 + g;
        for (int c = t; c < D; c += WARPS * 32) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) acc += weight[w] * warp_o[w][g][c];
            if (slices == 1)
                out[head * D + c] = from_f32<T>(sum > 0.f ? acc / sum : 0.f);
            else
                part_o[(head * splits + split) * D + c] = acc;
        }
        if (slices > 1 && t == 0) part_ml[2 * (head * splits + split)] = mx, part_ml[2 * (head * splits + split) + 1] = sum;
    }
}

// One decode row per sequence over its cached keys, each split along its keys into at most
// `splits` slices (slices_of). CTA (k, s, p) takes slice p of sequence s for every query head
// of KV head k (local query head h reads KV head (h + offset) / group; a rank's first group
// may be cut), so each K and V row is read once for the group. Sequence s's query is row
// q_rows[s] of `q` `[rows, q_heads, D]`; its key at position j lies in slot
// tables[s][j >> block_shift] << block_shift | j % block_size. Lane (slot, piece) of a warp
// scores its key against every head of the group (the pieces' dot products summed across the
// key's lanes) and adds the key's weighted V piece into its own E output columns; each warp
// keeps its own online softmax (base 2) and the warps meet in shared memory at the end. A
// sequence with one slice writes `out` `[n, q_heads, D]` here; with several, each slice
// writes its partial (o, then max and sum) for merge_slices.
template <typename T, int D, int G>
__device__ void paged_split(const T* __restrict__ q, const unsigned* __restrict__ q_rows,
                            const T* __restrict__ pool, const unsigned* __restrict__ tables,
                            const unsigned* __restrict__ lens, float* __restrict__ part_o,
                            float* __restrict__ part_ml, T* __restrict__ out, int q_heads, int kv_heads, int group,
                            int offset, int max_blocks, int block_shift, long pool_slots, float scale_log2) {
    using L = KeyLayout<T, D, G>;
    constexpr int LANES = L::LANES, E = L::E, KEYS = L::KEYS, STEPS = L::STEPS, PASS = L::PASS;
    using P = Pack<T, E>;
    PagedCta cta;
    if (!paged_cta<T, D>(lens, out, q_heads, group, offset, cta)) return;
    const int k = cta.k, s = cta.s, split = cta.split, splits = cta.splits, slices = cta.slices;
    const int h0 = cta.h0, heads = cta.heads, start = cta.start, end = cta.end;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int piece = lane % LANES, slot = lane / LANES;
    const unsigned* table = tables + (long)s * max_blocks;
    const int block_mask = (1 << block_shift) - 1;
    const long row = (long)kv_heads * D;
    const T* keys = pool + (long)k * D + piece * E;
    const T* values = keys + pool_slots * row;

    float qf[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= heads) break;
        const P p = *reinterpret_cast<const P*>(q + ((long)q_rows[s] * q_heads + h0 + g) * D + piece * E);
#pragma unroll
        for (int e = 0; e < E; ++e) qf[g][e] = to_f32(p.v[e]) * scale_log2;
    }
    // Head g's state in this lane: the warp's running max m (every lane alike), and the sum l
    // and output columns o over the keys of this lane's slot alone.
    float m[G], l[G], o[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[g][e] = 0.f;
    }
    for (int pass0 = start; pass0 < end; pass0 += PASS) {
        // Every step's slot first (their table reads in flight together), then its K and V.
        long at[STEPS];
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int j = min(pass0 + (i * WARPS + warp) * KEYS + slot, end - 1);
            at[i] = ((long)table[j >> block_shift] << block_shift | (j & block_mask)) * row;
        }
        P kr[STEPS], vr[STEPS];
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            kr[i] = *reinterpret_cast<const P*>(keys + at[i]);
            vr[i] = *reinterpret_cast<const P*>(values + at[i]);
        }
        // Scores; keys past the end (their loads repeat the last key) score -inf.
        float sc[G][STEPS];
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const bool filled = pass0 + (i * WARPS + warp) * KEYS + slot < end;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (g >= heads) break;
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) dot = fmaf(qf[g][e], to_f32(kr[i].v[e]), dot);
#pragma unroll
                for (int w = LANES / 2; w > 0; w /= 2) dot += __shfl_xor_sync(0xffffffff, dot, w);
                sc[g][i] = filled ? dot : -INFINITY;
            }
        }
        // The warp's max over this pass (its slots meet by shuffle), earlier sums rescaled. A
        // warp with no filled key yet keeps m = -inf; its exponentials are taken from 0.
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= heads) break;
            float mx = m[g];
#pragma unroll
            for (int i = 0; i < STEPS; ++i) mx = fmaxf(mx, sc[g][i]);
#pragma unroll
            for (int w = LANES; w < 32; w *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
            const float base = mx == -INFINITY ? 0.f : mx;
            const float alpha = exp2f(m[g] - base);
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) o[g][e] *= alpha;
#pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                const float p = exp2f(sc[g][i] - base);  // 0 past the end
                sum += p;
#pragma unroll
                for (int e = 0; e < E; ++e) o[g][e] = fmaf(p, to_f32(vr[i].v[e]), o[g][e]);
            }
            m[g] = mx;
            l[g] = l[g] * alpha + sum;
        }
    }
    // The slots of a warp share its max: their sums add, and slot 0's lanes hold the warp's.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= heads) break;
#pragma unroll
        for (int w = LANES; w < 32; w *= 2) {
            l[g] += __shfl_xor_sync(0xffffffff, l[g], w);
#pragma unroll
            for (int e = 0; e < E; ++e) o[g][e] += __shfl_xor_sync(0xffffffff, o[g][e], w);
        }
    }
    __shared__ float warp_o[WARPS][G][D];
    __shared__ float warp_ml[WARPS][G][2];
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= heads) break;
#pragma unroll
            for (int e = 0; e < E; ++e) warp_o[warp][g][piece * E + e] = o[g][e];
            if (piece == 0) warp_ml[warp][g][0] = m[g], warp_ml[warp][g][1] = l[g];
        }
    }
    __syncthreads();
    merge_warps<T, D, G>(warp_o, warp_ml, heads, (long)s * q_heads + h0, split, splits, slices, out, part_o, part_ml);
}

// Block-table entries a CTA holds in shared memory at a time (4,096 keys in blocks of 16).
constexpr int TABLE_SEGMENT = 256;
// Passes whose K and V rows are in shared memory or on their way: two load while one is scored.
constexpr int STAGES = 3;
// Steps a lane takes a pass of paged_stream: STREAM_STEPS · WARPS · 32 · 16 bytes of K and as
// many of V (8 KiB each) for rows of up to 512 bytes. Its dynamic shared memory is the stages'
// K and V rows, then the staged table: STAGES · 16 KiB + TABLE_SEGMENT · 4 bytes
// (PAGED_STREAM_SMEM in paged.rs).
constexpr int STREAM_STEPS = 4;


// paged_split's arithmetic with its keys streamed: the CTA copies each pass's K and V rows
// into shared memory with cp.async, STAGES - 1 passes ahead of the one it scores, so that the
// loads in flight hold no registers and never wait on the scoring; the slots come from the
// block table staged in shared memory, a segment at a time. 1.2–1.3× paged_split's speed with
// 32 to 128 sequences in groups of 4; slower with few sequences, whose slices are too short
// to fill the stages (benches/RESULTS.md). The scoring and the warps' meeting are
// paged_split's, written out again: a version sharing them through a helper (a struct of the
// lane's state, the pieces passed as lambdas) ran 10–13% slower here (measured 2026-12-04).
template <typename T, int D, int G>
__device__ void paged_stream(const T* __restrict__ q, const unsigned* __restrict__ q_rows,
                             const T* __restrict__ pool, const unsigned* __restrict__ tables,
                             const unsigned* __restrict__ lens, float* __restrict__ part_o,
                             float* __restrict__ part_ml, T* __restrict__ out, int q_heads, int kv_heads, int group,
                             int offset, int max_blocks, int block_shift, long pool_slots, float scale_log2) {
    using L = KeyLayout<T, D, G>;
    constexpr int LANES = L::LANES, E = L::E, KEYS = L::KEYS, STEPS = STREAM_STEPS, PASS = STEPS * WARPS * KEYS;
    constexpr int CHUNK = 16 / (int)sizeof(T), CHUNKS = D / CHUNK;  // 16-byte pieces of a row
    static_assert(PASS * D * sizeof(T) == 8192, "rows of up to 512 bytes: a stage of K is 8 KiB");
    using P = Pack<T, E>;
    extern __shared__ __align__(16) unsigned char smem[];
    T* stage_k = reinterpret_cast<T*>(smem);
    T* stage_v = stage_k + STAGES * PASS * D;
    unsigned* staged = reinterpret_cast<unsigned*>(stage_v + STAGES * PASS * D);
    PagedCta cta;
    if (!paged_cta<T, D>(lens, out, q_heads, group, offset, cta)) return;
    const int k = cta.k, s = cta.s, split = cta.split, splits = cta.splits, slices = cta.slices;
    const int h0 = cta.h0, heads = cta.heads, start = cta.start, end = cta.end;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int piece = lane % LANES, slot = lane / LANES;
    const unsigned* table = tables + (long)s * max_blocks;
    const int block_mask = (1 << block_shift) - 1;
    const long row = (long)kv_heads * D;
    const T* keys = pool + (long)k * D;
    const T* values = keys + pool_slots * row;

    float qf[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= heads) break;
        const P p = *reinterpret_cast<const P*>(q + ((long)q_rows[s] * q_heads + h0 + g) * D + piece * E);
#pragma unroll
        for (int e = 0; e < E; ++e) qf[g][e] = to_f32(p.v[e]) * scale_log2;
    }
    float m[G], l[G], o[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) o[g][e] = 0.f;
    }
    const int segment_keys = TABLE_SEGMENT << block_shift;
    for (int seg = start; seg < end; seg += segment_keys) {
        const int seg_end = min(end, seg + segment_keys);
        const int first_block = seg >> block_shift, blocks = ((seg_end - 1) >> block_shift) - first_block + 1;
        for (int i = t; i < blocks; i += WARPS * 32) staged[i] = table[first_block + i];
        __syncthreads();
        const int passes = (seg_end - seg + PASS - 1) / PASS;
        // Pass p's rows into stage p % STAGES (past the end: the last key again); a group is
        // committed even when empty, so that the waits below count alike.
        auto issue = [&](int p) {
            if (p < passes) {
                const int pass0 = seg + p * PASS;
                T* sk = stage_k + (p % STAGES) * PASS * D;
                T* sv = stage_v + (p % STAGES) * PASS * D;
                for (int c = t; c < PASS * CHUNKS; c += WARPS * 32) {
                    const int key = c / CHUNKS, col = c % CHUNKS * CHUNK;
                    const int j = min(pass0 + key, seg_end - 1);
                    const long at = ((long)staged[(j >> block_shift) - first_block] << block_shift | (j & block_mask)) * row + col;
                    cp_async16(smem_addr(sk + key * D + col), keys + at, true);
                    cp_async16(smem_addr(sv + key * D + col), values + at, true);
                }
            }
            cp_async_commit();
        };
#pragma unroll
        for (int p = 0; p < STAGES - 1; ++p) issue(p);
        for (int p = 0; p < passes; ++p) {
            cp_async_wait<STAGES - 2>();  // pass p has landed
            __syncthreads();              // for every thread, and every warp is done with pass p - 1
            issue(p + STAGES - 1);        // into pass p - 1's stage
            const int pass0 = seg + p * PASS;
            const T* sk = stage_k + (p % STAGES) * PASS * D;
            const T* sv = stage_v + (p % STAGES) * PASS * D;
            float sc[G][STEPS];
#pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                const int key = (i * WARPS + warp) * KEYS + slot;
                const bool filled = pass0 + key < seg_end;
                const P kr = *reinterpret_cast<const P*>(sk + key * D + piece * E);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g >= heads) break;
                    float dot = 0.f;
#pragma unroll
                    for (int e = 0; e < E; ++e) dot = fmaf(qf[g][e], to_f32(kr.v[e]), dot);
#pragma unroll
                    for (int w = LANES / 2; w > 0; w /= 2) dot += __shfl_xor_sync(0xffffffff, dot, w);
                    sc[g][i] = filled ? dot : -INFINITY;
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (g >= heads) break;
                float mx = m[g];
#pragma unroll
                for (int i = 0; i < STEPS; ++i) mx = fmaxf(mx, sc[g][i]);
#pragma unroll
                for (int w = LANES; w < 32; w *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
                const float base = mx == -INFINITY ? 0.f : mx;
                const float alpha = exp2f(m[g] - base);
                float sum = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) o[g][e] *= alpha;
#pragma unroll
                for (int i = 0; i < STEPS; ++i) {
                    const float p = exp2f(sc[g][i] - base);
                    sum += p;
                    const P vr = *reinterpret_cast<const P*>(sv + ((i * WARPS + warp) * KEYS + slot) * D + piece * E);
#pragma unroll
                    for (int e = 0; e < E; ++e) o[g][e] = fmaf(p, to_f32(vr.v[e]), o[g][e]);
                }
                m[g] = mx;
                l[g] = l[g] * alpha + sum;
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the stages and the staged table are free for the next segment
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= heads) break;
#pragma unroll
        for (int w = LANES; w < 32; w *= 2) {
            l[g] += __shfl_xor_sync(0xffffffff, l[g], w);
#pragma unroll
            for (int e = 0; e < E; ++e) o[g][e] += __shfl_xor_sync(0xffffffff, o[g][e], w);
        }
    }
    // The warps meet in the stages' memory, free now.
    auto warp_o = reinterpret_cast<float(*)[G][D]>(smem);
    auto warp_ml = reinterpret_cast<float(*)[G][2]>(smem + WARPS * G * D * sizeof(float));
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= heads) break;
#pragma unroll
            for (int e = 0; e < E; ++e) warp_o[warp][g][piece * E + e] = o[g][e];
            if (piece == 0) warp_ml[warp][g][0] = m[g], warp_ml[warp][g][1] = l[g];
        }
    }
    __syncthreads();
    merge_warps<T, D, G>(warp_o, warp_ml, heads, (long)s * q_heads + h0, split, splits, slices, out, part_o, part_ml);
}

// paged_split's CTAs, slices and partials, its keys scored on tensor cores: each warp folds
// every WARPS-th tile of 16 keys of the CTA's slice (decode_tile.cuh's fold_slice, the group's
// query heads as the rows of an mma.sync A operand) through its own cp.async ring, `stages`
// (2 or 4) tiles deep, the slots read from the sequence's block table a tile ahead; the warps
// meet as paged_split's do. 16-bit heads of 64 or 128.
template <typename T, int D, int G>
__device__ void paged_mma(const T* __restrict__ q, const unsigned* __restrict__ q_rows, const T* __restrict__ pool,
                          const unsigned* __restrict__ tables, const unsigned* __restrict__ lens,
                          float* __restrict__ part_o, float* __restrict__ part_ml, T* __restrict__ out, int q_heads,
                          int kv_heads, int group, int offset, int max_blocks, int block_shift, long pool_slots,
                          float scale_log2, int stages) {
    PagedCta cta;
    if (!paged_cta<T, D>(lens, out, q_heads, group, offset, cta)) return;
    const int k = cta.k, s = cta.s, split = cta.split, splits = cta.splits, slices = cta.slices;
    const int h0 = cta.h0, heads = cta.heads, start = cta.start, end = cta.end;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const long row = (long)kv_heads * D;
    const T* keys = pool + (long)k * D;
    const T* values = keys + pool_slots * row;
    const unsigned* table = tables + (long)s * max_blocks;

    uint32_t qf[D / 16][4];
    group_queries<T, D>(qf, q + ((long)q_rows[s] * q_heads + h0) * D, heads, lane);
    float o[D / 8][4] = {};
    OnlineSoftmax softmax;
    const Slice slice{start, end, warp, lane};
    fold_slice_ring<T, D, WARPS, true>(stages, slice, qf, keys, values, row, row, table, block_shift, scale_log2, o,
                                       softmax);
    // Row lane / 4's sum over the keys of its four lanes; the warps meet in shared memory.
#pragma unroll
    for (int w = 1; w < 4; w *= 2) softmax.sum_a += __shfl_xor_sync(0xffffffff, softmax.sum_a, w);
    __shared__ __align__(16) float warp_o[WARPS][G][D];
    __shared__ float warp_ml[WARPS][G][2];
    const int fg = lane / 4, ft = lane % 4;
    if (fg < heads) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            *reinterpret_cast<float2*>(&warp_o[warp][fg][i * 8 + 2 * ft]) = make_float2(o[i][0], o[i][1]);
        if (ft == 0) warp_ml[warp][fg][0] = softmax.max_a, warp_ml[warp][fg][1] = softmax.sum_a;
    }
    __syncthreads();
    merge_warps<T, D, G>(warp_o, warp_ml, heads, (long)s * q_heads + h0, split, splits, slices, out, part_o, part_ml);
}

// CTA (h, s): query head h of sequence s, when its keys took several slices: their partials
// weighted by exp2(max - the largest max), summed and divided by the weighted sums.
template <typename T, int D>
__device__ void merge_slices(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             const unsigned* __restrict__ lens, T* __restrict__ out, int q_heads, int splits) {
    const int h = blockIdx.x, s = blockIdx.y;
    const int active = slices_of(lens[s], splits).y;
    if (active <= 1) return;  // written by the slice itself (zeros for no keys)
    const long head = (long)s * q_heads + h;
    const float* ml = part_ml + 2 * head * splits;
    float mx = -INFINITY;
    for (int p = 0; p < active; ++p) mx = fmaxf(mx, ml[2 * p]);
    float sum = 0.f;
    for (int p = 0; p < active; ++p) sum += ml[2 * p] == -INFINITY ? 0.f : exp2f(ml[2 * p] - mx) * ml[2 * p + 1];
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < active; ++p)
            if (ml[2 * p] != -INFINITY) acc += exp2f(ml[2 * p] - mx) * part_o[(head * splits + p) * D + c];
        out[head * D + c] = from_f32<T>(sum > 0.f ? acc / sum : 0.f);
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

#define PAGED_ATTENTION(SUFFIX, T, D, G)                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) paged_split_##SUFFIX##_d##D##_g##G(                \
        const T* q, const unsigned* q_rows, const T* pool, const unsigned* tables, const unsigned* lens,        \
        float* part_o, float* part_ml, T* out, int q_heads, int kv_heads, int group, int offset, int max_blocks, \
        int block_shift, long pool_slots, float scale_log2) {                                                   \
        paged_split<T, D, G>(q, q_rows, pool, tables, lens, part_o, part_ml, out, q_heads, kv_heads, group,     \
                             offset, max_blocks, block_shift, pool_slots, scale_log2);                          \
    }

// At least four CTAs an SM (128 registers a thread), which their shared memory allows.
#define PAGED_STREAM(SUFFIX, T, D, G)                                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) paged_stream_##SUFFIX##_d##D##_g##G(           \
        const T* q, const unsigned* q_rows, const T* pool, const unsigned* tables, const unsigned* lens,        \
        float* part_o, float* part_ml, T* out, int q_heads, int kv_heads, int group, int offset, int max_blocks, \
        int block_shift, long pool_slots, float scale_log2) {                                                   \
        paged_stream<T, D, G>(q, q_rows, pool, tables, lens, part_o, part_ml, out, q_heads, kv_heads, group,    \
                              offset, max_blocks, block_shift, pool_slots, scale_log2);                         \
    }

// `stages`: 4 or 2, each warp's ring of tiles that the dynamic shared memory holds
// (`WARPS · stages · 2 · 16 · (D + 8)` elements of T).
#define PAGED_MMA(SUFFIX, T, D, G)                                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) paged_mma_##SUFFIX##_d##D##_g##G(                  \
        const T* q, const unsigned* q_rows, const T* pool, const unsigned* tables, const unsigned* lens,        \
        float* part_o, float* part_ml, T* out, int q_heads, int kv_heads, int group, int offset, int max_blocks, \
        int block_shift, long pool_slots, float scale_log2, int stages) {                                      \
        paged_mma<T, D, G>(q, q_rows, pool, tables, lens, part_o, part_ml, out, q_heads, kv_heads, group,       \
                           offset, max_blocks, block_shift, pool_slots, scale_log2, stages);                   \
    }

#define PAGED_MMAS(SUFFIX, T, D) \
    PAGED_MMA(SUFFIX, T, D, 1)   \
    PAGED_MMA(SUFFIX, T, D, 2)   \
    PAGED_MMA(SUFFIX, T, D, 4)   \
    PAGED_MMA(SUFFIX, T, D, 8)

#define MERGE_SLICES(SUFFIX, T, D)                                                                              \
    extern "C" __global__ void merge_slices_##SUFFIX##_d##D(const float* part_o, const float* part_ml,          \
                                                             const unsigned* lens, T* out, int q_heads,         \
                                                             int splits) {                                      \
        merge_slices<T, D>(part_o, part_ml, lens, out, q_heads, splits);                                        \
    }

#define PAGED_HEAD(SUFFIX, T, D)       \
    PAGED_ATTENTION(SUFFIX, T, D, 1)   \
    PAGED_ATTENTION(SUFFIX, T, D, 2)   \
    PAGED_ATTENTION(SUFFIX, T, D, 4)   \
    PAGED_ATTENTION(SUFFIX, T, D, 8)   \
    MERGE_SLICES(SUFFIX, T, D)

// The streamed kernel for rows of up to 512 bytes (not f32 heads of 256).
#define PAGED_STREAMS(SUFFIX, T, D) \
    PAGED_STREAM(SUFFIX, T, D, 1)   \
    PAGED_STREAM(SUFFIX, T, D, 2)   \
    PAGED_STREAM(SUFFIX, T, D, 4)

#define PAGED(SUFFIX, T)           \
    ROTARY_PAGED(SUFFIX, T)        \
    PAGED_HEAD(SUFFIX, T, 64)      \
    PAGED_HEAD(SUFFIX, T, 128)     \
    PAGED_HEAD(SUFFIX, T, 256)     \
    PAGED_STREAMS(SUFFIX, T, 64)   \
    PAGED_STREAMS(SUFFIX, T, 128)

PAGED(f32, float)
PAGED(bf16, __nv_bfloat16)
PAGED(f16, __half)
PAGED_STREAMS(bf16, __nv_bfloat16, 256)
PAGED_STREAMS(f16, __half, 256)
PAGED_MMAS(bf16, __nv_bfloat16, 64)
PAGED_MMAS(bf16, __nv_bfloat16, 128)
PAGED_MMAS(f16, __half, 64)
PAGED_MMAS(f16, __half, 128)
