// Fused row-wise kernels, each one pass over a `[rows, cols]` activation instead of candle's
// chain of casts and broadcasts (two to seven passes each): the DiT's replicated norms and
// residuals, an LLM's residual add with its RMSNorm, and a gated MLP's activation. f32 arithmetic whatever the storage type, as
// diffusers' FP32LayerNorm and gated residuals do.
#include <stdint.h>

#include "chain.cuh"
#include "convert.cuh"

namespace {

constexpr int THREADS = 256;

// Sum over a block of N threads; every thread gets the result.
template <int N = THREADS>
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[N / 32];
    __shared__ float total;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float w = threadIdx.x < N / 32 ? partial[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o /= 2) w += __shfl_xor_sync(0xffffffff, w, o);
        if (threadIdx.x == 0) total = w;
    }
    __syncthreads();
    float result = total;
    __syncthreads();  // partial/total may be reused by the next call
    return result;
}

// N consecutive values of T, moved as one access: 16 bytes for the packed kernels (N = 16 /
// sizeof(T)), which a launcher picks when every row starts on a pack boundary.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};
template <typename T, int N>
__device__ __forceinline__ void load_pack(const T* p, float (&f)[N]) {
    const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f32(pack.v[i]);
}
template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const float (&f)[N]) {
    Pack<T, N> pack;
#pragma unroll
    for (int i = 0; i < N; ++i) pack.v[i] = from_f32<T>(f[i]);
    *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// The row-wise kernels below run one block of THREADS per row, each thread N values at a time.

// A per-column f32 table's row for this block's row: `[2, cols]` tables serve the rows before
// `split` from their first row and the rest from their second (S2V's video rows, then its
// reference and motion rows at timestep 0); a `[cols]` table comes with `split` = rows.
__device__ __forceinline__ const float* table_row(const float* table, int split, int cols) {
    return (int)blockIdx.x < split ? table : table + cols;
}

// out = T(x + y · gate[col]), or without `gate` T(x + y): a residual update. `y` may be
// narrower than the stream `x` (bf16 products added to an f32 stream), widened exactly.
template <typename T, typename P, int N>
__device__ void gated_residual(const T* x, const P* y, const float* gate, int split, T* out, int cols) {
    const long at = (long)blockIdx.x * cols;
    const float* g = gate ? table_row(gate, split, cols) : nullptr;
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float a[N], b[N];
        load_pack<T, N>(x + at + j, a);
        load_pack<P, N>(y + at + j, b);
#pragma unroll
        for (int i = 0; i < N; ++i) a[i] += g ? b[i] * g[j + i] : b[i];
        store_pack<T, N>(out + at + j, a);
    }
}

// out = T(x + T(y0 + y1) · gate[col]), or without `gate` T(x + T(y0 + y1)): a residual update
// with a two-rank sum of row-parallel outputs fused in, rounded as the parts widened to the
// stream's type, summed, and the update apart would be.
template <typename T, typename P, int N>
__device__ void residual_pair(const T* x, const P* y0, const P* y1, const float* gate, int split, T* out,
                              int cols) {
    const long at = (long)blockIdx.x * cols;
    const float* g = gate ? table_row(gate, split, cols) : nullptr;
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float a[N], b[N], c[N];
        load_pack<T, N>(x + at + j, a);
        load_pack<P, N>(y0 + at + j, b);
        load_pack<P, N>(y1 + at + j, c);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const float sum = to_f32(from_f32<T>(b[i] + c[i]));
            a[i] += g ? sum * g[j + i] : sum;
        }
        store_pack<T, N>(out + at + j, a);
    }
}

