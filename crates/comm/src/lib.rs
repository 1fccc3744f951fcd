//! Collectives that join tensor-parallel ranks.
//!
//! Every rank holds one [`Communicator`]. Layers call it as the math needs: a row-parallel
//! linear sums its partial products with [`Communicator::all_reduce_sum`], a vocab-parallel
//! head concatenates its logits with [`Communicator::all_gather`]. CPU ranks are threads joined
//! by [`ThreadGroup`]; GPU ranks are joined by NCCL behind the same trait, so the CPU build runs
//! the very code that the GPU build runs.

mod error;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(any(feature = "nccl", test))]
mod parts;
#[cfg(feature = "nccl")]
mod peer;
#[cfg(feature = "nccl")]
mod peer_rows;
mod stats;
mod threads;

pub use error::{Collective, CommError};
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, NcclGroup};
pub use stats::{CommStats, StatsSnapshot};

/// Which of tpinfer's own paths between GPUs with peer access NCCL ranks may take instead of
/// NCCL: switches for measured alternatives, set by the caller (the CLI fills them from its
/// environment), never read by the library. CPU ranks have no peer paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommOptions {
    /// Use peer access between the GPUs at all. Off where NCCL's P2P is off
    /// (`NCCL_P2P_DISABLE=1`): a link that NCCL must not use, tpinfer must not either.
    pub peer_access: bool,
    /// Small all-reduces (up to 64 KiB, a decode step's rows) as one kernel that sums through
    /// the peers' memory.
    pub peer_all_reduce: bool,
    /// The sequence-parallel row exchanges by copy engines, overlapped with the GEMM.
    pub peer_rows: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        Self {
            peer_access: true,
            peer_all_reduce: true,
            peer_rows: true,
        }
    }
}
pub use threads::{ThreadComm, ThreadGroup, DEFAULT_TIMEOUT};

use std::ops::Range;

use candle_core::Tensor;

