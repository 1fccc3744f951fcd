// A block's largest value and its index, as the argmax and the sampler's draw reduce them:
// ties go to the lowest index, and NaN never wins.
#pragma once
#include <math.h>

namespace {

struct Best {
    float value;
    unsigned index;
};

__device__ __forceinline__ Best better(Best a, Best b) {
    return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

// The block's best, in every thread. Any block of whole warps, up to MAX_WARPS of them.
template <int MAX_WARPS>
__device__ Best block_best(Best b) {
    __shared__ Best warps[MAX_WARPS];
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
        b = better(b, Best{__shfl_xor_sync(0xffffffff, b.value, o), __shfl_xor_sync(0xffffffff, b.index, o)});
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // an earlier call's readers are done
    if (lane == 0) warps[warp] = b;
    __syncthreads();
    b = warps[0];
    for (int w = 1; w < (int)blockDim.x / 32; ++w) b = better(b, warps[w]);
    return b;
}

}  // namespace
