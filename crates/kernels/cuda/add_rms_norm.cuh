// The residual stream's sum and its RMSNorm over one row, shared by rowwise.cu's add_rms_norm
// and peer_all_reduce.cu's fused all-reduce + add_rms_norm, so that the two give the same bits.
#pragma once
#include "convert.cuh"
#include "reduce.cuh"

namespace {

// Threads per row, and the values each keeps in registers between its two passes. A decode
// step has one row: 1,024 threads with independent loads finish it in a few microseconds,
// where 256 threads looping over 4,096 columns waited on memory 16 times.
constexpr int NORM_THREADS = 1024;
constexpr int NORM_CACHED = 8;

// sum[j] = T(x[j] + y(j)), normed[j] = T(sum[j] · rsqrt(mean(sum²) + eps) · weight[j]), the
// norm taken over the rounded sum, as an add followed by an RMSNorm would. `y(j)` gives the
// addend as f32; `owns(j)` says which columns this CTA writes (the statistics always cover the
// whole row). Columns past NORM_CACHED · NORM_THREADS are read back from `sum`, so a CTA that
// does not own every column must not be given rows that wide.
template <typename T, typename Addend, typename Owns>
__device__ __forceinline__ void add_rms_norm_row(const T* __restrict__ x, Addend y, const T* __restrict__ weight,
                                                 T* __restrict__ sum, T* __restrict__ normed, int cols, float eps,
                                                 Owns owns) {
    float v[NORM_CACHED];
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_CACHED; ++i) {
        const int j = threadIdx.x + i * NORM_THREADS;
        v[i] = 0.f;
        if (j < cols) {
            const T s = from_f32<T>(to_f32(x[j]) + y(j));
            if (owns(j)) sum[j] = s;
            v[i] = to_f32(s);
            q += v[i] * v[i];
        }
    }
    for (int j = threadIdx.x + NORM_CACHED * NORM_THREADS; j < cols; j += NORM_THREADS) {
        const T s = from_f32<T>(to_f32(x[j]) + y(j));
        sum[j] = s;
        q += to_f32(s) * to_f32(s);
    }
    const float rstd = rsqrtf(block_sum<NORM_THREADS>(q) / cols + eps);
#pragma unroll
    for (int i = 0; i < NORM_CACHED; ++i) {
        const int j = threadIdx.x + i * NORM_THREADS;
        if (j < cols && owns(j)) normed[j] = from_f32<T>(v[i] * rstd * to_f32(weight[j]));
    }
    for (int j = threadIdx.x + NORM_CACHED * NORM_THREADS; j < cols; j += NORM_THREADS)
        normed[j] = from_f32<T>(to_f32(sum[j]) * rstd * to_f32(weight[j]));
}

}  // namespace
