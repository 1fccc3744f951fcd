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
    rows: Range<usize>,
    comm: Arc<dyn Communicator>,
}

impl VocabParallelEmbedding {
    pub fn decls(name: &str, vocab: usize, hidden: usize, rows: Range<usize>) -> Vec<WeightDecl> {
        vec![WeightDecl::new(name, &[vocab, hidden], ShardSpec::range(0, rows))]
    }

    pub fn load(
        weights: &mut ShardLoader,
        name: &str,
        rows: Range<usize>,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        Ok(Self {
            weight: weights.take(name)?,
            rows,
            comm,
        })
    }

    /// The embeddings of `ids` (a batch of `batch` equal-length sequences), `[batch, seq, hidden]`.
    pub fn embed(&self, ids: &[u32], batch: usize) -> Result<Tensor> {
        let device = self.weight.device();
        let (local, owned): (Vec<u32>, Vec<f32>) = ids
            .iter()
            .map(|&id| match self.rows.contains(&(id as usize)) {
                true => (id - self.rows.start as u32, 1.0),
                false => (0, 0.0),
            })
            .unzip();
        let local = Tensor::from_vec(local, ids.len(), device)?;
        let owned = Tensor::from_vec(owned, (ids.len(), 1), device)?.to_dtype(self.weight.dtype())?;
        let rows = self.weight.index_select(&local, 0)?.broadcast_mul(&owned)?;
        let hidden = self.weight.dim(1)?;
        let rows = rows.reshape((batch, ids.len() / batch, hidden))?;
        Ok(self.comm.all_reduce_sum(&rows)?)
    }

    /// Logits over the full vocabulary for hidden states `x` of shape `[.., hidden]`.
    pub fn project(&self, x: &Tensor) -> Result<Tensor> {
        let local = x.broadcast_matmul(&self.weight.t()?)?;
        Ok(self.comm.all_gather(&local.contiguous()?, local.rank() - 1)?)
    }
}
