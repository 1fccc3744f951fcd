// SMs held for a benchmark (src/hold.rs): each CTA is launched with all the shared memory a
// CTA may take, so no other kernel's CTA fits beside it, and sleeps until `ns` nanoseconds
// of the global timer have passed, touching no memory.
extern "C" __global__ void hold_sm(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
