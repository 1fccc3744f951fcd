// The next token of every row of a step's logits, chosen on the device: greedy rows take the
// argmax; sampled rows the Gumbel-max draw over the tokens that top-k and top-p keep, which is
// an exact draw from the softmax of the scaled logits without a normalization or a sort. Each
// row's uniforms come from Philox4x32-10 keyed by its request's seed at counter (token, draw):
// a request draws the same numbers alone as in any batch. The thresholds (only for rows with
// top-k or top-p) are radix selects over an order-preserving integer key of the scaled
// logits, with integer weights (counts, or probabilities in 2^-32 fixed point) so that every
// sum is exact and the result does not depend on the order the threads or CTAs add in.
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

// The thresholds run as stages, each a launch over (part, row) CTAs that each take `chunk`
// tokens of the row, so that a row's passes over its logits spread over many SMs instead of
// one CTA's (0.3–0.5 ms a row at 128K tokens). Top-k is a radix select of the k-th largest
// key, 8 bits a pass from the top (K24 .. K0), counting tokens; top-p finds the largest z
// (TOP), the weight of the tokens top-k kept (KEPT), then the key at which the weights in
// descending key order reach top_p of that (P24 .. P0). Each stage first takes what the
// stage before found from its parts' partials (every CTA of a row alike: each digit's weight
// summed over the parts, in integers, so that the order of the parts does not matter), then
// adds its own partials; the first part hands the row's state on. DONE writes the floors.
enum Stage : int { K24, K16, K8, K0, TOP, KEPT, P24, P16, P8, P0, DONE };

// A row's radix select and its result so far.
struct Select {
    unsigned long long left;  // the weight still to find at and below the digits chosen
    unsigned floor;           // the lowest key the row keeps
    unsigned prefix;          // the digits chosen so far
    float top;                // the largest z (top-p's weights are relative to it)
    unsigned unused;
};

// A row's settings as the thresholds read them.
struct Narrowing {
    bool top_k, top_p;
    __device__ bool takes(int stage) const { return stage <= K0 ? top_k : stage < DONE && top_p; }
};

__device__ __forceinline__ int digit_shift(int stage) { return stage <= K0 ? 24 - 8 * stage : 24 - 8 * (stage - P24); }

// The radix digit at which the weight from the top reaches what `s` has left, from the
// parts' histograms (partials[part · 256 + digit]); every thread gets `s` updated.
__device__ void choose_digit(const unsigned long long* partials, int parts, int shift, Select& s) {
    __shared__ unsigned long long total[256];
    for (int d = threadIdx.x; d < 256; d += THREADS) {
        unsigned long long sum = 0;
        for (int c = 0; c < parts; ++c) sum += __ldcg(partials + c * 256 + d);
        total[d] = sum;
    }
    __syncthreads();
    __shared__ Select chosen;
    if (threadIdx.x == 0) {
        unsigned long long above = 0;
        unsigned d = 0;
        for (int c = 255; c >= 0; --c) {
            if (above + total[c] >= s.left) {
                d = c;
                break;
            }
            above += total[c];
        }
        chosen = s;
        chosen.left -= above;
        chosen.prefix |= d << shift;
    }
    __syncthreads();
    s = chosen;
}

// `s` after stage `prev`, from the row's parts' partials of it.
__device__ void take_stage(int prev, float top_p, const unsigned long long* partials, int parts, Select& s) {
    if (prev == TOP) {
        float top = -INFINITY;
        for (int c = 0; c < parts; ++c) top = fmaxf(top, __uint_as_float((unsigned)__ldcg(partials + c * 256)));
        s.top = top;
    } else if (prev == KEPT) {
        unsigned long long kept = 0;
        for (int c = 0; c < parts; ++c) kept += __ldcg(partials + c * 256);
        s.left = max(1ull, (unsigned long long)((double)top_p * (double)kept));
        s.prefix = 0;
    } else {
        choose_digit(partials, parts, digit_shift(prev), s);
        if (prev == K0) s.floor = s.prefix;
        if (prev == P0) s.floor = max(s.floor, s.prefix);
    }
}

