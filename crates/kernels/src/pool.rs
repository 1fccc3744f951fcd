//! The device's stream-ordered memory pool, where every tensor lives.

use candle_core::Device;

/// While alive, the device's pool keeps the blocks freed into it at a synchronisation,
/// instead of returning them to the device (its release threshold is 0 by default, so every
/// synchronisation would unmap them and the next allocations map them again). Dropped, it
/// returns every unused block and the threshold to 0. A no-op on the CPU.
pub struct PoolHold {
    #[cfg(feature = "cuda")]
    device: Option<candle_core::CudaDevice>,
}

impl PoolHold {
    pub fn new(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        {
            let device = match device {
                Device::Cuda(cuda) => Some(cuda.clone()),
                _ => None,
            };
            if let Some(cuda) = &device {
                cuda::set_release_threshold(cuda, u64::MAX);
            }
            Self { device }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Self {}
        }
    }
}

impl Drop for PoolHold {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.device {
            cuda::set_release_threshold(cuda, 0);
            cuda::trim(cuda);
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::ffi::c_void;

    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::CudaDevice;

    fn pool(device: &CudaDevice) -> Option<sys::CUmemoryPool> {
        let ctx = device.cuda_stream().context().clone();
        ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device belongs to a live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
            .result()
            .ok()?;
        Some(pool)
    }

    /// A failure leaves the pool as it was: it changes how much memory is held, never
    /// whether a tensor is valid.
    pub(super) fn set_release_threshold(device: &CudaDevice, mut bytes: u64) {
        if let Some(pool) = pool(device) {
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            // SAFETY: a live pool; the release threshold is a 64-bit value read from `bytes`.
            let _ = unsafe { sys::cuMemPoolSetAttribute(pool, attr, &mut bytes as *mut u64 as *mut c_void) };
        }
    }

    /// Returns the pool's unused blocks whose frees the device has run.
    pub(super) fn trim(device: &CudaDevice) {
        if let (Ok(()), Some(pool)) = (device.cuda_stream().synchronize(), pool(device)) {
            // SAFETY: a live pool.
            let _ = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
        }
    }
}
