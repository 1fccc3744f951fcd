// Products with FP8 E4M3 weights, one f32 scale per weight row (crates/kernels/src/fp8.rs).
// - quantize_rows: each row of x as E4M3 values and one f32 scale, x ≈ q · scale, the scale
//   putting the row's largest magnitude at E4M3's largest (448); an all-zero row gets 1. The
//   activations of a W8A8 product, quantized per token as the weights are per row.
// - gemv_fp8_weights: one row through an FP8 weight `[n, k]`, y[j] = s_w[j] · Σ_k x[k] ·
//   q_w[j, k], the weight dequantized in registers and accumulated in f32 (W8A16): a decode
//   step's products, bound by reading q_w once. cuBLASLt's FP8 GEMM takes more rows.
// - dequantize_rows: q_w · s_w in T, for GPUs without FP8 tensor cores (before sm_89) and
//   shapes cuBLASLt's FP8 GEMM does not take.
// The byte order of a 16-byte load is the elements' order: the conversion of a pair takes
// the lower byte to the lower half.
#include <cuda_fp8.h>
#include <stdint.h>

#include "convert.cuh"

namespace {

constexpr int THREADS = 256;
constexpr float E4M3_MAX = 448.f;
constexpr int GEMV_ROWS = 4;  // weight rows per CTA

__device__ __forceinline__ float block_max(float v) {
    __shared__ float warps[THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
    __syncthreads();
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) m = fmaxf(m, warps[i]);
    return m;
}

template <typename T>
__device__ void quantize_rows(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scales, int k) {
    const long row = blockIdx.x;
    const T* xr = x + row * k;
    float amax = 0.f;
    for (int i = threadIdx.x; i < k; i += THREADS) amax = fmaxf(amax, fabsf(to_f32(xr[i])));
    amax = block_max(amax);
    const float scale = amax > 0.f ? amax / E4M3_MAX : 1.f;
    if (threadIdx.x == 0) scales[row] = scale;
    uint8_t* qr = q + row * k;
    // A division, as the weights' quantization and the reference divide.
    for (int i = threadIdx.x; i < k; i += THREADS)
        qr[i] = __nv_cvt_float_to_fp8(to_f32(xr[i]) / scale, __NV_SATFINITE, __NV_E4M3);
}

// 16 E4M3 values as f32.
__device__ __forceinline__ void fp8x16_to_f32(uint4 v, float (&out)[16]) {
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Quantizing the one row as well (W8A8, as more rows are) would put a reduction over it ahead
// of every product on the step's critical path (measured: a separate one-CTA kernel, or every
// CTA quantizing the row itself, 0.5–0.9× the bf16 GEMV). GEMV_ROWS outputs per CTA; the 256 threads split k in 16-byte chunks of the weight, each
// loading its chunk of every row before it uses any; x's 16 values of a chunk come from L1 in
// T. Needs k % 16 == 0 and 16-byte aligned rows.
template <typename T>
__device__ void gemv_fp8_weights(const T* __restrict__ x, const uint8_t* __restrict__ w,
                                 const float* __restrict__ sw, T* __restrict__ y, int n, int k) {
    const int row0 = blockIdx.x * GEMV_ROWS, chunks = k / 16;
    const uint4* wv[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) wv[r] = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, n - 1) * k);
    constexpr int X_LOADS = 16 * sizeof(T) / 16;  // 16-byte loads per chunk of x
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float acc[GEMV_ROWS] = {};
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
        uint4 ws[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) ws[r] = __ldcs(wv[r] + c);  // streamed: read once
        uint4 x_raw[X_LOADS];
#pragma unroll
        for (int i = 0; i < X_LOADS; ++i) x_raw[i] = xv[c * X_LOADS + i];
        const T* xs = reinterpret_cast<const T*>(x_raw);
        float xf[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) xf[i] = to_f32(xs[i]);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            float wf[16];
            fp8x16_to_f32(ws[r], wf);
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
        }
    }
    __shared__ float partial[THREADS / 32][GEMV_ROWS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
        if (lane == 0) partial[warp][r] = acc[r];
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r < GEMV_ROWS && row0 + r < n) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < THREADS / 32; ++i) s += partial[i][r];
        y[row0 + r] = from_f32<T>(s * sw[row0 + r]);
    }
}

template <typename T>
__device__ void dequantize_rows(const uint8_t* __restrict__ w, const float* __restrict__ sw, T* __restrict__ out,
                                long elements, int k) {
    for (long i = blockIdx.x * (long)THREADS + threadIdx.x; i < elements; i += (long)gridDim.x * THREADS) {
        const __half_raw raw = __nv_cvt_fp8_to_halfraw(w[i], __NV_E4M3);
        out[i] = from_f32<T>(__half2float(*reinterpret_cast<const __half*>(&raw)) * sw[i / k]);
    }
}

}  // namespace

#define FP8(SUFFIX, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                    \
        fp8_quantize_rows_##SUFFIX(const T* x, uint8_t* q, float* scales, int k) {                           \
        quantize_rows<T>(x, q, scales, k);                                                                   \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                    \
        fp8_gemv_weights_##SUFFIX(const T* x, const uint8_t* w, const float* sw, T* y, int n, int k) {       \
        gemv_fp8_weights<T>(x, w, sw, y, n, k);                                                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                    \
        fp8_dequantize_rows_##SUFFIX(const uint8_t* w, const float* sw, T* out, long elements, int k) {      \
        dequantize_rows<T>(w, sw, out, elements, k);                                                         \
    }

FP8(f32, float)
FP8(bf16, __nv_bfloat16)
FP8(f16, __half)
