// Fused attention forward, FlashAttention-2 scheme: each CTA keeps 64 or 128 query rows of one head
// on chip and streams the keys and values through shared memory in tiles of 64, with an
// online softmax; no score matrix ever reaches global memory. Tensor cores through
// mma.sync m16n8k16 (bf16/f16 in, f32 accumulate); tiles arrive by cp.async, the next K tile
// while P·V runs.
//
// Layout: element (row, head, d) of q/k/v lives at ptr[row * row_stride + head * head_stride + d]
// (any row/head strides, d contiguous); the output is contiguous [q_len, heads, D].
// Causal: query i sits at position kv_len - q_len + i and sees keys 0..=that position.
// With `position` (device memory, may be null): K and V are a cache's full capacity and only
// the first *position + q_len keys count, so that a captured CUDA graph replays at any length.
// GQA: query head h reads KV head h / group.
#include "tile.cuh"

namespace {

// BLOCK_M query rows per CTA (a template parameter: 64 or 128), 16 per warp, so each K/V
// tile serves BLOCK_M / 16 warps.
constexpr int BLOCK_N = 64;  // keys per tile

template <typename T, int D, int BLOCK_M>
__device__ void flash_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              T* __restrict__ out, const unsigned* __restrict__ position, int q_len, int kv_len,
                              int heads, int group, long q_row, long q_head, long k_row, long k_head, long v_row,
                              long v_head, float scale_log2, int causal) {
    if (position) kv_len = min(kv_len, (int)*position + q_len);
    constexpr int ROW = D + 8;  // padding: ldmatrix's 8 row addresses fall in distinct banks
    constexpr int THREADS = BLOCK_M / 16 * 32;
    // The queries pass through the K and V tiles on their way to registers.
    static_assert(BLOCK_M <= 2 * BLOCK_N, "the query tile borrows the K and V tiles");
    __shared__ __align__(16) T tiles[2 * BLOCK_N * ROW];
    T* k_tile = tiles;
    T* v_tile = tiles + BLOCK_N * ROW;

    const int head = blockIdx.y;
    const int kv_head = head / group;
    const int m0 = blockIdx.x * BLOCK_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment row group and column pair
    const T* qh = q + head * q_head;
    const T* kh = k + kv_head * k_head;
    const T* vh = v + kv_head * v_head;

    uint32_t qf[D / 16][4];
    load_queries<T, D, BLOCK_M, THREADS>(qf, tiles, qh, m0, q_len, q_row, threadIdx.x, [] { __syncthreads(); });

    const int offset = kv_len - q_len;  // causal position of query 0
    const int n_tiles = key_tiles(kv_len, causal ? offset + m0 + BLOCK_M : kv_len, BLOCK_N);
    const int row_a = m0 + warp * 16 + g;  // this thread's first query row; the second is 8 below

    float o[D / 8][4] = {};
    OnlineSoftmax softmax;

    load_tile<T, D, ROW, BLOCK_N, THREADS>(k_tile, kh, 0, kv_len, k_row);
    cp_async_commit();
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        load_tile<T, D, ROW, BLOCK_N, THREADS>(v_tile, vh, n0, kv_len, v_row);
        cp_async_commit();
        cp_async_wait<1>();  // K tile j has landed
        __syncthreads();

        // S = Q Kᵀ for this warp's 16 rows × 64 keys.
        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int p = 0; p < BLOCK_N / 16; ++p) {
                uint32_t b[4];
                ldmatrix_x4(b, k_tile + (p * 16 + (lane / 16) * 8 + lane % 8) * ROW + kk * 16 + ((lane / 8) % 2) * 8);
                Mma<T>::run(s[2 * p], qf[kk], b[0], b[1]);
                Mma<T>::run(s[2 * p + 1], qf[kk], b[2], b[3]);
            }
        }

        uint32_t pf[BLOCK_N / 16][4];  // P as A fragments: the accumulator layout of two n-tiles
        const bool masked = n0 + BLOCK_N > kv_len || (causal && n0 + BLOCK_N - 1 > offset + m0);
        OnlineSoftmax::rescale(o, softmax.update(s, scale_log2, masked, n0, kv_len, causal ? offset : -1, row_a, t));
        OnlineSoftmax::fragments<T>(s, pf);

        cp_async_wait<0>();  // V tile j has landed
        __syncthreads();     // every warp is done with K tile j
        if (j + 1 < n_tiles) load_tile<T, D, ROW, BLOCK_N, THREADS>(k_tile, kh, n0 + BLOCK_N, kv_len, k_row);
        cp_async_commit();

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int p = 0; p < D / 16; ++p) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, v_tile + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ROW + p * 16 + (lane / 16) * 8);
                Mma<T>::run(o[2 * p], pf[kk], b[0], b[1]);
                Mma<T>::run(o[2 * p + 1], pf[kk], b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with V tile j
    }

    softmax.store<T>(o, out, row_a, q_len, heads, head, t);
}

}  // namespace

#define FLASH_KERNEL(NAME, T, D, M)                                                                            \
    extern "C" __global__ void __launch_bounds__(M / 16 * 32)                                                  \
        NAME(const T* q, const T* k, const T* v, T* out, const unsigned* position, int q_len, int kv_len,       \
             int heads, int group, long q_row, long q_head, long k_row, long k_head, long v_row, long v_head,  \
             float scale_log2, int causal) {                                                                   \
        flash_forward<T, D, M>(q, k, v, out, position, q_len, kv_len, heads, group, q_row, q_head, k_row,      \
                               k_head, v_row, v_head, scale_log2, causal);                                     \
    }

// 64 query rows per CTA: 128 (one CTA per SM at 196 registers a thread) measured 14% slower
// on an H200 (benches/RESULTS.md, 2026-11-30), and every variant costs driver JIT time.
FLASH_KERNEL(flash_attention_bf16_d64, __nv_bfloat16, 64, 64)
FLASH_KERNEL(flash_attention_bf16_d128, __nv_bfloat16, 128, 64)
FLASH_KERNEL(flash_attention_f16_d64, __half, 64, 64)
FLASH_KERNEL(flash_attention_f16_d128, __half, 128, 64)
