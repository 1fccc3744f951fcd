// One input row through a linear layer, y[n] = Σ_k x[k] · w[n, k], with w `[n, k]` row-major
// (the layout of a checkpoint's weight) and f32 accumulation: the shape of every weight
// product of a decode step. It is bound by reading w once, and cuBLAS's kernels for it reach
// 1.4–3.3 TB/s on an H200 (benches/RESULTS.md); this one keeps more loads in flight: each CTA
// owns ROWS outputs and its 256 threads split k between them, every thread issuing its
// 16-byte loads of every row before it uses any.
// The weight is either dense, in x's type (bf16 or f16), or FP8: E4M3 bytes with one f32
// scale per row, y[j] = s[j] · Σ_k x[k] · q[j, k], dequantized in registers (W8A16; x in
// bf16, f16 or f32). A 16-byte load holds 8 dense values or 16 FP8 ones, so FP8 runs twice
// the rows per CTA (the launcher's tile) with one load per row and step where dense takes
// two: the same bytes in flight per thread. Quantizing x too (W8A8, as cuBLASLt's FP8 GEMM
// does for more rows) would put a reduction over it ahead of every product on a decode
// step's critical path: measured at 0.5–0.9× the bf16 GEMV.
// GATE_UP: w is a gated MLP's merged `[gate (n) | up (n)]` weight `[2n, k]` and output i is
// silu(gate_i) · up_i, each product rounded to T first and the SiLU product rounded as the
// silu_mul kernel rounds it: the bits of this kernel without GATE_UP followed by silu_mul,
// in one pass that writes n values instead of 2n (and leaves the down projection a plain
// product, where it had to recompute the SiLU product of its input in every CTA).
// gemv_rotary: the QKV product with the rotary embedding and the KV-cache write of
// rotary.cu in its epilogue (see there).
// Needs k a multiple of a load's values and 16-byte aligned rows (the launcher checks). A
// chain kernel (chain.cuh).
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "chain.cuh"
#include "convert.cuh"
#include "rotate.cuh"

namespace {

constexpr int THREADS = 256;

// The weight's formats: a row of T, or of E4M3 bytes with one f32 scale per row.
struct Dense {};
struct Fp8 {};

template <typename T, typename W>
struct Format {
    static constexpr bool FP8 = std::is_same<W, Fp8>::value;
    static constexpr int VALUES = FP8 ? 16 : 16 / sizeof(T);  // values in a 16-byte weight load
    static constexpr int X_LOADS = VALUES * sizeof(T) / 16;   // 16-byte loads of x they take
    static constexpr int UNROLL = FP8 ? 1 : 2;                // weight loads per row and step
};

// Σ w[i] · x[i] over a 16-byte load of weight values and the x values they multiply.
template <typename T, typename W>
__device__ __forceinline__ float dot_load(uint4 w_raw, const uint4 (&x_raw)[Format<T, W>::X_LOADS]) {
    const T* x = reinterpret_cast<const T*>(x_raw);
    float s = 0.f;
    if constexpr (Format<T, W>::FP8) {
        // The load's byte order is the values' order, and a pair converts its lower byte to
        // the lower half.
        const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&w_raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
            const float2 w = __half22float2(*reinterpret_cast<const __half2*>(&raw));
            s += w.x * to_f32(x[2 * i]);
            s += w.y * to_f32(x[2 * i + 1]);
        }
    } else {
        const T* w = reinterpret_cast<const T*>(&w_raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += to_f32(w[i]) * to_f32(x[i]);
    }
    return s;
}

// Σ_k x[k] · w[rows[r], k] for the CTA's W_ROWS weight rows, into `partial` (a sum per warp
// and row; row_sum adds them up in every thread after it returns), unscaled. Every thread
// issues UNROLL · W_ROWS 16-byte loads before it uses any. The caller has released the chain.
template <typename T, typename W, int W_ROWS>
__device__ void dot_rows(const T* x, const void* __restrict__ w, const int (&rows)[W_ROWS], int k,
                         float (&partial)[THREADS / 32][W_ROWS]) {
    using F = Format<T, W>;
    constexpr int UNROLL = F::UNROLL;
    const int chunks = k / F::VALUES;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    // Typed rows: byte arithmetic on the pointer costs the dense kernels 20 registers.
    using Value = typename std::conditional<F::FP8, uint8_t, T>::type;
    const uint4* wv[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) wv[r] = reinterpret_cast<const uint4*>(static_cast<const Value*>(w) + (long)rows[r] * k);

    float acc[W_ROWS] = {};
    uint4 ws[UNROLL][W_ROWS];
    const auto load_weights = [&](int c0) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) ws[u][r] = __ldcs(wv[r] + c);  // streamed: read once
            }
        }
    };
    // In a chain, the first weight loads fly while the kernel before still writes x.
    load_weights(threadIdx.x);
    chain_wait();
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * UNROLL) {
        // The weight loads go out first; the input while they fly.
        if (c0 != threadIdx.x) load_weights(c0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
                // Plain loads: x may have been written by a kernel that ran beside this one.
                uint4 xs[F::X_LOADS];
#pragma unroll
                for (int i = 0; i < F::X_LOADS; ++i) xs[i] = xv[c * F::X_LOADS + i];
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) acc[r] += dot_load<T, W>(ws[u][r], xs);
            }
        }
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
        if (lane == 0) partial[warp][r] = acc[r];
    }
    __syncthreads();
}

