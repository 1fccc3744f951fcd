//! The bytes one rank of [`crate::LlamaRank`] holds on its device besides its weights, as the
//! memory planner counts them. Each term names the code it models; keep them in step.

use candle_core::DType;
use tpinfer_layers::{KvCache, PagedKvCache};
use tpinfer_plan::Placement;

use crate::{LlamaConfig, LlamaShard};

/// Bytes one prompt chunk may spend on one attention score buffer (f32, `q_heads × chunk ×
/// context`): prompts run in chunks sized to stay under it.
pub const SCORE_BUFFER_BYTES: usize = 512 << 20;

/// Positions per block of a paged KV cache: small enough that a sequence wastes little of its
/// last block, large enough that a block table stays short.
pub const KV_BLOCK_SIZE: usize = 16;

/// The blocks of a paged KV cache that holds `sequences` sequences of `max_positions` each.
pub fn kv_blocks(max_positions: usize, sequences: usize) -> usize {
    sequences * max_positions.div_ceil(KV_BLOCK_SIZE)
}

/// The sequences a rank runs at once, and how many of them at full length the paged KV
/// cache they share holds (`None`: all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub sequences: usize,
    pub kv_sequences: Option<usize>,
}

impl Batch {
    /// The paged cache's blocks for sequences of up to `max_positions`.
    pub fn pool_blocks(&self, max_positions: usize) -> usize {
        kv_blocks(max_positions, self.kv_sequences.unwrap_or(self.sequences))
    }
}

/// The rows of the captured batched step that runs `n` decode rows (the smallest bucket that
/// holds them, its spare rows idle): powers of two to 8, then multiples of 16.
pub fn step_rows(n: usize) -> usize {
    match n {
        0..=8 => n.next_power_of_two(),
        _ => n.next_multiple_of(16),
    }
}

/// The blocks of the paged KV cache a rank loaded for `placement` allocates, and its
/// scheduler hands out: `None` where there is none (one sequence, with a cache of its own).
pub fn paged_blocks(placement: Placement) -> Option<usize> {
    match placement {
        Placement::Llm {
            max_context,
            batch,
            kv_sequences,
        } if batch > 1 => Some(
            Batch {
                sequences: batch,
                kv_sequences,
            }
            .pool_blocks(max_context),
        ),
        _ => None,
    }
}

/// The prompt positions per forward pass for a rank with `q_heads` local query heads and a
/// context of `max_positions`: with `flash` attention 2048 (no score buffer exists), else as
/// many as keep a score buffer under [`SCORE_BUFFER_BYTES`], a multiple of 16 between 16 and
/// 2048.
pub fn prefill_chunk(q_heads: usize, max_positions: usize, flash: bool) -> usize {
    if flash {
        return 2048;
    }
    let per_position = q_heads.max(1) * max_positions.max(1) * 4;
    (SCORE_BUFFER_BYTES / per_position).clamp(16, 2048) / 16 * 16
}

/// Whether a rank's attention runs the fused flash kernel (`tpinfer_kernels`): on CUDA in
/// bf16/f16 with a head size of 64 or 128, when each KV head serves whole groups of the
/// rank's Q heads. Otherwise the unfused f32 path with score buffers.
pub fn flash_attention(cuda: bool, dtype: DType, head_dim: usize, shard: &LlamaShard) -> bool {
    cuda && tpinfer_layers::cuda_flash_attention_covers(dtype, head_dim) && shard.heads.uniform_group().is_some()
}

/// One rank's device bytes apart from its weight slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMemory {
    /// Rotary tables and the GQA index, allocated at load; with flash attention (CUDA), also
    /// what the captured decode steps keep: their f32 logits output and a memory pool for
    /// one step's temporaries (a batched rank's graphs share both, on one stream, sized for
    /// the largest bucket), and the one-token step's buffers and decode scratch.
    pub buffers: usize,
    /// Keys and values for every layer, allocated at load for the whole context.
    pub kv_cache: usize,
    /// The peak of a forward's temporaries: the last prompt chunk of a full context, or a
    /// decode step, whichever is larger.
    pub activations: usize,
    /// The two largest temporaries of that forward: what a stream-ordered allocator may hold
    /// beside the live tensors (see [`ForwardMemory::pool_slack`]).
    pub pool_slack: usize,
}

impl RankMemory {
    /// The model for `shard` of `config` in `dtype` with a context of `max_positions`, prompts
    /// in chunks of `chunk` positions, attention `flash` or not: one sequence, as the engine
    /// serves.
    pub fn new(
        config: &LlamaConfig,
        shard: &LlamaShard,
        dtype: DType,
        max_positions: usize,
        chunk: usize,
        flash: bool,
    ) -> Self {
        let one = Batch {
            sequences: 1,
            kv_sequences: None,
        };
        Self::batched(config, shard, dtype, max_positions, chunk, one, flash)
    }

    /// For `batch` sequences of up to `max_positions` each. One sequence has a KV cache of its
    /// own and a captured decode step; more share a paged cache ([`Batch::pool_blocks`]),
    /// their decode tokens and prompt chunks in one forward.
    pub fn batched(
        config: &LlamaConfig,
        shard: &LlamaShard,
        dtype: DType,
        max_positions: usize,
        chunk: usize,
        batch: Batch,
        flash: bool,
    ) -> Self {
        let (t, d, e) = (max_positions, config.head_dim, dtype.size_in_bytes());
        let (nq, nkv) = (shard.heads.q_heads.len(), shard.heads.kv_heads.len());
        // `Rope::new`: cos and sin, `[2, t, d / 2]`; `kv_index`: one u32 per local Q head.
        let buffers = 2 * t * (d / 2) * e + nq * 4;
        let kv_cache = config.num_hidden_layers
            * match batch.sequences {
                0 | 1 => KvCache::bytes(nkv, t, d, dtype),
                _ => PagedKvCache::bytes(nkv, batch.pool_blocks(t), KV_BLOCK_SIZE, d, dtype),
            };
        let forward = |positions: usize| forward_memory(config, shard, e, positions, t, flash);
        let worst = forward(chunk.min(t)).max(forward(batch.sequences.max(1)));
        // A lone sequence's rank captures its one-row step; a batched rank a step per bucket of
        // rows, up to the largest.
        let rows = match batch.sequences {
            0 | 1 => 1,
            n => step_rows(n),
        };
        let graph = match flash {
            true => rows * config.vocab_size * 4 + forward(rows).peak,
            false => 0,
        };
        // The one-token step's buffers and the split-KV decode kernel's scratch, over the
        // sequence's cache or the pool: a lone sequence's step, or a batched rank's step of
        // one decode row (`LlamaRank::lone_steps`).
        let step = match flash {
            true => {
                let cache_rows = match batch.sequences {
                    0 | 1 => t,
                    _ => batch.pool_blocks(t) * KV_BLOCK_SIZE,
                };
                let rows = 4 * config.hidden_size + (nq + 2 * nkv) * d + 2 * nq * d + shard.ffn_cols.len();
                rows * e + tpinfer_layers::decode_scratch_bytes(nq, nkv, cache_rows, d)
            }
            false => 0,
        };
        // A batched step's prompt chunk attends over keys and values gathered from its
        // sequence's blocks (`PagedKvCache::read`): two `[t, kv, d]` copies beside the rest.
        let gathered = match batch.sequences {
            0 | 1 => 0,
            _ => 2 * t * nkv * d * e,
        };
        Self {
            buffers: buffers + graph + step,
            kv_cache,
            activations: worst.peak + gathered,
            pool_slack: worst.pool_slack(),
        }
    }
}

/// The temporaries of one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ForwardMemory {
    /// The most bytes alive at once.
    pub peak: usize,
    /// The largest single buffer (a score buffer for prompts).
    pub largest: usize,
    /// The largest buffer of another kind.
    pub second: usize,
}

impl ForwardMemory {
    /// What CUDA's stream-ordered pool holds beyond the live tensors at the peak: a freed
    /// largest buffer gets split by a smaller allocation, so the next largest one needs a new
    /// reservation (measured on the H200: benches/RESULTS.md).
    pub fn pool_slack(&self) -> usize {
        self.largest + self.second
    }
}

