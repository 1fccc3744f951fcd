use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;
use tpinfer_comm::Communicator;
use tpinfer_weights::{ShardLoader, ShardSpec, WeightDecl};

use crate::Result;

/// A `[vocab, hidden]` matrix split over vocabulary rows. As an embedding, each rank looks up
/// the ids it owns, writes zeros for the rest, and an all-reduce assembles the rows. As an LM
/// head, each rank scores its own slice of the vocabulary and an all-gather joins the logits.
pub struct VocabParallelEmbedding {
    weight: Tensor,
    /// This rank's first vocabulary row.
    first: usize,
    /// Every rank's number of rows, in rank order.
    sizes: Vec<usize>,
    comm: Arc<dyn Communicator>,
}

impl VocabParallelEmbedding {
    pub fn decls(name: &str, vocab: usize, hidden: usize, rows: Range<usize>) -> Vec<WeightDecl> {
        vec![WeightDecl::new(name, &[vocab, hidden], ShardSpec::range(0, rows))]
    }

    /// Loads this rank's part of `parts`, every rank's rows in rank order.
    pub fn load(
        weights: &mut ShardLoader,
        name: &str,
        parts: &[Range<usize>],
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let rows = parts.get(comm.rank()).filter(|r| !r.is_empty()).ok_or_else(|| {
            crate::Error::Shard(format!(
                "rank {} has no rows of the vocabulary split {parts:?}",
                comm.rank()
            ))
        })?;
        let weight = weights.take(name)?;
        Ok(Self {
            first: rows.start,
            sizes: parts.iter().map(|p| p.len()).collect(),
            weight,
            comm,
        })
    }

    /// The embeddings of token ids `[batch, seq]` (u32, on this rank's device): `[batch, seq,
    /// hidden]`. The ids are matched against this rank's rows on the device, so a captured
    /// CUDA graph can embed whatever token its input buffer holds.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (batch, seq) = ids.dims2()?;
        let rows = tpinfer_kernels::embed_owned_rows(ids, &self.weight, self.first)?;
        Ok(self.comm.all_reduce_sum(&rows.reshape((batch, seq, ()))?)?)
    }

    /// Logits over the full vocabulary for hidden states `x` of shape `[.., hidden]`. No host
    /// wait: read them on the host after [`Communicator::wait`].
    pub fn project(&self, x: &Tensor) -> Result<Tensor> {
        let local = match tpinfer_kernels::gemv_on_cuda(x, &self.weight) {
            true => tpinfer_kernels::gemv(x, &self.weight)?,
            false => x.broadcast_matmul(&self.weight.t()?)?,
        };
        Ok(self
            .comm
            .all_gather_sized(&local.contiguous()?, local.rank() - 1, &self.sizes)?)
    }
}
