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
// A decode step at TP 1 makes its input norms without kernels of their own: the row-parallel
// product before a norm (gemv_residual) adds its output to the residual stream and writes
// u = T(s · norm) of the new stream s and each CTA's sum of s² (one float a CTA, so that the
// total is summed in one order: no atomics); the product after it (NORMED, the `_normed`
// kernels) multiplies u and scales its sums by rsqrt(Σ s² / k + eps). So a norm costs
// neither a kernel between two GEMVs nor a pass ahead of the products (making the normed row
// in every CTA measured slower, as did reading the stream, its update and the norm's weight
// in every CTA: three times the input bytes). The bits differ from add_rms_norm then the
// product in where the scale applies: to the sums, after u is rounded, not to the row.
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
    static constexpr int UNROLL = FP8 ? 1 : 2;                // weight loads per row and step
};

// The input row of a product: x, and with NORMED the sums of squares (`slots` of them, one
// per CTA of the gemv_residual that made x) and eps of the input norm whose u it is (see the
// top).
template <typename T>
struct Row {
    const T* x;
    const float* squares;
    int slots;
    float eps;
};

// The VALUES input values of chunk c (c · VALUES onwards), in f32.
template <typename T, int VALUES>
__device__ __forceinline__ void load_row(const T* x, int c, float (&xf)[VALUES]) {
    constexpr int LOADS = VALUES * sizeof(T) / 16;
    // Plain loads: x may have been written by a kernel that ran beside this one.
    uint4 raw[LOADS];
#pragma unroll
    for (int i = 0; i < LOADS; ++i) raw[i] = reinterpret_cast<const uint4*>(x)[c * LOADS + i];
    const T* values = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int i = 0; i < VALUES; ++i) xf[i] = to_f32(values[i]);
}

// Σ w[i] · x[i] over a 16-byte load of weight values and the x values they multiply.
template <typename T, typename W>
__device__ __forceinline__ float dot_load(uint4 w_raw, const float (&x)[Format<T, W>::VALUES]) {
    float s = 0.f;
    if constexpr (Format<T, W>::FP8) {
        // The load's byte order is the values' order, and a pair converts its lower byte to
        // the lower half.
        const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&w_raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
            const float2 w = __half22float2(*reinterpret_cast<const __half2*>(&raw));
            s += w.x * x[2 * i];
            s += w.y * x[2 * i + 1];
        }
    } else {
        const T* w = reinterpret_cast<const T*>(&w_raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += to_f32(w[i]) * x[i];
    }
    return s;
}

// Σ_k x[k] · w[rows[r], k] for the CTA's W_ROWS weight rows, into `partial` (a sum per warp
// and row; row_sum adds them up in every thread after it returns), unscaled; with NORMED
// column W_ROWS totals the input norm's squares. Every thread issues UNROLL · W_ROWS
// 16-byte loads before it uses any. The caller has released the chain.
template <typename T, typename W, int W_ROWS, bool NORMED>
__device__ void dot_rows(const Row<T>& in, const void* __restrict__ w, const int (&rows)[W_ROWS], int k,
                         float (&partial)[THREADS / 32][W_ROWS + NORMED]) {
    using F = Format<T, W>;
    constexpr int UNROLL = F::UNROLL;
    const int chunks = k / F::VALUES;
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
    // The producer before wrote the squares: read after the wait, added up after the loop.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float squares = 0.f;
    if constexpr (NORMED) {
        for (int i = threadIdx.x; i < in.slots; i += THREADS) squares += in.squares[i];
    }
    for (int c0 = threadIdx.x; c0 < chunks; c0 += THREADS * UNROLL) {
        // The weight loads go out first; the input while they fly.
        if (c0 != threadIdx.x) load_weights(c0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * THREADS;
            if (c < chunks) {
                float xs[F::VALUES];
                load_row<T, F::VALUES>(in.x, c, xs);
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r) acc[r] += dot_load<T, W>(ws[u][r], xs);
            }
        }
    }

#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
        if (lane == 0) partial[warp][r] = acc[r];
    }
    if constexpr (NORMED) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) squares += __shfl_xor_sync(0xffffffff, squares, o);
        if (lane == 0) partial[warp][W_ROWS] = squares;
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

template <int WIDTH>
__device__ __forceinline__ float row_sum(const float (&partial)[THREADS / 32][WIDTH], int r) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) s += partial[i][r];
    return s;
}

// What the products' sums are multiplied by: the input norm's rsqrt(mean(s²) + eps) from
// column W_ROWS of `partial` with NORMED, else 1 (which leaves the bits as they are).
template <bool NORMED, int W_ROWS>
__device__ __forceinline__ float norm_scale(const float (&partial)[THREADS / 32][W_ROWS + NORMED], int k,
                                            float eps) {
    if constexpr (NORMED) return rsqrtf(row_sum(partial, W_ROWS) / k + eps);
    return 1.f;
}

