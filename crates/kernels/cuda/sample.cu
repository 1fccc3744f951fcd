// The next token of every row of a step's logits, chosen on the device: greedy rows take the
// argmax; sampled rows the Gumbel-max draw over the tokens that top-k and top-p keep, which is
// an exact draw from the softmax of the scaled logits without a normalization or a sort. Each
// row's uniforms come from Philox4x32-10 keyed by its request's seed at counter (token, draw):
// a request draws the same numbers alone as in any batch. The thresholds (one CTA per row,
// only for rows with top-k or top-p) are radix selects over an order-preserving integer key
// of the scaled logits, with integer weights (counts, or probabilities in 2^-32 fixed point)
// so that every sum is exact and the result does not depend on the order the threads add in.
// The draw itself splits each row over many CTAs, whose winners a second pass joins.
//
// params `[rows, 8]` u32: temperature (f32 bits; 0 is greedy), top_k (0: off), top_p (f32
// bits; 1 or more: off), seed low and high, draw low and high, unused.
#include <stdint.h>

#include "best.cuh"

namespace {

constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr unsigned NONE = 0xffffffffu;

// The u32 whose unsigned order is the float order (negatives flipped, positives' sign set).
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned b = __float_as_uint(x);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// Philox4x32-10's first output word for counter (c0, c1, c2, 0) and key (k0, k1).
__device__ __forceinline__ unsigned philox(unsigned c0, unsigned c1, unsigned c2, unsigned k0, unsigned k1) {
    unsigned c3 = 0;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const unsigned lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// A standard Gumbel variate from 23 random bits: u in (0, 1), exact in f32.
__device__ __forceinline__ float gumbel(unsigned bits) {
    const float u = ((float)(bits >> 9) + 0.5f) * (1.f / 8388608.f);
    return -logf(-logf(u));
}

// The block's sum, in every thread (exact: integers).
__device__ unsigned long long block_sum(unsigned long long v) {
    __shared__ unsigned long long warps[WARPS];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) warps[warp] = v;
    __syncthreads();
    v = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += warps[w];
    return v;
}

// One row's view: logit i scaled by 1 / temperature, and its key.
struct Row {
    const float* x;
    int n;
    float inv_temperature;
    __device__ float z(int i) const { return x[i] * inv_temperature; }
};

// exp(z - top) in 2^-32 fixed point: the largest token weighs 2^32, the sum of a 128K-token
// vocabulary stays below 2^49.
__device__ __forceinline__ unsigned long long fixed_weight(float z, float top) {
    return (unsigned long long)(exp2f((z - top) * 1.4426950408889634f) * 4294967296.f);
}

// The largest key t such that the tokens with key ≥ max(t, floor) weigh at least `target`
// (≥ 1) in all: a radix select, 8 bits a pass from the top, over per-warp histograms in
// `hist` (shared, one set for both instantiations). MASS: weights are fixed_weight(z, top);
// else 1 (counts).
template <bool MASS>
__device__ unsigned radix_threshold(const Row& row, unsigned floor, float top, unsigned long long target,
                                    unsigned long long (*hist)[256]) {
    __shared__ unsigned chosen;
    __shared__ unsigned long long left;
    const int warp = threadIdx.x / 32;
    unsigned prefix = 0;
    if (threadIdx.x == 0) left = target;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < WARPS * 256; i += THREADS) (&hist[0][0])[i] = 0;
        __syncthreads();
        // Tokens whose bits above `shift` equal the prefix found so far.
        const unsigned high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (int i = threadIdx.x; i < row.n; i += THREADS) {
            const float z = row.z(i);
            const unsigned key = order_key(z);
            if (key < floor || (key & high) != prefix) continue;
            atomicAdd(&hist[warp][(key >> shift) & 255], MASS ? fixed_weight(z, top) : 1ull);
        }
        __syncthreads();
        for (int d = threadIdx.x; d < 256; d += THREADS) {
            unsigned long long sum = 0;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) sum += hist[w][d];
            hist[0][d] = sum;
        }
        __syncthreads();
        // From the highest digit down, the first at which the weight reaches what is left.
        if (threadIdx.x == 0) {
            unsigned long long above = 0;
            unsigned d = 0;
            for (int c = 255; c >= 0; --c) {
                if (above + hist[0][c] >= left) {
                    d = c;
                    break;
                }
                above += hist[0][c];
            }
            left -= above;
            chosen = d;
        }
        __syncthreads();
        prefix |= chosen << shift;
    }
    return prefix;
}

