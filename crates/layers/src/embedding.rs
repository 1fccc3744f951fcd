use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::QMatMul;
use candle_core::Tensor;
use tpinfer_comm::Communicator;
use tpinfer_weights::{ShardLoader, ShardSpec, Weight, WeightDecl};

use crate::Result;

/// A `[vocab, hidden]` matrix split over vocabulary rows. As an embedding, each rank looks up
/// the ids it owns, writes zeros for the rest, and an all-reduce assembles the rows. As an LM
/// head, each rank scores its own slice of the vocabulary and an all-gather joins the logits;
/// an LM head may stay in its GGML blocks or be held in FP8 (`--quantize-lm-head`).
pub struct VocabParallelEmbedding {
    weight: Rows,
    /// This rank's first vocabulary row.
    first: usize,
    /// Every rank's number of rows, in rank order.
    sizes: Vec<usize>,
    comm: Arc<dyn Communicator>,
}

/// A rank's rows of the matrix: dense, or quantized (an LM head only: lookups read dense rows).
enum Rows {
    Dense(Tensor),
    Quantized(QMatMul),
    /// E4M3 values `[rows, hidden]` and one f32 scale per row.
    Fp8 {
        values: Tensor,
        scales: Tensor,
    },
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
        let weight = match weights.take_weight(name)? {
            Weight::Dense(w) => Rows::Dense(w),
            Weight::Quantized(q) => Rows::Quantized(QMatMul::from_arc(q)?),
            Weight::Fp8 { values, scales } => Rows::Fp8 { values, scales },
        };
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
        let Rows::Dense(weight) = &self.weight else {
            return Err(crate::Error::Shard(
                "a quantized matrix serves as an LM head, not as an embedding".into(),
            ));
        };
        let rows = tpinfer_kernels::embed_owned_rows(ids, weight, self.first)?;
        Ok(self.comm.all_reduce_sum(&rows.reshape((batch, seq, ()))?)?)
    }

    /// Logits over the full vocabulary for hidden states `x` of shape `[.., hidden]`. No host
    /// wait: read them on the host after [`Communicator::wait`].
    pub fn project(&self, x: &Tensor) -> Result<Tensor> {
        let local = match &self.weight {
            Rows::Quantized(q) => crate::linear::quantized_product(q, x)?,
            Rows::Fp8 { values, scales } => tpinfer_kernels::fp8_linear(x, values, scales, None, false)?,
            Rows::Dense(w) if tpinfer_kernels::gemv_on_cuda(x, w) => tpinfer_kernels::gemv(x, w)?,
            Rows::Dense(w) => x.broadcast_matmul(&w.t()?)?,
        };
        Ok(self
            .comm
            .all_gather_sized(&local.contiguous()?, local.rank() - 1, &self.sizes)?)
    }
}
