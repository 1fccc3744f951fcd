//! Wan2.2-S2V's audio modules (`wan/modules/s2v/audio_utils.py` and `auxi_blocks.py` of the
//! wan22 wheel): the causal audio encoder, which turns a clip's wav2vec2 features into audio
//! tokens for each latent frame and one global embedding, and the audio injections after some
//! DiT blocks, where each latent frame's video tokens, AdaIN-modulated by the global
//! embedding, cross-attend that frame's audio tokens. The cross-attentions are sharded by
//! heads like the DiT's; the encoder and the AdaIN projections are replicated.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_kernels::{layer_norm, ColumnTable};
use tpinfer_layers::{
    full_attention, ColumnParallelLinear, Error, MergedColumnParallelLinear, Result, RowParallelLinear,
};
use tpinfer_weights::ShardLoader;

use crate::memory::SCORE_BUFFER_BYTES;
use crate::model::{full_width_rms_norm, modulated_norm};
use crate::{S2vModules, WanConfig};

/// The wav2vec2 hidden states S2V weighs together: a large encoder's input to each of its 24
/// layers and its output.
pub const AUDIO_LAYERS: usize = 25;

/// The epsilon of the encoder's LayerNorms (`MotionEncoder_tc`).
const ENCODER_NORM_EPS: f64 = 1e-6;

/// The epsilon of AdaIN's LayerNorm (diffusers' `AdaLayerNorm` default).
const ADAIN_NORM_EPS: f64 = 1e-5;

/// A clip's audio as the DiT's injections take it.
#[derive(Debug, Clone)]
pub struct AudioEmbedding {
    /// `[latent frames, dim]` f32: the global embedding each frame's AdaIN reads.
    pub global: Tensor,
    /// `[latent frames, audio tokens + 1, dim]`: each frame's audio tokens and the learned
    /// padding token its cross-attention also sees.
    pub local: Tensor,
}

/// One rank's part of S2V's audio modules.
pub struct S2vAudio {
    encoder: CausalAudioEncoder,
    injectors: Vec<AudioInjector>,
}

/// A 1-D convolution that sees only the past: its input padded on the left with copies of
/// its first frame.
struct CausalConv {
    weight: Tensor,
    /// `[1, channels, 1]`.
    bias: Tensor,
    stride: usize,
}

/// Held and run in f32 whatever the compute dtype (its declarations are `wide`), as S2V's
/// reference runs it under autocast to f32; its weights are a few tens of MB.
struct CausalAudioEncoder {
    /// The dtype of the local tokens it hands the injections' products.
    compute: DType,
    /// `silu(w) / Σ silu(w)` over the wav2vec2 states, `[1, states, 1]`.
    layer_weights: Tensor,
    conv1_local: CausalConv,
    conv1_global: CausalConv,
    conv2: CausalConv,
    conv3: CausalConv,
    final_linear: (Tensor, Tensor),
    /// `[1, 1, dim]`: the token appended to every frame's audio tokens.
    padding: Tensor,
    tokens: usize,
}

struct AudioInjector {
    /// AdaIN's projection of the global embedding to a shift and a scale, `[2 · dim, dim]`.
    adain: (Tensor, Tensor),
    q: ColumnParallelLinear,
    kv: MergedColumnParallelLinear,
    o: RowParallelLinear,
    /// This rank's channels of the full-width QK RMSNorm weights, f32.
    norm_q: Tensor,
    norm_k: Tensor,
}

impl CausalConv {
    fn load(w: &mut ShardLoader, prefix: &str, stride: usize) -> Result<Self> {
        Ok(Self {
            weight: w.take(&format!("{prefix}.conv.weight"))?,
            bias: w.take(&format!("{prefix}.conv.bias"))?.reshape((1, (), 1))?,
            stride,
        })
    }

    /// `x` `[batch, channels, frames]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (batch, channels, _) = x.dims3()?;
        let past = self.weight.dim(2)? - 1;
        let first = x.narrow(2, 0, 1)?.broadcast_as((batch, channels, past))?;
        let padded = Tensor::cat(&[&first, x], 2)?;
        Ok(padded
            .conv1d(&self.weight, 0, self.stride, 1, 1)?
            .broadcast_add(&self.bias)?)
    }
}

/// LayerNorm without an affine part over the channels of `x` `[batch, channels, frames]`,
/// then SiLU: `[batch, frames, channels]`.
fn norm_silu(x: &Tensor, eps: f64) -> Result<Tensor> {
    let (batch, channels, frames) = x.dims3()?;
    let rows = x.transpose(1, 2)?.contiguous()?.reshape((batch * frames, channels))?;
    let normed = plain_layer_norm(&rows, eps)?;
    Ok(normed.silu()?.reshape((batch, frames, channels))?)
}