// CTA r: the lowest key row r keeps, `floors[r]` (0 keeps every token): the top-k threshold,
// then the top-p threshold over what it kept. Greedy rows, and rows without either, keep all.
__device__ void sample_floor(const float* logits, const unsigned* params, unsigned* floors, int n) {
    const int r = blockIdx.x;
    const unsigned* p = params + 8L * r;
    const float temperature = __uint_as_float(p[0]);
    const Row row{logits + (long)r * n, n, temperature > 0.f ? 1.f / temperature : 1.f};
    const unsigned top_k = p[1];
    const float top_p = __uint_as_float(p[2]);
    __shared__ unsigned long long hist[WARPS][256];
    unsigned floor = 0;
    if (!(temperature > 0.f)) {
        if (threadIdx.x == 0) floors[r] = 0;
        return;
    }
    if (top_k > 0 && top_k < (unsigned)n) floor = radix_threshold<false>(row, 0, 0.f, top_k, hist);
    if (top_p < 1.f) {
        Best b{-INFINITY, NONE};
        for (int i = threadIdx.x; i < n; i += THREADS) b = better(b, Best{row.z(i), (unsigned)i});
        const float top = block_best<WARPS>(b).value;
        unsigned long long kept = 0;
        for (int i = threadIdx.x; i < n; i += THREADS) {
            const float z = row.z(i);
            if (order_key(z) >= floor) kept += fixed_weight(z, top);
        }
        kept = block_sum(kept);
        const unsigned long long target = max(1ull, (unsigned long long)((double)top_p * (double)kept));
        floor = max(floor, radix_threshold<true>(row, floor, top, target, hist));
    }
    if (threadIdx.x == 0) floors[r] = floor;
}

// CTA (part, r) takes `chunk` tokens of row r: a greedy row's largest logit, a sampled row's
// largest z + Gumbel over the tokens at or above its floor; the part's winner goes to
// values/indices[r · parts + part].
__device__ void sample_part(const float* logits, const unsigned* params, const unsigned* floors, int n, int chunk,
                            float* values, unsigned* indices) {
    const int r = blockIdx.y, part = blockIdx.x;
    const unsigned* p = params + 8L * r;
    const float temperature = __uint_as_float(p[0]);
    const Row row{logits + (long)r * n, n, temperature > 0.f ? 1.f / temperature : 1.f};
    const int begin = part * chunk, end = min(n, begin + chunk);
    Best b{-INFINITY, NONE};
    if (!(temperature > 0.f)) {
        for (int i = begin + threadIdx.x; i < end; i += blockDim.x) b = better(b, Best{row.x[i], (unsigned)i});
    } else {
        const unsigned floor = floors[r];
        for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const float z = row.z(i);
            if (order_key(z) < floor) continue;
            b = better(b, Best{z + gumbel(philox((unsigned)i, p[5], p[6], p[3], p[4])), (unsigned)i});
        }
    }
    b = block_best<WARPS>(b);
    if (threadIdx.x == 0) {
        values[r * gridDim.x + part] = b.value;
        indices[r * gridDim.x + part] = b.index;
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_floors(const float* logits, const unsigned* params, unsigned* floors, int n) {
    sample_floor(logits, params, floors, n);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_parts(const float* logits, const unsigned* params, const unsigned* floors, int n, int chunk, float* values,
                 unsigned* indices) {
    sample_part(logits, params, floors, n, chunk, values, indices);
}

// CTA r joins row r's `parts` winners into out[r] (0 when no token won: a row of NaN).
extern "C" __global__ void __launch_bounds__(THREADS)
    sample_join(const float* values, const unsigned* indices, int parts, unsigned* out) {
    Best b{-INFINITY, NONE};
    for (int i = threadIdx.x; i < parts; i += blockDim.x)
        b = better(b, Best{values[blockIdx.x * parts + i], indices[blockIdx.x * parts + i]});
    b = block_best<WARPS>(b);
    if (threadIdx.x == 0) out[blockIdx.x] = b.index == NONE ? 0 : b.index;
}

// Penalizes each listed token of its row in place: divides a positive logit (multiplies a
// negative one) by the entry's factor, the repetition penalty, then takes its offset off,
// the frequency and presence penalties: `tokens` `[count]` (distinct within a row), `rows`
// their rows.
extern "C" __global__ void penalize(float* logits, const unsigned* tokens, const unsigned* rows,
                                    const float* factors, const float* offsets, int count, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
        float* x = logits + (long)rows[i] * n + tokens[i];
        const float factor = factors[i];
        // Rounded as the host rounds each step: no multiply-add fused from the two.
        const float scaled = *x > 0.f ? __fdiv_rn(*x, factor) : __fmul_rn(*x, factor);
        *x = __fsub_rn(scaled, offsets[i]);
    }
}