// out[row] = Σ_col x²; rows `row_stride` apart.
template <typename T, int N>
__device__ void row_sum_squares(const T* x, long row_stride, float* out, int cols) {
    const T* r = x + blockIdx.x * row_stride;
    float s = 0.f;
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float v[N];
        load_pack<T, N>(r + j, v);
#pragma unroll
        for (int i = 0; i < N; ++i) s += v[i] * v[i];
    }
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// out = T(x · row_scale[row] · col_scale[col]) for x's rows `row_stride` apart; with a `rope`
// table ([rows, 2, pairs] f32: cos, then sin), each pair (2p, 2p + 1) of a row's values is
// then rotated by the row's angle p mod pairs (interleaved RoPE, every head alike), rounded
// once. N is even: a pack holds whole pairs.
template <typename T, int N>
__device__ void scale_rows_cols(const T* x, long row_stride, const float* row_scale, const float* col_scale,
                                const float* rope, int pairs, T* out, int cols) {
    const T* r = x + blockIdx.x * row_stride;
    T* o = out + (long)blockIdx.x * cols;
    const float scale = row_scale[blockIdx.x];
    const float* cos = rope ? rope + (long)blockIdx.x * 2 * pairs : nullptr;
    const float* sin = cos + pairs;
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float v[N];
        load_pack<T, N>(r + j, v);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] *= scale * col_scale[j + i];
        if (rope) {
#pragma unroll
            for (int i = 0; i < N; i += 2) {
                const int p = (j + i) / 2 % pairs;
                const float a = v[i], b = v[i + 1];
                v[i] = a * cos[p] - b * sin[p];
                v[i + 1] = a * sin[p] + b * cos[p];
            }
        }
        store_pack<T, N>(o + j, v);
    }
}

// LayerNorm over each row in f32 (two passes: mean, then variance about it), then
// `· weight + bias` (tables as `table_row`'s), written as O: a norm of an f32 stream goes
// straight into the products' dtype, rounded once.
template <typename T, typename O, int N>
__device__ void layer_norm(const T* x, const float* weight, const float* bias, int split, O* out, int cols,
                           float eps) {
    const T* r = x + (long)blockIdx.x * cols;
    O* o = out + (long)blockIdx.x * cols;
    const float *w = table_row(weight, split, cols), *b = table_row(bias, split, cols);
    float s = 0.f;
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float v[N];
        load_pack<T, N>(r + j, v);
#pragma unroll
        for (int i = 0; i < N; ++i) s += v[i];
    }
    const float mean = block_sum(s) / cols;
    float q = 0.f;
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float v[N];
        load_pack<T, N>(r + j, v);
#pragma unroll
        for (int i = 0; i < N; ++i) q += (v[i] - mean) * (v[i] - mean);
    }
    const float rstd = rsqrtf(block_sum(q) / cols + eps);
    for (int j = threadIdx.x * N; j < cols; j += THREADS * N) {
        float v[N];
        load_pack<T, N>(r + j, v);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = (v[i] - mean) * rstd * w[j + i] + b[j + i];
        store_pack<O, N>(o + j, v);
    }
}

// Threads per row of `add_rms_norm`, and the values each keeps in registers between its two
// passes. A decode step has one row: 1,024 threads with independent loads finish it in a few
// microseconds, where 256 threads looping over 4,096 columns waited on memory 16 times.
constexpr int NORM_THREADS = 1024;
constexpr int NORM_CACHED = 8;

// The residual stream's sum and its RMSNorm in one pass, one block per row:
// out[0] = T(x + y), out[1] = T(out[0] · rsqrt(mean(out[0]²) + eps) · weight), the norm taken
// over the rounded sum, as an add followed by an RMSNorm would. x may be out[0] (each element
// is read before the same thread writes it). A chain kernel (chain.cuh): the weight, which no
// kernel writes, is loaded before the wait, so the norm costs one memory latency, not two.
template <typename T>
__device__ void add_rms_norm(const T* x, const T* __restrict__ y, const T* __restrict__ weight, T* out, int rows,
                             int cols, float eps) {
    chain_release();
    float w[NORM_CACHED];
#pragma unroll
    for (int i = 0; i < NORM_CACHED; ++i) {
        const int j = threadIdx.x + i * NORM_THREADS;
        w[i] = j < cols ? to_f32(weight[j]) : 0.f;
    }
    chain_wait();
    const long at = (long)blockIdx.x * cols;
    T* sum = out + at;
    T* normed = out + (long)rows * cols + at;
    float v[NORM_CACHED];
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_CACHED; ++i) {
        const int j = threadIdx.x + i * NORM_THREADS;
        v[i] = 0.f;
        if (j < cols) {
            const T s = from_f32<T>(to_f32(x[at + j]) + to_f32(y[at + j]));
            sum[j] = s;
            v[i] = to_f32(s);
            q += v[i] * v[i];
        }
    }
    // Rows wider than the registers hold: the rest is read back in the second pass.
    for (int j = threadIdx.x + NORM_CACHED * NORM_THREADS; j < cols; j += NORM_THREADS) {
        const T s = from_f32<T>(to_f32(x[at + j]) + to_f32(y[at + j]));
        sum[j] = s;
        q += to_f32(s) * to_f32(s);
    }
    const float rstd = rsqrtf(block_sum<NORM_THREADS>(q) / cols + eps);
