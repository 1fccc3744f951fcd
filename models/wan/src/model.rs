use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_kernels::{layer_norm, residual_sum, row_sum_squares, scale_rows_cols, ColumnTable};
use tpinfer_layers::{
    full_attention, ColumnParallelLinear, Error, MergedColumnParallelLinear, Result, RowParallelLinear,
};
use tpinfer_weights::{ShardLoader, TensorInfo, WeightDecl, WeightFormat, WeightStore};

use crate::memory::{SelfAttention, SCORE_BUFFER_BYTES};
use crate::profile::StageTimes;
use crate::s2v::{S2vClip, S2vCondition, S2vEmbedders};
use crate::s2v_audio::AudioEmbedding;
use crate::{WanConfig, WanShard, S2V_MOTION_FRAMES};

/// One rank's part of a Wan DiT: its heads of every attention and its FFN columns; the
/// embeddings, modulation tables and head replicated.
pub struct WanRank {
    config: WanConfig,
    shard: WanShard,
    dtype: DType,
    /// The residual stream's dtype ([`WanConfig::stream_dtype`]).
    stream: DType,
    patch: PatchLinear,
    time_1: Linear,
    time_2: Linear,
    time_proj: Linear,
    text_1: Linear,
    text_2: Linear,
    blocks: Vec<Block>,
    /// The head's `[2, dim]` shift/scale table, f32.
    head_table: Tensor,
    proj_out: Linear,
    /// S2V's audio modules, frame packer, condition encoder and token marks.
    s2v: Option<S2vEmbedders>,
    comm: Arc<dyn Communicator>,
    bytes_loaded: usize,
    self_attention: SelfAttention,
}

/// A replicated linear.
struct Linear(candle_nn::Linear);

impl Linear {
    fn load(w: &mut ShardLoader, prefix: &str) -> Result<Self> {
        let weight = w.take(&format!("{prefix}.weight"))?;
        let bias = w.take(&format!("{prefix}.bias"))?;
        Ok(Self(candle_nn::Linear::new(weight, Some(bias))))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_core::Module::forward(&self.0, x)?)
    }

    /// The product in `dtype`: the weights widened to it for the call where they are
    /// narrower (a temporary, made where a forward's activations are few).
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let wide = candle_nn::Linear::new(
            self.0.weight().to_dtype(dtype)?,
            self.0.bias().map(|b| b.to_dtype(dtype)).transpose()?,
        );
        Ok(candle_core::Module::forward(&wide, &x.to_dtype(dtype)?)?)
    }
}

/// A 3-D convolution whose stride is its kernel: a linear map of patches.
pub(crate) struct PatchLinear {
    /// `[dim, channels · kt · kh · kw]`.
    weight: Tensor,
    bias: Tensor,
    kernel: [usize; 3],
}

impl PatchLinear {
    pub(crate) fn load(w: &mut ShardLoader, prefix: &str, kernel: [usize; 3]) -> Result<Self> {
        let weight = w.take(&format!("{prefix}.weight"))?;
        let dim = weight.dim(0)?;
        Ok(Self {
            weight: weight.reshape((dim, ()))?,
            bias: w.take(&format!("{prefix}.bias"))?,
            kernel,
        })
    }

    /// The same map with `extra` added to its bias.
    pub(crate) fn with_bias_plus(self, extra: &Tensor) -> Result<Self> {
        Ok(Self {
            bias: (&self.bias + extra)?,
            ..self
        })
    }

    /// Patches from [`patches`] to `[patches, dim]`.
    pub(crate) fn project(&self, patches: &Tensor) -> Result<Tensor> {
        Ok(match tpinfer_kernels::fused_linear_covers(patches, &self.weight) {
            true => tpinfer_kernels::linear_bias(patches, &self.weight, &self.bias, false)?,
            false => patches.matmul(&self.weight.t()?)?.broadcast_add(&self.bias)?,
        })
    }

    /// `latents` `[channels, frames, height, width]` to `[patches, dim]`, with the grid of
    /// patches.
    pub(crate) fn forward(&self, latents: &Tensor, dtype: DType) -> Result<(Tensor, (usize, usize, usize))> {
        let (grid, patches) = patches(latents, self.kernel, dtype)?;
        Ok((self.project(&patches)?, grid))
    }
}