// ROWS outputs per CTA; with GATE_UP each output reads two weight rows (gate_i and up_i).
template <typename T, typename W, int ROWS, bool GATE_UP, bool NORMED>
__device__ void gemv(const Row<T>& in, const void* __restrict__ w, const float* __restrict__ scales,
                     T* __restrict__ y, int n, int k) {
    constexpr int W_ROWS = GATE_UP ? 2 * ROWS : ROWS;
    const int row0 = blockIdx.x * ROWS;
    int rows[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) rows[r] = min(row0 + r % ROWS, n - 1) + (r < ROWS ? 0 : n);
    __shared__ float partial[THREADS / 32][W_ROWS + NORMED];
    chain_release();
    float scale = 1.f, up_scale = 1.f;
    if (Format<T, W>::FP8 && threadIdx.x < ROWS) {
        const int mine = min(row0 + (int)threadIdx.x, n - 1);
        scale = row_scale<W>(scales, mine);
        if (GATE_UP) up_scale = row_scale<W>(scales, n + mine);
    }
    dot_rows<T, W, W_ROWS, NORMED>(in, w, rows, k, partial);
    if (threadIdx.x < ROWS && row0 + threadIdx.x < n) {
        const float normed = norm_scale<NORMED, W_ROWS>(partial, k, in.eps);
        const float s = row_sum(partial, threadIdx.x) * normed * scale;
        if (GATE_UP) {
            const float u = row_sum(partial, ROWS + threadIdx.x) * normed * up_scale;
            const float g = to_f32(from_f32<T>(s));
            y[row0 + threadIdx.x] = from_f32<T>(g / (1.f + expf(-g)) * to_f32(from_f32<T>(u)));
        } else {
            y[row0 + threadIdx.x] = from_f32<T>(s);
        }
    }
}

// A row-parallel product at TP 1 followed by the next input norm's making (see the top):
// y_j = T(Σ_k x[k] · w[j, k]) (gemv's bits) added to the residual stream, s_j = T(stream[j] +
// y_j) (add_rms_norm's sum) written back to stream[j], u_j = T(s_j · norm[j]) to normed[j], and
// the CTA's Σ s_j² to squares[blockIdx.x]. Each element of the stream is read and written by
// the thread that owns its row, so the stream is updated in place.
template <typename T, typename W, int ROWS>
__device__ void gemv_residual(const T* x, const void* __restrict__ w, const float* __restrict__ scales, T* stream,
                              const T* __restrict__ norm, T* __restrict__ normed, float* squares, int n, int k) {
    const int row0 = blockIdx.x * ROWS;
    int rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = min(row0 + r, n - 1);
    __shared__ float partial[THREADS / 32][ROWS];
    chain_release();
    const int mine = row0 + (int)threadIdx.x;
    const bool owner = threadIdx.x < ROWS && mine < n;
    float scale = 1.f, weight = 0.f;
    if (owner) {
        scale = row_scale<W>(scales, mine);
        weight = to_f32(norm[mine]);
    }
    dot_rows<T, W, ROWS, false>(Row<T>{x, nullptr, 0, 0.f}, w, rows, k, partial);
    if (threadIdx.x >= 32) return;
    float square = 0.f;
    if (owner) {
        const T y = from_f32<T>(row_sum(partial, threadIdx.x) * scale);
        const T s = from_f32<T>(to_f32(stream[mine]) + to_f32(y));
        stream[mine] = s;
        normed[mine] = from_f32<T>(to_f32(s) * weight);
        square = to_f32(s) * to_f32(s);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) square += __shfl_xor_sync(0xffffffff, square, o);
    if (threadIdx.x == 0) squares[blockIdx.x] = square;
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
template <typename T, typename W, bool NORMED>
__device__ void gemv_rotary(const Row<T>& in, const void* __restrict__ w, const float* __restrict__ scales,
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
    __shared__ float partial[THREADS / 32][2 + NORMED];
    dot_rows<T, W, 2, NORMED>(in, w, products, k, partial);
    if (threadIdx.x >= 2 || skip) return;
    // Thread 0 writes column j, thread 1 column j + half.
    const bool second = threadIdx.x == 1;
    const float normed = norm_scale<NORMED, 2>(partial, k, in.eps);
    float x1 = to_f32(from_f32<T>(row_sum(partial, 0) * normed * scale[0]));
    float x2 = to_f32(from_f32<T>(row_sum(partial, 1) * normed * scale[1]));
    if (bias != nullptr) x1 = to_f32(from_f32<T>(x1 + added[0])), x2 = to_f32(from_f32<T>(x2 + added[1]));
    const float y = value ? (second ? x2 : x1) : rotate(x1, x2, c, s, second);
    const int head = value ? slot - q_heads - kv_heads : slot - q_heads;
    T* to = query ? queries + (long)slot * d
                  : keys + (value ? values : 0) + cached * row_stride + (long)head * head_stride;
    to[j + (second ? half : 0)] = from_f32<T>(y);
}

}  // namespace

