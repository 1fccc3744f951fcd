// One-shot all-reduce of small messages (a decode step's hidden rows) between GPUs that can
// read each other's memory. Each rank copies its input into its own peer-visible buffer,
// raises a flag in every rank's memory, waits for every rank's flag, then sums all ranks'
// buffers in rank order, so every rank computes the same bits. Nothing involves the host:
// the kernel replays inside a captured CUDA graph like any other.
//
// A rank's buffer (`Peers::base[rank]`): two data slots of `slot_bytes`, then the flags
// `[2 slots][MAX_BLOCKS][MAX_RANKS]` u32, then a counter per block. Every call runs all
// MAX_BLOCKS blocks; call k uses epoch k + 1 and slot (k + 1) & 1. A rank writes a slot again
// two calls later, after every peer has raised its flags for the call in between, which a
// peer does only once its kernel of the call before (all its reads of that slot) has ended.
// The fused all-reduce + add_rms_norm follows the same protocol on the same buffers, so the
// two kernels may alternate.
#include <cstdint>

#include "add_rms_norm.cuh"
#include "convert.cuh"

#define MAX_RANKS 8
#define MAX_BLOCKS 16
#define THREADS 512
// A peer that never raises its flag (it died mid-step): trap after about half a minute, so
// the host's wait reports a CUDA error instead of the kernel spinning forever.
#define SPIN_CYCLES (1LL << 36)

struct Peers {
    char* base[MAX_RANKS];
};