/// `latents` `[channels, frames, height, width]` cut into `kernel`-sized patches, each
/// flattened as (channel, t, y, x) like a convolution's weight: `[patches, channels · kt ·
/// kh · kw]` in (frame, row, column) order, with the grid of patches. A remainder short of a
/// kernel is dropped, as the convolution drops it.
pub(crate) fn patches(
    latents: &Tensor,
    [kt, kh, kw]: [usize; 3],
    dtype: DType,
) -> Result<((usize, usize, usize), Tensor)> {
    let (c, frames, height, width) = latents.dims4()?;
    let (f, h, w) = (frames / kt, height / kh, width / kw);
    let cropped = latents
        .narrow(1, 0, f * kt)?
        .narrow(2, 0, h * kh)?
        .narrow(3, 0, w * kw)?;
    let patches = cropped
        .to_dtype(dtype)?
        .reshape(vec![c, f, kt, h, kh, w, kw])?
        .permute(vec![1, 3, 5, 0, 2, 4, 6])?
        .reshape((f * h * w, c * kt * kh * kw))?;
    Ok(((f, h, w), patches))
}

/// An attention sharded by heads: Q (and K/V, from the same input or the text) column-parallel,
/// the full-width QK RMSNorm kept exact by an all-reduce of per-token sums of squares, the
/// output row-parallel.
struct Attention {
    q: ColumnParallelLinear,
    kv: MergedColumnParallelLinear,
    o: RowParallelLinear,
    /// This rank's channels of the RMSNorm weights, f32.
    norm_q: Tensor,
    norm_k: Tensor,
}

struct Block {
    /// `[6, dim]` f32: shift, scale, gate (self-attention), shift, scale, gate (FFN).
    table: Tensor,
    self_attn: Attention,
    cross_attn: Attention,
    /// The cross-attention's affine LayerNorm (weight, bias), f32.
    norm2: Option<(Tensor, Tensor)>,
    ffn_up: ColumnParallelLinear,
    ffn_down: RowParallelLinear,
}

/// What every block of one forward shares.
struct Step<'a> {
    /// The RoPE table, `[s, 2, head_dim / 2]` f32: each token's cos, then sin.
    rope: &'a Tensor,
    /// The embedded text, `[text_tokens, dim]`.
    context: &'a Tensor,
    /// The time projection, `[6, dim]` f32.
    time: &'a Tensor,
    /// S2V: timestep 0's projection, and how many of this rank's rows (the video's, which
    /// come first) take `time` instead.
    zero_time: Option<(&'a Tensor, usize)>,
    /// The products' dtype, which the norms write (the stream may be wider).
    compute: DType,
    self_attention: SelfAttention,
    /// This rank's rows of the residual stream at TP > 1 (sequence parallelism).
    rows: Option<&'a Rows>,
    times: Option<&'a StageTimes>,
}

/// Sequence parallelism at TP > 1: each rank keeps its own rows of the residual stream (an
/// even split of the tokens) and runs the replicated norms, modulation and residuals on them
/// alone. The row-parallel outputs are reduce-scattered to these rows instead of all-reduced,
/// and the norms' outputs all-gathered before the column-parallel GEMMs that need every
/// token: the same bytes on the link as the all-reduces, a rank's share of the rest.
struct Rows {
    /// Every rank's number of rows, in rank order.
    sizes: Vec<usize>,
    /// This rank's first row.
    start: usize,
}

impl Rows {
    fn new(tokens: usize, world: usize, rank: usize) -> Self {
        let ranges = tpinfer_layers::split_evenly(tokens, world);
        Self {
            sizes: ranges.iter().map(|r| r.len()).collect(),
            start: ranges[rank].start,
        }
    }

    fn len(&self, rank: usize) -> usize {
        self.sizes[rank]
    }
}

impl Step<'_> {
    /// Ends a profiled stage (a no-op unless profiling).
    fn mark(&self, stage: &'static str) -> Result<()> {
        match self.times {
            Some(times) => times.mark(stage),
            None => Ok(()),
        }
    }

    /// Every token's rows of `x` (this rank's rows under sequence parallelism, gathered), to
    /// `each` with the first row of each part; `tokens` rows in all. Under sequence
    /// parallelism the ranks' rows move while `each` works on those at hand (profiled with the
    /// products `each` runs).
    fn gather_each(
        &self,
        x: &Tensor,
        comm: &dyn Communicator,
        mut each: impl FnMut(&Tensor, usize) -> candle_core::Result<()>,
    ) -> Result<()> {
        match self.rows {
            Some(rows) => Ok(comm.all_gather_rows(x, &rows.sizes, &mut each)?),
            None => Ok(each(x, 0)?),
        }
    }

    /// The number of tokens: every rank's rows.
    fn tokens(&self, x: &Tensor) -> Result<usize> {
        Ok(match self.rows {
            Some(rows) => rows.sizes.iter().sum(),
            None => x.dim(0)?,
        })
    }

    /// Every token's rows of `x`, this rank's rows under sequence parallelism.
    fn gather(&self, x: Tensor, comm: &dyn Communicator) -> Result<Tensor> {
        match self.rows {
            Some(rows) => {
                let all = comm.all_gather_sized(&x, 0, &rows.sizes)?;
                self.mark("all-gather")?;
                Ok(all)
            }
            None => Ok(x),
        }
    }

    /// A row-parallel linear's output summed over the ranks (scattered to this rank's rows
    /// under sequence parallelism), handed to `finish` as parts to add in order; returns what
    /// `finish` makes of them.
    fn sum(
        &self,
        linear: &RowParallelLinear,
        x: &Tensor,
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        match self.rows {
            Some(rows) => linear.forward_scattered(x, &rows.sizes, finish),
            None => Ok(finish(&[linear.forward(x)?])?),
        }
    }
}

