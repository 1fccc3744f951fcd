// The rotary embedding's rotation of a pair (x1, x2) = (x[j], x[j + d/2]) by the angle with
// cosine c and sine s: element j (second = false) or j + d/2 (second = true). Each product
// and the sum rounded apart (no FMA contraction), so that every kernel that rotates — and
// the CPU twin — gives the same bits.
#pragma once

namespace {

__device__ __forceinline__ float rotate(float x1, float x2, float c, float s, bool second) {
    return second ? __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)) : __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
}

}  // namespace
