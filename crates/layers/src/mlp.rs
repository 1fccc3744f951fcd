use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;
use tpinfer_comm::Communicator;
use tpinfer_kernels::{GemvRow, ResidualNorm};
use tpinfer_weights::{ShardLoader, WeightDecl};

use crate::{ColumnParallelLinear, MergedColumnParallelLinear, Result, RowParallelLinear};

/// `down(silu(gate(x)) * up(x))`, sharded over hidden columns: gate/up column-parallel and
/// fused, down row-parallel. One all-reduce.
pub struct GatedMlp {
    gate_up: MergedColumnParallelLinear,
    down: RowParallelLinear,
}

/// Checkpoint names of a gated MLP's three projections.
pub struct GatedMlpNames<'a> {
    pub gate: &'a str,
    pub up: &'a str,
    pub down: &'a str,
}

impl GatedMlp {
    pub fn decls(names: &GatedMlpNames, hidden: usize, intermediate: usize, cols: Range<usize>) -> Vec<WeightDecl> {
        let mut decls = ColumnParallelLinear::decls(names.gate, hidden, intermediate, cols.clone(), false);
        decls.extend(ColumnParallelLinear::decls(
            names.up,
            hidden,
            intermediate,
            cols.clone(),
            false,
        ));
        decls.extend(RowParallelLinear::decls(names.down, intermediate, hidden, cols, false));
        decls
    }

    pub fn load(weights: &mut ShardLoader, names: &GatedMlpNames, comm: Arc<dyn Communicator>) -> Result<Self> {
        let gate_up = MergedColumnParallelLinear::load(weights, &[names.gate, names.up], false)?;
        if let [gate, up] = gate_up.out_sizes() {
            if gate != up {
                return Err(crate::Error::Shard(format!(
                    "{} has {gate} local columns but {} has {up}",
                    names.gate, names.up
                )));
            }
        }
        Ok(Self {
            gate_up,
            down: RowParallelLinear::load(weights, names.down, false, comm)?,
        })
    }

    /// [`Self::forward`] of one row `x` through buffers that outlive a decode step: the SiLU
    /// product into `hidden`, the summed output into `out`.
    pub fn forward_row_into(&self, x: impl Into<GemvRow>, hidden: &Tensor, out: &Tensor) -> Result<()> {
        self.gate_up.forward_silu_product_into(x, hidden)?;
        self.down.forward_row_into(hidden, out)
    }

    /// [`Self::forward_row_into`] with the output added to a decode step's residual stream
    /// and the next input norm made as `out` says
    /// ([`RowParallelLinear::forward_row_residual_into`]), which it returns as a row.
    pub fn forward_row_residual_into(
        &self,
        x: impl Into<GemvRow>,
        hidden: &Tensor,
        out: ResidualNorm,
    ) -> Result<GemvRow> {
        self.gate_up.forward_silu_product_into(x, hidden)?;
        self.down.forward_row_residual_into(hidden, out)
    }

    /// Whether [`Self::forward_row_residual_into`] runs at all: the down projection's
    /// [`RowParallelLinear::residual_weight`].
    pub fn has_residual_weight(&self) -> bool {
        self.down.residual_weight().is_some()
    }

    /// Whether [`Self::forward_row_residual_into`] runs as two CUDA kernels for the MLP's
    /// input row `x` and its hidden row `hidden` (the SiLU product in the gate/up GEMV, the
    /// residual in the down projection's).
    pub fn residual_kernels_cover(&self, x: &Tensor, hidden: &Tensor) -> bool {
        self.gate_up.covers_silu_product(x) && self.down.residual_kernel_covers(hidden)
    }

    /// `x` `[..., hidden]`; the SiLU product runs fused on the gate/up output (inside the
    /// gate/up product for one row on CUDA).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(hidden) = self.gate_up.forward_silu_product(x)? {
            return self.down.forward(&hidden);
        }
        let gate_up = self.gate_up.forward_merged(x)?;
        self.down.forward_silu_mul(gate_up)
    }
}
