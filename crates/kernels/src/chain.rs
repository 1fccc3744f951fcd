//! Kernel chains: programmatic dependent launch for a decode step's kernels (cuda/chain.cuh).
//!
//! A decode step at batch 1 is a chain of some 300 kernels, each waiting for the last. Most
//! of them are GEMVs bound by reading their weight, and between two GEMVs run small kernels
//! (the norm, rotary, attention, the all-reduce) during which HBM idles. Launched as links of
//! a chain, a kernel starts while the one before it still runs and issues the loads that do
//! not depend on it (a GEMV's first weights) before it waits: the small kernels' time and the
//! launch gaps overlap the weight reads instead of adding to them.
//!
//! Links are launched so only inside [`chained`], where the caller vouches that every kernel
//! it queues reads its predecessor's outputs only after the chain wait (the kernels of this
//! crate that launch through [`Launch`] do) and that no non-kernel work (a copy, an allocation)
//! sits between two links. A caller that wants no links does not call [`chained`]; GPUs
//! before Hopper have none.

use std::cell::Cell;

thread_local! {
    static CHAINED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `queue` with this thread's launches of chain kernels made links of a chain (see the
/// module's notes for what `queue` must keep to).
pub fn chained<R>(queue: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            CHAINED.set(self.0);
        }
    }
    let _restore = Restore(CHAINED.replace(true));
    queue()
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::Launch;
#[cfg(feature = "timeline")]
pub use timeline::{trace_launches, trace_step, trace_to, TracedLaunch};

#[cfg(feature = "cuda")]
mod cuda {
    use std::ffi::c_void;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction, LaunchConfig};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaDevice, Result};

    use super::CHAINED;

    /// A kernel's arguments by value (device pointers as `u64`), launched with
    /// `cuLaunchKernelEx`: as a chain link inside [`super::chained`] on Hopper or newer, as a
    /// plain launch elsewhere.
    #[derive(Default)]
    pub(crate) struct Launch {
        /// Each argument's bytes; 64 bytes is the largest (the peer all-reduce's `Peers`).
        args: Vec<[u64; 8]>,
    }

    impl Launch {
        pub(crate) fn arg<T: Copy>(&mut self, value: T) -> &mut Self {
            const { assert!(std::mem::size_of::<T>() <= 64) };
            let mut slot = [0u64; 8];
            // SAFETY: T is Copy, at most 64 bytes (checked above), copied as bytes into the slot.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (&value as *const T).cast::<u8>(),
                    slot.as_mut_ptr().cast::<u8>(),
                    std::mem::size_of::<T>(),
                )
            };
            self.args.push(slot);
            self
        }

        /// # Safety
        /// The arguments must match `func`'s signature, and the pointers the memory it reads
        /// and writes for `cfg`'s grid.
        pub(crate) unsafe fn launch(&mut self, dev: &CudaDevice, func: &CudaFunction, cfg: LaunchConfig) -> Result<()> {
            let stream = dev.cuda_stream();
            #[cfg(feature = "timeline")]
            self.arg(super::timeline::slot(func, cfg.grid_dim));
            let link = CHAINED.get() && hopper(dev)?;
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid_dim.0,
                gridDimY: cfg.grid_dim.1,
                gridDimZ: cfg.grid_dim.2,
                blockDimX: cfg.block_dim.0,
                blockDimY: cfg.block_dim.1,
                blockDimZ: cfg.block_dim.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream.cu_stream(),
                attrs: &mut attribute,
                numAttrs: link as u32,
            };
            let mut params: Vec<*mut c_void> = self.args.iter_mut().map(|a| a.as_mut_ptr().cast()).collect();
            stream.context().bind_to_thread().w()?;
            // SAFETY: per the caller, the arguments match the kernel; params outlives the call.
            unsafe { sys::cuLaunchKernelEx(&config, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
                .result()
                .w()
        }
    }

    /// Whether `dev` is a Hopper or newer GPU: asked once per thread (a rank's thread drives
    /// one device).
    fn hopper(dev: &CudaDevice) -> Result<bool> {
        thread_local! {
            static HOPPER: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
        }
        if let Some(known) = HOPPER.get() {
            return Ok(known);
        }
        let major = dev
            .cuda_stream()
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .w()?;
        let known = major >= 9;
        HOPPER.set(Some(known));
        Ok(known)
    }
}

/// Where the chain kernels of a `timeline` build record their CTAs' times (cuda/chain.cuh):
/// each launch of this thread gets its own rows of the buffer given to [`trace_to`].
#[cfg(feature = "timeline")]
mod timeline {
    use std::cell::RefCell;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction};

    /// One chain kernel's launch: its CTAs' records start at CTA row `first` of the buffer
    /// (8 u64 a CTA: start, chain wait done, end, SM, 4 marks; times in ns of the global timer).
    #[derive(Clone, Debug)]
    pub struct TracedLaunch {
        pub name: String,
        pub first: u64,
        pub ctas: u64,
    }

    struct Trace {
        base: u64,
        capacity: u64,
        next: u64,
        restart: bool,
        launches: Vec<TracedLaunch>,
    }

    thread_local! {
        static TRACE: RefCell<Option<Trace>> = const { RefCell::new(None) };
    }

    /// Makes this thread's chain kernels record into `capacity` CTA rows (64 bytes each) of
    /// device memory at `base`, which must outlive every graph captured meanwhile.
    pub fn trace_to(base: u64, capacity: u64) {
        TRACE.set(Some(Trace {
            base,
            capacity,
            next: 0,
            restart: false,
            launches: Vec::new(),
        }));
    }

    /// Starts a step: its first launch takes the buffer's first rows again. A replayed graph
    /// launches nothing and writes where its capture's launches did.
    pub fn trace_step() {
        TRACE.with_borrow_mut(|t| {
            if let Some(t) = t {
                t.restart = true;
            }
        });
    }

    /// The launches of the last step that launched any.
    pub fn trace_launches() -> Vec<TracedLaunch> {
        TRACE.with_borrow(|t| t.as_ref().map(|t| t.launches.clone()).unwrap_or_default())
    }

    /// The `trace` argument of a launch of `func`: its rows, or null where nothing is traced
    /// or the buffer is full.
    pub(super) fn slot(func: &CudaFunction, grid: (u32, u32, u32)) -> u64 {
        TRACE.with_borrow_mut(|t| {
            let Some(t) = t else { return 0 };
            if t.restart {
                t.restart = false;
                t.next = 0;
                t.launches.clear();
            }
            let ctas = grid.0 as u64 * grid.1 as u64 * grid.2 as u64;
            if t.next + ctas > t.capacity {
                return 0;
            }
            let mut name: *const std::ffi::c_char = std::ptr::null();
            // SAFETY: the function is loaded; the driver owns the string it returns.
            let name = match unsafe { sys::cuFuncGetName(&mut name, func.cu_function()) }.result() {
                Ok(()) if !name.is_null() => unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned(),
                _ => "?".into(),
            };
            t.launches.push(TracedLaunch {
                name,
                first: t.next,
                ctas,
            });
            let at = t.base + 64 * t.next;
            t.next += ctas;
            at
        })
    }
}