/// One rank's view of its group of ranks.
///
/// Collectives are out-of-place and must be entered by every rank in the same order. A
/// collective never waits forever: when a peer has failed, exited or stalled, it returns an
/// error that names that peer.
///
/// A communicator belongs to its rank's thread and is not required to be `Send` or `Sync`:
/// an NCCL communicator must not be used from two threads at once, so each rank builds its
/// own on its own thread.
pub trait Communicator {
    /// This rank's index, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn world_size(&self) -> usize;
    /// The elementwise sum of `x` over all ranks. Every rank receives the same tensor.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor, CommError>;
    /// [`Communicator::all_reduce_sum`] in place: contiguous `x` becomes the sum. A decode
    /// step sums into buffers that outlive it, so that its kernels chain
    /// (`tpinfer_kernels::chained`); where the sum cannot run in place, it is copied back.
    fn all_reduce_sum_in_place(&self, x: &Tensor) -> Result<(), CommError> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let sum = self.all_reduce_sum(x)?;
        x.slice_set(&sum, 0, 0)
            .map_err(rows_error(self.rank(), Collective::AllReduceSum))
    }
    /// The elementwise sum of `x` over all ranks, of which each rank receives its own rows
    /// along dim 0: rank r the `sizes[r]` rows after those of ranks `0..r` (`sizes`, in rank
    /// order and the same on every rank, adds up to `x`'s rows). Sequence-parallel layers use
    /// it in place of an all-reduce: half of one in bytes on the link. Counted with the
    /// all-reduces in [`Communicator::stats`].
    fn reduce_scatter_sum(&self, x: &Tensor, sizes: &[usize]) -> Result<Tensor, CommError>;
    /// The ranks' tensors concatenated along `dim`, in rank order. Sizes along `dim` may
    /// differ between ranks (uneven shards); all other dims must agree.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor, CommError>;
    /// [`Communicator::all_gather`] when every rank already knows every rank's size along
    /// `dim` (`sizes`, in rank order): no exchange of sizes and no host wait, so it may run
    /// inside a captured CUDA graph. Read the result on the host only after
    /// [`Communicator::wait`].
    fn all_gather_sized(&self, x: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor, CommError>;
    /// [`Communicator::all_gather_sized`] of rows (dim 0) for work on each rank's rows: `each`
    /// gets parts of the gathered tensor with the row each part starts at, covering every row
    /// once. Where the rows move while `each` works on those at hand (GPUs with peer access),
    /// the parts are the ranks' rows, this rank's first; elsewhere one part may hold them all.
    /// On a device a part is valid for the work `each` queues, not beyond this call.
    fn all_gather_rows(
        &self,
        x: &Tensor,
        sizes: &[usize],
        each: &mut dyn FnMut(&Tensor, usize) -> candle_core::Result<()>,
    ) -> Result<(), CommError> {
        gather_rows_whole(self, x, sizes, each)
    }
    /// [`Communicator::reduce_scatter_sum`] of a product computed by rows, handed to `finish`:
    /// `partial(rows)` is this rank's partial product of those rows of the whole, and every
    /// row is asked for once; `finish` gets this rank's rows of the sum as parts to add in
    /// order and returns what its caller makes of them (a residual update, say), so that the
    /// sum need not be written apart. Where the parts move while the next is computed (GPUs
    /// with peer access), each rank's rows are asked for apart, this rank's last, and `finish`
    /// gets every rank's partial of them, in rank order, valid for the work it queues;
    /// elsewhere all rows may be asked for at once and `finish` gets the sum.
    fn reduce_scatter_rows(
        &self,
        sizes: &[usize],
        partial: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor, CommError> {
        reduce_scatter_rows_whole(self, sizes, partial, finish)
    }
    /// The `root` rank's tensor, on every rank. Other ranks pass a tensor of the same shape.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor, CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;
    /// Returns once the work this rank has queued on its device, collectives included, has
    /// finished, so that the host may read its results; fails, naming the rank, when a peer
    /// has failed or stalled meanwhile. CPU ranks have nothing queued.
    fn wait(&self) -> Result<(), CommError>;
    /// [`Communicator::wait`] for part of the queued work: returns once `done` (which polls
    /// a marker queued behind that part, never waiting) says so, failing as `wait` does. Work
    /// queued after the part may still run. CPU ranks have nothing queued, and a lone rank
    /// no peer to watch: they poll `done` alone.
    fn wait_until(&self, done: &mut dyn FnMut() -> candle_core::Result<bool>) -> Result<(), CommError> {
        while !done().map_err(rows_error(self.rank(), Collective::Wait))? {
            std::thread::yield_now();
        }
        Ok(())
    }
    /// Marks this rank as failed with `cause`, so that every peer's pending and next collective
    /// fails at once with this rank named instead of waiting for it.
    fn abort(&self, cause: &str);
    /// Counters of the collectives this rank has entered.
    fn stats(&self) -> &CommStats;
}

/// [`Communicator::all_gather_rows`] in one part: the gathered tensor.
fn gather_rows_whole(
    comm: &(impl Communicator + ?Sized),
    x: &Tensor,
    sizes: &[usize],
    each: &mut dyn FnMut(&Tensor, usize) -> candle_core::Result<()>,
) -> Result<(), CommError> {
    let all = comm.all_gather_sized(x, 0, sizes)?;
    each(&all, 0).map_err(rows_error(comm.rank(), Collective::AllGather { dim: 0 }))
}

/// [`Communicator::reduce_scatter_rows`] in one part: every row's partial at once, their sum
/// to `finish`.
fn reduce_scatter_rows_whole(
    comm: &(impl Communicator + ?Sized),
    sizes: &[usize],
    partial: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
    finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
) -> Result<Tensor, CommError> {
    let op = Collective::ReduceScatterSum;
    let whole = partial(0..sizes.iter().sum()).map_err(rows_error(comm.rank(), op))?;
    let sum = comm.reduce_scatter_sum(&whole, sizes)?;
    drop(whole);
    finish(&[sum]).map_err(rows_error(comm.rank(), op))
}

/// Reports an error of the work a row-wise collective ran for its caller.
fn rows_error(rank: usize, op: Collective) -> impl Fn(candle_core::Error) -> CommError {
    move |source| CommError::Tensor { rank, op, source }
}

/// The ranks' row ranges of `sizes`, in rank order.
fn row_ranges(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&n| {
            start += n;
            start - n..start
        })
        .collect()
}

/// Checks the `sizes` of a [`Communicator::reduce_scatter_sum`]: one per rank, adding up to
/// `x`'s rows. Returns this rank's first row.
fn check_scatter_sizes(rank: usize, world: usize, x: &Tensor, sizes: &[usize]) -> Result<usize, CommError> {
    let op = Collective::ReduceScatterSum;
    let rows = x.dim(0).map_err(|source| CommError::Tensor { rank, op, source })?;
    if sizes.len() != world || sizes.iter().sum::<usize>() != rows {
        return Err(CommError::Shape {
            rank,
            op,
            detail: format!("sizes {sizes:?} for {world} ranks do not split {rows} rows"),
        });
    }
    Ok(sizes[..rank].iter().sum())
}

/// Checks the `sizes` of an [`Communicator::all_gather_sized`]: one per rank, this rank's
/// matching `x`.
fn check_gather_sizes(rank: usize, world: usize, x: &Tensor, dim: usize, sizes: &[usize]) -> Result<(), CommError> {
    let own = x.dim(dim).map_err(|source| CommError::Tensor {
        rank,
        op: Collective::AllGather { dim },
        source,
    })?;
    if sizes.len() != world || sizes[rank] != own {
        return Err(CommError::Shape {
            rank,
            op: Collective::AllGather { dim },
            detail: format!("sizes {sizes:?} for {world} ranks, but this rank has {own} along dim {dim}"),
        });
    }
    Ok(())
}
