use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_layers::{
    add_rms_norm, add_rms_norm_into, argmax, causal_mask, chained, flash_attention_cached, flash_attention_cached_into,
    gemv_residual_squares, grouped_attention, rms_norm, write_u32s, DecodeScratch, GatedMlp, GemvRow, HeadNorms,
    KvCache, LoneRow, MergedColumnParallelLinear, PagedKvCache, Position, ResidualNorm, Result, Rope,
    RowParallelLinear, U32Readback, VocabParallelEmbedding,
};
use tpinfer_weights::ShardLoader;

use crate::shard::names;

mod batch;
use crate::{LlamaCheckpoint, LlamaConfig, LlamaShard};
#[cfg(feature = "cuda")]
pub(crate) use batch::BatchLayout;
pub use batch::SequenceChunk;

/// One rank's part of a Llama model, with its KV cache.
pub struct LlamaRank {
    config: LlamaConfig,
    shard: LlamaShard,
    embed: VocabParallelEmbedding,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<VocabParallelEmbedding>,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    rope: Rope,
    /// For each local Q head, its local KV head (for GQA groups that straddle ranks).
    kv_index: Tensor,
    /// Prompts run in chunks of this many positions, which bounds attention's score buffers.
    prefill_chunk: usize,
    /// Attention through the fused flash kernel (see `memory::flash_attention`).
    flash: bool,
    /// A decode step's kernels launched as one chain (see `tpinfer_kernels::chained`).
    kernel_chains: bool,
    /// A decode step's input norms made by the products around them, as a test set it
    /// (`None`: where every product's kernel makes them; see `norms_in_products`).
    product_norms: Option<bool>,
    /// Decode attention's partials, shared by every layer and captured step of this rank.
    decode_scratch: DecodeScratch,
    /// The number of positions in the KV cache.
    cached: usize,
    /// Where the next forward pass starts, for the kernels.
    position: Position,
    /// The decode step's inputs and outputs on the device.
    step_io: StepIo,
    /// The decode step's activations (flash attention), made by the first decode step.
    step_buffers: std::cell::OnceCell<StepBuffers>,
    /// The captured decode step (CUDA with flash attention), once there is one.
    #[cfg(feature = "cuda")]
    decode: Option<crate::graph::DecodeGraph>,
    /// A paged rank's captured decode steps, one per bucket of sequence counts (CUDA).
    #[cfg(feature = "cuda")]
    batch_graphs: Option<crate::graph::BatchGraphs>,
    /// A batched rank's paged cache and step size (`None`: one sequence at a time).
    paged: Option<PagedCache>,
    /// Whether a batched step of one decode row runs as the one-sequence step does, its
    /// kernels chained, over the paged cache: where attention is fused (CUDA), the split-KV
    /// decode kernel takes the heads, and every QKV product is a fused GEMV.
    lone_steps: bool,
    comm: Arc<dyn Communicator>,
    dtype: DType,
    bytes_loaded: usize,
    bytes_on_device: usize,
    /// Whether some weights are held in GGML blocks. candle's quantized matmuls capture in the
    /// one-sequence decode step (an 8B Q4_K_M's logits equal the eager step's bit for bit on
    /// an H200, at 1.25× its speed), their scratch reserved first
    /// (`tpinfer_layers::reserve_quantized_product_scratch`), but are not validated in batched
    /// steps, which such a rank runs eagerly. (FP8 products are tpinfer's kernels and
    /// cuBLASLt, which capture.)
    #[cfg(feature = "cuda")]
    ggml_blocks: bool,
}

/// A batched rank's paged KV cache: `blocks` blocks of `block_size` positions in every layer,
/// shared by up to `max_seqs` sequences a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedCache {
    pub blocks: usize,
    pub block_size: usize,
    pub max_seqs: usize,
}

/// The device buffers a decode step reads and writes, at fixed addresses so that a captured
/// step can be replayed.
struct StepIo {
    /// The token to run, `[1, 1]` u32: written by the host when it samples, or by the previous
    /// step's argmax under greedy decoding on the device.
    token: Tensor,
    /// This rank's word to its peers, `[1]` u32, summed over the ranks within the step: how
    /// rank 0 tells the others to stop without a collective of its own.
    flag: Tensor,
    /// The step's greedy token and the summed flags, `[2]` u32: all the host reads of a
    /// greedy step.
    out: Tensor,
    /// The greedy steps queued and not yet taken, oldest first: the host buffer each one's
    /// `out` is copied to behind it, and its logits.
    in_flight: std::collections::VecDeque<(U32Readback, Tensor)>,
    /// The buffers of steps taken, for later steps (page-locked memory is slow to allocate).
    spare: Vec<U32Readback>,
}

impl StepIo {
    fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            token: Tensor::zeros((1, 1), DType::U32, device)?,
            flag: Tensor::zeros(1, DType::U32, device)?,
            out: Tensor::zeros(2, DType::U32, device)?,
            in_flight: Default::default(),
            spare: Vec::new(),
        })
    }
}