#pragma unroll
    for (int i = 0; i < NORM_CACHED; ++i) {
        const int j = threadIdx.x + i * NORM_THREADS;
        if (j < cols) normed[j] = from_f32<T>(v[i] * rstd * w[i]);
    }
    for (int j = threadIdx.x + NORM_CACHED * NORM_THREADS; j < cols; j += NORM_THREADS)
        normed[j] = from_f32<T>(to_f32(sum[j]) * rstd * to_f32(weight[j]));
}

// out[row, j] = T(act(x[row, j]) · x[row, half + j]) for x `[rows, 2 · half]`: a gated MLP's
// activation on its fused gate/up output, rounded once. act is SiLU, or with `gelu` the tanh
// approximation of GELU (T5's gated-GELU FFN).
template <typename T>
__device__ void gate_mul(const T* x, T* out, long n, int half, int gelu) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long row = i / half;
        const int j = i % half;
        const float g = to_f32(x[row * 2 * half + j]);
        const float u = to_f32(x[row * 2 * half + half + j]);
        const float a = gelu ? 0.5f * g * (1.f + tanhf(0.7978845608028654f * g * (1.f + 0.044715f * g * g)))
                             : g / (1.f + expf(-g));
        out[i] = from_f32<T>(a * u);
    }
}

// out[h, q, :] = T(softmax(scores[h, q, k] + table[buckets[k - q + queries - 1], h] over k)):
// attention probabilities with T5's relative position bias, the bias looked up by the key's
// distance from the query (buckets holds one entry per distance, `queries + keys - 1`), in
// f32 and rounded once. One warp per row: an online max and sum, then the write.
template <typename T>
__device__ void softmax_relative_bias(const T* scores, const float* table, const unsigned* buckets, T* out,
                                      int heads, int queries, int keys) {
    const int lane = threadIdx.x & 31;
    const long row = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5;
    if (row >= (long)heads * queries) return;
    const int h = row / queries, q = row % queries;
    const T* s = scores + row * keys;
    const unsigned* b = buckets + (queries - 1 - q);
    // Finite, so that a lane with no keys (keys < 32) joins the reduction as a zero sum.
    float m = -3.0e38f, sum = 0.f;
    for (int k = lane; k < keys; k += 32) {
        const float v = to_f32(s[k]) + table[(long)b[k] * heads + h];
        const float top = fmaxf(m, v);
        sum = sum * expf(m - top) + expf(v - top);
        m = top;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m_other = __shfl_xor_sync(0xffffffffu, m, offset);
        const float sum_other = __shfl_xor_sync(0xffffffffu, sum, offset);
        const float top = fmaxf(m, m_other);
        sum = sum * expf(m - top) + sum_other * expf(m_other - top);
        m = top;
    }
    const float inv = 1.f / sum;
    T* o = out + row * keys;
    for (int k = lane; k < keys; k += 32)
        o[k] = from_f32<T>(expf(to_f32(s[k]) + table[(long)b[k] * heads + h] - m) * inv);
}

// out[t] = w[ids[t] - first] where first <= ids[t] < end, else zeros: a vocabulary-parallel
// embedding's rows on the rank that holds them, one CTA per token.
template <typename T>
__device__ void embed_owned_rows(const unsigned* ids, const T* w, T* out, unsigned first, unsigned end, int cols) {
    const unsigned id = ids[blockIdx.x];
    const bool owned = id >= first && id < end;
    const T* row = w + (long)(owned ? id - first : 0) * cols;
    T* o = out + (long)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = owned ? row[j] : from_f32<T>(0.f);
}

// out[p, c] = x[p, c] / max(‖x[p, :]‖, 1e-12) · scale[c], then SiLU when `silu`: the video
// VAE's RMS norm over the channels of each pixel of a channels-last activation, one warp per
// pixel (its lanes read consecutive channels). x `[n, rows, width, channels]` may be a view of
// some rows: strides per image and row, each row of pixels packed; out is contiguous.
template <typename T>
__device__ void channel_rms_norm(const T* x, const float* scale, T* out, int channels, int rows, int width,
                                 long images, long image_stride, long row_stride, int silu) {
    const int lane = threadIdx.x & 31;
    const long p = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5;
    const long per_image = (long)rows * width;
    if (p >= images * per_image) return;
    const long image = p / per_image, within = p % per_image;
    const T* in = x + image * image_stride + (within / width) * row_stride + (within % width) * channels;
    T* o = out + p * channels;
    float sum = 0.f;
    for (int c = lane; c < channels; c += 32) {
        const float v = to_f32(in[c]);
        sum += v * v;
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float inv = 1.f / fmaxf(sqrtf(sum), 1e-12f);
    for (int c = lane; c < channels; c += 32) {
        float v = to_f32(in[c]) * inv * scale[c];
        if (silu) v = v / (1.f + expf(-v));
        o[c] = from_f32<T>(v);
    }
}

// The same, each thread moving one 16-byte unit of a pixel's channels (channels · size a
// multiple of 16, rows of pixels on 16 bytes): a pixel's `units` threads are consecutive, a
// block holds blockDim.x / units pixels, and each pixel's sum is added up in order by its
// first thread (deterministic).
template <typename T>
__device__ void channel_rms_norm_units(const T* x, const float* scale, T* out, int channels, int rows,
                                       int width, long images, long image_stride, long row_stride, int silu) {
    constexpr int PER = 16 / sizeof(T);
    __shared__ float partial[THREADS];
    const int units = channels / PER;
    const int per_block = blockDim.x / units;
    const int local = threadIdx.x / units, unit = threadIdx.x % units;
    const long p = (long)blockIdx.x * per_block + local;
    const long per_image = (long)rows * width;
    const bool active = local < per_block && p < images * per_image;
    float v[PER];
    float sum = 0.f;
    if (active) {
        const long image = p / per_image, within = p % per_image;
        const T* in =
            x + image * image_stride + (within / width) * row_stride + (within % width) * channels + unit * PER;
        const uint4 raw = *reinterpret_cast<const uint4*>(in);
        const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            v[k] = to_f32(values[k]);
            sum += v[k] * v[k];
        }
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    if (active && unit == 0) {
        float total = 0.f;
        for (int u = 0; u < units; ++u) total += partial[threadIdx.x + u];
        partial[threadIdx.x] = total;
    }
    __syncthreads();
    if (!active) return;
    const float inv = 1.f / fmaxf(sqrtf(partial[local * units]), 1e-12f);
    uint4 raw;
    T* values = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        float y = v[k] * inv * scale[unit * PER + k];
        if (silu) y = y / (1.f + expf(-y));
        values[k] = from_f32<T>(y);
    }
    *reinterpret_cast<uint4*>(out + p * channels + unit * PER) = raw;
}

// out = x repeated in 2 × 2 squares: nearest 2× upsampling of a packed channels-last x
// `[n, rows, width, units]` (n · rows = image_rows; a unit is an element or 16 bytes). Output
// row r2 of the stacked n · 2 · rows reads input row r2 / 2, column c2 reads c2 / 2.
template <typename U>
__device__ void upsample_nearest2x(const U* x, U* out, long image_rows, int width, int units) {
    const long total = image_rows * 4 * width * units;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const long p = i / units;
        const long c2 = p % (2 * width), r2 = p / (2 * width);
        out[i] = x[((r2 >> 1) * width + (c2 >> 1)) * units + i % units];
    }
}

}  // namespace

// The kernels that read or write a second type P beside the stream's T (P = T, or an f32
// stream's bf16 or f16 products), as `NAME_SUFFIX` (one value at a time) and
// `NAME_SUFFIX_packed` (16 bytes of T at a time).
#define MIXED_KERNELS(SUFFIX, T, P, N)                                                                     \
    extern "C" __global__ void gated_residual_##SUFFIX(const T* x, const P* y, const float* gate, int split, \
                                                        T* out, int cols) {                                \
        gated_residual<T, P, N>(x, y, gate, split, out, cols);                                             \
    }                                                                                                      \
    extern "C" __global__ void residual_pair_##SUFFIX(const T* x, const P* y0, const P* y1,               \
                                                       const float* gate, int split, T* out, int cols) {  \
        residual_pair<T, P, N>(x, y0, y1, gate, split, out, cols);                                         \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_##SUFFIX(const T* x, const float* w, const float* b, int split,  \
                                                    P* out, int cols, float eps) {                        \
        layer_norm<T, P, N>(x, w, b, split, out, cols, eps);                                               \
    }

