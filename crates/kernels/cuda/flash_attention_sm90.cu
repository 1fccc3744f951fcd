// Fused attention forward for Hopper (sm_90a): flash_attention.cu's scheme with both products
// on warpgroup tensor-core instructions (wgmma), which mma.sync cannot feed fast enough on
// an H100/H200, organized as FlashAttention-3 does. A CTA has three warpgroups: a producer
// that only moves K and V tiles of 64 keys with the tensor memory accelerator (TMA) into a
// ring of shared-memory stages, and two consumers of 64 query rows each. Stages change hands
// on mbarriers (a "full" one the TMA completes by its byte count, an "empty" one every
// consumer thread arrives on), so the consumers never wait for each other: while one does
// its softmax the other keeps the tensor cores busy. setmaxnreg hands the producer's
// registers to the consumers.
//
// A consumer's queries stay in registers as the A operand of S = Q·Kᵀ, and P, the softmax of
// S, is the register A operand of O += P·V. The TMA writes the tiles 128-byte-swizzled, as
// wgmma reads its B operand: K as stored (K-major), V as stored too (MN-major, through
// wgmma's B transpose), so nothing is transposed.
//
// K and V come as 3-D tensor maps (dims innermost first: d, rows, KV heads; boxes of 64 × 64
// × 1), which the launcher encodes (src/lib.rs); rows past the map's end arrive as zeros.
// Otherwise the same layouts, masking and GQA as flash_attention.cu, which the launcher picks
// on other GPUs.
#include <cuda.h>
#include <cuda_fp8.h>
#include <cfloat>

#include "fp8_attention.cuh"
#include "tile.cuh"

namespace {

constexpr int D = 128;                   // head size
constexpr int BLOCK_N = 64;              // keys per tile
constexpr int STAGES = 4;                // K/V tile pairs in the ring
constexpr int SWIZZLE_ROW = 128;         // bytes per row of a swizzle atom (64 16-bit values)
constexpr int SWIZZLE_ATOM = 8 * 128;    // 8 rows: the unit the XOR pattern repeats over
constexpr int TILE_BYTES = BLOCK_N * D * 2;
constexpr int STAGING_ROW = D + 8;       // a query staging row, padded for ldmatrix
// Registers per thread after setmaxnreg: 128 · 40 + 256 · 232 ≤ 65,536.
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;

// The layout type of an sm_90 GMMA descriptor (bits 62-63) this file uses.
constexpr uint64_t SWIZZLE_128B_LAYOUT = 1;

// The descriptor of a swizzled shared-memory operand (sm_90 GMMA descriptor): start address,
// leading and stride byte offsets (each in 16-byte units) and the layout type.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride,
                                              uint64_t layout = SWIZZLE_128B_LAYOUT) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(leading >> 4) << 16) | ((uint64_t)(stride >> 4) << 32) |
           (layout << 62);
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

// D = A·B (+ D when scale_d) for one m64nNk32 step with E4M3 operands: A 64×32 in registers,
// four bytes a register in mma.sync's m16n8k32 A layout (register r: row g + 8 (r & 1),
// columns 4t + 16 (r >> 1) .. + 3), B 32×N in shared memory through `desc`, always K-major
// (8-bit wgmma has no transpose).
template <int N>
struct WgmmaE4m3;

