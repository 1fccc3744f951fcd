//! A rank's device memory as measured, to hold the plan to account.

use candle_core::Device;
use tpinfer_plan::RankPlan;

/// A GPU's memory as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes in use on the device (by every process), the memory pool's reserve included.
    pub used: u64,
    pub total: u64,
    /// Bytes the device's stream-ordered memory pool (where every tensor lives) holds now.
    pub pool_reserved: u64,
    /// Bytes of it the live tensors take now.
    pub pool_used: u64,
    /// The most the pool has held since the engine started.
    pub pool_peak: u64,
    /// The most the pool's live allocations have summed to since the engine started: the
    /// tensors alone, without the pool's fragmentation.
    pub pool_used_peak: u64,
}

impl DeviceMemory {
    /// The peak device memory: what is in use outside the pool (CUDA context, cuBLAS, NCCL,
    /// all allocated once at start) plus the pool's peak.
    pub fn peak(&self) -> u64 {
        self.used - self.pool_reserved + self.pool_peak
    }

    pub fn free(&self) -> u64 {
        self.total - self.used
    }
}

/// The host's memory available to a new allocation (Linux's `MemAvailable`), or `None` where
/// it cannot be read.
pub fn host_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// How far a measurement may stray from the plan before the rank warns.
pub const PLAN_TOLERANCE: f64 = 0.03;

/// Warns when `measured` bytes differ from `planned` by more than [`PLAN_TOLERANCE`].
fn check_against_plan(rank: usize, stage: &str, measured: u64, planned: u64) {
    let off = (measured as f64 - planned as f64) / planned.max(1) as f64;
    if off.abs() > PLAN_TOLERANCE {
        tracing::warn!(
            rank,
            "{stage}: device memory {:.1} MiB differs from the plan's {:.1} MiB by {:+.1}%",
            tpinfer_plan::mib(measured),
            tpinfer_plan::mib(planned),
            100.0 * off
        );
    } else {
        tracing::info!(
            rank,
            "{stage}: device memory {:.1} MiB, plan {:.1} MiB ({:+.1}%)",
            tpinfer_plan::mib(measured),
            tpinfer_plan::mib(planned),
            100.0 * off
        );
    }
}

/// Compares the tensors a rank holds after loading with the `planned` bytes (its weights and
/// what its footprint allocates at load).
pub fn check_after_load(rank: usize, device: &Device, planned: u64) {
    if let Some(m) = measure(device) {
        // The tensors themselves: the pool reserves in chunks (256 MiB for the 140 MiB of a
        // video VAE's weights).
        check_against_plan(rank, "tensors after loading", m.pool_used, planned);
        tracing::info!(
            rank,
            "device memory outside the tensor pool after loading: {:.1} MiB",
            tpinfer_plan::mib(m.used - m.pool_reserved)
        );
    }
}

/// Compares a DiT rank's peak device memory over its first step at the planned video size
/// with the `planned` bytes of everything the rank holds (see `RankGroup::held_now`).
pub fn check_after_step(rank: usize, device: &Device, planned: u64) {
    if let Some(m) = measure(device) {
        check_against_plan(rank, "peak over the first step", m.peak(), planned);
    }
}

/// Compares the rank's peak device memory over its first request with the plan for that
/// request: the plan with the temporaries the model predicts for the request's prompt and
/// length (`activations`, and the `pool_slack` beside them) in place of the worst case.
pub fn check_after_request(rank: usize, device: &Device, plan: &RankPlan, activations: u64, pool_slack: u64) {
    if let Some(m) = measure(device) {
        let slack = if plan.allocator_slack > 0 { pool_slack } else { 0 };
        let planned = plan.total_with(activations, slack);
        check_against_plan(rank, "peak over the first request", m.peak(), planned);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::ffi::c_void;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext, DriverError};
    use candle_core::Device;

    use super::DeviceMemory;

    fn pool(ctx: &CudaContext) -> Result<sys::CUmemoryPool, DriverError> {
        ctx.bind_to_thread()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device belongs to a live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
        Ok(pool)
    }

    fn attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64, DriverError> {
        let mut value = 0u64;
        // SAFETY: the reserved/used attributes are 64-bit values written to `value`.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, &mut value as *mut u64 as *mut c_void) }.result()?;
        Ok(value)
    }

    pub fn measure(device: &Device) -> Option<DeviceMemory> {
        let Device::Cuda(cuda) = device else {
            return None;
        };
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        // Freed blocks return to the pool at the stream's pace: measure after the work is done.
        stream.synchronize().ok()?;
        let (free, total) = ctx.mem_get_info().ok()?;
        let pool = pool(ctx).ok()?;
        use sys::CUmemPool_attribute::*;
        Some(DeviceMemory {
            used: (total - free) as u64,
            total: total as u64,
            pool_reserved: attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).ok()?,
            pool_used: attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT).ok()?,
            pool_peak: attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH).ok()?,
            pool_used_peak: attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH).ok()?,
        })
    }

    /// Returns the pool's unused memory to the device and restarts its peak from now, so that
    /// a rank's peak is its own and not an earlier engine's.
    pub fn reset_peak(device: &Device) {
        let Device::Cuda(cuda) = device else {
            return;
        };
        let stream = cuda.cuda_stream();
        let Ok(pool) = stream.synchronize().and_then(|()| pool(stream.context())) else {
            return;
        };
        use sys::CUmemPool_attribute::*;
        // SAFETY: a live pool; the high-water attributes take a 64-bit zero to reset.
        unsafe {
            let _ = sys::cuMemPoolTrimTo(pool, 0);
            for attr in [CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, CU_MEMPOOL_ATTR_USED_MEM_HIGH] {
                let mut zero = 0u64;
                let _ = sys::cuMemPoolSetAttribute(pool, attr, &mut zero as *mut u64 as *mut c_void);
            }
        }
    }
}

#[cfg(feature = "cuda")]
pub use cuda::{measure, reset_peak};

#[cfg(not(feature = "cuda"))]
pub fn measure(_device: &Device) -> Option<DeviceMemory> {
    None
}

#[cfg(not(feature = "cuda"))]
pub fn reset_peak(_device: &Device) {}
