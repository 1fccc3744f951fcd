// Fused attention forward for Hopper (sm_90a): flash_attention.cu's scheme with both products
// on warpgroup tensor-core instructions (wgmma), which mma.sync cannot feed fast enough on
// an H100/H200. Each warpgroup (4 warps) owns 64 query rows; its queries stay in registers as
// the A operand of S = Q·Kᵀ, and P, the softmax of S, is the register A operand of O += P·V.
// K and V tiles of 64 keys arrive by cp.async into 128-byte-swizzled shared memory that
// wgmma reads as its B operand: K as stored (K-major), V as stored too (MN-major, through
// wgmma's B transpose), so nothing is transposed. Tiles are double-buffered: the next one
// loads while this one's products run. WARPGROUPS warpgroups per CTA share each tile.
//
// Same arguments, layouts, masking and GQA as flash_attention.cu, which the launcher picks
// on other GPUs.
#include "tile.cuh"

namespace {

constexpr int BLOCK_N = 64;              // keys per tile
constexpr int STAGES = 3;                // tiles in flight: one in use, two loading
constexpr int SWIZZLE_ROW = 128;         // bytes per row of a swizzle atom (64 16-bit values)
constexpr int SWIZZLE_ATOM = 8 * 128;    // 8 rows: the unit the XOR pattern repeats over

// The descriptor of a 128-byte-swizzled shared-memory operand (sm_90 GMMA descriptor):
// start address, leading and stride byte offsets (each in 16-byte units) and the layout type.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(leading >> 4) << 16) | ((uint64_t)(stride >> 4) << 32) |
           (1ull << 62);
}

#define ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define ACC32 ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7)
#define ACC64 ACC32, ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15)
#define REGS32                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define REGS64                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "     \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D = A·B (+ D when scale_d) for one m64nNk16 step of a warpgroup: A 64×16 in registers, four
// per thread in mma.sync's A-fragment layout (warp w: rows 16w..16w+15), B 16×N in shared
// memory through `desc` (TRANS_B: MN-major), D in mma.sync's accumulator layout, N/8 n-tiles.
template <typename T, int N>
struct Wgmma;

// The operands after D's registers (%N..): A's four registers, B's descriptor, scale-d, trans-b.
#define TAIL32 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
#define TAIL64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
#define PRED32 "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
#define PRED64 "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"