/// A decode step's activations, one row each, at fixed addresses: the step's layers write
/// into them in place, so that nothing is allocated between two of its kernels and they run
/// as one chain (`tpinfer_kernels::chained`).
struct StepBuffers {
    /// The residual stream and its norm, `[2, 1, hidden]`; where the step's products make the
    /// norms ([`ProductNorms`]), the norm's `u` ([`GemvRow::Normed`]) in place of the norm.
    stream: Tensor,
    /// `[1, hidden]` zeros: what the first layer's norm adds to the embedding.
    zeros: Tensor,
    /// The QKV projection, `[1, (q + 2 · kv) · head_dim]` local, where it is not computed by
    /// the kernel that rotates it (CUDA, 16 bits, no bias).
    qkv: Tensor,
    /// The rotated queries, `[1, q, head_dim]` local.
    queries: Tensor,
    /// Attention's output, `[1, q · head_dim]` local.
    attention: Tensor,
    /// The MLP's SiLU product, `[1, intermediate]` local.
    hidden: Tensor,
    /// A row-parallel product summed over the ranks (attention's or the MLP's), `[1, hidden]`.
    sum: Tensor,
    /// The partial sums of squares of the norms the step's products make, f32: row 0 after
    /// attention, row 1 after the MLP (each read by the product after it before the next
    /// layer writes it again).
    squares: Tensor,
}

impl StepBuffers {
    fn new(c: &LlamaConfig, shard: &LlamaShard, dtype: DType, device: &Device) -> Result<Self> {
        let (q, kv, d) = (shard.heads.q_heads.len(), shard.heads.kv_heads.len(), c.head_dim);
        let row = |n: usize| Tensor::zeros((1, n), dtype, device);
        Ok(Self {
            stream: Tensor::zeros((2, 1, c.hidden_size), dtype, device)?,
            zeros: row(c.hidden_size)?,
            qkv: row((q + 2 * kv) * d)?,
            queries: Tensor::zeros((1, q, d), dtype, device)?,
            attention: row(q * d)?,
            hidden: row(shard.ffn_cols.len())?,
            sum: row(c.hidden_size)?,
            squares: Tensor::zeros((2, gemv_residual_squares(c.hidden_size)), DType::F32, device)?,
        })
    }

    /// Where a product makes a norm, its sums of squares in row `squares`.
    fn norm_output(&self, squares: usize) -> Result<NormOutput> {
        Ok(NormOutput {
            stream: self.stream.get(0)?,
            normed: self.stream.get(1)?,
            squares: self.squares.get(squares)?,
        })
    }
}

/// Where a product of a decode step makes a norm ([`ProductNorms`]): the residual stream
/// (`stream[0]`), the norm's `u` (`stream[1]`) and a row of [`StepBuffers::squares`].
struct NormOutput {
    stream: Tensor,
    normed: Tensor,
    squares: Tensor,
}

impl NormOutput {
    /// The product's output added to the stream, and the norm for `weight` made.
    fn residual<'a>(&'a self, weight: &'a Tensor, eps: f64) -> ResidualNorm<'a> {
        ResidualNorm {
            stream: &self.stream,
            weight,
            eps,
            normed: &self.normed,
            squares: &self.squares,
        }
    }
}

/// A decode step whose input norms the products make (TP 1 on CUDA in 16 bits,
/// [`LlamaRank::norms_in_products`]): the next layer's input norm (none after the last
/// layer, whose output the final norm's kernel adds).
#[derive(Clone, Copy)]
struct ProductNorms<'a> {
    next: Option<&'a Tensor>,
}

/// What a greedy decode step returns.
pub struct GreedyStep {
    /// The argmax of the step's logits, already queued as the next step's input.
    pub token: u32,
    /// The sum over the ranks of the `flag`s they passed to [`LlamaRank::greedy_step`].
    pub flags: u32,
    /// The step's f32 logits `[1, vocab]`; on a captured step, the graph's output buffer,
    /// which every later step overwrites: with a step queued after this one, it may hold that
    /// step's already.
    pub logits: Tensor,
}

struct DecoderLayer {
    input_norm: Tensor,
    qkv: MergedColumnParallelLinear,
    /// Qwen3's RMSNorm weights over each query and key head (`[head_dim]`), applied before
    /// the rotation.
    qk_norm: Option<(Tensor, Tensor)>,
    o_proj: RowParallelLinear,
    post_norm: Tensor,
    mlp: GatedMlp,
    cache: KvCache,
    /// The layer's paged KV cache, for batched forwards (`LlamaRank::load_paged`).
    paged: Option<PagedKvCache>,
}

impl LlamaRank {
    /// Loads this rank's slices of `checkpoint` onto `device`, in `dtype`, with rotary tables
    /// and a KV cache for `max_positions` positions. `shard` must have been checked against
    /// the checkpoint's headers ([`LlamaCheckpoint::check`]; `LlamaModel::shards` does): the
    /// reads trust its shapes.
    pub fn load(
        checkpoint: &LlamaCheckpoint,
        shard: LlamaShard,
        comm: Arc<dyn Communicator>,
        dtype: DType,
        device: &Device,
        max_positions: usize,
    ) -> Result<Self> {
        Self::load_with_cache(checkpoint, shard, comm, dtype, device, max_positions, None)
    }

