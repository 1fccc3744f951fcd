use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_kernels::{layer_norm, residual_sum, row_sum_squares, scale_rows_cols};
use tpinfer_layers::{full_attention, ColumnParallelLinear, MergedColumnParallelLinear, Result, RowParallelLinear};
use tpinfer_weights::{ShardLoader, TensorInfo, WeightDecl, WeightFormat, WeightStore};

use crate::memory::SCORE_BUFFER_BYTES;
use crate::profile::StageTimes;
use crate::{WanConfig, WanShard};

/// One rank's part of a Wan DiT: its heads of every attention and its FFN columns; the
/// embeddings, modulation tables and head replicated.
pub struct WanRank {
    config: WanConfig,
    shard: WanShard,
    dtype: DType,
    patch: Tensor,
    patch_bias: Tensor,
    time_1: Linear,
    time_2: Linear,
    time_proj: Linear,
    text_1: Linear,
    text_2: Linear,
    blocks: Vec<Block>,
    /// The head's `[2, dim]` shift/scale table, f32.
    head_table: Tensor,
    proj_out: Linear,
    comm: Arc<dyn Communicator>,
    bytes_loaded: usize,
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
        let patch = w.take("patch_embedding.weight")?;
        let patch = patch.reshape((d, patch.elem_count() / d))?;
        let patch_bias = w.take("patch_embedding.bias")?;
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
        let bytes_loaded = w.bytes_read();
        Ok(Self {
            config: config.clone(),
            shard,
            dtype,
            patch,
            patch_bias,
            time_1,
            time_2,
            time_proj,
            text_1,
            text_2,
            blocks,
            head_table,
            proj_out,
            comm,
            bytes_loaded,
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
        self.forward_with(latents, timestep, context, None)
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
        self.forward_with(latents, timestep, context, Some(times))
    }

    fn forward_with(
        &self,
        latents: &Tensor,
        timestep: f64,
        context: &Tensor,
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
        let device = latents.device();
        let d = c.hidden_size();

        // Patch embedding: the 3-D convolution with stride = kernel is a linear map of patches.
        let patches = latents
            .to_dtype(self.dtype)?
            .reshape(vec![channels, f, pt, h, ph, w, pw])?
            .permute(vec![1, 3, 5, 0, 2, 4, 6])?
            .reshape((f * h * w, channels * pt * ph * pw))?;
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        let rows = (world > 1 && f * h * w >= world).then(|| Rows::new(f * h * w, world, rank));
        let patches = match &rows {
            Some(r) => patches.narrow(0, r.start, r.len(rank))?.contiguous()?,
            None => patches,
        };
        let mut x = match tpinfer_kernels::fused_linear_covers(&patches, &self.patch) {
            true => tpinfer_kernels::linear_bias(&patches, &self.patch, &self.patch_bias, false)?,
            false => patches.matmul(&self.patch.t()?)?.broadcast_add(&self.patch_bias)?,
        };
        drop(patches);

        let temb = self.time_embedding(timestep, device)?;
        let time = self
            .time_proj
            .forward(&candle_nn::ops::silu(&temb)?)?
            .to_dtype(DType::F32)?
            .reshape((6, d))?;
        let rope = rope_table(c.attention_head_dim, (f, h, w), device)?;
        let step = Step {
            rope: &rope,
            context,
            time: &time,
            rows: rows.as_ref(),
            times,
        };
        step.mark("embeddings")?;
        for block in &self.blocks {
            x = block.forward(x, &step, c, &*self.comm)?;
        }

        // Head: LayerNorm modulated by its own table and the time embedding, then unpatchify.
        let temb = temb.to_dtype(DType::F32)?.squeeze(0)?;
        let shift = self.head_table.get(0)?.broadcast_add(&temb)?;
        let scale = self.head_table.get(1)?.broadcast_add(&temb)?;
        let x = modulated_norm(&x, &shift, &scale, c.eps)?;
        let out = self.proj_out.forward(&x)?;
        step.mark("head")?;
        let out = step.gather(out, &*self.comm)?;
        Ok(out
            .reshape(vec![f, h, w, pt, ph, pw, c.out_channels])?
            .permute(vec![6, 0, 3, 1, 4, 2, 5])?
            .reshape((c.out_channels, frames, height, width))?
            .to_dtype(DType::F32)?)
    }

    /// The sinusoidal embedding of the timestep (cos then sin halves) through the time MLP:
    /// `[1, dim]`.
    fn time_embedding(&self, timestep: f64, device: &Device) -> Result<Tensor> {
        let half = self.config.freq_dim / 2;
        let mut sinusoid: Vec<f32> = (0..half)
            .map(|i| (timestep * 10_000f64.powf(-(i as f64) / half as f64)).cos() as f32)
            .collect();
        sinusoid.extend((0..half).map(|i| (timestep * 10_000f64.powf(-(i as f64) / half as f64)).sin() as f32));
        let sinusoid = Tensor::from_vec(sinusoid, (1, 2 * half), device)?.to_dtype(self.dtype)?;
        let h = candle_nn::ops::silu(&self.time_1.forward(&sinusoid)?)?;
        self.time_2.forward(&h)
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
        let e = self.table.broadcast_add(step.time)?;
        let row = |i: usize| e.get(i);

        // Self-attention, gated.
        let n = modulated_norm(&x, &row(0)?, &row(1)?, c.eps)?;
        step.mark("norms and residuals")?;
        let gate = row(2)?;
        x = self.self_attn.forward(n, None, c, comm, step, &mut |parts| {
            residual_sum(&x, parts, Some(&gate))
        })?;

        // Cross-attention to the text, plain residual.
        let n = match &self.norm2 {
            Some((w, b)) => layer_norm(&x, w, b, c.eps)?,
            None => x.clone(),
        };
        step.mark("norms and residuals")?;
        x = self
            .cross_attn
            .forward(n, Some(step.context), c, comm, step, &mut |parts| {
                residual_sum(&x, parts, None)
            })?;

        // FFN (GELU, tanh approximation), gated.
        let n = modulated_norm(&x, &row(3)?, &row(4)?, c.eps)?;
        step.mark("norms and residuals")?;
        let hidden = self.ffn_up.empty_output(step.tokens(&n)?, &n)?;
        step.gather_each(&n, comm, |part, first| {
            self.ffn_up.forward_into(&hidden, first, part, true)
        })?;
        drop(n);
        step.mark("ffn up + gelu")?;
        let gate = row(5)?;
        let updated = step.sum(&self.ffn_down, &hidden, &mut |parts| {
            residual_sum(&x, parts, Some(&gate))
        })?;
        drop(hidden);
        step.mark("ffn down + sum")?;
        Ok(updated)
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
        let heads = |t: &Tensor| -> Result<Tensor> {
            let (s, width) = t.dims2()?;
            Ok(t.reshape((s, width / hd, hd))?)
        };
        // V stays a view into the merged K/V output, which lives until attention ends.
        let (q, k, v) = (heads(&q)?, heads(&k)?, heads(&kv[1])?);
        drop(kv);
        let out = full_attention(&q, &k, &v, 1.0 / (hd as f64).sqrt(), SCORE_BUFFER_BYTES)?;
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

/// 3-D RoPE for an `f × h × w` grid of patches and heads of `hd` channels: each head's pairs
/// split into time, height and width parts (`hd − 4⌊hd/6⌋`, `2⌊hd/6⌋`, `2⌊hd/6⌋` channels),
/// each rotated by its coordinate. `[s, 2, hd/2]` f32, cos then sin per token. The angles'
/// cos and sin are computed per axis in f64 on the host (as diffusers does) and laid out
/// over the grid on the device.
fn rope_table(hd: usize, (f, h, w): (usize, usize, usize), device: &Device) -> Result<Tensor> {
    let hw_dim = 2 * (hd / 6);
    let t_dim = hd - 2 * hw_dim;
    // `[positions, 2, dim / 2]`: cos and sin of position · 10000^(−2j / dim).
    let axis = |positions: usize, dim: usize| -> Result<Tensor> {
        let mut values = Vec::with_capacity(positions * dim);
        for p in 0..positions {
            let angles: Vec<f64> = (0..dim / 2)
                .map(|j| p as f64 / 10_000f64.powf(2.0 * j as f64 / dim as f64))
                .collect();
            values.extend(angles.iter().map(|a| a.cos() as f32));
            values.extend(angles.iter().map(|a| a.sin() as f32));
        }
        Ok(Tensor::from_vec(values, (positions, 2, dim / 2), device)?)
    };
    let time = axis(f, t_dim)?.reshape((f, 1, 1, 2, t_dim / 2))?;
    let height = axis(h, hw_dim)?.reshape((1, h, 1, 2, hw_dim / 2))?;
    let width = axis(w, hw_dim)?.reshape((1, 1, w, 2, hw_dim / 2))?;
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
/// FP32LayerNorm: one fused LayerNorm with weight `1 + scale` and bias `shift`.
fn modulated_norm(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(layer_norm(x, &(scale + 1.0)?, shift, eps)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table against each token's angles written out one by one.
    #[test]
    fn rope_table_rotates_each_axis_by_its_coordinate() -> Result<()> {
        let (hd, f, h, w) = (12, 3, 4, 5);
        let table = rope_table(hd, (f, h, w), &Device::Cpu)?;
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
