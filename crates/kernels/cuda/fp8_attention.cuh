// What the FP8 (E4M3) attention kernels share (attention_fp8.cu's mma.sync kernel and
// flash_attention_sm90.cu's wgmma one, FlashAttention-3's FP8 path): both products on E4M3
// operands. The passes in attention_fp8.cu quantize the inputs first. Q takes one scale per 64
// rows of a head, K one per 128 (a key tile of the Hopper kernel, two of the mma.sync one's),
// so that a tile's scores take one multiply; V takes one scale per channel of a KV head,
// applied to O at the end; P, which the stale maximum keeps at most 2^8, goes to E4M3 (at
// most 448) unscaled. E4M3 keeps 4 significant bits, so each product's operands are off by up
// to 1/16 of themselves: on random inputs the output is off by about 5% (benches/RESULTS.md).
//
// 8-bit tensor-core products read B only K-major, so V comes transposed (`[KV head, d,
// keys]`), and within each 32 keys in the order in which P's accumulator layout hands over its
// A fragments: thread t of a quad holds keys 2t, 2t + 1, 8 + 2t, 9 + 2t (and those + 16) of a
// k32 step, which the A layout (mma.sync m16n8k32's, which wgmma's register A shares) takes as
// columns 4t .. 4t + 3 (and + 16). A sum over keys does not depend on their order, so V's rows
// follow P's instead of P being shuffled between lanes.
#pragma once
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

constexpr int QUANT_ROWS = 64;   // rows of a head under one Q scale; V's keys are padded to it
constexpr int KEYS_FP8 = 128;    // rows of a head under one K scale
constexpr float E4M3_MAX = 448.f;

// Four values as one register of E4M3 bytes, the first in the lowest byte.
__device__ __forceinline__ uint32_t pack_e4m3(float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}

// The A fragments of a warp's 16 query rows of E4M3 Q (`[q_len, heads, HEAD]`), read straight
// from global memory: row_a is the thread's first row, the second 8 below; rows past q_len
// read as zeros. mma.sync m16n8k32's 8-bit A layout, which wgmma's register A shares.
template <int HEAD>
__device__ __forceinline__ void query_fragments_e4m3(const uint8_t* q, int row_a, int q_len, int heads, int head,
                                                     int t, uint32_t (&qf)[HEAD / 32][4]) {
#pragma unroll
    for (int kk = 0; kk < HEAD / 32; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = row_a + 8 * (r & 1), col = 32 * kk + 4 * t + 16 * (r >> 1);
            qf[kk][r] = row < q_len ? *reinterpret_cast<const uint32_t*>(q + ((long)row * heads + head) * HEAD + col) : 0;
        }
}

// O (accumulator layout, a thread's columns 8i + 2t and 8i + 2t + 1) times V's per-channel
// scales of KV head kv_head (`v_scale` `[KV heads, HEAD]`).
template <int HEAD>
__device__ __forceinline__ void scale_by_channels(float (&o)[HEAD / 8][4], const float* v_scale, int kv_head, int t) {
#pragma unroll
    for (int i = 0; i < HEAD / 8; ++i) {
        const float2 sv = *reinterpret_cast<const float2*>(v_scale + kv_head * HEAD + i * 8 + 2 * t);
        o[i][0] *= sv.x;
        o[i][1] *= sv.y;
        o[i][2] *= sv.x;
        o[i][3] *= sv.y;
    }
}

// P of a tile of 8 · NT keys (accumulator layout) as the A fragments of NT / 4 k32 steps.
template <int NT>
__device__ __forceinline__ void p_fragments_e4m3(const float (&p)[NT][4], uint32_t (&pf)[NT / 4][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 4; ++kk) {
        const int i = 4 * kk;
        pf[kk][0] = pack_e4m3(p[i][0], p[i][1], p[i + 1][0], p[i + 1][1]);
        pf[kk][1] = pack_e4m3(p[i][2], p[i][3], p[i + 1][2], p[i + 1][3]);
        pf[kk][2] = pack_e4m3(p[i + 2][0], p[i + 2][1], p[i + 3][0], p[i + 3][1]);
        pf[kk][3] = pack_e4m3(p[i + 2][2], p[i + 2][3], p[i + 3][2], p[i + 3][3]);
    }
}

}  // namespace
