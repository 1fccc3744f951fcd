// Products with FP8 E4M3 weights, one f32 scale per weight row (crates/kernels/src/fp8.rs).
// - quantize_rows: each row of x as E4M3 values and one f32 scale, x ≈ q · scale, the scale
//   putting the row's largest magnitude at E4M3's largest (448); an all-zero row gets 1. The
//   activations of a W8A8 product, quantized per token as the weights are per row.
// - silu_mul_quantize_rows: quantize_rows of a gated MLP's hidden, silu(gate) · up, made from
//   the fused gate/up output as it is read.
// - dequantize_rows: q_w · s_w in T, for GPUs without FP8 tensor cores (before sm_89) and
//   shapes cuBLASLt's FP8 GEMM does not take.
#include <cuda_fp8.h>
#include <stdint.h>

#include "convert.cuh"

namespace {

constexpr int THREADS = 256;
constexpr float E4M3_MAX = 448.f;

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

// V bytes stored at once: a vector's quantized values.
template <int V>
struct alignas(V) Bytes {
    uint8_t b[V];
};

// Row blockIdx.x of k values made V at a time, vector i by `make(i, values)`, quantized to E4M3
// bytes in q and one f32 scale: the largest magnitude over the row, then the values made again
// and divided by the scale (as the weights' quantization and the reference divide), UNROLL
// vectors in flight a thread in each pass.
template <int V, int UNROLL, typename Make>
__device__ __forceinline__ void quantize_made_row(Make make, uint8_t* __restrict__ q, float* __restrict__ scales,
                                                  int k) {
    const long row = blockIdx.x;
    const int vectors = k / V;
    float amax = 0.f;
#pragma unroll UNROLL
    for (int i = threadIdx.x; i < vectors; i += THREADS) {
        float h[V];
        make(i, h);
#pragma unroll
        for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(h[j]));
    }
    amax = block_max(amax);
    const float scale = amax > 0.f ? amax / E4M3_MAX : 1.f;
    if (threadIdx.x == 0) scales[row] = scale;
    Bytes<V>* qr = reinterpret_cast<Bytes<V>*>(q + row * k);
#pragma unroll UNROLL
    for (int i = threadIdx.x; i < vectors; i += THREADS) {
        float h[V];
        make(i, h);
        Bytes<V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) out.b[j] = __nv_cvt_float_to_fp8(h[j] / scale, __NV_SATFINITE, __NV_E4M3);
        qr[i] = out;
    }
}

// Rows read in 16-byte vectors, four in flight a thread: one 2-byte load a thread at a time
// left the quantization of a Wan-14B DiT's activations far below the memory's rate. The caller
// passes x 16-byte aligned (k is a multiple of 16, so every row is).
template <typename T>
__device__ void quantize_rows(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scales, int k) {
    constexpr int V = 16 / sizeof(T);
    const uint4* xr = reinterpret_cast<const uint4*>(x + blockIdx.x * (long)k);
    const auto load = [xr](int i, float(&h)[V]) {
        const uint4 raw = xr[i];
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < V; ++j) h[j] = to_f32(v[j]);
    };
    quantize_made_row<V, 4>(load, q, scales, k);
}

// silu(gate) · up of a row of x `[rows, 2n]` (gate, then up), rounded to T as silu_mul
// rounds it (rowwise.cu's gate_mul), then quantized as quantize_rows quantizes: a gated MLP's
// hidden made and quantized for the down projection's W8A8 GEMM without being written. The
// caller passes x 16-byte aligned and n a multiple of 16.
template <typename T>
__device__ void silu_mul_quantize_rows(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scales,
                                       int n) {
    constexpr int V = 16 / sizeof(T);
    const uint4* gate = reinterpret_cast<const uint4*>(x + blockIdx.x * 2 * (long)n);
    const uint4* up = reinterpret_cast<const uint4*>(x + blockIdx.x * 2 * (long)n + n);
    const auto silu_mul = [gate, up](int i, float(&h)[V]) {
        const uint4 graw = gate[i], uraw = up[i];
        const T* g = reinterpret_cast<const T*>(&graw);
        const T* u = reinterpret_cast<const T*>(&uraw);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float gj = to_f32(g[j]);
            h[j] = to_f32(from_f32<T>(gj / (1.f + expf(-gj)) * to_f32(u[j])));
        }
    };
    quantize_made_row<V, 2>(silu_mul, q, scales, n);
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
        fp8_silu_mul_quantize_rows_##SUFFIX(const T* x, uint8_t* q, float* scales, int n) {                  \
        silu_mul_quantize_rows<T>(x, q, scales, n);                                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                    \
        fp8_dequantize_rows_##SUFFIX(const uint8_t* w, const float* sw, T* out, long elements, int k) {      \
        dequantize_rows<T>(w, sw, out, elements, k);                                                         \
    }

FP8(f32, float)
FP8(bf16, __nv_bfloat16)
FP8(f16, __half)