// Weight row `row`'s scale: 1 for a dense weight. Read before the chain wait (nothing in a
// chain writes a weight), so that its latency hides behind the product's.
template <typename W>
__device__ __forceinline__ float row_scale(const float* __restrict__ scales, int row) {
    if constexpr (std::is_same<W, Fp8>::value) return scales[row];
    return 1.f;
}

template <int W_ROWS>
__device__ __forceinline__ float row_sum(const float (&partial)[THREADS / 32][W_ROWS], int r) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) s += partial[i][r];
    return s;
}

// ROWS outputs per CTA; with GATE_UP each output reads two weight rows (gate_i and up_i).
template <typename T, typename W, int ROWS, bool GATE_UP>
__device__ void gemv(const T* x, const void* __restrict__ w, const float* __restrict__ scales, T* __restrict__ y, int n,
                     int k) {
    constexpr int W_ROWS = GATE_UP ? 2 * ROWS : ROWS;
    const int row0 = blockIdx.x * ROWS;
    int rows[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) rows[r] = min(row0 + r % ROWS, n - 1) + (r < ROWS ? 0 : n);
    __shared__ float partial[THREADS / 32][W_ROWS];
    chain_release();
    float scale = 1.f, up_scale = 1.f;
    if (Format<T, W>::FP8 && threadIdx.x < ROWS) {
        const int mine = min(row0 + (int)threadIdx.x, n - 1);
        scale = row_scale<W>(scales, mine);
        if (GATE_UP) up_scale = row_scale<W>(scales, n + mine);
    }
    dot_rows<T, W, W_ROWS>(x, w, rows, k, partial);
    if (threadIdx.x < ROWS && row0 + threadIdx.x < n) {
        const float s = row_sum(partial, threadIdx.x) * scale;
        if (GATE_UP) {
            const float u = row_sum(partial, ROWS + threadIdx.x) * up_scale;
            const float g = to_f32(from_f32<T>(s));
            y[row0 + threadIdx.x] = from_f32<T>(g / (1.f + expf(-g)) * to_f32(from_f32<T>(u)));
        } else {
            y[row0 + threadIdx.x] = from_f32<T>(s);
        }
    }
}

