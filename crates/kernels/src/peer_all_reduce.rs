//! The one-shot all-reduce of small messages between GPUs that read each other's memory
//! (`cuda/peer_all_reduce.cu`): a decode step's 64 all-reduces of one hidden row, each a
//! single kernel that needs no host and no NCCL channel setup, inside a captured graph too.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Result, Storage, Tensor};
use half::{bf16, f16};

use crate::launch::suffix;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/peer_all_reduce.ptx"));

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
    if !covers(x) || world > MAX_RANKS || rank >= world {
        candle_core::bail!(
            "peer_all_reduce: {:?} {:?} at rank {rank} of {world} is not covered",
            x.dtype(),
            x.dims()
        );
    }
    let x = x.contiguous()?;
    let Device::Cuda(dev) = x.device() else {
        candle_core::bail!("peer_all_reduce needs a CUDA tensor");
    };
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        candle_core::bail!("peer_all_reduce needs a CUDA tensor");
    };
    let (start, n) = (layout.start_offset(), x.elem_count());
    // SAFETY: as the caller vouches.
    let out = unsafe {
        match x.dtype() {
            DType::F32 => {
                CudaStorage::wrap_cuda_slice(typed::<f32>(storage, start, n, peers, rank, world)?, dev.clone())
            }
            DType::BF16 => {
                CudaStorage::wrap_cuda_slice(typed::<bf16>(storage, start, n, peers, rank, world)?, dev.clone())
            }
            _ => CudaStorage::wrap_cuda_slice(typed::<f16>(storage, start, n, peers, rank, world)?, dev.clone()),
        }
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        x.dims(),
        BackpropOp::none(),
        false,
    ))
}

unsafe fn typed<T: CudaDType + DeviceRepr>(
    x: &CudaStorage,
    start: usize,
    n: usize,
    peers: &Peers,
    rank: usize,
    world: usize,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
    let dev = &x.device;
    let func = dev.get_or_load_custom_func(
        &format!("peer_all_reduce_{}", suffix(x.dtype())?),
        "tpinfer_peer_all_reduce",
        PTX,
    )?;
    let input = x.as_cuda_slice::<T>()?.slice(start..start + n);
    // SAFETY: every element is written by the block that owns it.
    let out = unsafe { dev.alloc::<T>(n)? };
    let (n_i, rank_i, world_i, slot) = (n as i32, rank as i32, world as i32, MAX_BYTES as u64);
    let cfg = LaunchConfig {
        grid_dim: (MAX_BLOCKS as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&input)
        .arg(&out)
        .arg(&n_i)
        .arg(peers)
        .arg(&rank_i)
        .arg(&world_i)
        .arg(&slot);
    // SAFETY: the arguments match the kernel's signature; the caller vouches for `peers`.
    unsafe { b.launch(cfg) }.w()?;
    Ok(out)
}
