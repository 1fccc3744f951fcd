// The index of each row's largest value, as greedy decoding picks the next token from 128K
// logits. candle's argmax gives a row to one CTA (≈ 94 µs for Llama 3's vocabulary on an
// H200, 2% of a decode step); here CTAs split the row and a second pass joins their winners.
// Ties go to the first index, as on CPU; NaN never wins (a row of NaN gives 0).
#include "best.cuh"
#include "convert.cuh"

namespace {

constexpr int THREADS = 256;
constexpr unsigned NONE = 0xffffffffu;

// CTA (part, row) takes `chunk` values of row `row` (of `n`) and writes its winner to
// values/indices[row * parts + part].
template <typename T>
__device__ void argmax_parts(const T* x, int n, int chunk, float* values, unsigned* indices) {
    const T* row = x + (long)blockIdx.y * n;
    const int begin = blockIdx.x * chunk, end = min(n, begin + chunk);
    Best b{-INFINITY, NONE};
    for (int i = begin + threadIdx.x; i < end; i += THREADS) b = better(b, Best{to_f32(row[i]), (unsigned)i});
    b = block_best<THREADS / 32>(b);
    if (threadIdx.x == 0) {
        values[blockIdx.y * gridDim.x + blockIdx.x] = b.value;
        indices[blockIdx.y * gridDim.x + blockIdx.x] = b.index;
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_parts_f32(const float* x, int n, int chunk, float* values, unsigned* indices) {
    argmax_parts(x, n, chunk, values, indices);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_parts_bf16(const __nv_bfloat16* x, int n, int chunk, float* values, unsigned* indices) {
    argmax_parts(x, n, chunk, values, indices);
}
extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_parts_f16(const __half* x, int n, int chunk, float* values, unsigned* indices) {
    argmax_parts(x, n, chunk, values, indices);
}

// CTA `row` joins the row's `parts` winners into out[row].
extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_join(const float* values, const unsigned* indices, int parts, unsigned* out) {
    Best b{-INFINITY, NONE};
    for (int i = threadIdx.x; i < parts; i += THREADS)
        b = better(b, Best{values[blockIdx.x * parts + i], indices[blockIdx.x * parts + i]});
    b = block_best<THREADS / 32>(b);
    if (threadIdx.x == 0) out[blockIdx.x] = b.index == NONE ? 0 : b.index;
}
