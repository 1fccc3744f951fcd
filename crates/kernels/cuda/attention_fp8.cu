// FP8 (E4M3) attention's input passes (fp8_attention.cuh), which every GPU of the build
// runs, and its mma.sync kernel for GPUs without wgmma (the RTX 4090, compute capability 8.9,
// whose tensor cores run E4M3 at twice bf16's f32-accumulate rate): flash_attention.cu's
// scheme on m16n8k32 e4m3 products.
#include <cfloat>

#include "fp8_attention.cuh"
#include "tile.cuh"

namespace {

constexpr int D = 128;  // head size

// The key at position p of a 32-key group of the transposed V.
__device__ __forceinline__ int p_order_key(int p) {
    const int t = (p % 16) / 4, i = p % 4;
    return (p / 16) * 16 + (i / 2) * 8 + 2 * t + (i % 2);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int w = 16; w > 0; w /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, w));
    return v;
}

// Eight bf16 values (16 bytes) as floats.
__device__ __forceinline__ void unpack8(const uint4& chunk, float (&out)[8]) {
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&chunk);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __bfloat162float(v[j]);
}

}  // namespace

// The largest magnitude of each channel of each head of `v` (`[len, heads, 128]`), maxed into
// `absmax` (`[heads, 128]`, zero before the first launch) as the bits of a non-negative float,
// which order as unsigned integers do (so the result does not depend on the blocks' order).
// Grid (len / 256 rounded up, heads), 128 threads: 16 a row, 8 channels each.
extern "C" __global__ void __launch_bounds__(128)
    channel_absmax_bf16(const __nv_bfloat16* __restrict__ v, long row_stride, long head_stride, int len,
                        unsigned* __restrict__ absmax) {
    __shared__ float maxima[8][D];
    const int head = blockIdx.y, r = threadIdx.x / 16, c8 = (threadIdx.x % 16) * 8;
    float m[8] = {};
    const int end = min(len, (int)(blockIdx.x + 1) * 256);
    for (int row = blockIdx.x * 256 + r; row < end; row += 8) {
        float x[8];
        unpack8(*reinterpret_cast<const uint4*>(v + row * row_stride + head * head_stride + c8), x);
#pragma unroll
        for (int j = 0; j < 8; ++j) m[j] = fmaxf(m[j], fabsf(x[j]));
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) maxima[r][c8 + j] = m[j];
    __syncthreads();
    float best = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) best = fmaxf(best, maxima[i][threadIdx.x]);
    atomicMax(absmax + head * D + threadIdx.x, __float_as_uint(best));
}

// Q or K `[len, heads, 128]` (row and head strides in elements, d contiguous, 16-byte-aligned
// rows) to E4M3 `[len, heads, 128]` with one scale per ROWS rows of a head: scales[head ·
// gridDim.x + block] = absmax / 448, each value divided by it. Grid (blocks, heads), 256
// threads, each ROWS / 16 16-byte chunks of the ROWS × 128 block.
template <int ROWS>
__device__ __forceinline__ void quantize_row_blocks(const __nv_bfloat16* __restrict__ x, long row_stride,
                                                    long head_stride, int len, uint8_t* __restrict__ out,
                                                    float* __restrict__ scales) {
    constexpr int CHUNKS = ROWS / 16;
    __shared__ float warp_maxima[8];
    const int head = blockIdx.y, heads = gridDim.y, row0 = blockIdx.x * ROWS;
    float v[CHUNKS][8], m = 0.f;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int c = threadIdx.x + 256 * i, row = row0 + c / 16, col = (c % 16) * 8;
        unpack8(row < len ? *reinterpret_cast<const uint4*>(x + row * row_stride + head * head_stride + col)
                          : make_uint4(0, 0, 0, 0),
                v[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[i][j]));
    }
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) warp_maxima[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) m = fmaxf(m, warp_maxima[w]);
    const float scale = m / E4M3_MAX, inverse = m > 0.f ? E4M3_MAX / m : 0.f;
    if (threadIdx.x == 0) scales[head * gridDim.x + blockIdx.x] = scale;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int c = threadIdx.x + 256 * i, row = row0 + c / 16, col = (c % 16) * 8;
        if (row >= len) continue;
        const float(&x8)[8] = v[i];
        uint2 q;
        q.x = pack_e4m3(x8[0] * inverse, x8[1] * inverse, x8[2] * inverse, x8[3] * inverse);
        q.y = pack_e4m3(x8[4] * inverse, x8[5] * inverse, x8[6] * inverse, x8[7] * inverse);
        *reinterpret_cast<uint2*>(out + ((long)row * heads + head) * D + col) = q;
    }
}

// Q: one scale per consumer warpgroup's 64 query rows.
extern "C" __global__ void __launch_bounds__(256)
    quantize_query_blocks_e4m3(const __nv_bfloat16* __restrict__ x, long row_stride, long head_stride, int len,
                               uint8_t* __restrict__ out, float* __restrict__ scales) {
    quantize_row_blocks<QUANT_ROWS>(x, row_stride, head_stride, len, out, scales);
}

