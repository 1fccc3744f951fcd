//! The bytes one rank of [`crate::Umt5Rank`] holds besides its weights while it encodes a
//! prompt, as the memory planner counts them. Each term names the code in `model.rs` it
//! models; keep them in step.

use candle_core::DType;

use crate::{Umt5Config, Umt5Shard};

/// The temporaries of one `encode` of `tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeMemory {
    /// The most bytes alive at once.
    pub peak: usize,
    /// What a stream-ordered pool may hold beyond them: the two largest buffers, the
    /// score-sized ones, freed and split by smaller allocations.
    pub pool_slack: usize,
}

impl EncodeMemory {
    pub fn new(c: &Umt5Config, shard: &Umt5Shard, dtype: DType, tokens: usize) -> Self {
        let (s, d, e) = (tokens, c.d_model, dtype.size_in_bytes());
        let (heads, ffn) = (shard.heads.len(), shard.ffn_cols.len());
        // `encode`: the distance buckets (u32 `[2s − 1]`) and the residual stream `x` live
        // throughout; each half of a layer adds its normed input `h`.
        let (buckets, x, h) = ((2 * s - 1) * 4, s * d * e, s * d * e);
        // `Layer::attention`: the merged Q/K/V output (its views stay alive) and the three
        // per-head copies; then the scores beside their probabilities, or the probabilities
        // beside the product with V and its heads-last copy (`[heads, s, s]` and
        // `[s, heads · d_kv]` in the compute dtype).
        let qkv = 2 * 3 * s * heads * c.d_kv * e;
        let score = heads * s * s * e;
        let attention = qkv + score + score.max(2 * s * heads * c.d_kv * e);
        // The FFN: the merged gate/up output, beside it the gated product, and at the down
        // projection its partial sum and the all-reduced sum.
        let mlp = 2 * s * ffn * e + s * ffn * e + 2 * s * d * e;
        Self {
            peak: buckets + x + h + attention.max(mlp),
            pool_slack: 2 * score,
        }
    }
}
