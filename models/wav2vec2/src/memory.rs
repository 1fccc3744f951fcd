//! The bytes one rank of [`crate::Wav2Vec2Rank`] holds besides its weights while it encodes
//! one audio, as the memory planner counts them. Each term names the code in `model.rs` it
//! models; keep them in step.

use candle_core::DType;

use crate::{Wav2Vec2Config, Wav2Vec2Shard, FEATURE_CHUNK_FRAMES};

/// The largest score buffer the attention without a fused kernel (CUDA in f32) keeps.
pub const SCORE_BUFFER_BYTES: usize = 64 << 20;

/// The temporaries of one `hidden_states` of `frames` encoder frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeMemory {
    /// The most bytes alive at once.
    pub peak: usize,
    /// What a stream-ordered pool may hold beyond them: the largest freed buffer (the
    /// feature convolutions' unfolded input or output), split by smaller allocations.
    pub pool_slack: usize,
}

impl EncodeMemory {
    pub fn new(c: &Wav2Vec2Config, shard: &Wav2Vec2Shard, dtype: DType, frames: usize) -> Self {
        Self::in_chunks(c, shard, dtype, frames, FEATURE_CHUNK_FRAMES)
    }

    /// [`Self::new`] for the feature convolutions run `chunk` frames at a time
    /// (`hidden_states_in_chunks`).
    pub fn in_chunks(c: &Wav2Vec2Config, shard: &Wav2Vec2Shard, dtype: DType, frames: usize, chunk: usize) -> Self {
        let e = dtype.size_in_bytes();
        let (f, h) = (frames.max(1), c.hidden_size);
        let hop: usize = c.conv.iter().map(|l| l.stride).product();
        let field = c.receptive_field();
        let samples = (f - 1) * hop + field;
        let last = c.conv.last().map_or(1, |l| l.dim);

        // `features`: the normalized samples (f32) live throughout; the chunks made so far
        // wait for the concatenation. In `convolve`, one window of samples (f32, and its
        // copy in the compute dtype); at each convolution its input, candle's unfolded input
        // `[out, in · kernel]`, its product `[out, channels]` and the product's transposed
        // copy. Every later step of a layer holds two of its outputs at most.
        let chunk = chunk.clamp(1, f);
        let window = (chunk - 1) * hop + field;
        let (mut length, mut input, mut conv_peak, mut largest) = (window, window * 4, 0, 0);
        if dtype != DType::F32 {
            input += window * e;
        }
        let mut channels = 1;
        for layer in &c.conv {
            let out = (length - layer.kernel) / layer.stride + 1;
            let unfolded = out * channels * layer.kernel * e;
            let product = out * layer.dim * e;
            conv_peak = conv_peak.max(input + unfolded + 2 * product);
            largest = largest.max(unfolded.max(product));
            (length, input, channels) = (out, product, layer.dim);
        }
        let earlier_chunks = (f - chunk) * last * e;
        let features = samples * 4 + earlier_chunks + conv_peak;
        // The chunks beside their concatenation; then the projection's norm and product.
        let concatenated = 2 * f * last * e;
        let projection = f * last * e + f * h * e;

        // `positional`: the projected states, and candle's grouped convolution: each group's
        // unfolded input and product (and its transposed copy) beside the groups done, then
        // the groups beside their concatenation (`[hidden, frames + 1]`).
        let (k, groups) = (c.num_conv_pos_embeddings, c.num_conv_pos_embedding_groups);
        let padded = f + 2 * (k / 2) + 1 - k;
        let per_group = h / groups;
        let group_conv =
            (groups - 1) * padded * per_group * e + padded * per_group * k * e + 2 * padded * per_group * e;
        let positional = f * h * e + group_conv.max(2 * padded * h * e).max(3 * f * h * e);
        largest = largest.max(padded * per_group * k * e);

        // The layers: the stack of states and the residual stream live throughout. Attention:
        // the merged Q/K/V output beside the three per-head copies and the attention output;
        // the output projection's partial sum (and, over ranks, the all-reduced sum) beside
        // it; the new residual beside the old and the projection. The FFN: its normed input
        // beside the up projection, then the up projection beside its GELU.
        let stack = (c.num_hidden_layers + 1) * f * h * e;
        let (local, ffn) = (shard.heads.len() * c.head_dim(), shard.ffn_cols.len());
        let reduced = if shard.world > 1 { f * h * e } else { 0 };
        let attention = (7 * f * local * e).max(f * local * e + f * h * e + reduced);
        let residual = 2 * f * h * e;
        let mlp = (f * h * e + f * ffn * e)
            .max(2 * f * ffn * e)
            .max(f * ffn * e + f * h * e + reduced);
        let layers = stack + f * h * e + attention.max(residual).max(mlp);

        Self {
            peak: features.max(concatenated).max(projection).max(positional).max(layers),
            pool_slack: largest,
        }
    }
}