/// LayerNorm of the rows of `x` without weight or bias.
fn plain_layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let width = x.dim(1)?;
    let ones = Tensor::ones(width, DType::F32, x.device())?;
    let zeros = Tensor::zeros(width, DType::F32, x.device())?;
    let (ones, zeros) = (ColumnTable::every_row(&ones), ColumnTable::every_row(&zeros));
    Ok(layer_norm(x, ones, zeros, eps, x.dtype())?)
}

impl CausalAudioEncoder {
    fn load(w: &mut ShardLoader, s2v: &S2vModules) -> Result<Self> {
        let enc = "casual_audio_encoder.encoder";
        let compute = w.dtype();
        let raw = w.take("casual_audio_encoder.weights")?;
        let silu = raw.flatten_all()?.silu()?;
        let layer_weights = silu.broadcast_div(&silu.sum_keepdim(0)?)?.reshape((1, (), 1))?;
        Ok(Self {
            compute,
            layer_weights,
            conv1_local: CausalConv::load(w, &format!("{enc}.conv1_local"), 1)?,
            conv1_global: CausalConv::load(w, &format!("{enc}.conv1_global"), 1)?,
            conv2: CausalConv::load(w, &format!("{enc}.conv2"), 2)?,
            conv3: CausalConv::load(w, &format!("{enc}.conv3"), 2)?,
            final_linear: (
                w.take(&format!("{enc}.final_linear.weight"))?,
                w.take(&format!("{enc}.final_linear.bias"))?,
            ),
            padding: w.take(&format!("{enc}.padding_tokens"))?.reshape((1, 1, ()))?,
            tokens: s2v.num_audio_token,
        })
    }

    /// `features` `[frames, states, audio dim]` (one clip, `per_video_frame`'s rows), after
    /// `motion_frames` copies of its first frame, through the encoder; the first
    /// `latent_motion_frames` latent frames (the motion frames') dropped.
    fn forward(&self, features: &Tensor, motion_frames: usize, latent_motion_frames: usize) -> Result<AudioEmbedding> {
        let weighted = features
            .to_dtype(DType::F32)?
            .broadcast_mul(&self.layer_weights)?
            .sum(1)?;
        let width = weighted.dim(1)?;
        let first = weighted.narrow(0, 0, 1)?.broadcast_as((motion_frames, width))?;
        // `[1, audio dim, frames]`, the motion frames first.
        let x = Tensor::cat(&[&first, &weighted], 0)?.t()?.unsqueeze(0)?;
        let down = |x: &Tensor| -> Result<Tensor> {
            let h = norm_silu(x, ENCODER_NORM_EPS)?.transpose(1, 2)?;
            let h = norm_silu(&self.conv2.forward(&h)?, ENCODER_NORM_EPS)?.transpose(1, 2)?;
            norm_silu(&self.conv3.forward(&h)?, ENCODER_NORM_EPS)
        };
        // Local: one stream of channels per audio token, `[tokens, latent frames, dim]`.
        let local = self.conv1_local.forward(&x)?;
        let (_, channels, frames) = local.dims3()?;
        let local = down(&local.reshape((self.tokens, channels / self.tokens, frames))?)?;
        let latent = local.dim(1)?;
        let kept = latent
            .checked_sub(latent_motion_frames)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::Shard(format!(
                "S2V audio: {latent} latent frames of audio do not outlast the {latent_motion_frames} motion frames"
            ))
            })?;
        let local = local.narrow(1, latent_motion_frames, kept)?.transpose(0, 1)?;
        let dim = local.dim(2)?;
        let padding = self.padding.broadcast_as((kept, 1, dim))?;
        let local = Tensor::cat(&[&local, &padding], 1)?.to_dtype(self.compute)?;
        // Global: one stream, through the final projection.
        let global = down(&self.conv1_global.forward(&x)?)?.squeeze(0)?;
        let global = global.narrow(0, latent_motion_frames, kept)?;
        let global = tpinfer_kernels::linear_bias(&global, &self.final_linear.0, &self.final_linear.1, false)?;
        Ok(AudioEmbedding { global, local })
    }
}

impl AudioInjector {
    fn load(w: &mut ShardLoader, i: usize, comm: &Arc<dyn Communicator>) -> Result<Self> {
        let p = format!("audio_injector.injector.{i}");
        let adain = format!("audio_injector.injector_adain_layers.{i}.linear");
        Ok(Self {
            adain: (w.take(&format!("{adain}.weight"))?, w.take(&format!("{adain}.bias"))?),
            q: ColumnParallelLinear::load(w, &format!("{p}.q"), true)?,
            kv: MergedColumnParallelLinear::load(w, &[&format!("{p}.k"), &format!("{p}.v")], true)?,
            o: RowParallelLinear::load(w, &format!("{p}.o"), true, comm.clone())?,
            norm_q: w.take(&format!("{p}.norm_q.weight"))?.to_dtype(DType::F32)?,
            norm_k: w.take(&format!("{p}.norm_k.weight"))?.to_dtype(DType::F32)?,
        })
    }

