use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_kernels::{layer_norm, linear_bias, ColumnTable};
use tpinfer_layers::{full_attention, ColumnParallelLinear, MergedColumnParallelLinear, Result, RowParallelLinear};
use tpinfer_weights::{ShardLoader, WeightStore};

use crate::memory::SCORE_BUFFER_BYTES;
use crate::shard::{Names, PositionWeight};
use crate::{Wav2Vec2Config, Wav2Vec2Shard};

/// The frames the feature convolutions compute at once (10 s of audio at wav2vec2's 50 frames
/// a second): they see only their receptive field, so cutting the audio into overlapping
/// windows gives the same frames, with temporaries bounded whatever the audio's length.
pub const FEATURE_CHUNK_FRAMES: usize = 500;

/// The epsilon of the feature convolutions' LayerNorms: `nn.LayerNorm`'s default, which
/// transformers does not set from the config there.
const CONV_NORM_EPS: f64 = 1e-5;

/// S2V's processor (`Wav2Vec2FeatureExtractor`, `do_normalize`): its variance epsilon.
const NORMALIZE_EPS: f64 = 1e-7;

/// One rank's part of a wav2vec2 encoder.
pub struct Wav2Vec2Rank {
    config: Wav2Vec2Config,
    convs: Vec<FeatureConv>,
    projection_norm: Norm,
    projection: (Tensor, Tensor),
    /// The weight-normalized positional convolution's weight, multiplied out, and its bias.
    position: (Tensor, Tensor),
    layers: Vec<Layer>,
    final_norm: Norm,
    device: Device,
    dtype: DType,
    bytes_loaded: usize,
}

/// A LayerNorm's weight and bias, in f32 as the norm kernel takes them.
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

struct FeatureConv {
    weight: Tensor,
    /// `[1, channels, 1]`, added to every frame.
    bias: Option<Tensor>,
    stride: usize,
    norm: Norm,
}

struct Layer {
    attention_norm: Norm,
    qkv: MergedColumnParallelLinear,
    o: RowParallelLinear,
    ffn_norm: Norm,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
}

impl Norm {
    fn load(w: &mut ShardLoader, prefix: &str) -> Result<Self> {
        Ok(Self {
            weight: w.take(&format!("{prefix}.weight"))?.to_dtype(DType::F32)?,
            bias: w.take(&format!("{prefix}.bias"))?.to_dtype(DType::F32)?,
        })
    }

    fn forward(&self, x: &Tensor, eps: f64) -> Result<Tensor> {
        let (weight, bias) = (ColumnTable::every_row(&self.weight), ColumnTable::every_row(&self.bias));
        Ok(layer_norm(x, weight, bias, eps, x.dtype())?)
    }
}