// K: one scale per tile of keys, so that a tile's scores take one multiply.
extern "C" __global__ void __launch_bounds__(256)
    quantize_key_blocks_e4m3(const __nv_bfloat16* __restrict__ x, long row_stride, long head_stride, int len,
                             uint8_t* __restrict__ out, float* __restrict__ scales) {
    quantize_row_blocks<KEYS_FP8>(x, row_stride, head_stride, len, out, scales);
}

// V `[len, heads, 128]` to E4M3 `[heads, 128, padded]` (`padded`: len rounded up to 64; the
// keys past len are zeros), each channel divided by its scale absmax / 448, which the first
// block of each head writes to `scales` (`[heads, 128]`); the keys of each 32 in P's order
// (p_order_key). Grid (padded / 64, heads), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    transpose_values_e4m3(const __nv_bfloat16* __restrict__ v, long row_stride, long head_stride, int len, int padded,
                          const unsigned* __restrict__ absmax, uint8_t* __restrict__ out, float* __restrict__ scales) {
    constexpr int ROW = D + 8;  // padded rows: a warp's reads of one channel spread over banks
    __shared__ __nv_bfloat16 tile[QUANT_ROWS][ROW];
    const int head = blockIdx.y, key0 = blockIdx.x * QUANT_ROWS;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = threadIdx.x + 256 * i, row = c / 16, col = (c % 16) * 8;
        const uint4 chunk = key0 + row < len
                                ? *reinterpret_cast<const uint4*>(v + (key0 + row) * row_stride + head * head_stride + col)
                                : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(&tile[row][col]) = chunk;
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < D)
        scales[head * D + threadIdx.x] = __uint_as_float(absmax[head * D + threadIdx.x]) / E4M3_MAX;
    // 128 channels × 8 runs of 8 positions, four a thread; a run is one 8-byte store.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int task = threadIdx.x + 256 * i, channel = task / 8, p0 = (task % 8) * 8;
        const float m = __uint_as_float(absmax[head * D + channel]), inverse = m > 0.f ? E4M3_MAX / m : 0.f;
        float x[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int p = p0 + j, key = (p / 32) * 32 + p_order_key(p % 32);
            x[j] = __bfloat162float(tile[key][channel]) * inverse;
        }
        uint2 q;
        q.x = pack_e4m3(x[0], x[1], x[2], x[3]);
        q.y = pack_e4m3(x[4], x[5], x[6], x[7]);
        *reinterpret_cast<uint2*>(out + ((long)head * D + channel) * padded + key0 + p0) = q;
    }
}


namespace {

constexpr int BLOCK_M_MMA = 64;   // query rows per CTA: one Q scale block, 16 a warp
constexpr int BLOCK_N_MMA = 64;   // keys per tile: half a K scale block
constexpr int K_ROW = D + 16;     // bytes per K tile row: ldmatrix's 8 rows fall in distinct banks
constexpr int V_ROW = BLOCK_N_MMA + 16;  // bytes per V tile row (a channel's keys)

// D += A·B for one m16n8k32 tile with E4M3 operands (A 16×32 row-major in mma.sync's 8-bit A
// layout, B 32×8 column-major: b0 rows 4t .. 4t + 3, b1 rows 16 + 4t .. of column g), f32
// accumulate. Only sm_89 and newer have it; the kernel never launches elsewhere.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// `rows` rows of `bytes` bytes from `base` (`stride` bytes apart) from row `row0` into a tile
// of `tile_row`-byte rows, 16 bytes a copy; rows at or past `len` become zeros.
template <int ROWS, int BYTES, int TILE_ROW, int THREADS>
__device__ __forceinline__ void load_bytes(uint8_t* tile, const uint8_t* base, int row0, int len, long stride) {
    constexpr int CHUNKS = BYTES / 16;
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 16;
        const bool valid = row0 + r < len;
        cp_async16(smem_addr(tile + r * TILE_ROW + col), valid ? base + (row0 + r) * stride + col : base, valid);
    }
}

}  // namespace