// This CTA's partial of stage `stage` over tokens [begin, end) of `row`, into partial[0..256).
__device__ void stage_partial(int stage, const Row& row, int begin, int end, const Select& s,
                              unsigned long long* partial) {
    if (stage == TOP) {
        Best b{-INFINITY, NONE};
        for (int i = begin + threadIdx.x; i < end; i += THREADS) b = better(b, Best{row.z(i), (unsigned)i});
        b = block_best<WARPS>(b);
        if (threadIdx.x == 0) partial[0] = __float_as_uint(b.value);
        return;
    }
    if (stage == KEPT) {
        unsigned long long kept = 0;
        for (int i = begin + threadIdx.x; i < end; i += THREADS) {
            const float z = row.z(i);
            if (order_key(z) >= s.floor) kept += fixed_weight(z, s.top);
        }
        kept = block_sum(kept);
        if (threadIdx.x == 0) partial[0] = kept;
        return;
    }
    // A radix pass: the weight of each digit at `shift` among the kept tokens whose higher
    // digits are the prefix, in per-warp histograms.
    __shared__ unsigned long long hist[WARPS][256];
    const bool mass = stage >= P24;
    const int shift = digit_shift(stage), warp = threadIdx.x / 32;
    const unsigned high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
    for (int i = threadIdx.x; i < WARPS * 256; i += THREADS) (&hist[0][0])[i] = 0;
    __syncthreads();
    for (int i = begin + threadIdx.x; i < end; i += THREADS) {
        const float z = row.z(i);
        const unsigned key = order_key(z);
        if (key < s.floor || (key & high) != s.prefix) continue;
        atomicAdd(&hist[warp][(key >> shift) & 255], mass ? fixed_weight(z, s.top) : 1ull);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += THREADS) {
        unsigned long long sum = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += hist[w][d];
        partial[d] = sum;
    }
}

// CTA (part, r) of stage `stage` (after `prev`, -1 for none): partials `[rows, parts, 256]`
// and selects `[rows]` from the stage before (`_in`) and for the one after (`_out`).
__device__ void sample_threshold(const float* logits, const unsigned* params, int n, int chunk, int stage, int prev,
                                 const unsigned long long* partials_in, unsigned long long* partials_out,
                                 const Select* selects_in, Select* selects_out, unsigned* floors) {
    const int r = blockIdx.y, part = blockIdx.x, parts = gridDim.x;
    const unsigned* p = params + 8L * r;
    const float temperature = __uint_as_float(p[0]), top_p = __uint_as_float(p[2]);
    const unsigned top_k = p[1];
    const Row row{logits + (long)r * n, n, temperature > 0.f ? 1.f / temperature : 1.f};
    const bool sampled = temperature > 0.f;
    const Narrowing narrowing{sampled && top_k > 0 && top_k < (unsigned)n, sampled && top_p < 1.f};
    __shared__ Select shared_select;
    if (threadIdx.x == 0) shared_select = prev < 0 ? Select{top_k, 0, 0, 0.f, 0} : selects_in[r];
    __syncthreads();
    Select s = shared_select;
    if (prev >= 0 && narrowing.takes(prev)) take_stage(prev, top_p, partials_in + (long)r * parts * 256, parts, s);
    if (part == 0 && threadIdx.x == 0) {
        if (stage == DONE) floors[r] = s.floor;
        else selects_out[r] = s;
    }
    if (stage == DONE || !narrowing.takes(stage)) return;
    const int begin = part * chunk, end = min(n, begin + chunk);
    stage_partial(stage, row, begin, end, s, partials_out + ((long)r * parts + part) * 256);
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
    sample_threshold_stage(const float* logits, const unsigned* params, int n, int chunk, int stage, int prev,
                           const unsigned long long* partials_in, unsigned long long* partials_out,
                           const Select* selects_in, Select* selects_out, unsigned* floors) {
    sample_threshold(logits, params, n, chunk, stage, prev, partials_in, partials_out, selects_in, selects_out,
                     floors);
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