    /// The injection's residual for the clip's video tokens `video` `[video tokens, dim]`
    /// (frame by frame): AdaIN of each frame's tokens by its global audio embedding, then
    /// their cross-attention to its audio tokens. Takes `video` by value to let it go once
    /// the queries exist (the memory model in `memory.rs` counts on it).
    fn residual(
        &self,
        video: Tensor,
        audio: &AudioEmbedding,
        c: &WanConfig,
        comm: &dyn Communicator,
    ) -> Result<Tensor> {
        let (frames, per_frame, dim) = audio.local.dims3()?;
        let video_tokens = video.dim(0)?;
        if video_tokens == 0 || !video_tokens.is_multiple_of(frames) {
            return Err(Error::Shard(format!(
                "S2V audio: {video_tokens} video tokens do not split into {frames} latent frames"
            )));
        }
        let hw = video_tokens / frames;
        // AdaIN (`AdaLayerNorm`, chunk_dim 1): shift, then scale, from silu(global); one fused
        // LayerNorm per frame straight into its queries, so that no stream-sized temporary
        // is made besides them.
        let global = audio.global.silu()?.to_dtype(audio.local.dtype())?;
        let emb = tpinfer_kernels::linear_bias(&global, &self.adain.0, &self.adain.1, false)?.to_dtype(DType::F32)?;
        let q = {
            let parts = (0..frames)
                .map(|f| {
                    let (shift, scale) = (emb.get(f)?.narrow(0, 0, dim)?, emb.get(f)?.narrow(0, dim, dim)?);
                    let frame = video.narrow(0, f * hw, hw)?;
                    let modulated = modulated_norm(&frame, &shift, &scale, ADAIN_NORM_EPS, audio.local.dtype())?;
                    self.q.forward(&modulated)
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)?
        };
        drop(video);
        let merged = self
            .kv
            .forward_merged(&audio.local.reshape((frames * per_frame, dim))?)?;
        let kv = self.kv.split(&merged)?;
        let (q, k) = full_width_rms_norm(q, &kv[0], &self.norm_q, &self.norm_k, None, c, comm)?;
        let hd = c.attention_head_dim;
        let heads = q.dim(1)? / hd;
        // Each latent frame's tokens attend that frame's audio tokens only.
        let parts = (0..frames)
            .map(|f| {
                let q = q.narrow(0, f * hw, hw)?.reshape((hw, heads, hd))?;
                let k = k.narrow(0, f * per_frame, per_frame)?.reshape((per_frame, heads, hd))?;
                let v = kv[1]
                    .narrow(0, f * per_frame, per_frame)?
                    .reshape((per_frame, heads, hd))?;
                Ok(
                    full_attention(&q, &k, &v, 1.0 / (hd as f64).sqrt(), SCORE_BUFFER_BYTES)?
                        .reshape((hw, heads * hd))?,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        drop((q, k, kv, merged));
        let out = Tensor::cat(&parts, 0)?;
        drop(parts);
        self.o.forward(&out)
    }
}

impl S2vAudio {
    /// Loads the audio modules' tensors this rank declared ([`crate::WanShard::s2v_audio_decls`]).
    pub fn load(w: &mut ShardLoader, s2v: &S2vModules, comm: &Arc<dyn Communicator>) -> Result<Self> {
        Ok(Self {
            encoder: CausalAudioEncoder::load(w, s2v)?,
            injectors: (0..s2v.audio_inject_layers.len())
                .map(|i| AudioInjector::load(w, i, comm))
                .collect::<Result<Vec<_>>>()?,
        })
    }

    /// One clip's audio embedding from its per-frame wav2vec2 features `[frames, states,
    /// audio dim]` (`tpinfer_wav2vec2::per_video_frame`'s rows of the clip), on `device`:
    /// S2V's `forward` prepends `motion_frames` copies of the first frame and drops the
    /// `latent_motion_frames` latent frames they make.
    pub fn encode(
        &self,
        features: &Tensor,
        motion_frames: usize,
        latent_motion_frames: usize,
        device: &Device,
    ) -> Result<AudioEmbedding> {
        let (_, states, _) = features.dims3()?;
        if states != self.encoder.layer_weights.dim(1)? {
            return Err(Error::Shard(format!(
                "S2V audio: the features hold {states} wav2vec2 states; the encoder weighs {}",
                self.encoder.layer_weights.dim(1)?
            )));
        }
        self.encoder
            .forward(&features.to_device(device)?, motion_frames, latent_motion_frames)
    }

    /// What the `injector`-th audio injection (`after_transformer_block`) adds to the clip's
    /// video tokens `video` `[video tokens, dim]`: every rank's rows of them, in order.
    pub fn injection(
        &self,
        injector: usize,
        video: Tensor,
        audio: &AudioEmbedding,
        c: &WanConfig,
        comm: &dyn Communicator,
    ) -> Result<Tensor> {
        let injection = self
            .injectors
            .get(injector)
            .ok_or_else(|| Error::Shard(format!("S2V audio: injection {injector} of {}", self.injectors.len())))?;
        injection.residual(video, audio, c, comm)
    }
}
