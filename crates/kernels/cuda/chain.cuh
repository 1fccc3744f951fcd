// Programmatic dependent launch (Hopper and newer): a kernel launched as a chain's next link
// (src/chain.rs) may start while the kernel before it still runs. Each chain kernel lets its
// successor launch as soon as it starts (`chain_release`), and waits (`chain_wait`) for the
// kernel before it to finish, and its writes to be visible, before it reads anything that
// kernel wrote or writes anything at all. Before the wait a kernel may only read what no
// kernel of the chain writes (weights, the rotary table, the position, which a copy before
// the chain writes): that is the overlap, a GEMV's weight loads in flight while the small
// kernels before it run. Without the launch attribute, or before sm_90, both
// are no-ops and stream order holds as ever.
#pragma once

namespace {

__device__ __forceinline__ void chain_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void chain_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace
