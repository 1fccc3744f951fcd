//! The bytes one rank of the Wan DiT holds on its device besides its weights, as the memory
//! planner counts them, for batch 1 with the conditional and unconditional (CFG) passes run
//! one after the other. Each term names the code in `model.rs` it models; keep them in step.
//!
//! The forward is written for this model: the residual stream is passed by value and every
//! intermediate is dropped as soon as the next exists; norms, residuals and the sharded
//! RMSNorm are one-pass fused ops (`tpinfer_kernels`) that allocate only their output;
//! attention is flash attention (no score matrix; self-attention optionally with E4M3
//! products) except for f32 on CUDA, which runs [`tpinfer_layers::blockwise_attention`] with
//! bounded score buffers.

use candle_core::DType;

use crate::{WanConfig, WanShard};

/// Bytes of one attention score buffer of the blockwise path (f32, one head, a block of
/// queries × all keys).
pub const SCORE_BUFFER_BYTES: usize = 256 << 20;
/// Text tokens of the umT5 embeddings the DiT cross-attends to.
pub const TEXT_TOKENS: usize = 512;
/// f32 latent-sized buffers the sampler keeps: the latents, the conditional and
/// unconditional predictions, the guided velocity and two steps of UniPC history; without
/// guidance, the latents, the velocity and the history.
pub const SAMPLER_BUFFERS: usize = 6;
const SAMPLER_BUFFERS_WITHOUT_CFG: usize = 4;

/// A video to denoise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Video {
    pub frames: usize,
    pub width: usize,
    pub height: usize,
    /// Classifier-free guidance: an unconditional pass after each conditional one (in turn,
    /// so it adds the negative prompt's states and two latent buffers, not activations).
    pub cfg: bool,
}

/// How a rank runs attention, which decides whether score buffers exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPath {
    /// `tpinfer_kernels::flash_attention`: CPU ranks, and CUDA ranks in bf16/f16.
    Flash,
    /// `tpinfer_layers::blockwise_attention`: CUDA ranks in f32.
    Blockwise,
    /// Self-attention by `tpinfer_kernels::flash_attention_fp8` ([`SelfAttention::Fp8`]),
    /// cross-attention by flash attention.
    Fp8,
}

/// The precision of the DiT's self-attention products, the bulk of its step at video lengths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SelfAttention {
    /// In the compute dtype.
    #[default]
    ComputeDtype,
    /// Q·Kᵀ and P·V on E4M3 operands (`tpinfer_kernels::flash_attention_fp8`,
    /// FlashAttention-3's FP8 path): Hopper and Ada GPUs in bf16 only, a numerics choice of the user's.
    Fp8,
}

/// How the blocks' linear products run, which decides what a product holds while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearWeights {
    /// In the compute dtype.
    Dense,
    /// E4M3 (`--quantize fp8`, or stored so): on FP8 tensor cores (`tensor_cores`, a CUDA
    /// plan) each product quantizes its input, elsewhere it expands its weight
    /// (`tpinfer_layers::fp8_product_extra`).
    Fp8 { tensor_cores: bool },
}

/// How a rank runs its forward, which decides its temporaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardPath {
    pub attention: AttentionPath,
    pub weights: LinearWeights,
    /// Linear layers with a bias add it (and the FFN its GELU) inside the GEMM, allocating
    /// only their output (`tpinfer_kernels::linear_bias`): CUDA ranks in bf16/f16, CPU ranks
    /// in f32.
    pub fused_linear: bool,
    /// The fused linears' library workspace: cuBLASLt's on CUDA, none on CPU.
    pub linear_workspace: usize,
}

impl ForwardPath {
    /// The path on a CUDA device (`cuda`) or CPU ranks in `dtype`, self-attention in the
    /// compute dtype.
    pub fn for_device(cuda: bool, dtype: DType, head_dim: usize) -> Self {
        let attention = match !cuda || tpinfer_kernels::cuda_flash_attention_covers(dtype, head_dim) {
            true => AttentionPath::Flash,
            false => AttentionPath::Blockwise,
        };
        Self {
            attention,
            weights: LinearWeights::Dense,
            fused_linear: tpinfer_kernels::fused_linear_runs(cuda, dtype),
            linear_workspace: tpinfer_kernels::fused_linear_workspace(cuda, dtype),
        }
    }

    /// This path with self-attention at `precision`: FP8 where flash attention runs.
    pub fn with_self_attention(self, precision: SelfAttention) -> Self {
        match (precision, self.attention) {
            (SelfAttention::Fp8, AttentionPath::Flash) => Self {
                attention: AttentionPath::Fp8,
                ..self
            },
            _ => self,
        }
    }