#define TAIL64_E4M3 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
#define WGMMA_E4M3(N, REGS, ACC, PRED, TAIL)                                                                  \
    template <>                                                                                            \
    struct WgmmaE4m3<N> {                                                                                  \
        static __device__ __forceinline__ void run(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc, \
                                                   int scale_d) {                                          \
            asm volatile(PRED "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS TAIL         \
                         : ACC                                                                             \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));           \
        }                                                                                                  \
    };

WGMMA_E4M3(128, REGS64, ACC64, PRED64, TAIL64_E4M3)
#undef WGMMA_E4M3

#undef TAIL64_E4M3
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

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of `bar` with this parity has completed (a fresh barrier counts as
// having completed the phase before its first, parity 1).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// One box of a 3-D tensor map (coordinates innermost first) into shared memory, counted
// against `bar`'s expected bytes.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
// A barrier among the 128 threads of one warpgroup (ids 1, 2; 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

// A ring of STAGES stages at `bars`: a "full" mbarrier per stage (bars + 8 · stage), which the
// producer's copies complete, then an "empty" one (bars + 8 · (STAGES + stage)), on which both
// consumers' 256 threads arrive. Thread 0 initializes them; the whole CTA waits for it.
template <int STAGES_N>
__device__ __forceinline__ void init_ring(uint32_t bars) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES_N; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (STAGES_N + s), 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// The producer warpgroup: gives its registers to the consumers, then thread 0 fills the ring
// with tiles 0 .. n_tiles − 1 in turn, each `bytes` long, `load(stage, j)` issuing tile j's
// copies into `stage` once both consumers have let it go.
template <int STAGES_N, typename Load>
__device__ __forceinline__ void produce(uint32_t bars, int n_tiles, uint32_t bytes, Load load) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (threadIdx.x == 0) {
        for (int j = 0; j < n_tiles; ++j) {
            const int stage = j % STAGES_N;
            mbar_wait(bars + 8 * (STAGES_N + stage), ((j / STAGES_N) & 1) ^ 1);
            mbar_expect_tx(bars + 8 * stage, bytes);
            load(stage, j);
        }
    }
}

}  // namespace

// Grid: (q_len / 128 rounded up, heads); 384 threads. Dynamic shared memory (SM90_SMEM_BYTES
// in src/lib.rs): 1 KiB to align the swizzle atoms, STAGES pairs of K and V tiles, the two
// consumers' query staging, 2 · STAGES mbarriers. `position`, when not null, is a KV cache's
// device-side position of query 0: the maps then span the cache's capacity (`kv_len`) and
// only its first *position + q_len rows count.
extern "C" __global__ void __launch_bounds__(384, 1)
    flash_attention_sm90_bf16_d128(const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                                   const __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ out,
                                   const unsigned* __restrict__ position, int q_len, int kv_len, int heads, int group,
                                   long q_row, long q_head, float scale_log2, int causal) {
    using T = __nv_bfloat16;
    constexpr int BLOCK_M = 128;
    constexpr int Q_STAGING = 64 * STAGING_ROW * 2;
    const int capacity = kv_len;
    if (position) kv_len = min(kv_len, (int)*position + q_len);
    extern __shared__ uint8_t dynamic_smem[];
    // Swizzle atoms must start on 1,024-byte boundaries: the XOR uses address bits 7-9.
    const uint32_t smem = (smem_addr(dynamic_smem) + SWIZZLE_ATOM - 1) & ~(uint32_t)(SWIZZLE_ATOM - 1);
    uint8_t* smem_ptr = dynamic_smem + (smem - smem_addr(dynamic_smem));
    // Stage i: K tile at smem + 2i · TILE_BYTES, V tile right after it; each tile is two
    // column blocks of 64 rows × 128 bytes (d 0..63, then 64..127).
    const auto k_tile = [&](int stage) { return smem + 2 * stage * TILE_BYTES; };
    const auto v_tile = [&](int stage) { return smem + (2 * stage + 1) * TILE_BYTES; };
    T* staging = reinterpret_cast<T*>(smem_ptr + 2 * STAGES * TILE_BYTES);
    const uint32_t bars = smem + 2 * STAGES * TILE_BYTES + 2 * Q_STAGING;
    const auto full = [&](int stage) { return bars + 8 * stage; };
    const auto empty = [&](int stage) { return bars + 8 * (STAGES + stage); };

    const int head = blockIdx.y, kv_head = head / group, m0 = blockIdx.x * BLOCK_M;
    const int warpgroup = threadIdx.x / 128;
    const int offset = kv_len - q_len;  // causal position of query 0
    const int n_tiles = key_tiles(kv_len, causal ? offset + m0 + BLOCK_M : kv_len, BLOCK_N);

    init_ring<STAGES>(bars);
    if (warpgroup == 0) {  // the producer: one thread issues every copy
        produce<STAGES>(bars, n_tiles, 2 * TILE_BYTES, [&](int stage, int j) {
            for (int block = 0; block < 2; ++block) {
                const uint32_t at = block * BLOCK_N * SWIZZLE_ROW;
                tma_load(k_tile(stage) + at, &k_map, full(stage), block * 64, j * BLOCK_N, kv_head);
                tma_load(v_tile(stage) + at, &v_map, full(stage), block * 64, j * BLOCK_N, kv_head);
            }
        });
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));

    // Consumer c (0, 1): query rows wg_row0 .. wg_row0 + 63; tid is the thread's index in it.
    const int c = warpgroup - 1, tid = threadIdx.x - 128 * warpgroup;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wg_row0 = m0 + 64 * c;
    uint32_t qf[D / 16][4];
    load_queries<T, D, 64, 128>(qf, staging + c * 64 * STAGING_ROW, q + head * q_head, wg_row0, q_len, q_row, tid,
                                [c] { warpgroup_sync(1 + c); });
    const int row_a = wg_row0 + warp * 16 + g;  // this thread's first query row; the second is 8 below

    float o[D / 8][4] = {};
    OnlineSoftmax softmax;
    if (n_tiles == 0) {  // no visible key: zeros
        softmax.store<T>(o, out, row_a, q_len, heads, head, t);
        return;
    }
    const int causal_offset = causal ? offset : -1;
    const auto masked = [&](int n0) {
        return n0 + BLOCK_N > kv_len || (causal && n0 + BLOCK_N - 1 > offset + wg_row0);
    };
    // S = Q Kᵀ of a stage's tile into s, issued but not waited for: B is the K tile as stored,
    // K-major; a k16 step moves 32 bytes along a row (inside one swizzle atom), each 64 values
    // of d are one column block.
    const auto issue_scores = [&](float (&s)[BLOCK_N / 8][4], int stage) {
        const uint64_t desc = smem_desc(k_tile(stage), 16, SWIZZLE_ATOM);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            // The address field counts 16-byte units; these offsets never carry out of it.
            const uint32_t at = (kk / 4) * (BLOCK_N * SWIZZLE_ROW) + (kk % 4) * 32;
            Wgmma<T, BLOCK_N>::template run<0>(s, qf[kk], desc + (at >> 4), kk > 0);
        }
        wgmma_commit();
    };
    // O += P V of a stage's tile, issued but not waited for: B is the V tile as stored,
    // MN-major (d contiguous); a k16 step is 16 rows of keys (two 8-row groups, SWIZZLE_ATOM
    // apart), the two 64-value halves of d a column block apart.
    uint32_t pf[BLOCK_N / 16][4];  // P as the A operand of P·V
    const auto issue_values = [&](int stage) {
        const uint64_t desc = smem_desc(v_tile(stage), BLOCK_N * SWIZZLE_ROW, SWIZZLE_ATOM);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            Wgmma<T, D>::template run<1>(o, pf[kk], desc + ((kk * 16 * SWIZZLE_ROW) >> 4), 1);
        wgmma_commit();
    };

    float s[BLOCK_N / 8][4];  // S of a tile, then (softmax) its P until the next S is issued
    mbar_wait(full(0), 0);
    issue_scores(s, 0);
    wgmma_wait<0>();
    fence_registers(s);
    softmax.update(s, scale_log2, masked(0), 0, kv_len, causal_offset, row_a, t);
    // Iteration j: S of tile j + 1 and P·V of tile j run on the tensor cores while the
    // softmax of tile j + 1 runs on the other units; O is rescaled once its product ends, and
    // then tile j's stage goes back to the producer.
    // (No branch inside: ptxas serializes wgmma when it cannot prove which group a wait ends.)
    for (int j = 0; j + 1 < n_tiles; ++j) {
        const int stage = j % STAGES, next = (j + 1) % STAGES;
        mbar_wait(full(next), ((j + 1) / STAGES) & 1);
        OnlineSoftmax::fragments<T>(s, pf);  // before s takes the next scores
        issue_scores(s, next);
        issue_values(stage);
        wgmma_wait<1>();  // the scores (committed first) are done; P·V may still run
        fence_registers(s);
        const int n0 = (j + 1) * BLOCK_N;
        const float2 alpha = softmax.update(s, scale_log2, masked(n0), n0, kv_len, causal_offset, row_a, t);
        wgmma_wait<0>();
        fence_registers(o);
        OnlineSoftmax::rescale(o, alpha);
        mbar_arrive(empty(stage));
    }
    const int last = (n_tiles - 1) % STAGES;
    // A cache's rows between its filled length and its capacity arrive as whatever the cache
    // holds: their P is zero, but 0 · NaN is not, so the last V tile's rows past the length
    // become zeros (the other consumer writes the same zeros; S ignores them, being masked).
    const int filled = kv_len - (n_tiles - 1) * BLOCK_N;
    if (filled < BLOCK_N && kv_len < capacity) {
        uint8_t* v_last = smem_ptr + (v_tile(last) - smem);
        for (int i = tid; i < 2 * (BLOCK_N - filled) * 8; i += 128) {
            const int block = i / ((BLOCK_N - filled) * 8), row = filled + i / 8 % (BLOCK_N - filled);
            *reinterpret_cast<uint4*>(v_last + block * BLOCK_N * SWIZZLE_ROW + row * SWIZZLE_ROW + (i % 8) * 16) =
                make_uint4(0, 0, 0, 0);
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma's reads
        warpgroup_sync(1 + c);
    }
    OnlineSoftmax::fragments<T>(s, pf);
    issue_values(last);
    wgmma_wait<0>();
    fence_registers(o);
    mbar_arrive(empty(last));
    softmax.store<T>(o, out, row_a, q_len, heads, head, t);
}

// ---- FP8 (E4M3) attention -------------------------------------------------------------------
//
// fp8_attention.cuh's scheme on this file's pipeline: both products on wgmma with E4M3
// operands, which Hopper's tensor cores run at twice bf16's rate, after attention_fp8.cu's
// input passes.
//
// A tile holds 128 keys, where the bf16 kernel's holds 64: the per-tile work besides the
// products (the row maxima's shuffles, the barriers, the waits) is then spread over twice the
// keys, and each wgmma is twice as wide.

namespace {

constexpr int STAGES_FP8 = 6;                 // K/V tile pairs in the ring
constexpr int TILE_BYTES_FP8 = KEYS_FP8 * D;  // a K tile (128 keys × 128 values) or a V tile

}  // namespace

// Grid: (q_len / 128 rounded up, heads); 384 threads. Dynamic shared memory (SMEM_BYTES in
// src/attention_fp8.rs): 1 KiB to align the swizzle atoms, STAGES_FP8 pairs of a K tile (128
// keys × 128 bytes) and a V tile (128 channels × 128 keys), both 128-byte-swizzled,
// 2 · STAGES_FP8 mbarriers. `q` is E4M3 `[q_len, heads, 128]`, the K map's K E4M3 `[kv_len,
// KV heads, 128]`, the V map's V E4M3 transposed; q_scale `[heads, q_len / 64 rounded up]`,
// k_scale `[KV heads, kv_len / 128 rounded up]`, v_scale `[KV heads, 128]`; `out` is bf16
// `[q_len, heads, 128]`. Non-causal, no cache.
extern "C" __global__ void __launch_bounds__(384, 1)
    flash_attention_sm90_e4m3_d128(const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                                   const uint8_t* __restrict__ q, const float* __restrict__ q_scale,
                                   const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                   __nv_bfloat16* __restrict__ out, int q_len, int kv_len, int heads, int group,
                                   float scale_log2) {
    constexpr int BLOCK_M = 128;
    extern __shared__ uint8_t dynamic_smem[];
    const uint32_t smem = (smem_addr(dynamic_smem) + SWIZZLE_ATOM - 1) & ~(uint32_t)(SWIZZLE_ATOM - 1);
    const auto k_tile = [&](int stage) { return smem + 2 * stage * TILE_BYTES_FP8; };
    const auto v_tile = [&](int stage) { return smem + (2 * stage + 1) * TILE_BYTES_FP8; };
    const uint32_t bars = smem + 2 * STAGES_FP8 * TILE_BYTES_FP8;
    const auto full = [&](int stage) { return bars + 8 * stage; };
    const auto empty = [&](int stage) { return bars + 8 * (STAGES_FP8 + stage); };

    const int head = blockIdx.y, kv_head = head / group, m0 = blockIdx.x * BLOCK_M;
    const int warpgroup = threadIdx.x / 128;
    const int n_tiles = key_tiles(kv_len, kv_len, KEYS_FP8);

    init_ring<STAGES_FP8>(bars);
    if (warpgroup == 0) {  // the producer: one thread issues every copy
        produce<STAGES_FP8>(bars, n_tiles, 2 * TILE_BYTES_FP8, [&](int stage, int j) {
            tma_load(k_tile(stage), &k_map, full(stage), 0, j * KEYS_FP8, kv_head);
            tma_load(v_tile(stage), &v_map, full(stage), j * KEYS_FP8, 0, kv_head);
        });
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));

    // Consumer c (0, 1): query rows wg_row0 .. wg_row0 + 63, one Q scale block.
    const int c = warpgroup - 1, tid = threadIdx.x - 128 * warpgroup;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wg_row0 = m0 + 64 * c;
    const int row_a = wg_row0 + warp * 16 + g;  // this thread's first query row; the second is 8 below
    // The queries straight from global memory into A fragments: read once per CTA.
    uint32_t qf[D / 32][4];
    query_fragments_e4m3<D>(q, row_a, q_len, heads, head, t, qf);
    const int q_blocks = (q_len + QUANT_ROWS - 1) / QUANT_ROWS, k_blocks = (kv_len + KEYS_FP8 - 1) / KEYS_FP8;
    const float q_scale_log2 = wg_row0 < q_len ? scale_log2 * q_scale[head * q_blocks + wg_row0 / QUANT_ROWS] : 0.f;
    // A tile's scale from raw scores to base-2 logits; never zero, which would turn a masked
    // score's −inf into NaN (a zero Q or K block has zero scores, which any scale keeps).
    const auto tile_scale = [&](int j) { return fmaxf(q_scale_log2 * k_scale[kv_head * k_blocks + j], FLT_MIN); };

    float o[D / 8][4] = {};
    OnlineSoftmax softmax;
    if (n_tiles == 0) {  // no keys: zeros
        softmax.store<__nv_bfloat16>(o, out, row_a, q_len, heads, head, t);
        return;
    }
    const auto masked = [&](int n0) { return n0 + KEYS_FP8 > kv_len; };
    // S = Q Kᵀ of a stage's tile, issued but not waited for: B is the K tile as stored
    // (K-major, one 128-byte row a key); a k32 step moves 32 bytes along the rows.
    const auto issue_scores = [&](float (&s)[KEYS_FP8 / 8][4], int stage) {
        const uint64_t desc = smem_desc(k_tile(stage), 16, SWIZZLE_ATOM);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) WgmmaE4m3<KEYS_FP8>::run(s, qf[kk], desc + ((kk * 32) >> 4), kk > 0);
        wgmma_commit();
    };
    // O += P V of a stage's tile, issued but not waited for: B is the transposed V tile
    // (K-major, one 128-byte row a channel, as K's); a k32 step moves 32 bytes along the rows.
    uint32_t pf[KEYS_FP8 / 32][4];
    const auto issue_values = [&](int stage) {
        const uint64_t desc = smem_desc(v_tile(stage), 16, SWIZZLE_ATOM);
        fence_registers(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KEYS_FP8 / 32; ++kk) WgmmaE4m3<D>::run(o, pf[kk], desc + ((kk * 32) >> 4), 1);
        wgmma_commit();
    };

    float s[KEYS_FP8 / 8][4];
    mbar_wait(full(0), 0);
    issue_scores(s, 0);
    wgmma_wait<0>();
    fence_registers(s);
    softmax.update(s, tile_scale(0), masked(0), 0, kv_len, -1, row_a, t);
    // As the bf16 kernel: S of tile j + 1 and P·V of tile j on the tensor cores while the
    // softmax of tile j + 1 runs.
    for (int j = 0; j + 1 < n_tiles; ++j) {
        const int stage = j % STAGES_FP8, next = (j + 1) % STAGES_FP8;
        mbar_wait(full(next), ((j + 1) / STAGES_FP8) & 1);
        p_fragments_e4m3(s, pf);
        issue_scores(s, next);
        issue_values(stage);
        wgmma_wait<1>();
        fence_registers(s);
        const int n0 = (j + 1) * KEYS_FP8;
        const float2 alpha = softmax.update(s, tile_scale(j + 1), masked(n0), n0, kv_len, -1, row_a, t);
        wgmma_wait<0>();
        fence_registers(o);
        OnlineSoftmax::rescale(o, alpha);
        mbar_arrive(empty(stage));
    }
    const int last = (n_tiles - 1) % STAGES_FP8;
    p_fragments_e4m3(s, pf);
    issue_values(last);
    wgmma_wait<0>();
    fence_registers(o);
    mbar_arrive(empty(last));
    // V's per-channel scales, then the row sums.
    scale_by_channels<D>(o, v_scale, kv_head, t);
    softmax.store<__nv_bfloat16>(o, out, row_a, q_len, heads, head, t);
}