namespace {

__device__ __forceinline__ uint32_t* flags(char* base, unsigned long long slot_bytes) {
    return reinterpret_cast<uint32_t*>(base + 2 * slot_bytes);
}

// This call's epoch (counter `block`'s previous one + 1), which also picks the data slot.
__device__ __forceinline__ uint32_t next_epoch(const uint32_t* counters, int block) {
    __shared__ uint32_t shared_epoch;
    if (threadIdx.x == 0) shared_epoch = counters[block] + 1;
    __syncthreads();
    return shared_epoch;
}

// Announces this block's copy to every rank (the threads below `world`), after the CTA's
// writes to the slot.
__device__ __forceinline__ void raise_flags(Peers peers, int rank, int world, unsigned long long slot_bytes,
                                            int slot, uint32_t epoch) {
    __syncthreads();
    if (threadIdx.x < world) {
        // The block's copy, made visible to every GPU, before the flag that announces it.
        __threadfence_system();
        uint32_t* flag = flags(peers.base[threadIdx.x], slot_bytes) + (slot * MAX_BLOCKS + blockIdx.x) * MAX_RANKS + rank;
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
    }
}

// Waits until rank `from`'s block `block` has raised its flag for this epoch in `own`.
__device__ __forceinline__ void await_flag(char* own, unsigned long long slot_bytes, int slot, int block, int from,
                                           uint32_t epoch) {
    const uint32_t* flag = flags(own, slot_bytes) + (slot * MAX_BLOCKS + block) * MAX_RANKS + from;
    const long long start = clock64();
    uint32_t seen;
    do {
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
        if (clock64() - start > SPIN_CYCLES) __trap();
    } while (seen != epoch);
}

// Element i of the sum over the ranks' copies in `slot`, in rank order (every rank computes
// the same bits), rounded to T as an all-reduce's output is.
template <typename T>
__device__ __forceinline__ T sum_over_ranks(Peers peers, int world, unsigned long long slot_bytes, int slot, int i) {
    float sum = 0.f;
    for (int r = 0; r < world; ++r) {
        // Not through L1: the slot held another call's values two calls ago.
        sum += to_f32(__ldcv(reinterpret_cast<const T*>(peers.base[r] + slot * slot_bytes) + i));
    }
    return from_f32<T>(sum);
}

template <typename T, int THREADS_>
__device__ __forceinline__ void copy_own_slice(const T* __restrict__ in, T* mine, int lo, int hi) {
    for (int i = lo + threadIdx.x; i < hi; i += THREADS_) mine[i] = in[i];
}

template <typename T>
__device__ void peer_all_reduce(const T* __restrict__ in, T* __restrict__ out, int n, Peers peers, int rank,
                                int world, unsigned long long slot_bytes) {
    char* own = peers.base[rank];
    uint32_t* counters = flags(own, slot_bytes) + 2 * MAX_BLOCKS * MAX_RANKS;
    const uint32_t epoch = next_epoch(counters, blockIdx.x);
    const int slot = epoch & 1;
    const int per_block = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per_block;
    const int hi = min(n, lo + per_block);

    copy_own_slice<T, THREADS>(in, reinterpret_cast<T*>(own + slot * slot_bytes), lo, hi);
    raise_flags(peers, rank, world, slot_bytes, slot, epoch);
    // This block's slice only: the same block of every rank.
    if (threadIdx.x < world) await_flag(own, slot_bytes, slot, blockIdx.x, threadIdx.x, epoch);
    __syncthreads();
    for (int i = lo + threadIdx.x; i < hi; i += THREADS) out[i] = sum_over_ranks<T>(peers, world, slot_bytes, slot, i);
    if (threadIdx.x == 0) counters[blockIdx.x] = epoch;
}

// The all-reduce of one row followed by add_rms_norm with the residual stream: out[0] =
// T(residual + Σ partial), out[1] its RMSNorm times weight, the bits of peer_all_reduce then
// rowwise.cu's add_rms_norm. One block of NORM_THREADS: the norm needs the whole row, and a
// decode row is a few values per thread. It keeps the buffers' protocol for all MAX_BLOCKS
// (every counter advances, every flag is raised and awaited), so the two kernels alternate.
// Needs cols ≤ NORM_CACHED · NORM_THREADS (add_rms_norm.cuh).
template <typename T>
__device__ void peer_all_reduce_add_rms_norm(const T* __restrict__ partial, const T* __restrict__ residual,
                                             const T* __restrict__ weight, T* __restrict__ out, int cols, float eps,
                                             Peers peers, int rank, int world, unsigned long long slot_bytes) {
    char* own = peers.base[rank];
    uint32_t* counters = flags(own, slot_bytes) + 2 * MAX_BLOCKS * MAX_RANKS;
    const uint32_t epoch = next_epoch(counters, 0);
    const int slot = epoch & 1;

    copy_own_slice<T, NORM_THREADS>(partial, reinterpret_cast<T*>(own + slot * slot_bytes), 0, cols);
    __syncthreads();
    if (threadIdx.x < world * MAX_BLOCKS) {
        const int peer = threadIdx.x % world, block = threadIdx.x / world;
        // The row, made visible to every GPU, before the flags that announce it.
        __threadfence_system();
        uint32_t* flag = flags(peers.base[peer], slot_bytes) + (slot * MAX_BLOCKS + block) * MAX_RANKS + rank;
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
        await_flag(own, slot_bytes, slot, block, peer, epoch);
    }
    __syncthreads();
    add_rms_norm_row<T>(
        residual, [=](int j) { return to_f32(sum_over_ranks<T>(peers, world, slot_bytes, slot, j)); }, weight, out,
        out + cols, cols, eps, [](int) { return true; });
    if (threadIdx.x < MAX_BLOCKS) counters[threadIdx.x] = epoch;
}

}  // namespace

#define PEER_ALL_REDUCE(T, SUFFIX)                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        peer_all_reduce_##SUFFIX(const T* in, T* out, int n, Peers peers, int rank, int world,                 \
                                 unsigned long long slot_bytes) {                                              \
        peer_all_reduce<T>(in, out, n, peers, rank, world, slot_bytes);                                        \
    }

PEER_ALL_REDUCE(float, f32)
PEER_ALL_REDUCE(__nv_bfloat16, bf16)
PEER_ALL_REDUCE(__half, f16)

#define PEER_ALL_REDUCE_ADD_RMS_NORM(T, SUFFIX)                                                                 \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS) peer_all_reduce_add_rms_norm_##SUFFIX(          \
        const T* partial, const T* residual, const T* weight, T* out, int cols, float eps, Peers peers, int rank, \
        int world, unsigned long long slot_bytes) {                                                            \
        peer_all_reduce_add_rms_norm<T>(partial, residual, weight, out, cols, eps, peers, rank, world, slot_bytes); \
    }

PEER_ALL_REDUCE_ADD_RMS_NORM(float, f32)
PEER_ALL_REDUCE_ADD_RMS_NORM(__nv_bfloat16, bf16)
PEER_ALL_REDUCE_ADD_RMS_NORM(__half, f16)