// Grid: (q_len / 64 rounded up, heads); 128 threads. The Hopper kernel's inputs and output
// (flash_attention_sm90.cu's flash_attention_sm90_e4m3_d128), V transposed to `[KV heads, 128,
// padded]`. Each warp keeps 16 query rows; K and V tiles of 64 keys arrive by cp.async, the next
// K tile while P·V runs, as flash_attention.cu's bf16 kernel does. Non-causal, no cache.
// acc[2p], acc[2p + 1] += a · the k32 step at `tile` (shared memory) of the tile's rows
// 16p .. 16p + 15 (keys of K, channels of Vᵀ), ROW_BYTES apart, for every p < ROWS / 16;
// ld_row and ld_byte are the lane's ldmatrix address (see the kernel).
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ void mma_k32_step(float (&acc)[ROWS / 8][4], const uint32_t (&a)[4], const uint8_t* tile,
                                             int ld_row, int ld_byte) {
#pragma unroll
    for (int p = 0; p < ROWS / 16; ++p) {
        uint32_t b[4];
        ldmatrix_x4(b, tile + (p * 16 + ld_row) * ROW_BYTES + ld_byte);
        mma_e4m3(acc[2 * p], a, b[0], b[1]);
        mma_e4m3(acc[2 * p + 1], a, b[2], b[3]);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_M_MMA / 16 * 32)
    flash_attention_e4m3_d128(const uint8_t* __restrict__ q, const float* __restrict__ q_scale,
                              const uint8_t* __restrict__ k, const float* __restrict__ k_scale,
                              const uint8_t* __restrict__ vt, const float* __restrict__ v_scale,
                              __nv_bfloat16* __restrict__ out, int q_len, int kv_len, int padded, int heads, int group,
                              float scale_log2) {
    constexpr int THREADS = BLOCK_M_MMA / 16 * 32;
    __shared__ __align__(16) uint8_t k_tile[BLOCK_N_MMA * K_ROW];
    __shared__ __align__(16) uint8_t v_tile[D * V_ROW];
    const int head = blockIdx.y, kv_head = head / group, kv_heads = heads / group, m0 = blockIdx.x * BLOCK_M_MMA;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row_a = m0 + warp * 16 + g;  // this thread's first query row; the second is 8 below
    // The queries straight from global memory into A fragments, as the Hopper kernel reads them.
    uint32_t qf[D / 32][4];
    query_fragments_e4m3<D>(q, row_a, q_len, heads, head, t, qf);
    const int q_blocks = (q_len + QUANT_ROWS - 1) / QUANT_ROWS, k_blocks = (kv_len + KEYS_FP8 - 1) / KEYS_FP8;
    const float q_scale_log2 = scale_log2 * q_scale[head * q_blocks + m0 / QUANT_ROWS];
    const uint8_t* kh = k + (long)kv_head * D;
    const long k_stride = (long)kv_heads * D;
    const uint8_t* vh = vt + (long)kv_head * D * padded;
    const int n_tiles = key_tiles(kv_len, kv_len, BLOCK_N_MMA);

    float o[D / 8][4] = {};
    OnlineSoftmax softmax;
    // ldmatrix's four 8 × 16-byte matrices of a k32 step over 16 rows (keys of K, channels of
    // Vᵀ): rows 0-7 then 8-15 of the first 16 bytes and of the second; lane l addresses row
    // l % 8 of matrix l / 8, so that b[0], b[1] are the first 8 rows' operand and b[2], b[3]
    // the next 8's.
    const int m = lane / 8, ld_row = (m / 2) * 8 + lane % 8, ld_byte = (m % 2) * 16;

    load_bytes<BLOCK_N_MMA, D, K_ROW, THREADS>(k_tile, kh, 0, kv_len, k_stride);
    cp_async_commit();
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N_MMA;
        // Vᵀ's keys n0 .. n0 + 63 of every channel: within `padded`, which the transpose zeroed
        // past `kv_len`.
        load_bytes<D, BLOCK_N_MMA, V_ROW, THREADS>(v_tile, vh + n0, 0, D, padded);
        cp_async_commit();
        cp_async_wait<1>();  // K tile j has landed
        __syncthreads();

        float s[BLOCK_N_MMA / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) mma_k32_step<BLOCK_N_MMA, K_ROW>(s, qf[kk], k_tile + kk * 32, ld_row, ld_byte);
        // Never zero, which would turn a masked score's −inf into NaN.
        const float tile_scale = fmaxf(q_scale_log2 * k_scale[kv_head * k_blocks + n0 / KEYS_FP8], FLT_MIN);
        OnlineSoftmax::rescale(o, softmax.update(s, tile_scale, n0 + BLOCK_N_MMA > kv_len, n0, kv_len, -1, row_a, t));
        uint32_t pf[BLOCK_N_MMA / 32][4];
        p_fragments_e4m3(s, pf);

        cp_async_wait<0>();  // V tile j has landed
        __syncthreads();     // every warp is done with K tile j
        if (j + 1 < n_tiles) load_bytes<BLOCK_N_MMA, D, K_ROW, THREADS>(k_tile, kh, n0 + BLOCK_N_MMA, kv_len, k_stride);
        cp_async_commit();

#pragma unroll
        for (int kk = 0; kk < BLOCK_N_MMA / 32; ++kk) mma_k32_step<D, V_ROW>(o, pf[kk], v_tile + kk * 32, ld_row, ld_byte);
        __syncthreads();  // every warp is done with V tile j
    }
    // V's per-channel scales, then the row sums.
    scale_by_channels<D>(o, v_scale, kv_head, t);
    softmax.store<__nv_bfloat16>(o, out, row_a, q_len, heads, head, t);
}