    /// This path with the blocks' linear products over `weights`.
    pub fn with_linear_weights(self, weights: LinearWeights) -> Self {
        Self { weights, ..self }
    }
}

/// One rank's device bytes apart from its weight slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DitMemory {
    /// The 3-D RoPE table (cos and sin per token, f32), built at the start of each forward
    /// (S2V: each clip) and alive through it, the fused linears' workspace, and S2V's clip.
    pub buffers: usize,
    /// The sampler's latents, the text states (conditional and negative, f32) and their
    /// embeddings.
    pub latents: usize,
    /// The peak of a forward's other temporaries: the residual stream and one block's.
    pub activations: usize,
    /// What a stream-ordered allocator may hold beyond the live tensors: the largest
    /// temporary (their allocations repeat in size block after block). Calibrated on the H200
    /// host (benches/RESULTS.md): with the two largest, as the Llama plan counts, the measured
    /// peaks sat up to 3.9% under the plan in bf16 and 3.7% in f32 at TP 1.
    pub pool_slack: usize,
}

impl DitMemory {
    /// The plan's case: [`TEXT_TOKENS`] of text.
    pub fn new(c: &WanConfig, shard: &WanShard, dtype: DType, video: Video, path: ForwardPath) -> Self {
        Self::with_text(c, shard, dtype, video, TEXT_TOKENS, path)
    }

