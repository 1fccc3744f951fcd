// Programmatic dependent launch (Hopper and newer): a kernel launched as a chain's next link
// (src/chain.rs) may start while the kernel before it still runs. Each chain kernel lets its
// successor launch as soon as it starts (`chain_release`), and waits (`chain_wait`) for the
// kernel before it to finish, and its writes to be visible, before it reads anything that
// kernel wrote or writes anything at all. Before the wait a kernel may only read what no
// kernel of the chain writes (weights, the rotary table, the position, which a copy before
// the chain writes): that is the overlap, a GEMV's weight loads in flight while the small
// kernels before it run. Without the launch attribute, or before sm_90, both
// are no-ops and stream order holds as ever.
//
// With TPINFER_TIMELINE (the `timeline` feature; `tpinfer-bench timeline`) every chain kernel
// takes one more argument, `trace`: null, or 8 u64 per CTA, where thread 0 of the CTA writes
// the global timer (ns) when the CTA starts, when its chain wait returns and when it ends,
// its SM, and up to 4 marks (`trace_mark`) a kernel sets at points of its own. Without it the
// argument and the marks do not exist.
#pragma once

namespace {

#ifdef TPINFER_TIMELINE
#define CHAIN_TRACE_PARAM , unsigned long long *trace
#define CHAIN_TRACE_SCOPE TraceScope trace_scope(trace);

__shared__ unsigned long long* trace_cta;

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ bool trace_thread() { return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0; }

// Records the CTA's start and SM on construction, its end on destruction: one at the top of
// each chain kernel's entry point.
struct TraceScope {
    __device__ explicit TraceScope(unsigned long long* trace) {
        if (!trace_thread()) return;
        const long cta = blockIdx.x + (long)gridDim.x * (blockIdx.y + (long)gridDim.y * blockIdx.z);
        trace_cta = trace ? trace + 8 * cta : nullptr;
        if (trace_cta) {
            unsigned sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            trace_cta[0] = global_ns();
            trace_cta[3] = sm;
        }
    }
    __device__ ~TraceScope() {
        if (trace_thread() && trace_cta) trace_cta[2] = global_ns();
    }
};

// Mark i (0..3): when thread 0 of the CTA passed this point.
__device__ __forceinline__ void trace_mark(int i) {
    if (trace_thread() && trace_cta) trace_cta[4 + i] = global_ns();
}
#else
#define CHAIN_TRACE_PARAM
#define CHAIN_TRACE_SCOPE
__device__ __forceinline__ void trace_mark(int) {}
#endif

__device__ __forceinline__ void chain_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef TPINFER_TIMELINE
    if (trace_thread() && trace_cta) trace_cta[1] = global_ns();
#endif
}

__device__ __forceinline__ void chain_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace
