//! The bytes one rank of the Wan DiT holds on its device besides its weights, as the memory
//! planner counts them, for batch 1 with the conditional and unconditional (CFG) passes run
//! one after the other. This is the memory contract of the DiT's forward: attention runs one
//! head and a block of queries at a time, never materializing `S × S` scores, and activation
//! all-reduces run over token chunks.

use candle_core::DType;

use crate::{WanConfig, WanShard};

/// Bytes of one attention score buffer (f32, one head, a block of queries × all keys).
pub const SCORE_BUFFER_BYTES: usize = 256 << 20;
/// Bytes of one f32 chunk of an activation all-reduce.
pub const REDUCE_CHUNK_BYTES: usize = 64 << 20;
/// Text tokens of the umT5 embeddings the DiT cross-attends to.
pub const TEXT_TOKENS: usize = 512;
/// f32 latent-sized buffers the sampler keeps: the latents, the conditional and
/// unconditional predictions, the guided velocity and two steps of UniPC history.
pub const SAMPLER_BUFFERS: usize = 6;

/// A video to denoise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Video {
    pub frames: usize,
    pub width: usize,
    pub height: usize,
}

/// One rank's device bytes apart from its weight slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DitMemory {
    /// 3-D rotary tables (f32 cos and sin per token).
    pub buffers: usize,
    /// The sampler's latents and the text embeddings (conditional and negative).
    pub latents: usize,
    /// The peak of one block's temporaries.
    pub activations: usize,
    /// What a stream-ordered allocator may hold beyond the live tensors: the two largest
    /// temporaries (as for the Llama forward).
    pub pool_slack: usize,
}

impl DitMemory {
    /// The plan's case: [`TEXT_TOKENS`] of text.
    pub fn new(c: &WanConfig, shard: &WanShard, dtype: DType, video: Video) -> Self {
        Self::with_text(c, shard, dtype, video, TEXT_TOKENS)
    }

    /// With `text` tokens of text states.
    pub fn with_text(c: &WanConfig, shard: &WanShard, dtype: DType, video: Video, text: usize) -> Self {
        let s = c.video_tokens(video.frames, video.width, video.height);
        let (d, hd, e) = (c.hidden_size(), c.attention_head_dim, dtype.size_in_bytes());
        let local = shard.channels(c).len();
        let ffn = shard.ffn_cols.len();
        let buffers = 2 * s * (hd / 2) * 4;
        let latents = SAMPLER_BUFFERS * c.latent_elements(video.frames, video.width, video.height) * 4
            + 2 * text * c.text_dim * 4;
        // Alive through every block: the residual stream and both embedded text contexts.
        let x = s * d * e;
        let context = 2 * text * d * e;
        let reduce = 2 * REDUCE_CHUNK_BYTES.min(s * d * 4);
        // Self-attention: the modulated norm, local Q/K/V (normalized and rotated in turn,
        // each replacing the last), two score buffers and one head's f32 keys and values,
        // the local output; then the row-parallel partial sum, its reduce chunks and the new
        // residual.
        let scores = SCORE_BUFFER_BYTES.min(s * s * 4);
        let attention = (x + 4 * s * local * e + 2 * scores + 2 * s * hd * 4).max(s * local * e + x + reduce + x);
        // Cross-attention to the 512 text tokens: the same shape with short keys.
        let cross = x + 2 * s * local * e + 2 * text * local * e + x + reduce;
        // FFN: the modulated norm, the hidden columns and their GELU; then the down partial
        // sum, its reduce chunks and the new residual.
        let ffn_peak = (x + 2 * s * ffn * e).max(s * ffn * e + x + reduce + x);
        let mut sizes = [s * d * e, s * local * e, scores, s * ffn * e, reduce / 2];
        sizes.sort_unstable();
        Self {
            buffers,
            latents,
            activations: x + context + attention.max(cross).max(ffn_peak),
            pool_slack: sizes[sizes.len() - 1] + sizes[sizes.len() - 2],
        }
    }
}