// Every kernel takes the weight's row scales; a dense weight's are not read (null).
// FORMAT is the kernel name's infix: empty for a dense weight, fp8_ for FP8. KIND is `given`
// (the input row x) or `normed` (the `_normed` kernels: u, the sums of squares, their count
// and eps in its place; NORMED above), NAME its name infix.
#define ROW_PARAMS_given(T) const T *x
#define ROW_PARAMS_normed(T) const T *x, const float *squares, int slots, float eps
#define ROW_ARGS_given(T) Row<T>{x, nullptr, 0, 0.f}
#define ROW_ARGS_normed(T) Row<T>{x, squares, slots, eps}
#define ROW_NORMED_given false
#define ROW_NORMED_normed true
#define GEMV_PLAIN(FORMAT, W, SUFFIX, T, ROWS)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_##FORMAT##SUFFIX##_r##ROWS(                      \
        const T* x, const void* w, const float* scales, T* y, int n, int k CHAIN_TRACE_PARAM) {               \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv<T, W, ROWS, false, false>(Row<T>{x, nullptr, 0, 0.f}, w, scales, y, n, k);                        \
    }
#define GEMV_GATE_UP(FORMAT, W, SUFFIX, T, ROWS, NAME, KIND)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_gate_up_silu_##NAME##FORMAT##SUFFIX##_r##ROWS(  \
        ROW_PARAMS_##KIND(T), const void* w, const float* scales, T* y, int n, int k CHAIN_TRACE_PARAM) {        \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv<T, W, ROWS, true, ROW_NORMED_##KIND>(ROW_ARGS_##KIND(T), w, scales, y, n, k);                        \
    }
#define GEMV_ROTARY(FORMAT, W, SUFFIX, T, NAME, KIND)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_rotary_##NAME##FORMAT##SUFFIX(                  \
        ROW_PARAMS_##KIND(T), const void* w, const float* scales, const T* bias, const T* table, T* queries,      \
        T* keys, long values, long row_stride, long head_stride, int q_heads, int kv_heads, int d, int k,     \
        const unsigned* position, const unsigned* row, int positions, long rows CHAIN_TRACE_PARAM) {          \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv_rotary<T, W, ROW_NORMED_##KIND>(ROW_ARGS_##KIND(T), w, scales, bias, table, queries, keys, values,   \
                                             row_stride, head_stride, q_heads, kv_heads, d, k, position, row, \
                                             positions, rows);                                                 \
    }
#define GEMV_RESIDUAL(FORMAT, W, SUFFIX, T, ROWS)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) gemv_residual_##FORMAT##SUFFIX##_r##ROWS(            \
        const T* x, const void* w, const float* scales, T* stream, const T* norm, T* normed, float* squares,  \
        int n, int k CHAIN_TRACE_PARAM) {                                                                      \
        CHAIN_TRACE_SCOPE                                                                                      \
        gemv_residual<T, W, ROWS>(x, w, scales, stream, norm, normed, squares, n, k);                          \
    }
// The products that follow a norm in the step, QKV (rotated) and gate/up, also take a normed
// row (Qwen3's plain QKV product keeps its norm kernel: llama's model.rs says why).
#define GEMV_ROWS(FORMAT, W, SUFFIX, T, ROWS)                  \
    GEMV_PLAIN(FORMAT, W, SUFFIX, T, ROWS)                     \
    GEMV_GATE_UP(FORMAT, W, SUFFIX, T, ROWS, , given)          \
    GEMV_GATE_UP(FORMAT, W, SUFFIX, T, ROWS, normed_, normed)  \
    GEMV_RESIDUAL(FORMAT, W, SUFFIX, T, ROWS)
#define GEMV_16BIT(FORMAT, W, SUFFIX, T)               \
    GEMV_ROTARY(FORMAT, W, SUFFIX, T, , given)         \
    GEMV_ROTARY(FORMAT, W, SUFFIX, T, normed_, normed) \
    GEMV_ROWS(FORMAT, W, SUFFIX, T, 2)                 \
    GEMV_ROWS(FORMAT, W, SUFFIX, T, 4)                 \
    GEMV_ROWS(FORMAT, W, SUFFIX, T, 8)

GEMV_16BIT(, Dense, bf16, __nv_bfloat16)
GEMV_16BIT(, Dense, f16, __half)
GEMV_16BIT(fp8_, Fp8, bf16, __nv_bfloat16)
GEMV_16BIT(fp8_, Fp8, f16, __half)
// An f32 decode step with FP8 weights takes the plain product alone.
GEMV_PLAIN(fp8_, Fp8, f32, float, 2)
GEMV_PLAIN(fp8_, Fp8, f32, float, 4)
GEMV_PLAIN(fp8_, Fp8, f32, float, 8)
