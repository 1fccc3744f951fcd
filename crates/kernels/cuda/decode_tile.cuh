// What the decode attention kernels on tensor cores share (decode_attention.cu's one sequence,
// paged.cu's batch): a warp folds its tiles of 16 keys of a slice into an online softmax, the
// query heads of a GQA group as the rows of an mma.sync m16n8k16 A operand, each tile's K and
// V rows copied by cp.async into a ring of the warp's own in dynamic shared memory.
#pragma once
#include "chain.cuh"
#include "tile.cuh"

namespace {

// The A fragments of D/16 k16 steps for `heads` consecutive query heads from `first` (row g of
// the tile is head g; rows from `heads` on, 8..15 always, are zeros).
template <typename T, int D>
__device__ __forceinline__ void group_queries(uint32_t (&qf)[D / 16][4], const T* first, int heads, int lane) {
    const int g = lane / 4, t = lane % 4;
    const T* row = first + (long)g * D + 2 * t;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][0] = g < heads ? *reinterpret_cast<const uint32_t*>(row + kk * 16) : 0u;
        qf[kk][2] = g < heads ? *reinterpret_cast<const uint32_t*>(row + kk * 16 + 8) : 0u;
        qf[kk][1] = qf[kk][3] = 0u;
    }
}

constexpr int TILE = 16;  // keys a warp takes at a time: one k16 step of P·V

// The rows of the keys whose pieces this lane copies in the tile from key0 (the pool's rows
// through a block table when PAGED): piece c (c = lane + 32·i) of the tile is row c / (D/8).
template <int D, bool PAGED>
__device__ __forceinline__ void tile_rows(int key0, int end, const unsigned* __restrict__ blocks, int block_shift,
                                          int lane, long (&row)[TILE * D / 8 / 32]) {
    constexpr int CHUNKS = D / 8;
#pragma unroll
    for (int i = 0; i < TILE * CHUNKS / 32; ++i) {
        const int j = key0 + (lane + 32 * i) / CHUNKS;
        const int mask = (1 << block_shift) - 1;
        row[i] = j >= end ? 0 : !PAGED ? j : (long)blocks[j >> block_shift] << block_shift | (j & mask);
    }
}

// Copies the tile from key0 (K then V, TILE padded rows each) into a ring slot; keys past
// `end` become zeros.
template <typename T, int D>
__device__ __forceinline__ void tile_copy(T* slot, int key0, int end, const long (&row)[TILE * D / 8 / 32], const T* kh,
                                          const T* vh, long k_row, long v_row, int lane) {
    constexpr int CHUNKS = D / 8, ROW = D + 8;
#pragma unroll
    for (int i = 0; i < TILE * CHUNKS / 32; ++i) {
        const int c = lane + 32 * i, r = c / CHUNKS, col = (c % CHUNKS) * 8;
        const bool valid = key0 + r < end;
        cp_async16(smem_addr(slot + r * ROW + col), kh + row[i] * k_row + col, valid);
        cp_async16(smem_addr(slot + (TILE + r) * ROW + col), vh + row[i] * v_row + col, valid);
    }
}

// Where a warp's keys lie: the CTA's slice [start, end) of the cache.
struct Slice {
    int start, end, warp, lane;
};

