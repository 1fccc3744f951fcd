// One-shot all-reduce of small messages (a decode step's hidden rows) between GPUs that can
// read each other's memory. Each rank copies its input into its own peer-visible buffer,
// raises a flag in every rank's memory, waits for every rank's flag, then sums all ranks'
// buffers in rank order, so every rank computes the same bits. Nothing involves the host:
// the kernel replays inside a captured CUDA graph like any other. `in` may be `out` (a block
// reads its range into its slot before it writes the range's sums). A chain kernel (chain.cuh).
//
// A rank's buffer (`Peers::base[rank]`): two data slots of `slot_bytes`, then the flags
// `[2 slots][MAX_BLOCKS][MAX_RANKS]` u32, then a counter per block. Every call runs all
// MAX_BLOCKS blocks; call k uses epoch k + 1 and slot (k + 1) & 1. A rank writes a slot again
// two calls later, after every peer has raised its flags for the call in between, which a
// peer does only once its kernel of the call before (all its reads of that slot) has ended.
#include <cstdint>

#include "chain.cuh"
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

template <typename T>
__device__ void peer_all_reduce(const T* in, T* out, int n, Peers peers, int rank,
                                int world, unsigned long long slot_bytes) {
    chain_release();
    chain_wait();
    const int block = blockIdx.x;
    char* own = peers.base[rank];
    uint32_t* counters = flags(own, slot_bytes) + 2 * MAX_BLOCKS * MAX_RANKS;
    __shared__ uint32_t shared_epoch;
    if (threadIdx.x == 0) shared_epoch = counters[block] + 1;
    __syncthreads();
    const uint32_t epoch = shared_epoch;
    const int slot = epoch & 1;
    const int per_block = (n + gridDim.x - 1) / gridDim.x;
    const int lo = block * per_block;
    const int hi = min(n, lo + per_block);

    T* mine = reinterpret_cast<T*>(own + slot * slot_bytes);
    for (int i = lo + threadIdx.x; i < hi; i += THREADS) mine[i] = in[i];
    __syncthreads();
    if (threadIdx.x < world) {
        // The block's copy, made visible to every GPU, before the flag that announces it.
        __threadfence_system();
        uint32_t* flag = flags(peers.base[threadIdx.x], slot_bytes) + (slot * MAX_BLOCKS + block) * MAX_RANKS + rank;
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
        const uint32_t* mine_from = flags(own, slot_bytes) + (slot * MAX_BLOCKS + block) * MAX_RANKS + threadIdx.x;
        const long long start = clock64();
        uint32_t seen;
        do {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(mine_from) : "memory");
            if (clock64() - start > SPIN_CYCLES) __trap();
        } while (seen != epoch);
    }
    __syncthreads();
    for (int i = lo + threadIdx.x; i < hi; i += THREADS) {
        float sum = 0.f;
        for (int r = 0; r < world; ++r) {
            // Not through L1: the slot held another call's values two calls ago.
            sum += to_f32(__ldcv(reinterpret_cast<const T*>(peers.base[r] + slot * slot_bytes) + i));
        }
        out[i] = from_f32<T>(sum);
    }
    if (threadIdx.x == 0) counters[block] = epoch;
}

}  // namespace

#define PEER_ALL_REDUCE(T, SUFFIX)                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        peer_all_reduce_##SUFFIX(const T* in, T* out, int n, Peers peers, int rank, int world,                 \
                                 unsigned long long slot_bytes CHAIN_TRACE_PARAM) {                            \
        CHAIN_TRACE_SCOPE                                                                                      \
        peer_all_reduce<T>(in, out, n, peers, rank, world, slot_bytes);                                        \
    }

PEER_ALL_REDUCE(float, f32)
PEER_ALL_REDUCE(__nv_bfloat16, bf16)
PEER_ALL_REDUCE(__half, f16)