/// The temporaries of one request, at the forward with the highest peak: a prompt of `prompt`
/// positions in chunks of `chunk` (each attending to the chunks before it), then decode steps
/// up to `total` positions.
pub fn request_memory(
    config: &LlamaConfig,
    shard: &LlamaShard,
    dtype: DType,
    chunk: usize,
    prompt: usize,
    total: usize,
    flash: bool,
) -> ForwardMemory {
    let e = dtype.size_in_bytes();
    let chunk = chunk.max(1);
    (0..prompt.div_ceil(chunk))
        .map(|i| {
            let end = ((i + 1) * chunk).min(prompt);
            forward_memory(config, shard, e, end - i * chunk, end, flash)
        })
        .fold(
            forward_memory(config, shard, e, 1, total.max(1), flash),
            ForwardMemory::max,
        )
}

/// The largest set of temporaries alive at once in a forward of `s` positions reaching `t`
/// positions, with `e`-byte activations (f32 attention and all-reduces, 4 bytes), and its
/// largest buffers.
fn forward_memory(c: &LlamaConfig, shard: &LlamaShard, e: usize, s: usize, t: usize, flash: bool) -> ForwardMemory {
    let (h, d) = (c.hidden_size, c.head_dim);
    let (nq, nkv) = (shard.heads.q_heads.len(), shard.heads.kv_heads.len());
    let ffn = shard.ffn_cols.len();
    // `hidden_states`: the causal mask (f32 `[s, t]`; flash attention masks in the kernel);
    // through each layer, the residual stream and its norm in one buffer (`add_norm`), and
    // while a norm makes the next pair, the old pair and the addend beside it.
    let mask = if s > 1 && !flash { s * t * 4 } else { 0 };
    let x = s * h * e;
    let (pair, join) = (2 * x, 5 * x);

    // `DecoderLayer::attention` once `qkv` is dropped: the rotated queries, then in
    // `causal_attention` the scaled f32 queries and two score buffers (scores → masked →
    // softmax, each freed when the next exists), or one with f32 values and output.
    let q = s * nq * d * e;
    let q32 = s * nq * d * 4;
    let scores = nq * s * t * 4;
    let kv32 = nkv * t * d * 4;
    // GQA groups straddling ranks: keys and values are gathered per Q head first.
    let (gathered, kv32) = match shard.heads.uniform_group() {
        Some(_) => (0, kv32),
        None => (2 * nq * t * d * e, nq * t * d * 4),
    };
    let (attention, scores, kv32) = match flash {
        // The fused kernel reads the cache in place and writes only its output.
        true => (2 * q, 0, 0),
        false => (
            q + gathered + q32 + scores + scores.max(kv32 + q32).max(kv32),
            scores,
            kv32,
        ),
    };
    // Before that: the fused QKV output, then beside it the rotated queries (keys and values
    // go straight into the cache).
    let qkv = s * (nq + 2 * nkv) * d * e;
    // Qwen3's per-head norms (`DecoderLayer::qk_normed`): the normed queries and keys, then
    // their join, beside the product.
    let qk_norm = match c.qk_norm {
        true => 2 * qkv + s * (nq + nkv) * d * e,
        false => 0,
    };
    let attention = attention.max(qkv + q).max(qk_norm);

    // The MLP on the post-attention pair: fused gate/up, the fused SiLU product beside it,
    // then (gate/up freed) the down projection and its f32 all-reduce (input and output).
    let gate_up = 2 * s * ffn * e;
    let mlp = (gate_up + s * ffn * e).max(s * ffn * e + x + 2 * s * h * 4);

    let mut sizes = [scores, gathered / 2, kv32, gate_up, qkv, mask, s * h * 4];
    sizes.sort_unstable();
    ForwardMemory {
        peak: mask + join.max(pair + attention.max(mlp)),
        largest: sizes[sizes.len() - 1],
        second: sizes[sizes.len() - 2],
    }
}