// The other row-wise kernels, likewise.
#define ROW_KERNELS(SUFFIX, T, N)                                                                          \
    MIXED_KERNELS(SUFFIX, T, T, N)                                                                         \
    extern "C" __global__ void row_sum_squares_##SUFFIX(const T* x, long row_stride, float* out, int cols) { \
        row_sum_squares<T, N>(x, row_stride, out, cols);                                                   \
    }                                                                                                      \
    extern "C" __global__ void scale_rows_cols_##SUFFIX(const T* x, long row_stride, const float* r,       \
                                                         const float* c, const float* rope, int pairs,    \
                                                         T* out, int cols) {                              \
        scale_rows_cols<T, (N < 2 ? 2 : N)>(x, row_stride, r, c, rope, pairs, out, cols);                  \
    }

ROW_KERNELS(f32, float, 1)
ROW_KERNELS(bf16, __nv_bfloat16, 1)
ROW_KERNELS(f16, __half, 1)
ROW_KERNELS(f32_packed, float, 4)
ROW_KERNELS(bf16_packed, __nv_bfloat16, 8)
ROW_KERNELS(f16_packed, __half, 8)
MIXED_KERNELS(f32_bf16, float, __nv_bfloat16, 1)
MIXED_KERNELS(f32_f16, float, __half, 1)
MIXED_KERNELS(f32_bf16_packed, float, __nv_bfloat16, 4)
MIXED_KERNELS(f32_f16_packed, float, __half, 4)

#define ROWWISE(SUFFIX, T)                                                                                      \
    extern "C" __global__ void gate_mul_##SUFFIX(const T* x, T* out, long n, int half, int gelu) {             \
        gate_mul<T>(x, out, n, half, gelu);                                                                    \
    }                                                                                                          \
    extern "C" __global__ void silu_mul_into_##SUFFIX(const T* x, T* out, long n, int half CHAIN_TRACE_PARAM) { \
        CHAIN_TRACE_SCOPE                                                                                      \
        chain_release();                                                                                       \
        chain_wait();                                                                                          \
        gate_mul<T>(x, out, n, half, 0);                                                                       \
    }                                                                                                          \
    extern "C" __global__ void softmax_relative_bias_##SUFFIX(const T* scores, const float* table,             \
                                                               const unsigned* buckets, T* out, int heads,      \
                                                               int queries, int keys) {                         \
        softmax_relative_bias<T>(scores, table, buckets, out, heads, queries, keys);                           \
    }                                                                                                          \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T* x, const T* y, const T* w, T* out, int rows,     \
                                                      int cols, float eps CHAIN_TRACE_PARAM) {                \
        CHAIN_TRACE_SCOPE                                                                                      \
        add_rms_norm<T>(x, y, w, out, rows, cols, eps);                                                        \
    }                                                                                                          \
    extern "C" __global__ void embed_owned_rows_##SUFFIX(const unsigned* ids, const T* w, T* out,              \
                                                          unsigned first, unsigned end, int cols) {            \
        embed_owned_rows<T>(ids, w, out, first, end, cols);                                                    \
    }                                                                                                          \
    extern "C" __global__ void channel_rms_norm_##SUFFIX(const T* x, const float* scale, T* out, int channels, \
                                                          int rows, int width, long images, long image_stride, \
                                                          long row_stride, int silu) {                         \
        channel_rms_norm<T>(x, scale, out, channels, rows, width, images, image_stride, row_stride, silu);     \
    }                                                                                                          \
    extern "C" __global__ void channel_rms_norm_units_##SUFFIX(                                                 \
        const T* x, const float* scale, T* out, int channels, int rows, int width, long images,                \
        long image_stride, long row_stride, int silu) {                                                        \
        channel_rms_norm_units<T>(x, scale, out, channels, rows, width, images, image_stride, row_stride,      \
                                  silu);                                                                       \
    }

ROWWISE(f32, float)
ROWWISE(bf16, __nv_bfloat16)
ROWWISE(f16, __half)

extern "C" __global__ void upsample_nearest2x_16(const uint4* x, uint4* out, long image_rows, int width, int units) {
    upsample_nearest2x<uint4>(x, out, image_rows, width, units);
}
extern "C" __global__ void upsample_nearest2x_2(const unsigned short* x, unsigned short* out, long image_rows,
                                                int width, int units) {
    upsample_nearest2x<unsigned short>(x, out, image_rows, width, units);
}
extern "C" __global__ void upsample_nearest2x_4(const unsigned* x, unsigned* out, long image_rows, int width,
                                                int units) {
    upsample_nearest2x<unsigned>(x, out, image_rows, width, units);
}
