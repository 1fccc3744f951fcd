// What the attention kernels share: shared-memory addresses, cp.async copies, ldmatrix loads
// and the mma.sync m16n8k16 fragment (whose A and accumulator layouts the Hopper kernel's
// register operands share).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (a shared-window byte address); zero-filled when !valid (rows
// past the end).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

template <typename T>
struct Mma;

// D += A·B for one m16n8k16 tile (A 16×16 row-major, B 16×8 column-major, f32 accumulate),
// and the packing of two f32 values into one register of T.
#define MMA(T, PTX_TYPE, PAIR, TO_PAIR)                                                                      \
    template <>                                                                                            \
    struct Mma<T> {                                                                                        \
        static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,     \
                                                   uint32_t b1) {                                          \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                    \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                    \
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                  \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                  \
        }                                                                                                  \
        static __device__ __forceinline__ uint32_t pack(float lo, float hi) {                             \
            PAIR v = TO_PAIR(lo, hi);                                                                      \
            return *reinterpret_cast<uint32_t*>(&v);                                                       \
        }                                                                                                  \
    };

MMA(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
MMA(__half, "f16", __half2, __floats2half2_rn)
#undef MMA

// Copies ROWS rows of D elements starting at `row0` into a padded tile, THREADS threads
// (`tid` is this one's index among them); rows at or past `len` become zeros so that masked
// keys can never inject NaN through V.
template <typename T, int D, int ROW, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int row0, int len, long row_stride,
                                          int tid = threadIdx.x) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
        int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        bool valid = row0 + r < len;
        const T* src = valid ? base + (long)(row0 + r) * row_stride + col : base;
        cp_async16(smem_addr(tile + r * ROW + col), src, valid);
    }
}

// The queries of rows m0.. of one head into registers, as the A fragments of D/16 k16 steps
// (warp w: rows 16w..16w+15), through shared memory `staging` (ROWS padded rows; free again
// on return). Rows at or past `q_len` are zeros. THREADS threads take part (`tid` is this
// one's index among them) and `sync` is a barrier among them.
template <typename T, int D, int ROWS, int THREADS, typename Sync>
__device__ __forceinline__ void load_queries(uint32_t (&qf)[D / 16][4], T* staging, const T* qh, int m0, int q_len,
                                             long q_row, int tid, Sync sync) {
    constexpr int ROW = D + 8;  // padding: ldmatrix's 8 row addresses fall in distinct banks
    load_tile<T, D, ROW, ROWS, THREADS>(staging, qh, m0, q_len, q_row, tid);
    cp_async_commit();
    cp_async_wait<0>();
    sync();
    const int warp = tid / 32, lane = tid % 32;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], staging + (warp * 16 + lane % 16) * ROW + kk * 16 + (lane / 16) * 8);
    sync();
}

// Tiles of `block_n` keys a CTA visits: those holding any of the first `visible` keys (all
// `kv_len`, or under a causal mask up to its last query's position), at most all of them.
__device__ __forceinline__ int key_tiles(int kv_len, int visible, int block_n) {
    return (min(kv_len, visible) + block_n - 1) / block_n;
}

// 2^x in one MUFU instruction (relative error about 2^-22; 2^-inf = 0). exp2f would add range
// checks for denormal results, which the softmax flushes anyway.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The running softmax of a thread's two query rows, `a` (fragment row g) and `b` (g + 8), in
// base 2, over tiles of scores in the m16n8 accumulator layout: s[i][0..1] are row a's keys
// 8i + 2t, 8i + 2t + 1 and s[i][2..3] row b's (t = lane % 4). The rows' other keys live in
// the three lanes sharing g, hence the shuffles over lane bits 0 and 1.
struct OnlineSoftmax {
    float max_a = -INFINITY, max_b = -INFINITY, sum_a = 0.f, sum_b = 0.f;

    // Masks keys at or past `kv_len` and, when `causal_offset >= 0`, keys after the query's
    // position (row + causal_offset), and replaces the raw scores by P of the scaled ones
    // (see `fragments`), adding to the running sums. Returns the factors (row a, row b) by
    // which O must be rescaled to the new maxima before P·V is added (1 while they stay): a
    // separate step, so that a pipelined kernel can do it once an earlier product into O ends.
    template <int NT>
    __device__ __forceinline__ float2 update(float (&s)[NT][4], float scale_log2, bool masked, int n0, int kv_len,
                                             int causal_offset, int row_a, int t) {
        // Maxima of the raw scores (scale_log2 > 0 keeps the order); P = 2^(s · scale − max),
        // one FFMA and one MUFU.EX2 per score.
        float tile_a = -INFINITY, tile_b = -INFINITY;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            if (masked) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int key = n0 + i * 8 + 2 * t + (e & 1);
                    int row = e < 2 ? row_a : row_a + 8;
                    if (key >= kv_len || (causal_offset >= 0 && key > causal_offset + row)) s[i][e] = -INFINITY;
                }
            }
            tile_a = fmaxf(tile_a, fmaxf(s[i][0], s[i][1]));
            tile_b = fmaxf(tile_b, fmaxf(s[i][2], s[i][3]));
        }