#define WGMMA(T, PTX_TYPE, N, REGS, ACC, PRED, TAIL)                                                          \
    template <>                                                                                            \
    struct Wgmma<T, N> {                                                                                   \
        template <int TRANS_B>                                                                             \
        static __device__ __forceinline__ void run(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc, \
                                                   int scale_d) {                                          \
            asm volatile(PRED "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " " REGS \
                         TAIL                                                                              \
                         : ACC                                                                             \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B)); \
        }                                                                                                  \
    };

WGMMA(__nv_bfloat16, "bf16", 64, REGS32, ACC32, PRED32, TAIL32)
WGMMA(__nv_bfloat16, "bf16", 128, REGS64, ACC64, PRED64, TAIL64)
#undef WGMMA
#undef TAIL32
#undef TAIL64
#undef PRED32
#undef PRED64
#undef REGS64
#undef REGS32
#undef ACC64
#undef ACC32
#undef ACC4

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins accumulator registers at this point of the program: wgmma writes them asynchronously,
// so the compiler must not move their reads above the wait nor their writes below the issue.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// Where this thread copies from and to in every tile: BLOCK_N rows of D elements go to a
// swizzled tile, column block c (64 values) of row r at tile + c · BLOCK_N · 128 + r · 128,
// its 16-byte chunk j stored at chunk j ^ (r % 8). The same pieces every tile, so computed
// once. Rows at or past `len` become zeros (masked keys must not bring NaN through V).
template <typename T, int D, int THREADS>
struct TileCopy {
    static constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    static constexpr int PIECES = BLOCK_N * CHUNKS / THREADS;
    static_assert(BLOCK_N * CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
    int row[PIECES];
    uint32_t dst[PIECES];
    long src[PIECES];

    __device__ __forceinline__ TileCopy(long row_stride) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const int c = threadIdx.x + i * THREADS, r = c / CHUNKS, chunk = c % CHUNKS;
            row[i] = r;
            dst[i] = (chunk / 8) * (BLOCK_N * SWIZZLE_ROW) + r * SWIZZLE_ROW + (((chunk % 8) ^ (r % 8)) * 16);
            src[i] = r * row_stride + chunk * 8;
        }
    }

    __device__ __forceinline__ void run(uint32_t tile, const T* base, int row0, int len) const {
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const bool valid = row0 + row[i] < len;
            cp_async16(tile + dst[i], valid ? base + src[i] : base, valid);
        }
    }
};

template <typename T, int D, int WARPGROUPS>
__device__ void flash_forward_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                   T* __restrict__ out, const unsigned* __restrict__ position, int q_len, int kv_len,
                                   int heads, int group, long q_row, long q_head, long k_row, long k_head,
                                   long v_row, long v_head, float scale_log2, int causal, int defer_above) {
    if (position) kv_len = min(kv_len, (int)*position + q_len);
    if (kv_len > defer_above) return;
    constexpr int BLOCK_M = 64 * WARPGROUPS;
    constexpr int THREADS = 128 * WARPGROUPS;
    constexpr int TILE_BYTES = BLOCK_N * D * 2;
    static_assert(BLOCK_M * (D + 8) * 2 <= 2 * STAGES * TILE_BYTES, "the queries pass through the tile buffers");
    extern __shared__ uint8_t dynamic_smem[];
    // Swizzle atoms must start on 1,024-byte boundaries: the XOR uses address bits 7-9.
    const uint32_t smem = (smem_addr(dynamic_smem) + SWIZZLE_ATOM - 1) & ~(uint32_t)(SWIZZLE_ATOM - 1);
    uint8_t* smem_ptr = dynamic_smem + (smem - smem_addr(dynamic_smem));
    // Stage i: K tile at smem + 2i · TILE_BYTES, V tile right after it.
    const auto k_tile = [&](int stage) { return smem + 2 * stage * TILE_BYTES; };
    const auto v_tile = [&](int stage) { return smem + (2 * stage + 1) * TILE_BYTES; };

    const int head = blockIdx.y;
    const int kv_head = head / group;
    const int m0 = blockIdx.x * BLOCK_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wg_row0 = m0 + (warp / 4) * 64;  // this warpgroup's first query row
    const int g = lane / 4, t = lane % 4;
    const T* qh = q + head * q_head;
    const T* kh = k + kv_head * k_head;
    const T* vh = v + kv_head * v_head;

    uint32_t qf[D / 16][4];
    load_queries<T, D, BLOCK_M, THREADS>(qf, reinterpret_cast<T*>(smem_ptr), qh, m0, q_len, q_row);

    const int offset = kv_len - q_len;  // causal position of query 0
    const int n_tiles = key_tiles(kv_len, causal ? offset + m0 + BLOCK_M : kv_len, BLOCK_N);
    const int row_a = m0 + warp * 16 + g;  // this thread's first query row; the second is 8 below

    float o[D / 8][4] = {};
    OnlineSoftmax softmax;
    const int causal_offset = causal ? offset : -1;
    const auto masked = [&](int n0) {
        return n0 + BLOCK_N > kv_len || (causal && n0 + BLOCK_N - 1 > offset + wg_row0);
    };
    // Tile j lives in stage j % STAGES, one cp.async group per tile (empty past the last), so
    // that waiting for a tile is always waiting until the same number of groups is pending.
    const TileCopy<T, D, THREADS> copy_k(k_row), copy_v(v_row);
    const auto load = [&](int j, int stage) {
        if (j < n_tiles) {
            copy_k.run(k_tile(stage), kh + (long)j * BLOCK_N * k_row, j * BLOCK_N, kv_len);
            copy_v.run(v_tile(stage), vh + (long)j * BLOCK_N * v_row, j * BLOCK_N, kv_len);
        }
        cp_async_commit();
    };
    // S = Q Kᵀ of tile j into s, issued but not waited for: B is the K tile as stored,
    // K-major; a k16 step moves 32 bytes along a row (inside one swizzle atom), each 64 values
    // of d are one column block.
    const auto issue_scores = [&](float (&s)[BLOCK_N / 8][4], int stage) {
        const uint64_t desc = smem_desc(k_tile(stage), 16, SWIZZLE_ATOM);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            // The address field counts 16-byte units; these offsets never carry out of it.
            const uint32_t offset = (kk / 4) * (BLOCK_N * SWIZZLE_ROW) + (kk % 4) * 32;
            Wgmma<T, BLOCK_N>::template run<0>(s, qf[kk], desc + (offset >> 4), kk > 0);
        }
        wgmma_commit();
    };
    // Waits until tile j is in shared memory, for every thread's copies and for wgmma's reads
    // (cp.async writes through the generic proxy, wgmma reads through the async one).
    const auto landed = [&]() {
        cp_async_wait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    };

    if (n_tiles == 0) {  // no visible key: zeros
        softmax.store<T>(o, out, row_a, q_len, heads, head, t);
        return;
    }