// Folds the warp's tiles of the slice (w, w + WARPS, ... for warp w) into its softmax state and
// O (the m16n8 accumulator layout: row lane / 4 is query head lane / 4 of the group), through
// a ring of STAGES tiles in dynamic shared memory: its lanes copy and read only the warp's
// slots, so the ring needs the warp's barrier alone.
template <typename T, int D, int WARPS, int STAGES, bool PAGED>
__device__ __forceinline__ void fold_slice(const Slice& at, const uint32_t (&qf)[D / 16][4], const T* kh, const T* vh,
                                           long k_row, long v_row, const unsigned* __restrict__ blocks,
                                           int block_shift, float scale_log2, float (&o)[D / 8][4],
                                           OnlineSoftmax& softmax) {
    constexpr int ROW = D + 8, SLOT = 2 * TILE * ROW;
    const int start = at.start, end = at.end, warp = at.warp, lane = at.lane;
    const int fg = lane / 4, ft = lane % 4;
    extern __shared__ __align__(16) unsigned char dynamic_shared[];
    T* ring = reinterpret_cast<T*>(dynamic_shared) + warp * STAGES * SLOT;
    const int tiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const int mine = tiles > warp ? (tiles - warp + WARPS - 1) / WARPS : 0;
    auto key0_of = [&](int i) { return start + (warp + i * WARPS) * TILE; };
    long row[TILE * D / 8 / 32];
    tile_rows<D, PAGED>(key0_of(0), end, blocks, block_shift, lane, row);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < mine) {
            tile_copy<T, D>(ring + s * SLOT, key0_of(s), end, row, kh, vh, k_row, v_row, lane);
            if (s + 1 < mine) tile_rows<D, PAGED>(key0_of(s + 1), end, blocks, block_shift, lane, row);
        }
        cp_async_commit();
    }
    // The chain is released once this CTA's first keys are requested: a GEMV after it,
    // launched early, fills the memory system with its weight loads, and the keys' loads
    // would queue behind them.
    chain_release();
    for (int i = 0; i < mine; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        const T* k_tile = ring + (i % STAGES) * SLOT;
        const T* v_tile = k_tile + TILE * ROW;
        const int key0 = key0_of(i);
        // S = Q Kᵀ: the group's rows × the tile's 16 keys.
        float s[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t b[4];
            ldmatrix_x4(b, k_tile + ((lane / 16) * 8 + lane % 8) * ROW + kk * 16 + ((lane / 8) % 2) * 8);
            Mma<T>::run(s[0], qf[kk], b[0], b[1]);
            Mma<T>::run(s[1], qf[kk], b[2], b[3]);
        }
        uint32_t pf[1][4];
        OnlineSoftmax::rescale(o, softmax.update(s, scale_log2, key0 + TILE > end, key0, end, -1, fg, ft));
        OnlineSoftmax::fragments<T>(s, pf);
        // O += P V.
#pragma unroll
        for (int p = 0; p < D / 16; ++p) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v_tile + (((lane / 8) % 2) * 8 + lane % 8) * ROW + p * 16 + (lane / 16) * 8);
            Mma<T>::run(o[2 * p], pf[0], b[0], b[1]);
            Mma<T>::run(o[2 * p + 1], pf[0], b[2], b[3]);
        }
        __syncwarp();  // every lane is done with the slot the next copy refills
        const int next = i + STAGES - 1;
        if (next < mine) {
            tile_copy<T, D>(ring + (next % STAGES) * SLOT, key0_of(next), end, row, kh, vh, k_row, v_row, lane);
            if (next + 1 < mine) tile_rows<D, PAGED>(key0_of(next + 1), end, blocks, block_shift, lane, row);
        }
        cp_async_commit();
    }
}

// fold_slice with the ring's depth chosen at run time: 4 tiles where the device's shared memory
// holds them, else 2 (src/lib.rs, decode_ring).
template <typename T, int D, int WARPS, bool PAGED>
__device__ __forceinline__ void fold_slice_ring(int stages, const Slice& at, const uint32_t (&qf)[D / 16][4],
                                                const T* kh, const T* vh, long k_row, long v_row,
                                                const unsigned* __restrict__ blocks, int block_shift,
                                                float scale_log2, float (&o)[D / 8][4], OnlineSoftmax& softmax) {
    if (stages == 4)
        fold_slice<T, D, WARPS, 4, PAGED>(at, qf, kh, vh, k_row, v_row, blocks, block_shift, scale_log2, o, softmax);
    else
        fold_slice<T, D, WARPS, 2, PAGED>(at, qf, kh, vh, k_row, v_row, blocks, block_shift, scale_log2, o, softmax);
}

}  // namespace