impl Wav2Vec2Rank {
    /// Loads this rank's slices from `store` onto `device`, in `dtype`. `shard` must have been
    /// checked against the store's headers (`Wav2Vec2Model::check` does): the reads trust
    /// its shapes.
    pub fn load(
        config: &Wav2Vec2Config,
        store: &dyn WeightStore,
        shard: &Wav2Vec2Shard,
        comm: Arc<dyn Communicator>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let names = Names::detect(|name| store.info(name).is_some());
        let decls = shard.weight_decls(config, &names);
        let mut w = ShardLoader::new(store, &decls, dtype, device);
        let convs = config
            .conv
            .iter()
            .enumerate()
            .map(|(i, layer)| {
                Ok(FeatureConv {
                    weight: w.take(&format!("{}.weight", names.conv(i)))?,
                    bias: match config.conv_bias {
                        true => Some(w.take(&format!("{}.bias", names.conv(i)))?.reshape((1, layer.dim, 1))?),
                        false => None,
                    },
                    stride: layer.stride,
                    norm: Norm::load(&mut w, &names.conv_norm(i))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let projection_norm = Norm::load(&mut w, &names.projection_norm())?;
        let projection = (
            w.take(&format!("{}.weight", names.projection()))?,
            w.take(&format!("{}.bias", names.projection()))?,
        );
        let position = names.position();
        let position_weight = match names.position_weight {
            PositionWeight::Normed { magnitude, direction } => weight_normed(
                &w.take(&format!("{position}.{magnitude}"))?,
                &w.take(&format!("{position}.{direction}"))?,
            )?,
            PositionWeight::Plain => w.take(&format!("{position}.weight"))?,
        };
        let position = (position_weight, w.take(&format!("{position}.bias"))?);
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let n = names.layer(i);
                Ok(Layer {
                    attention_norm: Norm::load(&mut w, &n.attention_norm)?,
                    qkv: MergedColumnParallelLinear::load(&mut w, &[&n.q, &n.k, &n.v], true)?,
                    o: RowParallelLinear::load(&mut w, &n.o, true, comm.clone())?,
                    ffn_norm: Norm::load(&mut w, &n.ffn_norm)?,
                    up: ColumnParallelLinear::load(&mut w, &n.up, true)?,
                    down: RowParallelLinear::load(&mut w, &n.down, true, comm.clone())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = Norm::load(&mut w, &names.final_norm())?;
        Ok(Self {
            config: config.clone(),
            convs,
            projection_norm,
            projection,
            position,
            layers,
            final_norm,
            device: device.clone(),
            dtype,
            bytes_loaded: w.bytes_read(),
        })
    }

    /// The weight bytes this rank copied out of the checkpoint.
    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    pub fn config(&self) -> &Wav2Vec2Config {
        &self.config
    }

    /// Every hidden state of 16 kHz mono `samples`, as transformers' `output_hidden_states`
    /// gives them and S2V stacks them: `[layers + 1, frames, hidden]` in the compute dtype,
    /// the same on every rank — the input of each layer, then the last layer's output through
    /// the final norm. The samples are first normalized to zero mean and unit variance, as
    /// S2V's processor does.
    pub fn hidden_states(&self, samples: &[f32]) -> Result<Tensor> {
        self.hidden_states_in_chunks(samples, FEATURE_CHUNK_FRAMES)
    }

    /// [`Self::hidden_states`], the feature convolutions run `chunk_frames` frames at a time.
    pub fn hidden_states_in_chunks(&self, samples: &[f32], chunk_frames: usize) -> Result<Tensor> {
        let c = &self.config;
        let field = c.receptive_field();
        if samples.len() < field {
            return Err(tpinfer_layers::Error::Shard(format!(
                "wav2vec2: {} samples are shorter than one frame ({field} samples, {:.0} ms at 16 kHz); give longer audio",
                samples.len(),
                field as f64 / 16.0
            )));
        }
        if let Some(bad) = samples.iter().find(|s| !s.is_finite()) {
            return Err(tpinfer_layers::Error::Shard(format!(
                "wav2vec2: the audio holds a sample of {bad}; decode it again or give another file"
            )));
        }
        let normalized = normalize(samples);
        let features = self.features(&normalized, chunk_frames.max(1))?;
        drop(normalized);
        let normed = self.projection_norm.forward(&features, c.layer_norm_eps)?;
        drop(features);
        let projected = linear_bias(&normed, &self.projection.0, &self.projection.1, false)?;
        drop(normed);
        let mut x = (&projected + self.positional(&projected)?)?;
        drop(projected);
        // Each state is written into the stack as it is made, not gathered and copied.
        let frames = x.dim(0)?;
        let states = Tensor::zeros(
            (c.num_hidden_layers + 1, frames, c.hidden_size),
            self.dtype,
            &self.device,
        )?;
        for (i, layer) in self.layers.iter().enumerate() {
            states.slice_set(&x.unsqueeze(0)?, 0, i)?;
            x = layer.forward(&x, c)?;
        }
        let last = self.final_norm.forward(&x, c.layer_norm_eps)?;
        drop(x);
        states.slice_set(&last.unsqueeze(0)?, 0, c.num_hidden_layers)?;
        Ok(states)
    }

    /// The feature convolutions' output `[frames, last conv width]` for the normalized
    /// samples, `chunk` frames at a time.
    fn features(&self, samples: &[f32], chunk: usize) -> Result<Tensor> {
        let c = &self.config;
        let (frames, field) = (c.frames(samples.len()), c.receptive_field());
        let hop: usize = c.conv.iter().map(|l| l.stride).product();
        let mut parts = Vec::with_capacity(frames.div_ceil(chunk));
        for first in (0..frames).step_by(chunk) {
            let count = chunk.min(frames - first);
            let window = &samples[first * hop..(first + count - 1) * hop + field];
            parts.push(self.convolve(window)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The feature convolutions over `samples`: `[frames, last conv width]`.
    fn convolve(&self, samples: &[f32]) -> Result<Tensor> {
        // `[1, channels, length]`, as a view of the frames-as-rows output of the layer before.
        let mut x = Tensor::from_slice(samples, (1, 1, samples.len()), &self.device)?.to_dtype(self.dtype)?;
        for conv in &self.convs {
            let y = x.conv1d(&conv.weight, 0, conv.stride, 1, 1)?;
            drop(x);
            let y = match &conv.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            };
            // The norm is over channels: frames as rows.
            let rows = y.squeeze(0)?.t()?.contiguous()?;
            drop(y);
            let normed = conv.norm.forward(&rows, CONV_NORM_EPS)?;
            drop(rows);
            x = normed.gelu_erf()?.t()?.unsqueeze(0)?;
        }
        Ok(x.squeeze(0)?.t()?)
    }

    /// The positional embedding of `x` `[frames, hidden]`: the grouped convolution, padded by
    /// half its kernel each side and its last output dropped when the kernel is even, through
    /// GELU.
    fn positional(&self, x: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let (frames, k) = (x.dim(0)?, c.num_conv_pos_embeddings);
        let conv = x
            .t()?
            .unsqueeze(0)?
            .conv1d(&self.position.0, k / 2, 1, 1, c.num_conv_pos_embedding_groups)?;
        let biased = conv
            .narrow(2, 0, frames)?
            .broadcast_add(&self.position.1.reshape((1, (), 1))?)?;
        drop(conv);
        Ok(biased.squeeze(0)?.t()?.gelu_erf()?)
    }
}

impl Layer {
    /// A pre-norm layer: attention over this rank's heads, then the FFN over its columns,
    /// each summed over ranks by its row-parallel output.
    fn forward(&self, x: &Tensor, c: &Wav2Vec2Config) -> Result<Tensor> {
        let (frames, d) = (x.dim(0)?, c.head_dim());
        let h = self.attention_norm.forward(x, c.layer_norm_eps)?;
        let qkv = self.qkv.forward(&h);
        drop(h);
        let [q, k, v] = <[Tensor; 3]>::try_from(qkv?)
            .map_err(|_| tpinfer_layers::Error::Shard("wav2vec2: q/k/v did not split in three".into()))?;
        let heads = q.dim(1)? / d;
        let per_head = |t: &Tensor| t.reshape((frames, heads, d));
        let attention = full_attention(
            &per_head(&q)?,
            &per_head(&k)?,
            &per_head(&v)?,
            1.0 / (d as f64).sqrt(),
            SCORE_BUFFER_BYTES,
        )?;
        drop((q, k, v));
        let attended = self.o.forward(&attention.reshape((frames, heads * d))?);
        drop(attention);
        let x = (x + attended?)?;
        let h = self.ffn_norm.forward(&x, c.layer_norm_eps)?;
        let up = self.up.forward(&h);
        drop(h);
        let up = up?.gelu_erf()?;
        let down = self.down.forward(&up);
        drop(up);
        Ok((&x + down?)?)
    }
}

/// Weight normalization over the kernel axis (`weight_norm(conv, dim=2)`):
/// `magnitude` `[1, 1, k]` times `direction` `[out, in, k]` over the norm of its `[out, in]`
/// slice at each kernel position. In f32, then in `direction`'s dtype.
fn weight_normed(magnitude: &Tensor, direction: &Tensor) -> Result<Tensor> {
    let dtype = direction.dtype();
    let v = direction.to_dtype(DType::F32)?;
    let norm = v.sqr()?.sum_keepdim((0, 1))?.sqrt()?;
    let w = v.broadcast_mul(&magnitude.to_dtype(DType::F32)?.broadcast_div(&norm)?)?;
    Ok(w.to_dtype(dtype)?)
}

/// Zero mean and unit variance, in f64, as `Wav2Vec2FeatureExtractor` normalizes.
fn normalize(samples: &[f32]) -> Vec<f32> {
    let n = samples.len() as f64;
    let mean = samples.iter().map(|&s| s as f64).sum::<f64>() / n;
    let variance = samples.iter().map(|&s| (s as f64 - mean).powi(2)).sum::<f64>() / n;
    let scale = 1.0 / (variance + NORMALIZE_EPS).sqrt();
    samples.iter().map(|&s| ((s as f64 - mean) * scale) as f32).collect()
}