#pragma unroll
    for (int j = 0; j < STAGES; ++j) load(j, j);
    cp_async_wait<STAGES - 1>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float s[BLOCK_N / 8][4];  // S of a tile, then (softmax) its P until the next S is issued
    uint32_t pf[BLOCK_N / 16][4];  // P as the A operand of P·V
    issue_scores(s, 0);
    wgmma_wait<0>();
    fence_registers(s);
    softmax.update(s, scale_log2, masked(0), 0, kv_len, causal_offset, row_a, t);

    // O += P V of tile j, issued but not waited for: B is the V tile as stored, MN-major (d
    // contiguous); a k16 step is 16 rows of keys (two 8-row groups, SWIZZLE_ATOM apart), the
    // two 64-value halves of d a column block apart.
    const auto issue_values = [&](int stage) {
        const uint64_t desc = smem_desc(v_tile(stage), BLOCK_N * SWIZZLE_ROW, SWIZZLE_ATOM);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            Wgmma<T, D>::template run<1>(o, pf[kk], desc + ((kk * 16 * SWIZZLE_ROW) >> 4), 1);
        wgmma_commit();
    };

    // Iteration j: S of tile j + 1 and P·V of tile j run on the tensor cores while the
    // softmax of tile j + 1 runs on the other units; O is rescaled once its product ends.
    // (No branch inside: ptxas serializes wgmma when it cannot prove which group a wait ends.)
    int stage = 0, next_stage = 1;  // j % STAGES, (j + 1) % STAGES
    for (int j = 0; j + 1 < n_tiles; ++j) {
        landed();  // tile j + 1
        OnlineSoftmax::fragments<T>(s, pf);  // before s takes the next scores
        issue_scores(s, next_stage);
        issue_values(stage);
        wgmma_wait<1>();  // the scores (committed first) are done; P·V may still run
        fence_registers(s);
        const int n0 = (j + 1) * BLOCK_N;
        const float2 alpha = softmax.update(s, scale_log2, masked(n0), n0, kv_len, causal_offset, row_a, t);
        wgmma_wait<0>();
        fence_registers(o);
        OnlineSoftmax::rescale(o, alpha);
        __syncthreads();  // every warpgroup is done with tile j's stage before it is refilled
        load(j + STAGES, stage);
        stage = next_stage;
        next_stage = next_stage + 1 == STAGES ? 0 : next_stage + 1;
    }
    OnlineSoftmax::fragments<T>(s, pf);
    issue_values(stage);
    wgmma_wait<0>();
    fence_registers(o);
    softmax.store<T>(o, out, row_a, q_len, heads, head, t);
}

}  // namespace

// Dynamic shared memory: STAGES stages of K and V tiles plus alignment slack (see
// `flash_attention_sm90_smem_bytes` in src/lib.rs).
#define FLASH_SM90_KERNEL(NAME, T, D, WG)                                                                     \
    extern "C" __global__ void __launch_bounds__(WG * 128)                                                    \
        NAME(const T* q, const T* k, const T* v, T* out, const unsigned* position, int q_len, int kv_len,     \
             int heads, int group, long q_row, long q_head, long k_row, long k_head, long v_row, long v_head, \
             float scale_log2, int causal, int defer_above) {                                                 \
        flash_forward_sm90<T, D, WG>(q, k, v, out, position, q_len, kv_len, heads, group, q_row, q_head,      \
                                     k_row, k_head, v_row, v_head, scale_log2, causal, defer_above);          \
    }

FLASH_SM90_KERNEL(flash_attention_sm90_bf16_d128, __nv_bfloat16, 128, 2)
