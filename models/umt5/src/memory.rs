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
    /// What a stream-ordered pool may hold beyond them: the two largest buffers, the f32
    /// score-sized ones, freed and split by smaller allocations.
    pub pool_slack: usize,
}

impl EncodeMemory {
    pub fn new(c: &Umt5Config, shard: &Umt5Shard, dtype: DType, tokens: usize) -> Self {
        let (s, d, e) = (tokens, c.d_model, dtype.size_in_bytes());
        let (heads, ffn) = (shard.heads.len(), shard.ffn_cols.len());
        // `encode`: the bucket grid (u32 `[s, s]`) and the residual stream `x` live
        // throughout; each half of a layer adds its normed input `h`.
        let (buckets, x, h) = (s * s * 4, s * d * e, s * d * e);
        // `Layer::attention`: the merged Q/K/V output (its views stay alive) and the three
        // per-head copies; at the bias add, the gathered bias, the f32 scores and their sum
        // (f32 `[heads, s, s]` each).
        let qkv = 2 * 3 * s * heads * c.d_kv * e;
        let score = heads * s * s * 4;
        let attention = qkv + 3 * score;
        // The FFN: the merged gate/up output, then beside it the GELU and the product, or at
        // the down projection its partial sum and the all-reduced sum.
        let gate_up = 2 * s * ffn * e;
        let mlp = gate_up + (2 * s * ffn * e).max(s * ffn * e + 2 * s * d * e);
        Self {
            peak: buckets + x + h + attention.max(mlp),
            pool_slack: 2 * score,
        }
    }
}