/// The tensors `shard` reads, the blocks' linear weights in `format` (`stored` giving a
/// tensor's header where there is a checkpoint).
pub(crate) fn weight_decls(
    config: &WanConfig,
    shard: &WanShard,
    format: WeightFormat,
    stored: impl Fn(&str) -> Option<TensorInfo>,
) -> Vec<WeightDecl> {
    let mut decls = shard.weight_decls(config);
    let linear = |d: &WeightDecl| d.name.starts_with("blocks.") && d.shape.len() == 2;
    tpinfer_weights::hold_matrices(&mut decls, format, linear, linear, stored);
    decls
}

impl WanRank {
    /// Loads this rank's slices from `store` (diffusers' names; wrap original checkpoints in a
    /// [`tpinfer_weights::RenamedStore`] with [`crate::original_names`]).
    pub fn load(
        config: &WanConfig,
        store: &dyn WeightStore,
        shard: WanShard,
        format: WeightFormat,
        comm: Arc<dyn Communicator>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let decls = weight_decls(config, &shard, format, |name| store.info(name));
        let mut w = ShardLoader::new(store, &decls, dtype, device);
        let d = config.hidden_size();
        let f32 = |t: Tensor| t.to_dtype(DType::F32);
        let patch = PatchLinear::load(&mut w, "patch_embedding", config.patch_size)?;
        let ce = "condition_embedder";
        let time_1 = Linear::load(&mut w, &format!("{ce}.time_embedder.linear_1"))?;
        let time_2 = Linear::load(&mut w, &format!("{ce}.time_embedder.linear_2"))?;
        let time_proj = Linear::load(&mut w, &format!("{ce}.time_proj"))?;
        let text_1 = Linear::load(&mut w, &format!("{ce}.text_embedder.linear_1"))?;
        let text_2 = Linear::load(&mut w, &format!("{ce}.text_embedder.linear_2"))?;
        let attention = |w: &mut ShardLoader, p: &str| -> Result<Attention> {
            Ok(Attention {
                q: ColumnParallelLinear::load(w, &format!("{p}.to_q"), true)?,
                kv: MergedColumnParallelLinear::load(w, &[&format!("{p}.to_k"), &format!("{p}.to_v")], true)?,
                o: RowParallelLinear::load(w, &format!("{p}.to_out.0"), true, comm.clone())?,
                norm_q: f32(w.take(&format!("{p}.norm_q.weight"))?)?,
                norm_k: f32(w.take(&format!("{p}.norm_k.weight"))?)?,
            })
        };
        let blocks = (0..config.num_layers)
            .map(|i| {
                let p = format!("blocks.{i}");
                Ok(Block {
                    table: f32(w.take(&format!("{p}.scale_shift_table"))?)?.reshape((6, d))?,
                    self_attn: attention(&mut w, &format!("{p}.attn1"))?,
                    cross_attn: attention(&mut w, &format!("{p}.attn2"))?,
                    norm2: match config.cross_attn_norm {
                        true => Some((
                            f32(w.take(&format!("{p}.norm2.weight"))?)?,
                            f32(w.take(&format!("{p}.norm2.bias"))?)?,
                        )),
                        false => None,
                    },
                    ffn_up: ColumnParallelLinear::load(&mut w, &format!("{p}.ffn.net.0.proj"), true)?,
                    ffn_down: RowParallelLinear::load(&mut w, &format!("{p}.ffn.net.2"), true, comm.clone())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let head_table = f32(w.take("scale_shift_table")?)?.reshape((2, d))?;
        let proj_out = Linear::load(&mut w, "proj_out")?;
        let s2v = match &config.s2v {
            Some(modules) => Some(S2vEmbedders::load(&mut w, config, modules, &comm)?),
            None => None,
        };
        let bytes_loaded = w.bytes_read();
        Ok(Self {
            config: config.clone(),
            shard,
            dtype,
            stream: config.stream_dtype(dtype),
            patch,
            time_1,
            time_2,
            time_proj,
            text_1,
            text_2,
            blocks,
            head_table,
            proj_out,
            s2v,
            comm,
            bytes_loaded,
            self_attention: SelfAttention::ComputeDtype,
        })
    }

    pub fn config(&self) -> &WanConfig {
        &self.config
    }

    /// Embeds umT5 text states `[tokens, text_dim]` for the cross-attentions: run once per
    /// prompt, not per step.
    pub fn embed_text(&self, text: &Tensor) -> Result<Tensor> {
        let h = self.text_1.forward(&text.to_dtype(self.dtype)?)?.gelu()?;
        self.text_2.forward(&h)
    }

    /// The velocity for `latents` `[channels, frames, height, width]` (f32) at flow time
    /// `timestep` (0–1000), attending to `context` from [`Self::embed_text`]. Returns f32 of
    /// the latents' shape; every rank returns the same. Per block, three sums of activations
    /// (self-attention, cross-attention, FFN outputs: all-reduces at TP 1, reduce-scatters
    /// with an all-gather each under sequence parallelism) and two all-reduces of per-token
    /// norms.
    pub fn forward(&self, latents: &Tensor, timestep: f64, context: &Tensor) -> Result<Tensor> {
        self.forward_with(latents, timestep, context, None, None)
    }

    /// [`Self::forward`] with the time of each stage recorded in `times` (CUDA events on a GPU):
    /// for finding where a step's time goes.
    pub fn forward_profiled(
        &self,
        latents: &Tensor,
        timestep: f64,
        context: &Tensor,
        times: &StageTimes,
    ) -> Result<Tensor> {
        self.forward_with(latents, timestep, context, None, Some(times))
    }

    /// S2V: one clip's audio embedding from its wav2vec2 features `[frames, states, audio
    /// dim]` (`tpinfer_wav2vec2::per_video_frame`'s rows of the clip), behind the 73 motion
    /// frames as S2V runs it. Run once per clip (and once more with zero features for the
    /// unconditional pass).
    pub fn encode_s2v_audio(&self, features: &Tensor) -> Result<AudioEmbedding> {
        self.s2v_embedders()?.audio.encode(
            features,
            S2V_MOTION_FRAMES,
            S2V_MOTION_FRAMES.div_ceil(4),
            features.device(),
        )
    }

    /// S2V: embeds a clip's conditioning for latents of `latent_shape` `[channels, frames,
    /// height, width]`: once per clip, for all its steps.
    pub fn prepare_s2v(&self, latent_shape: &[usize], condition: &S2vCondition) -> Result<S2vClip> {
        let embedders = self.s2v_embedders()?;
        let device = condition.reference.device();
        let zero_time = self.time_projection(&self.time_embedding(0.0, device)?)?;
        embedders.prepare(
            &self.config,
            &self.patch,
            latent_shape,
            condition,
            zero_time,
            self.dtype,
        )
    }

    /// S2V's velocity for the clip's `latents`: [`Self::forward`]'s, with the clip's pose
    /// added to the video tokens, its reference and motion tokens after them at timestep 0,
    /// and its audio injected after the configured blocks.
    /// With `times`, the time of each stage as [`Self::forward_profiled`].
    pub fn forward_s2v(
        &self,
        latents: &Tensor,
        timestep: f64,
        context: &Tensor,
        clip: &S2vClip,
        times: Option<&StageTimes>,
    ) -> Result<Tensor> {
        self.forward_with(latents, timestep, context, Some(clip), times)
    }

    fn s2v_embedders(&self) -> Result<&S2vEmbedders> {
        self.s2v
            .as_ref()
            .ok_or_else(|| Error::Shard("this Wan DiT has no speech-to-video modules".into()))
    }

    fn forward_with(
        &self,
        latents: &Tensor,
        timestep: f64,
        context: &Tensor,
        clip: Option<&S2vClip>,
        times: Option<&StageTimes>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (channels, frames, height, width) = latents.dims4()?;
        let [pt, ph, pw] = c.patch_size;
        if channels != c.in_channels || frames % pt != 0 || height % ph != 0 || width % pw != 0 {
            return Err(candle_core::Error::Msg(format!(
                "latents {:?} do not fit the model: {} channels, frames a multiple of {pt}, height of {ph}, width of {pw}",
                latents.dims(),
                c.in_channels
            ))
            .into());
        }
        let (f, h, w) = (frames / pt, height / ph, width / pw);
        if clip.is_none() && self.s2v.is_some() {
            return Err(Error::Shard(
                "a speech-to-video (S2V) DiT's forward needs its clip: reference, motion, pose and audio".into(),
            ));
        }
        if let Some(clip) = clip.filter(|clip| clip.grid != (f, h, w)) {
            return Err(Error::Shard(format!(
                "S2V: the clip was prepared for {:?} patches; these latents make {:?}",
                clip.grid,
                (f, h, w)
            )));
        }
        let device = latents.device();
        let video = f * h * w;
        let tokens = video
            + match clip {
                Some(clip) => clip.condition.dim(0)?,
                None => 0,
            };

        // This rank's rows of the sequence: the video's patches (the patch embedding, a 3-D
        // convolution with stride = kernel, is a linear map of them), then S2V's reference
        // and motion tokens.
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        let rows = (world > 1 && tokens >= world).then(|| Rows::new(tokens, world, rank));
        let (start, len) = rows.as_ref().map_or((0, tokens), |r| (r.start, r.len(rank)));
        let video_rows = video.min(start + len).saturating_sub(start);
        let mut parts = Vec::with_capacity(2);
        if video_rows > 0 {
            let (_, patches) = patches(latents, c.patch_size, self.dtype)?;
            let patches = patches.narrow(0, start, video_rows)?.contiguous()?;
            let x = self.patch.project(&patches)?;
            parts.push(match (clip, &self.s2v) {
                (Some(clip), Some(s2v)) => {
                    let pose = clip.pose.narrow(0, start, video_rows)?.contiguous()?;
                    (x + s2v.cond_encoder.project(&pose)?)?
                }
                _ => x,
            });
        }
        if let Some(clip) = clip.filter(|_| len > video_rows) {
            let first = start.max(video) - video;
            parts.push(clip.condition.narrow(0, first, len - video_rows)?);
        }
        let mut x = match parts.len() {
            1 => parts.swap_remove(0),
            _ => Tensor::cat(&parts, 0)?,
        }
        .to_dtype(self.stream)?;
        drop(parts);

        let temb = self.time_embedding(timestep, device)?;
        let time = self.time_projection(&temb)?;
        let rope = match clip {
            Some(clip) => clip.rope.clone(),
            None => rope_grid(c.attention_head_dim, &PositionGrid::counting((f, h, w)), device)?,
        };
        let step = Step {
            rope: &rope,
            context,
            time: &time,
            zero_time: clip.map(|clip| (&clip.zero_time, video_rows)),
            compute: self.dtype,
            self_attention: self.self_attention,
            rows: rows.as_ref(),
            times,
        };
        step.mark("embeddings")?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(x, &step, c, &*self.comm)?;
            if let (Some(clip), Some(s2v)) = (clip, &self.s2v) {
                if let Some(&Some(injection)) = s2v.inject_after.get(i) {
                    // The injection reads every video token (its queries are sharded by
                    // heads) and adds to this rank's video rows.
                    let every = step.gather(x.clone(), &*self.comm)?.narrow(0, 0, video)?;
                    let residual = s2v.audio.injection(injection, every, &clip.audio, c, &*self.comm)?;
                    if video_rows > 0 {
                        let residual = residual.narrow(0, start, video_rows)?;
                        let updated = residual_sum(&x.narrow(0, 0, video_rows)?, &[residual], None)?;
                        x = match len > video_rows {
                            true => Tensor::cat(&[&updated, &x.narrow(0, video_rows, len - video_rows)?], 0)?,
                            false => updated,
                        };
                    }
                    step.mark("audio injection")?;
                }
            }
        }

        // Head: LayerNorm modulated by its own table and the time embedding, then unpatchify
        // the video's tokens.
        let temb = temb.to_dtype(DType::F32)?.squeeze(0)?;
        let shift = self.head_table.get(0)?.broadcast_add(&temb)?;
        let scale = self.head_table.get(1)?.broadcast_add(&temb)?;
        let x = modulated_norm(&x, &shift, &scale, c.eps, x.dtype())?;
        let out = self.proj_out.forward_in(&x, self.stream)?;
        step.mark("head")?;
        let out = step.gather(out, &*self.comm)?;
        Ok(out
            .narrow(0, 0, video)?
            .reshape(vec![f, h, w, pt, ph, pw, c.out_channels])?
            .permute(vec![6, 0, 3, 1, 4, 2, 5])?
            .reshape((c.out_channels, frames, height, width))?
            .to_dtype(DType::F32)?)
    }

    /// The six modulation rows of a time embedding, `[6, dim]` f32.
    fn time_projection(&self, temb: &Tensor) -> Result<Tensor> {
        Ok(self
            .time_proj
            .forward_in(&candle_nn::ops::silu(temb)?, self.stream)?
            .to_dtype(DType::F32)?
            .reshape((6, self.config.hidden_size()))?)
    }

    /// The sinusoidal embedding of the timestep (cos then sin halves) through the time MLP:
    /// `[1, dim]`.
    fn time_embedding(&self, timestep: f64, device: &Device) -> Result<Tensor> {
        let half = self.config.freq_dim / 2;
        let mut sinusoid: Vec<f32> = (0..half)
            .map(|i| (timestep * 10_000f64.powf(-(i as f64) / half as f64)).cos() as f32)
            .collect();
        sinusoid.extend((0..half).map(|i| (timestep * 10_000f64.powf(-(i as f64) / half as f64)).sin() as f32));
        let sinusoid = Tensor::from_vec(sinusoid, (1, 2 * half), device)?;
        let h = candle_nn::ops::silu(&self.time_1.forward_in(&sinusoid, self.stream)?)?;
        self.time_2.forward_in(&h, self.stream)
    }

    /// This rank with its self-attention at `precision`; refused where no kernel runs it
    /// (FP8: bf16 on a Hopper or Ada GPU).
    pub fn with_self_attention(self, precision: SelfAttention) -> Result<Self> {
        let (device, head_dim) = (self.head_table.device(), self.config.attention_head_dim);
        if precision == SelfAttention::Fp8
            && !tpinfer_kernels::flash_attention_fp8_supported(device, self.dtype, head_dim)
        {
            return Err(Error::Unsupported(format!(
                "--attention fp8 runs on Hopper and Ada GPUs (compute capability 9.0 and 8.9) in bf16 with head size 128; this rank \
                 is {:?} in {:?} with head size {head_dim} (leave --attention at its default)",
                device.location(),
                self.dtype
            )));
        }
        Ok(Self {
            self_attention: precision,
            ..self
        })
    }

    /// The weight bytes this rank copied out of the checkpoint.
    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    /// This rank's shard.
    pub fn shard(&self) -> &WanShard {
        &self.shard
    }
}

impl Block {
    /// Takes the residual stream (this rank's rows of it under sequence parallelism) by value
    /// so that each version is freed as soon as the next exists (the memory model in
    /// `memory.rs` counts on it).
    fn forward(&self, mut x: Tensor, step: &Step, c: &WanConfig, comm: &dyn Communicator) -> Result<Tensor> {
        let e = Modulation::new(&self.table, step)?;

        // Self-attention, gated.
        let n = e.norm(&x, 0, 1, c.eps, step.compute)?;
        step.mark("norms and residuals")?;
        x = self
            .self_attn
            .forward(n, None, c, comm, step, &mut |parts| e.gated_sum(&x, parts, 2))?;

        // Cross-attention to the text, plain residual.
        let n = match &self.norm2 {
            Some((w, b)) => layer_norm(
                &x,
                ColumnTable::every_row(w),
                ColumnTable::every_row(b),
                c.eps,
                step.compute,
            )?,
            None => x.to_dtype(step.compute)?,
        };
        step.mark("norms and residuals")?;
        x = self
            .cross_attn
            .forward(n, Some(step.context), c, comm, step, &mut |parts| {
                residual_sum(&x, parts, None)
            })?;

        // FFN (GELU, tanh approximation), gated.
        let n = e.norm(&x, 3, 4, c.eps, step.compute)?;
        step.mark("norms and residuals")?;
        let hidden = self.ffn_up.empty_output(step.tokens(&n)?, &n)?;
        step.gather_each(&n, comm, |part, first| {
            self.ffn_up.forward_into(&hidden, first, part, true)
        })?;
        drop(n);
        step.mark("ffn up + gelu")?;
        let updated = step.sum(&self.ffn_down, &hidden, &mut |parts| e.gated_sum(&x, parts, 5))?;
        drop(hidden);
        step.mark("ffn down + sum")?;
        Ok(updated)
    }
}

/// A block's modulation rows (shift, scale, gate; twice) for this rank's rows of the stream:
/// the timestep's for every row, or under S2V the timestep's for the video's rows, which
/// come first, and timestep 0's for the reference and motion rows after them.
struct Modulation {
    /// `[6, dim]`, or under S2V `[6, 2, dim]`: the timestep's, then timestep 0's.
    e: Tensor,
    /// Under S2V, the rows before timestep 0's.
    split: Option<usize>,
}

impl Modulation {
    fn new(table: &Tensor, step: &Step) -> Result<Self> {
        let e = table.broadcast_add(step.time)?;
        Ok(match step.zero_time {
            Some((zero, video)) => Self {
                e: Tensor::stack(&[e, table.broadcast_add(zero)?], 1)?,
                split: Some(video),
            },
            None => Self { e, split: None },
        })
    }

    /// `values` (a row of the tables) for each row of the stream.
    fn per_row<'a>(&self, values: &'a Tensor) -> ColumnTable<'a> {
        match self.split {
            Some(split) => ColumnTable::split_at(values, split),
            None => ColumnTable::every_row(values),
        }
    }

    /// `norm(x) · (1 + scale) + shift` in `out`, with rows `shift` and `scale` of the tables.
    fn norm(&self, x: &Tensor, shift: usize, scale: usize, eps: f64, out: DType) -> candle_core::Result<Tensor> {
        let (shift, scale) = (self.e.get(shift)?, (self.e.get(scale)? + 1.0)?);
        layer_norm(x, self.per_row(&scale), self.per_row(&shift), eps, out)
    }

    /// `x + gate · Σ parts`, with row `gate` of the tables.
    fn gated_sum(&self, x: &Tensor, parts: &[Tensor], gate: usize) -> candle_core::Result<Tensor> {
        let gate = self.e.get(gate)?;
        residual_sum(x, parts, Some(self.per_row(&gate)))
    }
}

impl Attention {
    /// Attention of the norm `n` (this rank's rows of it under sequence parallelism, gathered
    /// here) over `text` (the embedded text) or, without, over itself with RoPE (`step.rope`).
    /// The full-width output, summed over the ranks (this rank's rows of it under sequence
    /// parallelism), goes to `finish` as parts to add in order: returns what it makes of them.
    fn forward(
        &self,
        n: Tensor,
        text: Option<&Tensor>,
        c: &WanConfig,
        comm: &dyn Communicator,
        step: &Step,
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let tokens = step.tokens(&n)?;
        let q = self.q.empty_output(tokens, &n)?;
        let merged = match text {
            Some(text) => {
                step.gather_each(&n, comm, |part, first| self.q.forward_into(&q, first, part, false))?;
                self.kv.forward_merged(text)?
            }
            None => {
                let kv = self.kv.empty_output(tokens, &n)?;
                step.gather_each(&n, comm, |part, first| {
                    self.q.forward_into(&q, first, part, false)?;
                    self.kv.forward_merged_into(&kv, first, part)
                })?;
                kv
            }
        };
        drop(n);
        // Views into the merged output, which they keep alive until attention ends.
        let kv = self.kv.split(&merged)?;
        drop(merged);
        let rope = text.is_none().then_some(step.rope);
        step.mark("q/k/v projections")?;
        let (q, k) = full_width_rms_norm(q, &kv[0], &self.norm_q, &self.norm_k, rope, c, comm)?;
        step.mark(if rope.is_some() {
            "qk rms-norm + rope"
        } else {
            "qk rms-norm"
        })?;
        // `[tokens, heads, head_dim]` throughout: no transposes before or after attention.
        let hd = c.attention_head_dim;
        // By value: a view left bound beside its heads would keep Q and K alive through the
        // output projection. V's heads are a contiguous copy of its half of the merged K/V
        // output, which goes with `kv`.
        let heads = |t: Tensor| -> Result<Tensor> {
            let (s, width) = t.dims2()?;
            Ok(t.reshape((s, width / hd, hd))?)
        };
        let (q, k, v) = (heads(q)?, heads(k)?, heads(kv[1].clone())?);
        drop(kv);
        let scale = 1.0 / (hd as f64).sqrt();
        let out = match (rope, step.self_attention) {
            (Some(_), SelfAttention::Fp8) => tpinfer_kernels::flash_attention_fp8(&q, &k, &v, scale)?,
            _ => full_attention(&q, &k, &v, scale, SCORE_BUFFER_BYTES)?,
        };
        drop((q, k, v));
        step.mark(if rope.is_some() {
            "self-attention"
        } else {
            "cross-attention"
        })?;
        let (s, n, _) = out.dims3()?;
        let out = step.sum(&self.o, &out.reshape((s, n * hd))?, finish)?;
        step.mark("out projection + sum")?;
        Ok(out)
    }
}

/// RMSNorm of `q` and `k` over the model's full width although each rank holds only its
/// heads' channels: the per-token sums of squares of both go through one all-reduce. With a
/// RoPE table, both are rotated in the same pass. Takes `q` by value to free it once
/// normalized; `k` is a view into the merged K/V output, read in place.
pub(crate) fn full_width_rms_norm(
    q: Tensor,
    k: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    rope: Option<&Tensor>,
    c: &WanConfig,
    comm: &dyn Communicator,
) -> Result<(Tensor, Tensor)> {
    let sums = comm.all_reduce_sum(&Tensor::cat(&[row_sum_squares(&q)?, row_sum_squares(k)?], 0)?)?;
    let s = q.dim(0)?;
    let inv = ((sums / c.hidden_size() as f64)? + c.eps)?.sqrt()?.recip()?;
    let q_normed = scale_rows_cols(&q, &inv.narrow(0, 0, s)?, wq, rope)?;
    drop(q);
    let k = scale_rows_cols(k, &inv.narrow(0, s, k.dim(0)?)?, wk, rope)?;
    Ok((q_normed, k))
}

/// The RoPE positions of a grid of tokens, one list per axis; the tokens run time-major.
pub(crate) struct PositionGrid {
    pub(crate) times: Vec<i64>,
    pub(crate) rows: Vec<i64>,
    pub(crate) cols: Vec<i64>,
}

impl PositionGrid {
    /// Positions `0..f`, `0..h`, `0..w`: a video's grid of patches.
    pub(crate) fn counting((f, h, w): (usize, usize, usize)) -> Self {
        let count = |n: usize| (0..n as i64).collect();
        Self {
            times: count(f),
            rows: count(h),
            cols: count(w),
        }
    }
}

/// 3-D RoPE for a grid of tokens and heads of `hd` channels: each head's pairs split into
/// time, height and width parts (`hd − 4⌊hd/6⌋`, `2⌊hd/6⌋`, `2⌊hd/6⌋` channels), each rotated
/// by its coordinate (negative ones backwards). `[tokens, 2, hd/2]` f32, cos then sin per
/// token. The angles' cos and sin are computed per axis in f64 on the host (as diffusers
/// and Wan do) and laid out over the grid on the device.
pub(crate) fn rope_grid(hd: usize, grid: &PositionGrid, device: &Device) -> Result<Tensor> {
    let hw_dim = 2 * (hd / 6);
    let t_dim = hd - 2 * hw_dim;
    let (f, h, w) = (grid.times.len(), grid.rows.len(), grid.cols.len());
    // `[positions, 2, dim / 2]`: cos and sin of position · 10000^(−2j / dim).
    let axis = |positions: &[i64], dim: usize| -> Result<Tensor> {
        let mut values = Vec::with_capacity(positions.len() * dim);
        for &p in positions {
            let angles: Vec<f64> = (0..dim / 2)
                .map(|j| p as f64 / 10_000f64.powf(2.0 * j as f64 / dim as f64))
                .collect();
            values.extend(angles.iter().map(|a| a.cos() as f32));
            values.extend(angles.iter().map(|a| a.sin() as f32));
        }
        Ok(Tensor::from_vec(values, (positions.len(), 2, dim / 2), device)?)
    };
    let time = axis(&grid.times, t_dim)?.reshape((f, 1, 1, 2, t_dim / 2))?;
    let height = axis(&grid.rows, hw_dim)?.reshape((1, h, 1, 2, hw_dim / 2))?;
    let width = axis(&grid.cols, hw_dim)?.reshape((1, 1, w, 2, hw_dim / 2))?;
    let table = Tensor::cat(
        &[
            time.broadcast_as((f, h, w, 2, t_dim / 2))?,
            height.broadcast_as((f, h, w, 2, hw_dim / 2))?,
            width.broadcast_as((f, h, w, 2, hw_dim / 2))?,
        ],
        4,
    )?;
    Ok(table.reshape((f * h * w, 2, hd / 2))?)
}

/// LayerNorm modulated per channel, `norm(x) · (1 + scale) + shift`, in f32 as diffusers'
/// FP32LayerNorm, written as `out`: one fused LayerNorm with weight `1 + scale` and bias
/// `shift`.
pub(crate) fn modulated_norm(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f64,
    out: DType,
) -> candle_core::Result<Tensor> {
    let weight = (scale + 1.0)?;
    layer_norm(
        x,
        ColumnTable::every_row(&weight),
        ColumnTable::every_row(shift),
        eps,
        out,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table against each token's angles written out one by one.
    #[test]
    fn rope_table_rotates_each_axis_by_its_coordinate() -> Result<()> {
        let (hd, f, h, w) = (12, 3, 4, 5);
        let table = rope_grid(hd, &PositionGrid::counting((f, h, w)), &Device::Cpu)?;
        assert_eq!(table.dims(), [f * h * w, 2, hd / 2]);
        let table = table.flatten_all()?.to_vec1::<f32>()?;
        let (hw_dim, t_dim) = (2 * (hd / 6), hd - 4 * (hd / 6));
        let freq = |dim: usize, j: usize| 1.0 / 10_000f64.powf(2.0 * j as f64 / dim as f64);
        for (token, at) in (0..f)
            .flat_map(|t| (0..h).flat_map(move |y| (0..w).map(move |x| (t, y, x))))
            .enumerate()
        {
            let angles: Vec<f64> = (0..t_dim / 2)
                .map(|j| at.0 as f64 * freq(t_dim, j))
                .chain((0..hw_dim / 2).map(|j| at.1 as f64 * freq(hw_dim, j)))
                .chain((0..hw_dim / 2).map(|j| at.2 as f64 * freq(hw_dim, j)))
                .collect();
            for (j, a) in angles.iter().enumerate() {
                let (cos, sin) = (table[token * hd + j], table[token * hd + hd / 2 + j]);
                assert!(
                    (cos as f64 - a.cos()).abs() < 1e-6 && (sin as f64 - a.sin()).abs() < 1e-6,
                    "token {token} pair {j}"
                );
            }
        }
        Ok(())
    }
}