    /// [`Self::load`] with a paged KV cache in every layer, for [`Self::forward_batch`], and
    /// none for one sequence: a rank serves either one sequence at a time or batches.
    pub fn load_paged(
        checkpoint: &LlamaCheckpoint,
        shard: LlamaShard,
        comm: Arc<dyn Communicator>,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        paged: PagedCache,
    ) -> Result<Self> {
        Self::load_with_cache(checkpoint, shard, comm, dtype, device, max_positions, Some(paged))
    }

    fn load_with_cache(
        checkpoint: &LlamaCheckpoint,
        shard: LlamaShard,
        comm: Arc<dyn Communicator>,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        paged: Option<PagedCache>,
    ) -> Result<Self> {
        let c = &checkpoint.config;
        let decls = checkpoint.weight_decls(&shard);
        let mut w = ShardLoader::new(&*checkpoint.store, &decls, dtype, device);
        let n_kv = shard.heads.kv_heads.len();
        let one_sequence = if paged.is_some() { 0 } else { max_positions };
        let flash = crate::memory::flash_attention(device.is_cuda(), dtype, c.head_dim, &shard);
        let vocab_parts = LlamaShard::vocab_parts(c, shard.world);
        let embed = VocabParallelEmbedding::load(&mut w, names::EMBED, &vocab_parts, comm.clone())?;
        let lm_head = match c.tie_word_embeddings {
            true => None,
            false => Some(VocabParallelEmbedding::load(
                &mut w,
                names::LM_HEAD,
                &vocab_parts,
                comm.clone(),
            )?),
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let n = names::LayerNames::of(i);
                Ok(DecoderLayer {
                    input_norm: w.take(&n.input_norm)?,
                    qkv: MergedColumnParallelLinear::load(&mut w, &[&n.q, &n.k, &n.v], c.qkv_bias)?,
                    qk_norm: match c.qk_norm {
                        true => Some((w.take(&n.q_norm)?, w.take(&n.k_norm)?)),
                        false => None,
                    },
                    o_proj: RowParallelLinear::load(&mut w, &n.o, c.o_bias, comm.clone())?,
                    post_norm: w.take(&n.post_norm)?,
                    mlp: GatedMlp::load(&mut w, &n.mlp(), comm.clone())?,
                    cache: KvCache::new(n_kv, one_sequence, c.head_dim, dtype, device)?,
                    paged: paged
                        .map(|p| PagedKvCache::new(n_kv, p.blocks, p.block_size, c.head_dim, dtype, device))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = Rope::new(
            c.head_dim,
            c.rope_theta,
            c.rope_scaling.as_ref(),
            max_positions,
            dtype,
            device,
        )?;
        let kv_index = Tensor::new(shard.heads.kv_of_q.as_slice(), device)?;
        let norm = w.take(names::NORM)?;
        let lone_steps = paged.is_some()
            && flash
            && tpinfer_layers::paged_decode_attention_into_covers(dtype, shard.heads.q_heads.len(), n_kv, c.head_dim)
            && {
                let row = Tensor::zeros((1, c.hidden_size), dtype, device)?;
                layers
                    .iter()
                    .all(|l| l.qkv.gemv_weight(&row).is_some() && l.qk_norm.is_none())
            };
        let mut rank = Self {
            config: c.clone(),
            embed,
            lm_head,
            layers,
            norm,
            rope,
            kv_index,
            prefill_chunk: crate::memory::prefill_chunk(shard.heads.q_heads.len(), max_positions, flash),
            flash,
            kernel_chains: true,
            product_norms: None,
            decode_scratch: DecodeScratch::new(),
            cached: 0,
            position: Position::new(device)?,
            step_io: StepIo::new(device)?,
            step_buffers: std::cell::OnceCell::new(),
            #[cfg(feature = "cuda")]
            decode: None,
            #[cfg(feature = "cuda")]
            batch_graphs: None,
            paged,
            lone_steps,
            comm,
            dtype,
            shard,
            bytes_loaded: w.bytes_read(),
            bytes_on_device: w.bytes_on_device(),
            #[cfg(feature = "cuda")]
            ggml_blocks: decls
                .iter()
                .any(|d| matches!(d.quant, Some(tpinfer_weights::Quant::Ggml(_)))),
        };
        // The captured steps where they apply: the one-sequence step, or a batched rank's.
        rank.set_cuda_graphs(true)?;
        Ok(rank)
    }

    /// A paged rank's captured batched steps: on CUDA with flash attention, where the memory
    /// plan counts them (`memory::RankMemory::buffers`).
    #[cfg(feature = "cuda")]
    fn new_batch_graphs(&self) -> Result<Option<crate::graph::BatchGraphs>> {
        let device = self.norm.device();
        match (self.paged, device.is_cuda() && self.flash) {
            (Some(p), true) => Ok(Some(crate::graph::BatchGraphs::new(
                device,
                crate::graph::BatchShape {
                    max_seqs: p.max_seqs,
                    max_positions: self.max_positions(),
                    block_size: p.block_size,
                    vocab: self.config.vocab_size,
                },
            )?)),
            _ => Ok(None),
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn shard(&self) -> &LlamaShard {
        &self.shard
    }

    /// The weight bytes this rank copied out of the checkpoint.
    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    /// The weight bytes this rank placed on its device (in the compute dtype).
    pub fn weight_bytes_on_device(&self) -> usize {
        self.bytes_on_device
    }

    /// The number of prompt positions run per forward pass.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// The temporaries the memory model predicts for a request of `prompt` positions that
    /// reaches `total` positions, at this rank's prompt chunk size.
    pub fn planned_activations(&self, prompt: usize, total: usize) -> crate::memory::ForwardMemory {
        crate::memory::request_memory(
            &self.config,
            &self.shard,
            self.dtype,
            self.prefill_chunk,
            prompt,
            total,
            self.flash,
        )
    }

    /// Runs prompts in chunks of `positions` (at least 1) instead of the default, which the
    /// memory planner assumes: smaller chunks lower the activation peak.
    pub fn set_prefill_chunk(&mut self, positions: usize) {
        self.prefill_chunk = positions.max(1);
    }

    /// Runs attention through the fused flash kernel (`on`) or the unfused path. The default
    /// is `memory::flash_attention`'s choice (CUDA in bf16/f16); tests switch CPU ranks to the
    /// kernel's CPU twin to check the fused path against the unfused one. The memory model
    /// follows the default, not this switch.
    pub fn set_flash_attention(&mut self, on: bool) -> Result<()> {
        if on && self.shard.heads.uniform_group().is_none() {
            return Err(tpinfer_layers::Error::Shard(
                "flash attention needs whole GQA groups on each rank".into(),
            ));
        }
        self.flash = on;
        #[cfg(feature = "cuda")]
        if !on {
            self.decode = None;
        }
        Ok(())
    }

    /// Runs each decode step as one replay of a CUDA graph (`on`, the default on CUDA with
    /// flash attention) or kernel by kernel. The graph is captured on the second decode step,
    /// after a first eager one, and kept across requests. A paged rank captures its batched
    /// steps of decode rows alone, a graph per bucket of sequence counts, alike.
    /// CPU ranks have no graphs: there it changes nothing.
    pub fn set_cuda_graphs(&mut self, on: bool) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let device = self.norm.device().clone();
            (self.decode, self.batch_graphs) = match (on, self.paged) {
                (false, _) => (None, None),
                (true, None) => {
                    if self.ggml_blocks {
                        let widest = self.config.hidden_size.max(self.shard.ffn_cols.len());
                        tpinfer_layers::reserve_quantized_product_scratch(&device, widest)?;
                    }
                    (
                        crate::graph::DecodeGraph::new(&device, self.flash, self.config.vocab_size)?,
                        None,
                    )
                }
                (true, Some(_)) if self.ggml_blocks => (None, None),
                (true, Some(_)) => (None, self.new_batch_graphs()?),
            };
        }
        #[cfg(not(feature = "cuda"))]
        let _ = on;
        Ok(())
    }

    /// Launches a decode step's kernels as one chain (`on`, the default; Hopper and newer)
    /// or one after the other. Kernels chain only where the GPU can: elsewhere this changes
    /// nothing.
    pub fn set_kernel_chains(&mut self, on: bool) {
        self.kernel_chains = on;
    }

    /// Makes a decode step's input norms in the products around them (`on`) or with norm
    /// kernels. The default is where every product's kernel makes them (TP 1 on CUDA in 16
    /// bits); tests switch CPU ranks to the products' CPU twins to check the step against the
    /// norm kernels. Set it before the first decode step (a captured step keeps its kernels).
    pub fn set_norms_in_products(&mut self, on: bool) -> Result<()> {
        if on && !self.layers.iter().all(DecoderLayer::products_make_norms) {
            return Err(tpinfer_layers::Error::Shard(
                "a decode step's products make its norms only at TP 1, with dense or FP8 weights, unbiased \
                 row-parallel products and no head norms (Qwen3)"
                    .into(),
            ));
        }
        self.product_norms = Some(on);
        Ok(())
    }

    /// How many decode steps ran as replays of the captured graph since it was made (0 on CPU
    /// ranks, with `--enforce-eager`, or while the graph is not yet captured).
    pub fn decode_graph_replays(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(graph) = &self.decode {
            return graph.replays();
        }
        0
    }

    /// The number of positions in the KV cache.
    pub fn cached_positions(&self) -> usize {
        self.cached
    }

    /// The number of positions the rotary tables cover: the context limit.
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// Empties the KV cache for a new sequence.
    pub fn clear_cache(&mut self) {
        // Greedy steps left untaken (a request that failed) are no one's any more.
        let untaken = self.step_io.in_flight.drain(..).map(|(readback, _)| readback);
        self.step_io.spare.extend(untaken);
        self.cached = 0;
    }

    /// Runs `ids` (continuing what is cached) and returns the f32 logits over the full
    /// vocabulary at the last position, `[1, vocab]`, ready to read on the host. Every rank
    /// returns the same logits. Long inputs run in chunks of [`Self::prefill_chunk`]
    /// positions. Per chunk: two all-reduces per layer plus one for the embedding; one
    /// all-gather for the logits. A single token runs as a decode step, which adds the
    /// flag sum of [`Self::greedy_step`].
    pub fn forward(&mut self, ids: &[u32]) -> Result<Tensor> {
        self.check_room(ids.len())?;
        if let [token] = ids {
            write_u32s(&self.step_io.token, &[*token])?;
            // A copy: a captured step's output buffer is overwritten by the next replay.
            return Ok(self.decode_step()?.copy()?);
        }
        let device = self.norm.device().clone();
        let mut chunks = ids.chunks(self.prefill_chunk).peekable();
        let mut logits = None;
        while let Some(chunk) = chunks.next() {
            self.position.set(self.cached)?;
            let chunk_ids = Tensor::new(chunk, &device)?.unsqueeze(0)?;
            match chunks.peek() {
                // Only the last chunk's last position needs the LM head.
                None => logits = Some(self.logits(&chunk_ids)?),
                Some(_) => {
                    drop(self.hidden_states(&chunk_ids)?);
                    // Each chunk's score buffers are larger than the last one's; waiting here
                    // lets a stream-ordered allocator hand the freed ones back instead of
                    // holding them beside the new ones.
                    device.synchronize()?;
                }
            }
            self.cached += chunk.len();
        }
        let logits = logits.ok_or_else(|| candle_core::Error::Msg("forward of an empty sequence".into()))?;
        self.comm.wait()?;
        Ok(logits)
    }

    /// Starts greedy decoding on the device after a prompt's `logits` (from
    /// [`Self::forward`]): their argmax becomes the next step's input. Returns that token. Every
    /// rank holds the same logits, so every rank queues the same token.
    pub fn greedy_start(&mut self, logits: &Tensor) -> Result<u32> {
        let token = argmax(logits)?;
        self.step_io.token.slice_set(&token, 0, 0)?;
        Ok(token.flatten_all()?.to_vec1::<u32>()?[0])
    }

    /// One step of greedy decoding on the device: runs the queued token (from
    /// [`Self::greedy_start`] or the previous step), queues the argmax of its logits as the
    /// next input, and sums each rank's `flag` over the ranks. The host reads 8 bytes per
    /// step and never sends a token back, so ranks need no broadcast to stay in lockstep.
    /// [`Self::greedy_queue`] then [`Self::greedy_take`].
    pub fn greedy_step(&mut self, flag: u32) -> Result<GreedyStep> {
        self.greedy_queue(flag)?;
        self.greedy_take()
    }

    /// Queues a [`Self::greedy_step`] without waiting for it or for those queued before it,
    /// so that the device runs it as soon as they end while the host reads theirs
    /// ([`Self::greedy_take`]). Its input is the token the last step queued leaves.
    pub fn greedy_queue(&mut self, flag: u32) -> Result<()> {
        self.check_room(1)?;
        write_u32s(&self.step_io.flag, &[flag])?;
        let logits = self.queue_decode_step_at_position()?;
        let mut readback = match self.step_io.spare.pop() {
            Some(spare) => spare,
            None => U32Readback::new(self.step_io.out.device(), 2)?,
        };
        readback.queue(&self.step_io.out)?;
        self.step_io.in_flight.push_back((readback, logits));
        Ok(())
    }

    /// Waits for the oldest greedy step queued and not yet taken, and returns its token and
    /// summed flags. Fails, naming the rank, where a peer fails or stalls meanwhile.
    pub fn greedy_take(&mut self) -> Result<GreedyStep> {
        let Some((readback, logits)) = self.step_io.in_flight.pop_front() else {
            return Err(candle_core::Error::Msg("greedy_take: no greedy step is queued".into()).into());
        };
        self.comm.wait_until(&mut || readback.is_done())?;
        let out = readback.values()?;
        self.step_io.spare.push(readback);
        Ok(GreedyStep {
            token: out[0],
            flags: out[1],
            logits,
        })
    }

    /// Fails unless the KV cache has room for `positions` more.
    fn check_room(&self, positions: usize) -> Result<()> {
        match self.cached + positions > self.max_positions() {
            true => Err(tpinfer_layers::Error::CacheFull {
                needed: self.cached + positions,
                capacity: self.max_positions(),
            }),
            false => Ok(()),
        }
    }

    /// Runs the token in `step_io` at the cached position (as a captured graph where there is
    /// one) and waits for it. Returns the logits.
    fn decode_step(&mut self) -> Result<Tensor> {
        let logits = self.queue_decode_step_at_position()?;
        self.comm.wait()?;
        Ok(logits)
    }

    /// Queues the decode step of the token in `step_io` at the cached position (as a captured
    /// graph where there is one), and counts its position as cached. Returns the logits.
    fn queue_decode_step_at_position(&mut self) -> Result<Tensor> {
        self.position.set(self.cached)?;
        #[cfg(feature = "cuda")]
        let logits = match self.decode.take() {
            Some(mut graph) => {
                let logits = graph.step(self);
                self.decode = Some(graph);
                logits?
            }
            None => self.queue_decode_step()?,
        };
        #[cfg(not(feature = "cuda"))]
        let logits = self.queue_decode_step()?;
        self.cached += 1;
        Ok(logits)
    }

    /// Queues a decode step of the token in `step_io` at [`Self::position`] without waiting
    /// on the host: a captured step is exactly this call. Writes the argmax of the logits to
    /// `step_io.token` and, beside it, the ranks' summed flags to `step_io.out`; returns the
    /// logits.
    pub(crate) fn queue_decode_step(&self) -> Result<Tensor> {
        let io = &self.step_io;
        let logits = self.logits(&io.token)?;
        let next = argmax(&logits)?;
        io.token.slice_set(&next, 0, 0)?;
        let flags = self
            .comm
            .all_reduce_sum(&io.flag.to_dtype(DType::F32)?)?
            .to_dtype(DType::U32)?;
        io.out
            .slice_set(&Tensor::cat(&[next.flatten_all()?, flags], 0)?, 0, 0)?;
        Ok(logits)
    }

    /// The f32 logits of the last of `ids` `[1, s]`, `[1, vocab]`, after caching the keys and
    /// values of all of them at [`Self::position`]. Queues work without waiting on the host.
    fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.hidden_states(ids)?;
        let seq = x.dim(1)?;
        let last = x.narrow(1, seq - 1, 1)?.squeeze(1)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        Ok(head.project(&last)?.to_dtype(DType::F32)?)
    }

    /// What every layer of a forward shares: attention through the fused kernel where
    /// `flash`, else with `mask` (none for one query).
    fn layer_context<'a>(&'a self, flash: bool, mask: Option<&'a Tensor>) -> LayerContext<'a> {
        LayerContext {
            at: &self.position,
            flash,
            mask,
            rope: &self.rope,
            shard: &self.shard,
            kv_index: &self.kv_index,
            config: &self.config,
            decode_scratch: &self.decode_scratch,
        }
    }

    /// The final norm's output for `ids`, `[1, s, hidden]`, after caching their keys and values.
    fn hidden_states(&self, ids: &Tensor) -> Result<Tensor> {
        if self.flash && ids.dims() == [1, 1] {
            return self.step_hidden_states(ids, StepKv::Own);
        }
        let offset = self.position.value();
        let mut x = self.embed.embed(ids)?;
        let seq = ids.dim(1)?;
        let mask = match seq {
            1 => None,
            _ if self.flash => None,
            _ => Some(causal_mask(seq, offset + seq, x.device())?),
        };
        let ctx = self.layer_context(self.flash, mask.as_ref());
        let eps = self.config.rms_norm_eps;
        // The last MLP's output, not yet added to the residual stream `x`: the next input norm
        // adds it in the same pass.
        let mut pending = None;
        for layer in &self.layers {
            let (residual, h) = add_norm(x, pending.take(), &layer.input_norm, eps)?;
            let (residual, mlp) = layer.forward(residual, h, &ctx)?;
            (x, pending) = (residual, Some(mlp));
        }
        Ok(add_norm(x, pending, &self.norm, eps)?.1)
    }

    /// Whether a decode step's input norms are made by its products ([`ProductNorms`]): as
    /// [`Self::set_norms_in_products`] says, else where every layer's products make them in
    /// their kernels (TP 1, 16-bit GEMVs on CUDA).
    fn norms_in_products(&self, b: &StepBuffers) -> Result<bool> {
        if let Some(on) = self.product_norms {
            return Ok(on);
        }
        let h = b.stream.get(1)?;
        Ok(self
            .layers
            .iter()
            .all(|l| l.products_make_norms() && l.kernels_make_norms(&h, &b.attention, &b.hidden)))
    }

    /// [`Self::hidden_states`] of one token, through the [`StepBuffers`]: after the embedding
    /// and the first norm, every kernel up to the final norm is a link of one chain. Its key
    /// and value go where `kv` says.
    fn step_hidden_states(&self, ids: &Tensor, kv: StepKv) -> Result<Tensor> {
        let b = match self.step_buffers.get() {
            Some(b) => b,
            None => {
                let made = StepBuffers::new(&self.config, &self.shard, self.dtype, ids.device())?;
                self.step_buffers.get_or_init(|| made)
            }
        };
        let eps = self.config.rms_norm_eps;
        let x = self.embed.embed(ids)?;
        b.stream.slice_set(&x.reshape(b.zeros.shape())?.unsqueeze(0)?, 0, 0)?;
        drop(x);
        let ctx = self.layer_context(true, None);
        let norms_in_products = self.norms_in_products(b)?;
        // Outside the chain: a copy, not a kernel, comes before it.
        let first = self.layers.first().map_or(&self.norm, |l| &l.input_norm);
        add_rms_norm_into(&b.stream, &b.zeros, first, eps)?;
        let layers = || -> Result<()> {
            // The next layer's input norm, where the product before made it.
            let mut made = None;
            for (i, layer) in self.layers.iter().enumerate() {
                let input = match (i, made.take()) {
                    (0, _) => GemvRow::Given(b.stream.get(1)?),
                    (_, Some(row)) => row,
                    (_, None) => {
                        add_rms_norm_into(&b.stream, &b.sum, &layer.input_norm, eps)?;
                        GemvRow::Given(b.stream.get(1)?)
                    }
                };
                let norms = norms_in_products.then(|| ProductNorms {
                    next: self.layers.get(i + 1).map(|l| &l.input_norm),
                });
                made = layer.step(b, input, norms, &ctx, kv)?;
            }
            if !self.layers.is_empty() {
                add_rms_norm_into(&b.stream, &b.sum, &self.norm, eps)?;
            }
            Ok(())
        };
        match self.kernel_chains {
            true => chained(layers)?,
            false => layers()?,
        }
        Ok(b.stream.get(1)?.unsqueeze(0)?)
    }
}

/// The residual stream `x + y` (or `x` alone) and its RMSNorm times `weight`. With `y`, one
/// fused pass whose two outputs share a buffer; both inputs are consumed, so the old stream is
/// freed as soon as the new one exists.
fn add_norm(x: Tensor, y: Option<Tensor>, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let Some(y) = y else {
        let h = rms_norm(&x, weight, eps as f32)?;
        return Ok((x, h));
    };
    let (b, s, hidden) = x.dims3()?;
    let rows = |t: &Tensor| t.reshape((b * s, hidden));
    let (sum, normed) = add_rms_norm(&rows(&x)?, &rows(&y)?, weight, eps)?;
    Ok((sum.reshape((b, s, hidden))?, normed.reshape((b, s, hidden))?))
}

/// Where a one-token step caches its key and value and finds the cached ones.
#[derive(Clone, Copy)]
enum StepKv<'a> {
    /// The rank's own one-sequence cache, at [`LayerContext::at`].
    Own,
    /// A paged rank's pool: the lone sequence of a batched step.
    Paged(LoneRow<'a>),
}

/// What every layer of one forward shares.
struct LayerContext<'a> {
    at: &'a Position,
    /// Attention through the fused kernel (causal in the kernel; no mask).
    flash: bool,
    mask: Option<&'a Tensor>,
    rope: &'a Rope,
    shard: &'a LlamaShard,
    kv_index: &'a Tensor,
    config: &'a LlamaConfig,
    decode_scratch: &'a DecodeScratch,
}

// Attention is its own function so that its temporaries are freed when it returns: the
// activation model in `memory.rs` counts on it.
impl DecoderLayer {
    /// The residual stream and its input norm `h` in; out, the stream after attention and the
    /// MLP's output, which the next norm adds to it.
    fn forward(&self, residual: Tensor, h: Tensor, ctx: &LayerContext) -> Result<(Tensor, Tensor)> {
        let attn = self.attention(h, ctx)?;
        let (residual, h) = add_norm(residual, Some(attn), &self.post_norm, ctx.config.rms_norm_eps)?;
        let mlp = self.mlp.forward(&h)?;
        Ok((residual, mlp))
    }

    /// Whether this layer's products can make its norms in a decode step ([`ProductNorms`]):
    /// its row-parallel products add to the residual stream (TP 1, no bias, dense or FP8).
    /// Not Qwen3's: its QKV product, which its head norms keep out of the rotary GEMV, has
    /// not run on a normed row against a reference on a GPU (2026-12-05).
    fn products_make_norms(&self) -> bool {
        self.qk_norm.is_none() && self.o_proj.residual_weight().is_some() && self.mlp.has_residual_weight()
    }

    /// Whether every product around this layer's norms runs as its CUDA kernel for rows like
    /// the step buffers' of the input norm, attention's output and the SiLU product.
    fn kernels_make_norms(&self, h: &Tensor, attention: &Tensor, hidden: &Tensor) -> bool {
        self.qkv.gemv_weight(h).is_some()
            && self.o_proj.residual_kernel_covers(attention)
            && self.mlp.residual_kernels_cover(h, hidden)
    }

    /// One token through the layer in `b`: `input` its input norm, the residual stream in
    /// `b.stream[0]`. Out: the stream after attention in `b.stream[0]` and either the MLP's
    /// output in `b.sum`, which the next norm adds to it, or, with `norms` and a next layer,
    /// the stream after the MLP and the next layer's input norm, returned. Its key and value
    /// go where `kv` says.
    fn step(
        &self,
        b: &StepBuffers,
        input: GemvRow,
        norms: Option<ProductNorms>,
        ctx: &LayerContext,
        kv: StepKv,
    ) -> Result<Option<GemvRow>> {
        let n_q = ctx.shard.heads.q_heads.len();
        let scale = 1.0 / (ctx.config.head_dim as f64).sqrt();
        match kv {
            StepKv::Own => {
                match self.qkv.gemv_weight(input.like()).filter(|_| self.qk_norm.is_none()) {
                    // The product, its bias, its rotation and the cache write in one kernel.
                    Some((w, bias)) => self
                        .cache
                        .append_projected_rotated_into(input, w, bias, ctx.rope, ctx.at, n_q, &b.queries)?,
                    None => {
                        self.qkv.forward_row_into(input, &b.qkv)?;
                        let norms = self.qk_norm.as_ref().map(|(q, k)| HeadNorms {
                            q,
                            k,
                            eps: ctx.config.rms_norm_eps as f32,
                        });
                        self.cache
                            .append_rotated_into(&b.qkv, norms, ctx.rope, ctx.at, n_q, &b.queries)?;
                    }
                }
                let (k, v) = self.cache.slots()?;
                flash_attention_cached_into(
                    &b.queries,
                    &k,
                    &v,
                    ctx.at.tensor(),
                    scale,
                    ctx.decode_scratch,
                    &b.attention,
                )?;
            }
            StepKv::Paged(row) => {
                let (Some(pool), Some((w, bias))) = (&self.paged, self.qkv.gemv_weight(input.like())) else {
                    return Err(tpinfer_layers::Error::Shard(
                        "a lone paged step needs a paged cache and a fused QKV GEMV".into(),
                    ));
                };
                pool.write_projected_rotated_into(input, w, bias, ctx.rope, row, n_q, &b.queries)?;
                pool.lone_decode_attention_into(&b.queries, row, scale, ctx.decode_scratch, &b.attention)?;
            }
        }
        let eps = ctx.config.rms_norm_eps;
        let post_norm = match norms {
            Some(_) => {
                let out = b.norm_output(0)?;
                self.o_proj
                    .forward_row_residual_into(&b.attention, out.residual(&self.post_norm, eps))?
            }
            None => {
                self.o_proj.forward_row_into(&b.attention, &b.sum)?;
                add_rms_norm_into(&b.stream, &b.sum, &self.post_norm, eps)?;
                GemvRow::Given(b.stream.get(1)?)
            }
        };
        match norms.and_then(|n| n.next) {
            Some(next) => {
                let out = b.norm_output(1)?;
                let row = self
                    .mlp
                    .forward_row_residual_into(post_norm, &b.hidden, out.residual(next, eps))?;
                Ok(Some(row))
            }
            None => {
                self.mlp.forward_row_into(post_norm, &b.hidden, &b.sum)?;
                Ok(None)
            }
        }
    }

    /// `qkv` `[rows, (n_q + 2 · n_kv) · head_dim]` with each query and key head RMS-normed
    /// (Qwen3); as it is without the norms.
    fn qk_normed(&self, qkv: Tensor, ctx: &LayerContext) -> Result<Tensor> {
        let Some((q_norm, k_norm)) = &self.qk_norm else {
            return Ok(qkv);
        };
        let heads = &ctx.shard.heads;
        let (n_q, n_kv, d) = (heads.q_heads.len(), heads.kv_heads.len(), ctx.config.head_dim);
        let rows = qkv.dim(0)?;
        let x = qkv.reshape((rows, n_q + 2 * n_kv, d))?;
        let eps = ctx.config.rms_norm_eps as f32;
        let q = rms_norm(&x.narrow(1, 0, n_q)?.contiguous()?, q_norm, eps)?;
        let k = rms_norm(&x.narrow(1, n_q, n_kv)?.contiguous()?, k_norm, eps)?;
        let v = x.narrow(1, n_q + n_kv, n_kv)?;
        Ok(Tensor::cat(&[q, k, v], 1)?.reshape((rows, ()))?)
    }

    fn attention(&self, h: Tensor, ctx: &LayerContext) -> Result<Tensor> {
        let (c, shard) = (ctx.config, ctx.shard);
        let (b, s, _) = h.dims3()?;
        let d = c.head_dim;
        let qkv = self.qkv.forward_merged(&h)?.reshape((b * s, ()))?;
        drop(h);
        let qkv = self.qk_normed(qkv, ctx)?;
        let n_q = shard.heads.q_heads.len();
        // One fused kernel: the rotated keys and the values written into the cache, the rotated
        // queries `[s, n_q, d]` out.
        let q = self.cache.append_rotated(&qkv, ctx.rope, ctx.at, n_q)?;
        drop(qkv);
        let scale = 1.0 / (d as f64).sqrt();
        if ctx.flash {
            // Over the cache's full capacity: the kernel reads the filled length from the
            // device, so the shapes do not depend on the position.
            let (k, v) = self.cache.slots()?;
            let attn = flash_attention_cached(&q, &k, &v, ctx.at.tensor(), scale, ctx.decode_scratch)?;
            drop(q);
            return self.o_proj.forward(&attn.reshape((b, s, n_q * d))?);
        }
        let (k, v) = self.cache.filled(ctx.at.value() + s)?;
        // The unfused path's `[1, n_q, s, d]`; the token-major queries are freed.
        let q = {
            let tokens = q;
            tokens.transpose(0, 1)?.contiguous()?.unsqueeze(0)?
        };
        let attn = grouped_attention(&q, &k, &v, &shard.heads, ctx.kv_index, ctx.mask, scale)?;
        let attn = attn.transpose(1, 2)?.reshape((b, s, n_q * d))?;
        self.o_proj.forward(&attn)
    }
}
