// Fused row-wise kernels, each one pass over a `[rows, cols]` activation instead of candle's
// chain of casts and broadcasts (two to seven passes each): the DiT's replicated norms and
// residuals, an LLM's residual add with its RMSNorm, and a gated MLP's activation. f32 arithmetic whatever the storage type, as
// diffusers' FP32LayerNorm and gated residuals do.
#include <stdint.h>

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

// out = T(x + y · gate[col]): a gated residual.
template <typename T>
__device__ void gated_residual(const T* x, const T* y, const float* gate, T* out, long n, int cols) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = from_f32<T>(to_f32(x[i]) + to_f32(y[i]) * gate[i % cols]);
}

// out[row] = Σ_col x²: one block per row.
template <typename T>
__device__ void row_sum_squares(const T* x, float* out, int cols) {
    const T* r = x + (long)blockIdx.x * cols;
    float s = 0.f;
    for (int j = threadIdx.x; j < cols; j += THREADS) {
        float v = to_f32(r[j]);
        s += v * v;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// out = T(x · row_scale[row] · col_scale[col]).
template <typename T>
__device__ void scale_rows_cols(const T* x, const float* row_scale, const float* col_scale, T* out, long n,
                                int cols) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = from_f32<T>(to_f32(x[i]) * row_scale[i / cols] * col_scale[i % cols]);
}

// LayerNorm over each row in f32 (two passes: mean, then variance about it), then
// `· weight + bias`: one block per row.
template <typename T>
__device__ void layer_norm(const T* x, const float* weight, const float* bias, T* out, int cols, float eps) {
    const T* r = x + (long)blockIdx.x * cols;
    T* o = out + (long)blockIdx.x * cols;
    float s = 0.f;
    for (int j = threadIdx.x; j < cols; j += THREADS) s += to_f32(r[j]);
    const float mean = block_sum(s) / cols;
    float q = 0.f;
    for (int j = threadIdx.x; j < cols; j += THREADS) {
        float d = to_f32(r[j]) - mean;
        q += d * d;
    }
    const float rstd = rsqrtf(block_sum(q) / cols + eps);
    for (int j = threadIdx.x; j < cols; j += THREADS) o[j] = from_f32<T>((to_f32(r[j]) - mean) * rstd * weight[j] + bias[j]);
}

// Threads per row of `add_rms_norm`, and the values each keeps in registers between its two
// passes. A decode step has one row: 1,024 threads with independent loads finish it in a few
// microseconds, where 256 threads looping over 4,096 columns waited on memory 16 times.
constexpr int NORM_THREADS = 1024;
constexpr int NORM_CACHED = 8;

// The residual stream's sum and its RMSNorm in one pass, one block per row:
// out[0] = T(x + y), out[1] = T(out[0] · rsqrt(mean(out[0]²) + eps) · weight), the norm taken
// over the rounded sum, as an add followed by an RMSNorm would.
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ weight,
                             T* __restrict__ out, int rows, int cols, float eps) {
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
        if (j < cols) normed[j] = from_f32<T>(v[i] * rstd * to_f32(weight[j]));
    }
    for (int j = threadIdx.x + NORM_CACHED * NORM_THREADS; j < cols; j += NORM_THREADS)
        normed[j] = from_f32<T>(to_f32(sum[j]) * rstd * to_f32(weight[j]));
}

// out[row, j] = T(silu(x[row, j]) · x[row, half + j]) for x `[rows, 2 · half]`: a gated
// MLP's activation on its fused gate/up output, rounded once.
template <typename T>
__device__ void silu_mul(const T* x, T* out, long n, int half) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long row = i / half;
        const int j = i % half;
        const float g = to_f32(x[row * 2 * half + j]);
        const float u = to_f32(x[row * 2 * half + half + j]);
        out[i] = from_f32<T>(g / (1.f + expf(-g)) * u);
    }
}

}  // namespace

#define ROWWISE(SUFFIX, T)                                                                                      \
    extern "C" __global__ void gated_residual_##SUFFIX(const T* x, const T* y, const float* gate, T* out,      \
                                                        long n, int cols) {                                   \
        gated_residual<T>(x, y, gate, out, n, cols);                                                           \
    }                                                                                                          \
    extern "C" __global__ void row_sum_squares_##SUFFIX(const T* x, float* out, int cols) {                   \
        row_sum_squares<T>(x, out, cols);                                                                      \
    }                                                                                                          \
    extern "C" __global__ void scale_rows_cols_##SUFFIX(const T* x, const float* r, const float* c, T* out,    \
                                                         long n, int cols) {                                  \
        scale_rows_cols<T>(x, r, c, out, n, cols);                                                             \
    }                                                                                                          \
    extern "C" __global__ void layer_norm_##SUFFIX(const T* x, const float* w, const float* b, T* out,         \
                                                    int cols, float eps) {                                    \
        layer_norm<T>(x, w, b, out, cols, eps);                                                                \
    }                                                                                                          \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* x, T* out, long n, int half) {                       \
        silu_mul<T>(x, out, n, half);                                                                          \
    }                                                                                                          \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T* x, const T* y, const T* w, T* out, int rows,     \
                                                      int cols, float eps) {                                  \
        add_rms_norm<T>(x, y, w, out, rows, cols, eps);                                                        \
    }

ROWWISE(f32, float)
ROWWISE(bf16, __nv_bfloat16)
ROWWISE(f16, __half)
