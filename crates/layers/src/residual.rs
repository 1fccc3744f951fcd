use candle_core::Tensor;
use tpinfer_comm::Communicator;

use crate::Result;

/// The residual stream `residual + Σ partial`, where `partial` is a row-parallel layer's
/// unreduced output on each rank, and its RMSNorm times `weight`: the sum over the ranks, the
/// residual add and the next layer's norm. One kernel where the communicator fuses them (a
/// decode row between GPUs with peer access), else its all-reduce and the fused add + norm;
/// the same bits either way. Both results have `residual`'s shape.
pub fn all_reduce_add_rms_norm(
    comm: &dyn Communicator,
    partial: Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    if let Some(fused) = comm.all_reduce_add_rms_norm(&partial, residual, weight, eps) {
        return Ok(fused?);
    }
    let total = comm.all_reduce_sum(&partial)?;
    // Freed before the norm's output exists, as the Llama crate's activation model counts.
    drop(partial);
    let hidden = residual.dims().last().copied().unwrap_or(0);
    let rows = |t: &Tensor| t.reshape(((), hidden));
    let (sum, normed) = tpinfer_kernels::add_rms_norm(&rows(residual)?, &rows(&total)?, weight, eps)?;
    Ok((sum.reshape(residual.dims())?, normed.reshape(residual.dims())?))
}
