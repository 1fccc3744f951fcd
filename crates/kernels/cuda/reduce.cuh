// Reductions over a CTA, shared by the kernels whose results must agree bit for bit.
#pragma once

namespace {

// Sum over a block of N threads; every thread gets the result.
template <int N>
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

}  // namespace