#pragma unroll
        for (int w = 1; w < 4; w *= 2) {
            tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffff, tile_a, w));
            tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffff, tile_b, w));
        }
        tile_a *= scale_log2;
        tile_b *= scale_log2;
        // The maxima move only when a row of the warp would see P above 2^8: O and the sums
        // share the stale maximum, so keeping it is exact, and most tiles skip the rescale of
        // O (two FMULs per score at 64 keys a tile).
        float alpha_a = 1.f, alpha_b = 1.f;
        if (__any_sync(0xffffffff, tile_a > max_a + 8.f || tile_b > max_b + 8.f)) {
            const float new_a = fmaxf(max_a, tile_a), new_b = fmaxf(max_b, tile_b);
            // A row with no visible key yet keeps max -inf; its P and alpha use 0 (no inf - inf).
            alpha_a = exp2_approx(max_a - (new_a == -INFINITY ? 0.f : new_a));
            alpha_b = exp2_approx(max_b - (new_b == -INFINITY ? 0.f : new_b));
            max_a = new_a;
            max_b = new_b;
            sum_a *= alpha_a;
            sum_b *= alpha_b;
        }
        const float base_a = max_a == -INFINITY ? 0.f : max_a, base_b = max_b == -INFINITY ? 0.f : max_b;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            float p0 = exp2_approx(fmaf(s[i][0], scale_log2, -base_a));
            float p1 = exp2_approx(fmaf(s[i][1], scale_log2, -base_a));
            float p2 = exp2_approx(fmaf(s[i][2], scale_log2, -base_b));
            float p3 = exp2_approx(fmaf(s[i][3], scale_log2, -base_b));
            sum_a += p0 + p1;
            sum_b += p2 + p3;
            s[i][0] = p0, s[i][1] = p1, s[i][2] = p2, s[i][3] = p3;
        }
        return make_float2(alpha_a, alpha_b);
    }

    // P in the accumulator layout as the A fragments of the P·V product: two n-tiles per k16
    // step.
    template <typename T, int NT>
    static __device__ __forceinline__ void fragments(const float (&p)[NT][4], uint32_t (&pf)[NT / 2][4]) {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            pf[i / 2][(i % 2) * 2] = Mma<T>::pack(p[i][0], p[i][1]);
            pf[i / 2][(i % 2) * 2 + 1] = Mma<T>::pack(p[i][2], p[i][3]);
        }
    }

    template <int OT>
    static __device__ __forceinline__ void rescale(float (&o)[OT][4], float2 alpha) {
        if (!__any_sync(0xffffffff, alpha.x != 1.f || alpha.y != 1.f)) return;
#pragma unroll
        for (int i = 0; i < OT; ++i) {
            o[i][0] *= alpha.x;
            o[i][1] *= alpha.x;
            o[i][2] *= alpha.y;
            o[i][3] *= alpha.y;
        }
    }

    // Divides by the row sums and writes rows a and b (those below `q_len`) of one head into
    // the contiguous `[q_len, heads, 8 · OT]` output.
    template <typename T, int OT>
    __device__ __forceinline__ void store(const float (&o)[OT][4], T* out, int row_a, int q_len, int heads, int head,
                                          int t) {
#pragma unroll
        for (int w = 1; w < 4; w *= 2) {
            sum_a += __shfl_xor_sync(0xffffffff, sum_a, w);
            sum_b += __shfl_xor_sync(0xffffffff, sum_b, w);
        }
        const float inv_a = sum_a > 0.f ? 1.f / sum_a : 0.f, inv_b = sum_b > 0.f ? 1.f / sum_b : 0.f;
        const int row_b = row_a + 8;
        constexpr int D = OT * 8;
#pragma unroll
        for (int i = 0; i < OT; ++i) {
            const int col = i * 8 + 2 * t;
            if (row_a < q_len)
                *reinterpret_cast<uint32_t*>(out + ((long)row_a * heads + head) * D + col) =
                    Mma<T>::pack(o[i][0] * inv_a, o[i][1] * inv_a);
            if (row_b < q_len)
                *reinterpret_cast<uint32_t*>(out + ((long)row_b * heads + head) * D + col) =
                    Mma<T>::pack(o[i][2] * inv_b, o[i][3] * inv_b);
        }
    }
};

}  // namespace