    /// With `text` tokens of text states.
    pub fn with_text(
        c: &WanConfig,
        shard: &WanShard,
        dtype: DType,
        video: Video,
        text: usize,
        path: ForwardPath,
    ) -> Self {
        let s = c.sequence_tokens(video.frames, video.width, video.height);
        let (d, hd, e) = (c.hidden_size(), c.attention_head_dim, dtype.size_in_bytes());
        // The residual stream's bytes per element (f32 for S2V: `WanConfig::stream_dtype`).
        let es = c.stream_dtype(dtype).size_in_bytes();
        let heads = shard.heads.len();
        // Per-token sizes: a full-width activation X, this rank's attention width L, FFN width
        // F. At TP > 1 the residual stream is this rank's rows of it, R (sequence
        // parallelism, `Rows` in `model.rs`): the norms run on R and are all-gathered to X.
        // Between GPUs with peer access the gathered X is a norm's R plus the peers' rows in
        // this rank's receive slots, kept between forwards (`tpinfer_comm`'s row exchanges):
        // the same bytes, counted as X. R is in the stream's dtype; Rc is the same rows in
        // the compute dtype (a norm's output, a scattered sum).
        let (x, l, f) = (s * d * e, s * heads * hd * e, s * shard.ffn_cols.len() * e);
        let rows = match shard.world {
            1 => s,
            world => s.div_ceil(world),
        };
        let (r, rc) = (rows * d * es, rows * d * e);
        let (text_l, context) = (text * heads * hd * e, text * d * e);
        // What a product of an [n, k] weight slice over `m` rows holds while it runs beyond a
        // dense one's: with FP8 weights, its quantized input or its expanded weight.
        let product = |n: usize, k: usize, m: usize| match path.weights {
            LinearWeights::Dense => 0,
            LinearWeights::Fp8 { tensor_cores } => tpinfer_layers::fp8_product_extra(n, k, dtype, tensor_cores, m),
        };
        let (lw, fw) = (heads * hd, shard.ffn_cols.len());
        // Q's and the merged K/V's products over the norm (each in turn), the output
        // projection's over the attention output, the FFN's up and down; each over all `s`
        // rows (at TP > 1 a gathered norm's products may run a rank's rows at a time: an upper
        // bound there).
        let over_norm = product(lw, d, s).max(product(2 * lw, d, s));
        let (out_product, up, down) = (product(d, lw, s), product(fw, d, s), product(d, fw, s));

        // `Attention::forward` on the modulated norm `n` (X, all rows), self-attention: Q's
        // and the merged K/V's outputs are made first (3L) and the products write into them;
        // fused, the GEMM writes there itself; unfused, each product's GEMM output and its
        // biased copy sit beside them until copied in (Q's 2L, then K/V's 4L: 7L); `n` dropped,
        // `full_width_rms_norm`: normalized (and rotated) Q beside Q and the merged K/V (4L),
        // then, Q dropped, normalized K beside them (4L; K is read in place); then V's
        // contiguous copy for its heads beside Q, K and the merged K/V (5L), which goes next.
        let projections = match path.fused_linear {
            true => (x + 3 * l + over_norm).max(5 * l),
            false => x + 7 * l + over_norm,
        };
        // The attention output beside Q, K, V (4L), or the blockwise path's f32 work: within
        // the loop over heads, one head's scaled queries, keys (and a transposed copy) and
        // values, two score buffers and the f32 outputs of the heads so far; after it, those
        // outputs and their stacked copy.
        let attention = match path.attention {
            AttentionPath::Flash => 4 * l,
            // Beside them the kernel's E4M3 copies of Q, K and V and their scales.
            AttentionPath::Fp8 => 4 * l + tpinfer_kernels::flash_attention_fp8_bytes(s, heads, s, heads),
            AttentionPath::Blockwise => {
                let t = s;
                let scores = SCORE_BUFFER_BYTES.min(s * t * 4);
                let head = (s + 3 * t) * hd * 4;
                let outputs = s * heads * hd * 4;
                3 * l + (head + 2 * scores + outputs).max(2 * outputs)
            }
        };
        // `RowParallelLinear::forward` beside its input (the attention output, L; the FFN's
        // hidden, F): the partial product (with an FP8 weight, beside what its product holds),
        // then the sum (this rank's rows of it at TP > 1, R) and, unfused, the biased sum;
        // fused, the bias is added on rank 0 in the GEMM, and at TP 1 the sum is the partial
        // itself. Then the residual update beside the input: the sum and the new stream (Rc + R).
        let reduced = match (path.fused_linear, shard.world) {
            (true, 1) => x,
            (true, _) => x + rc,
            (false, 1) => 2 * x,
            (false, _) => x + 2 * rc,
        };
        let output = l + (reduced + out_product).max(rc + r);
        let self_attn = projections.max(attention).max(output);
        // Cross-attention: the same with keys over the text, beside `n`; unfused, Q's output
        // beside its product's two (3L), then beside the text's K/V product and its biased
        // copy (L + 4 text L).
        let cross = match path.fused_linear {
            true => x + 2 * l + 4 * text_l + over_norm,
            false => x + (3 * l).max(l + 4 * text_l) + over_norm,
        };
        let cross = cross.max(output);
        // `Block::forward`'s FFN: the hidden is made first (F) and the up product written
        // into it: fused, by the GEMM with its bias and GELU (X + F); unfused, the GEMM's
        // output, its biased copy, then GELU's output beside it and the hidden until copied in
        // (X + 3F, as traced on the GPU host, benches/RESULTS.md); the down projection beside
        // the hidden.
        let down_and_update = (reduced + down).max(rc + r);
        let ffn = match path.fused_linear {
            true => (x + f + up).max(f + down_and_update),
            false => (x + 3 * f + up).max(f + down_and_update),
        };
        // A residual update: old and new stream and the attention or FFN output (2R + Rc; a
        // wider stream reads the output as it is). A norm writes the compute dtype from the
        // stream (R + Rc), below it.
        let residual = 2 * r + rc;
        // Beside the residual stream (R) the block's peak; a norm's gather (R + X) is below.
        let block = (r + self_attn.max(cross).max(ffn)).max(residual);
        // S2V's audio injection after some blocks (`forward_with`, `S2vAudio::injection`), over
        // the video's tokens (V full width, Lv this rank's heads): beside the stream, every
        // token gathered (X; at TP 1 the stream itself) while each frame's AdaIN feeds its
        // queries (their parts, then the joined queries: 2Lv); then, the gathered tokens let
        // go, the attention's output and the output projection's partial and sum (Lv + 2V);
        // then the residual beside the updated rows and their join (2R + V).
        let video_tokens = c.video_tokens(video.frames, video.width, video.height);
        let injection = match &c.s2v {
            None => 0,
            Some(_) => {
                let (v, lv) = (video_tokens * d * e, video_tokens * heads * hd * e);
                let gathered = if shard.world > 1 { s * d * es } else { 0 };
                (r + gathered + 2 * lv).max(r + lv + 2 * v).max(3 * r + v)
            }
        };
        let block = block.max(injection);

        let mut sizes = [x, l, 2 * l, f];
        sizes.sort_unstable();
        let (buffers, prompts) = match video.cfg {
            true => (SAMPLER_BUFFERS, 2),
            false => (SAMPLER_BUFFERS_WITHOUT_CFG, 1),
        };
        // S2V's clip (`S2vClip`), held for all its steps: the reference and motion tokens and
        // the pose latents' patches.
        let clip = match &c.s2v {
            Some(s2v) => {
                (s - video_tokens) * d * e + video_tokens * s2v.cond_dim * c.patch_size.iter().product::<usize>() * e
            }
            None => 0,
        };
        Self {
            buffers: 2 * s * (hd / 2) * 4 + path.linear_workspace + clip,
            latents: buffers * c.latent_elements(video.frames, video.width, video.height) * 4
                + c.condition_latent_elements(video.width, video.height) * e
                + prompts * (text * c.text_dim * 4 + context),
            activations: block,
            pool_slack: sizes[sizes.len() - 1],
        }
    }
}