// A fused QKV product of one row, `w` `[(q_heads + 2 · kv_heads) · d, k]`, with rotary.cu's
// rotation and cache write after it: CTA b computes the rows j and j + d/2 of head slot
// b / (d/2) (query heads, then key heads, then value heads) — the two values that rotate
// together — rounds them to T as the plain product does, and writes the query head rotated
// into `queries`, the key head rotated and the value head as it is into the cache at row
// *row: key head h's element c at keys[row · row_stride + h · head_stride + c], value head h's
// `values` elements further (a sequence's own cache `[2, kv_heads, capacity, d]`, its row the
// position; or a paged pool `[2, slots, kv_heads, d]`, its row the token's slot). The bits of
// gemv followed by rotary_qkv; one kernel and no round trip of the product through memory. A
// `bias` (Qwen2's, or null) is added to each rounded product and rounded again, as a bias
// added to the product in T does. A position past the table or a row past the cache's `rows`
// is skipped (the host checks both before it launches).
template <typename T, typename W>
__device__ void gemv_rotary(const T* x, const void* __restrict__ w, const float* __restrict__ scales,
                            const T* __restrict__ bias, const T* __restrict__ table, T* __restrict__ queries,
                            T* __restrict__ keys, long values,
                            long row_stride, long head_stride, int q_heads, int kv_heads, int d, int k,
                            const unsigned* __restrict__ position, const unsigned* __restrict__ row, int positions,
                            long rows) {
    chain_release();
    const int half = d / 2, slot = blockIdx.x / half, j = blockIdx.x % half;
    const int products[2] = {slot * d + j, slot * d + j + half};
    const bool query = slot < q_heads, value = slot >= q_heads + kv_heads;
    // Only a copy before the chain writes the position and the row, and nothing writes the
    // table or the scales: they are read before the wait, while the first weight loads fly.
    const long at = *position, cached = *row;
    const bool skip = at >= positions || (!query && cached >= rows);
    float c = 1.f, s = 0.f, scale[2] = {1.f, 1.f}, added[2] = {0.f, 0.f};
    if (Format<T, W>::FP8 && threadIdx.x < 2) {
        scale[0] = row_scale<W>(scales, products[0]);
        scale[1] = row_scale<W>(scales, products[1]);
    }
    if (bias != nullptr && threadIdx.x < 2) added[0] = to_f32(bias[products[0]]), added[1] = to_f32(bias[products[1]]);
    if (!value && !skip && threadIdx.x < 2) {
        c = to_f32(table[at * half + j]);
        s = to_f32(table[((long)positions + at) * half + j]);
    }
    __shared__ float partial[THREADS / 32][2];
    dot_rows<T, W, 2>(x, w, products, k, partial);
    if (threadIdx.x >= 2 || skip) return;
    // Thread 0 writes column j, thread 1 column j + half.
    const bool second = threadIdx.x == 1;
    float x1 = to_f32(from_f32<T>(row_sum(partial, 0) * scale[0]));
    float x2 = to_f32(from_f32<T>(row_sum(partial, 1) * scale[1]));
    if (bias != nullptr) x1 = to_f32(from_f32<T>(x1 + added[0])), x2 = to_f32(from_f32<T>(x2 + added[1]));
    const float y = value ? (second ? x2 : x1) : rotate(x1, x2, c, s, second);
    const int head = value ? slot - q_heads - kv_heads : slot - q_heads;
    T* to = query ? queries + (long)slot * d
                  : keys + (value ? values : 0) + cached * row_stride + (long)head * head_stride;
    to[j + (second ? half : 0)] = from_f32<T>(y);
}

}  // namespace

// Every kernel takes the weight's row scales; a dense weight's are not read (null).
// FORMAT is the kernel name's infix: empty for a dense weight, fp8_ for FP8.
#define GEMV_PLAIN(FORMAT, W, SUFFIX, T, ROWS)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_##FORMAT##SUFFIX##_r##ROWS(                     \
        const T* x, const void* w, const float* scales, T* y, int n, int k CHAIN_TRACE_PARAM) {               \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv<T, W, ROWS, false>(x, w, scales, y, n, k);                                                        \
    }
#define GEMV_GATE_UP(FORMAT, W, SUFFIX, T, ROWS)                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_gate_up_silu_##FORMAT##SUFFIX##_r##ROWS(        \
        const T* x, const void* w, const float* scales, T* y, int n, int k CHAIN_TRACE_PARAM) {               \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv<T, W, ROWS, true>(x, w, scales, y, n, k);                                                         \
    }
#define GEMV_ROTARY(FORMAT, W, SUFFIX, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_rotary_##FORMAT##SUFFIX(                        \
        const T* x, const void* w, const float* scales, const T* bias, const T* table, T* queries, T* keys,    \
        long values, long row_stride, long head_stride, int q_heads, int kv_heads, int d, int k,              \
        const unsigned* position, const unsigned* row, int positions, long rows CHAIN_TRACE_PARAM) {          \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv_rotary<T, W>(x, w, scales, bias, table, queries, keys, values, row_stride, head_stride, q_heads,  \
                          kv_heads, d, k, position, row, positions, rows);                                     \
    }
#define GEMV_16BIT(FORMAT, W, SUFFIX, T) \
    GEMV_ROTARY(FORMAT, W, SUFFIX, T)    \
    GEMV_PLAIN(FORMAT, W, SUFFIX, T, 2)  \
    GEMV_PLAIN(FORMAT, W, SUFFIX, T, 4)  \
    GEMV_PLAIN(FORMAT, W, SUFFIX, T, 8)  \
    GEMV_GATE_UP(FORMAT, W, SUFFIX, T, 2) \
    GEMV_GATE_UP(FORMAT, W, SUFFIX, T, 4) \
    GEMV_GATE_UP(FORMAT, W, SUFFIX, T, 8)

GEMV_16BIT(, Dense, bf16, __nv_bfloat16)
GEMV_16BIT(, Dense, f16, __half)
GEMV_16BIT(fp8_, Fp8, bf16, __nv_bfloat16)
GEMV_16BIT(fp8_, Fp8, f16, __half)
// An f32 decode step with FP8 weights takes the plain product alone.
GEMV_PLAIN(fp8_, Fp8, f32, float, 2)
GEMV_PLAIN(fp8_, Fp8, f32, float, 4)
GEMV_PLAIN(fp8_, Fp8, f32, float, 8)
