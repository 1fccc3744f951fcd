//! The one-shot all-reduce of small messages between GPUs that read each other's memory
//! (`cuda/peer_all_reduce.cu`): a decode step's 64 all-reduces of one hidden row, each a
//! single kernel that needs no host and no NCCL channel setup, inside a captured graph too.
//! [`peer_all_reduce_add_rms_norm`] also adds the sum to the residual stream and takes its
//! RMSNorm in the same kernel: the layer's next norm needs no launch of its own.

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
/// Threads of the fused kernel's blocks, and the widest row it takes (NORM_THREADS and
/// NORM_THREADS · NORM_CACHED in cuda/add_rms_norm.cuh).
const NORM_THREADS: u32 = 1024;
const NORM_MAX_COLS: usize = 8 * 1024;
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

/// Whether [`peer_all_reduce_add_rms_norm`] takes `partial` with `residual` and `weight`: one
/// row of at most 8,192 columns and [`MAX_BYTES`], all three of one dtype.
pub fn covers_add_rms_norm(partial: &Tensor, residual: &Tensor, weight: &Tensor) -> bool {
    let cols = partial.dims().last().copied().unwrap_or(0);
    covers(partial)
        && partial.elem_count() == cols
        && cols <= NORM_MAX_COLS
        && residual.dims() == partial.dims()
        && weight.dims() == [cols]
        && residual.dtype() == partial.dtype()
        && weight.dtype() == partial.dtype()
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

/// The residual stream `residual + Σ partial` (summed over the ranks) and its RMSNorm times
/// `weight`, in one kernel, with the bits of [`peer_all_reduce`] followed by
/// [`crate::add_rms_norm`]. Both results have `partial`'s shape.
///
/// # Safety
/// As for [`peer_all_reduce`], whose buffers and call order this function shares: every rank
/// calls it (or [`peer_all_reduce`]) with tensors of the same shapes and dtype, in the same order.
pub unsafe fn peer_all_reduce_add_rms_norm(
    partial: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
    peers: &Peers,
    rank: usize,
    world: usize,
) -> Result<(Tensor, Tensor)> {
    if !covers_add_rms_norm(partial, residual, weight) || world > MAX_RANKS || rank >= world {
        candle_core::bail!(
            "peer_all_reduce_add_rms_norm: {:?} {:?} (residual {:?}, weight {:?}) at rank {rank} of {world} is not covered",
            partial.dtype(),
            partial.dims(),
            residual.dims(),
            weight.dims()
        );
    }
    let (partial, residual, weight) = (partial.contiguous()?, residual.contiguous()?, weight.contiguous()?);
    let Device::Cuda(dev) = partial.device() else {
        candle_core::bail!("peer_all_reduce_add_rms_norm needs CUDA tensors");
    };
    let cols = partial.elem_count();
    let views = [&partial, &residual, &weight].map(|t| t.storage_and_layout());
    let [Storage::Cuda(p), Storage::Cuda(r), Storage::Cuda(w)] = [&*views[0].0, &*views[1].0, &*views[2].0] else {
        candle_core::bail!("peer_all_reduce_add_rms_norm needs CUDA tensors");
    };
    let inputs = Fused {
        partial: (p, views[0].1.start_offset()),
        residual: (r, views[1].1.start_offset()),
        weight: (w, views[2].1.start_offset()),
        cols,
        eps: eps as f32,
    };
    // SAFETY: as the caller vouches.
    let both = unsafe {
        match partial.dtype() {
            DType::F32 => CudaStorage::wrap_cuda_slice(inputs.launch::<f32>(peers, rank, world)?, dev.clone()),
            DType::BF16 => CudaStorage::wrap_cuda_slice(inputs.launch::<bf16>(peers, rank, world)?, dev.clone()),
            _ => CudaStorage::wrap_cuda_slice(inputs.launch::<f16>(peers, rank, world)?, dev.clone()),
        }
    };
    let both = Tensor::from_storage(Storage::Cuda(both), (2, cols), BackpropOp::none(), false);
    Ok((
        both.get(0)?.reshape(partial.dims())?,
        both.get(1)?.reshape(partial.dims())?,
    ))
}

/// The fused kernel's inputs: (storage, first element) of each, all `cols` long but `weight`.
struct Fused<'a> {
    partial: (&'a CudaStorage, usize),
    residual: (&'a CudaStorage, usize),
    weight: (&'a CudaStorage, usize),
    cols: usize,
    eps: f32,
}

impl Fused<'_> {
    unsafe fn launch<T: CudaDType + DeviceRepr>(
        &self,
        peers: &Peers,
        rank: usize,
        world: usize,
    ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
        let dev = &self.partial.0.device;
        let func = dev.get_or_load_custom_func(
            &format!("peer_all_reduce_add_rms_norm_{}", suffix(self.partial.0.dtype())?),
            "tpinfer_peer_all_reduce",
            PTX,
        )?;
        let n = self.cols;
        let (partial, residual, weight) = (
            view::<T>(self.partial, n)?,
            view::<T>(self.residual, n)?,
            view::<T>(self.weight, n)?,
        );
        // SAFETY: every element of both halves is written by the kernel.
        let out = unsafe { dev.alloc::<T>(2 * n)? };
        let (cols, rank_i, world_i, slot) = (n as i32, rank as i32, world as i32, MAX_BYTES as u64);
        // One block: the norm needs the whole row (it keeps every block's flags and counter).
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&partial)
            .arg(&residual)
            .arg(&weight)
            .arg(&out)
            .arg(&cols)
            .arg(&self.eps)
            .arg(peers)
            .arg(&rank_i)
            .arg(&world_i)
            .arg(&slot);
        // SAFETY: the arguments match the kernel's signature and the sizes were checked; the
        // caller vouches for `peers`.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
}

/// `n` elements of `storage` from `at`.
fn view<T: CudaDType>(
    (storage, at): (&CudaStorage, usize),
    n: usize,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>> {
    Ok(storage.as_cuda_slice::<T>()?.slice(at..at + n))
}
