//! The one-shot all-reduce of small messages between GPUs that read each other's memory
//! (`cuda/peer_all_reduce.cu`): a decode step's 64 all-reduces of one hidden row, each a
//! single kernel that needs no host and no NCCL channel setup, inside a captured graph too.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::{DType, Device, Result, Tensor};

use crate::chain::Launch;
use crate::launch::{device_address, suffix};

/// The most ranks, and the blocks of every call (cuda/peer_all_reduce.cu). Every call runs all
/// blocks, even those with no elements: each block's handshake with its peers is what lets the
/// next calls reuse the buffers.
pub const MAX_RANKS: usize = 8;
const MAX_BLOCKS: usize = 16;
const THREADS: u32 = 512;
/// The largest message, in bytes: a data slot of a rank's buffer.
pub const MAX_BYTES: usize = 64 << 10;
/// A rank's buffer: two data slots, the flags and the per-block counters.
pub const BUFFER_BYTES: usize = 2 * MAX_BYTES + (2 * MAX_BLOCKS * MAX_RANKS + MAX_BLOCKS) * 4;

/// Every rank's buffer, by device address (unused entries 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Peers {
    pub base: [u64; MAX_RANKS],
}

// SAFETY: plain old data with the layout of the kernel's `struct Peers`.
unsafe impl DeviceRepr for Peers {}

/// Whether the kernel takes `x` (f32, bf16 or f16, at most [`MAX_BYTES`]).
pub fn covers(x: &Tensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && x.elem_count() * x.dtype().size_in_bytes() <= MAX_BYTES
}

/// The sum of `x` over the ranks, in rank order, on every rank.
///
/// # Safety
/// `peers` holds every rank's buffer of [`BUFFER_BYTES`] (zeroed before its first use, then
/// used by this function alone), readable and writable from `x`'s device; every rank calls
/// with tensors of the same shape and dtype, in the same order.
pub unsafe fn peer_all_reduce(x: &Tensor, peers: &Peers, rank: usize, world: usize) -> Result<Tensor> {
    let x = x.contiguous()?;
    let out = crate::empty(x.dims(), x.dtype(), x.device())?;
    // SAFETY: as this function's.
    unsafe { launch(&x, &out, peers, rank, world)? };
    Ok(out)
}

/// [`peer_all_reduce`] in place: `x` (contiguous) becomes the sum. A link of a kernel chain
/// ([`crate::chained`]).
///
/// # Safety
/// As [`peer_all_reduce`]'s.
pub unsafe fn peer_all_reduce_in_place(x: &Tensor, peers: &Peers, rank: usize, world: usize) -> Result<()> {
    if !x.is_contiguous() {
        candle_core::bail!("peer_all_reduce_in_place: x {:?} is not contiguous", x.dims());
    }
    // SAFETY: as this function's; the kernel reads each element before it writes its sum.
    unsafe { launch(x, x, peers, rank, world) }
}

unsafe fn launch(x: &Tensor, out: &Tensor, peers: &Peers, rank: usize, world: usize) -> Result<()> {
    if !covers(x) || world > MAX_RANKS || rank >= world {
        candle_core::bail!(
            "peer_all_reduce: {:?} {:?} at rank {rank} of {world} is not covered",
            x.dtype(),
            x.dims()
        );
    }
    let Device::Cuda(dev) = x.device() else {
        candle_core::bail!("peer_all_reduce needs a CUDA tensor");
    };
    let func = crate::module::PEER_ALL_REDUCE.kernel(dev, &format!("peer_all_reduce_{}", suffix(x.dtype())?))?;
    let cfg = LaunchConfig {
        grid_dim: (MAX_BLOCKS as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; x and out hold n elements; peers per
    // the caller.
    unsafe {
        Launch::default()
            .arg(device_address(x)?)
            .arg(device_address(out)?)
            .arg(x.elem_count() as i32)
            .arg(*peers)
            .arg(rank as i32)
            .arg(world as i32)
            .arg(MAX_BYTES as u64)
            .launch(dev, &func, cfg)
    }
}
