//! Small all-reduces without NCCL between GPUs that can read each other's memory: each rank
//! owns a buffer outside candle's memory pool, which its peers map through peer access, and
//! [`tpinfer_kernels::peer_all_reduce`]'s one kernel per call sums through them. A decode
//! step's all-reduces of one hidden row are latency-bound; NCCL spends several microseconds
//! of protocol on each.

use std::sync::Arc;

use candle_core::cuda::cudarc::driver::{result, sys, CudaContext, DriverError};
use candle_core::Tensor;
use tpinfer_kernels::peer_all_reduce::{peer_all_reduce, peer_all_reduce_in_place, Peers, BUFFER_BYTES, MAX_RANKS};

use crate::CommError;

/// A rank's part: its buffer and every rank's buffer address.
pub(crate) struct PeerReduce {
    peers: Peers,
    buffer: sys::CUdeviceptr,
    context: Arc<CudaContext>,
}

impl PeerReduce {
    /// Sets the rank's part up on `devices` (every rank's, all pairs with peer access
    /// enabled), or `None` where the kernel cannot run: more than [`MAX_RANKS`]. `meet` swaps one value per rank with every rank (a host meeting); every rank takes
    /// the same decision.
    pub(crate) fn set_up(
        context: &Arc<CudaContext>,
        rank: usize,
        devices: &[sys::CUdevice],
        mut meet: impl FnMut(u64) -> Result<Vec<u64>, CommError>,
    ) -> Result<Option<Self>, CommError> {
        let world = devices.len();
        if world > MAX_RANKS {
            return Ok(None);
        }
        let buffer = match allocate(context) {
            Ok(buffer) => buffer,
            Err(e) => {
                tracing::warn!(
                    rank,
                    "peer buffer not allocated ({e:?}); small all-reduces stay on NCCL"
                );
                0
            }
        };
        // Owned from here, so that an error or a refusal frees it.
        let mut this = Self {
            peers: Peers::default(),
            buffer,
            context: context.clone(),
        };
        let buffers = meet(buffer)?;
        if buffers.contains(&0) {
            return Ok(None);
        }
        this.peers.base[..world].copy_from_slice(&buffers);
        Ok(Some(this))
    }

    /// The sum of `x` over the ranks, if the kernel takes `x`.
    pub(crate) fn all_reduce(&self, x: &Tensor, rank: usize, world: usize) -> Option<candle_core::Result<Tensor>> {
        if !tpinfer_kernels::peer_all_reduce::covers(x) {
            return None;
        }
        // SAFETY: `peers` holds every rank's zeroed buffer of BUFFER_BYTES, mapped for this
        // device by `allocate`, used by this kernel alone; every rank of an NCCL group enters
        // its all-reduces with the same shapes in the same order.
        Some(unsafe { peer_all_reduce(x, &self.peers, rank, world) })
    }

    /// [`PeerReduce::all_reduce`] in place, if the kernel takes contiguous `x`.
    pub(crate) fn all_reduce_in_place(&self, x: &Tensor, rank: usize, world: usize) -> Option<candle_core::Result<()>> {
        if !tpinfer_kernels::peer_all_reduce::covers(x) || !x.is_contiguous() {
            return None;
        }
        // SAFETY: as in `all_reduce`.
        Some(unsafe { peer_all_reduce_in_place(x, &self.peers, rank, world) })
    }
}

impl Drop for PeerReduce {
    fn drop(&mut self) {
        if self.buffer != 0 && self.context.bind_to_thread().is_ok() {
            // SAFETY: allocated by `allocate`; the rank's work is done when its communicator
            // is dropped (a kernel still spinning for a dead peer traps first).
            let _ = unsafe { result::free_sync(self.buffer) };
        }
    }
}

/// Every rank's device, in rank order, where every pair of them has peer access, which this
/// rank's context then has to every peer (and theirs to it, as each rank does the same);
/// `None` where any pair lacks it or a rank could not enable it, or for one rank. Two
/// meetings; every rank takes the same decision.
pub(crate) fn peer_devices(
    context: &Arc<CudaContext>,
    rank: usize,
    world: usize,
    mut meet: impl FnMut(u64) -> Result<Vec<u64>, CommError>,
) -> Result<Option<Vec<sys::CUdevice>>, CommError> {
    if world == 1 {
        return Ok(None);
    }
    let own = context.cu_device();
    let devices: Vec<sys::CUdevice> = meet(own as u64)?.into_iter().map(|d| d as sys::CUdevice).collect();
    let reachable = devices.iter().all(|&a| {
        devices.iter().all(|&b| {
            let mut can = 0;
            // SAFETY: a plain query of two device ordinals this process has opened.
            a == b || (unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }.result().is_ok() && can == 1)
        })
    });
    if !reachable {
        return Ok(None);
    }
    let enabled = enable_peer_access(context, own, &devices);
    if let Err(e) = &enabled {
        tracing::warn!(rank, "peer access not enabled ({e:?}); collectives stay on NCCL");
    }
    let everywhere = meet(enabled.is_ok() as u64)?.iter().all(|&ok| ok == 1);
    Ok(everywhere.then_some(devices))
}

/// Grants this device access to every peer's memory.
fn enable_peer_access(
    context: &Arc<CudaContext>,
    own: sys::CUdevice,
    devices: &[sys::CUdevice],
) -> Result<(), DriverError> {
    context.bind_to_thread()?;
    for &peer in devices.iter().filter(|&&d| d != own) {
        let mut peer_context = std::ptr::null_mut();
        // SAFETY: retains the peer's primary context (candle's contexts are primary ones),
        // enables access to it from the current (own) one, and releases the extra reference.
        unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut peer_context, peer).result()?;
            let enabled = sys::cuCtxEnablePeerAccess(peer_context, 0);
            sys::cuDevicePrimaryCtxRelease_v2(peer).result()?;
            match enabled {
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                other => other.result()?,
            }
        }
    }
    Ok(())
}

/// This rank's zeroed buffer.
fn allocate(context: &Arc<CudaContext>) -> Result<u64, DriverError> {
    context.bind_to_thread()?;
    // SAFETY: a plain allocation in the bound context, zeroed before any kernel reads it.
    unsafe {
        let buffer = result::malloc_sync(BUFFER_BYTES)?;
        result::memset_d8_sync(buffer, 0, BUFFER_BYTES)?;
        Ok(buffer)
    }
}
