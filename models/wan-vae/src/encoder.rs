//! The Wan2.1 VAE's encoder (diffusers' `WanEncoder3d` and `quant_conv`): pixels to the
//! normalised latents the DiT reads, as Wan2.2-S2V encodes its reference image and the motion
//! frames of each clip. It is made of the decoder's layers (`conv`, `blocks`) on whole frames,
//! plus the downsamplers: a 3×3 convolution of stride 2 after one zero row and column below
//! and right, and, where time halves, a causal convolution over three frames of stride 2.
//!
//! Frames go through as diffusers' `_encode` sends them: the first alone, then four at a time,
//! each causal convolution continuing from the frames its cache holds; every four frames
//! make one latent frame. Every rank holds the whole encoder and encodes whole frames: the
//! encoder runs on a clip's few frames, not on the video.

use candle_core::{DType, Device, Tensor};
use tpinfer_kernels::{cat_frames, conv_filter, conv_frames_bias, conv_path};
use tpinfer_layers::{Error, Result};
use tpinfer_weights::{ShardLoader, ShardSpec, WeightDecl, WeightStore};

use crate::blocks::{FrameAttention, Head, ResBlock};
use crate::conv::{Band, Conv, ConvShape, FrameCache, Slots};
use crate::rows::Rows;
use crate::WanVaeConfig;

const ENCODER: &str = "encoder";
const QUANT: &str = "quant_conv";

/// Pixel frames per latent frame after the first.
const FRAMES_PER_CHUNK: usize = 4;

/// A step of the encoder's path from `conv_in` to the middle block.
enum Step {
    Res(ResBlock),
    Down(Downsample),
}

/// The encoder's layers, as the checkpoint names them, with their widths.
enum StepShape {
    Res { inp: usize, out: usize },
    Down { c: usize, temporal: bool },
}

/// Halves height and width (and, `time`, the frames after the first): diffusers' 3×3
/// convolution of stride 2 after one zero row below and one column right, computed as the
/// same convolution at stride 1 with a zero border all round (the decoder's convolution, on
/// cuDNN where it runs), of which the outputs at odd rows and columns are the strided ones:
/// output (i, j) of stride 2 reads rows 2i..2i+2 and columns 2j..2j+2, as output (2i+1, 2j+1)
/// of stride 1 does. The three downsamplers do a few per cent of the encoder's work, so the
/// outputs computed and dropped cost little, and memory is that of a modelled convolution.
struct Downsample {
    conv: Conv,
    time: Option<TimeDown>,
}

/// A convolution over three frames with stride 2 and no padding, reading the last frame of
/// the chunk before (its cache slot) ahead of the chunk's; on the first chunk it only keeps
/// that frame, as diffusers' `WanResample` does.
struct TimeDown {
    filter: Tensor,
    shape: [usize; 5],
    bias: Tensor,
    slot: usize,
}

/// One rank's VAE encoder.
pub struct WanVaeEncoder {
    conv_in: Conv,
    path: Vec<Step>,
    middle: [ResBlock; 2],
    attention: FrameAttention,
    head: Head,
    quant: Conv,
    slots: Slots,
    config: WanVaeConfig,
    dtype: DType,
    device: Device,
    bytes_loaded: usize,
}

/// The path's steps with their checkpoint prefixes (`encoder.down_blocks.{i}`, numbered in
/// order across levels, as diffusers' flat list is).
fn named_path(c: &WanVaeConfig) -> Vec<(String, StepShape)> {
    let widths: Vec<usize> = std::iter::once(1)
        .chain(c.dim_mult.iter().copied())
        .map(|m| c.encoder_base_dim * m)
        .collect();
    let levels = c.dim_mult.len();
    let mut steps = Vec::new();
    for level in 0..levels {
        let mut inp = widths[level];
        let out = widths[level + 1];
        for _ in 0..c.num_res_blocks {
            steps.push(StepShape::Res { inp, out });
            inp = out;
        }
        if level + 1 < levels {
            let temporal = c.temperal_downsample.get(level).copied().unwrap_or(false);
            steps.push(StepShape::Down { c: out, temporal });
        }
    }
    steps
        .into_iter()
        .enumerate()
        .map(|(i, s)| (format!("{ENCODER}.down_blocks.{i}"), s))
        .collect()
}

/// The encoder's middle width and the latent channels it writes (mean and log-variance).
fn middle_and_moments(c: &WanVaeConfig) -> (usize, usize) {
    let last = c.dim_mult.last().copied().unwrap_or(1);
    (c.encoder_base_dim * last, 2 * c.z_dim)
}

/// Every tensor the encoder reads, in diffusers' names, with its full shape.
pub fn encoder_weight_decls(c: &WanVaeConfig) -> Vec<WeightDecl> {
    let (middle, moments) = middle_and_moments(c);
    let mut decls = Vec::new();
    Conv::decls(
        &format!("{ENCODER}.conv_in"),
        ConvShape::causal(3, c.encoder_base_dim, 3, 3),
        &mut decls,
    );
    for (prefix, step) in named_path(c) {
        match step {
            StepShape::Res { inp, out } => ResBlock::decls(&prefix, inp, out, &mut decls),
            StepShape::Down { c, temporal } => {
                decls.push(WeightDecl::new(
                    format!("{prefix}.resample.1.weight"),
                    &[c, c, 3, 3],
                    ShardSpec::Replicated,
                ));
                decls.push(WeightDecl::new(
                    format!("{prefix}.resample.1.bias"),
                    &[c],
                    ShardSpec::Replicated,
                ));
                if temporal {
                    Conv::decls(
                        &format!("{prefix}.time_conv"),
                        ConvShape::causal(c, c, 3, 1),
                        &mut decls,
                    );
                }
            }
        }
    }
    for i in 0..2 {
        ResBlock::decls(&format!("{ENCODER}.mid_block.resnets.{i}"), middle, middle, &mut decls);
    }
    FrameAttention::decls(&format!("{ENCODER}.mid_block.attentions.0"), middle, &mut decls);
    Head::decls(ENCODER, middle, moments, &mut decls);
    Conv::decls(QUANT, ConvShape::causal(moments, moments, 1, 1), &mut decls);
    decls
}

impl Downsample {
    fn load(w: &mut ShardLoader, prefix: &str, c: usize, temporal: bool, slots: &mut Slots) -> Result<Self> {
        let time = match temporal {
            true => {
                let weight = w.take(&format!("{prefix}.time_conv.weight"))?;
                Some(TimeDown {
                    filter: conv_filter(&weight, conv_path(weight.device()))?,
                    shape: [c, 3, 1, 1, c],
                    bias: w.take(&format!("{prefix}.time_conv.bias"))?,
                    slot: slots.next(),
                })
            }
            false => None,
        };
        Ok(Self {
            conv: Conv::load(w, &format!("{prefix}.resample.1"), ConvShape::flat(c, c, 3), slots)?,
            time,
        })
    }

    fn forward(&self, x: &Band, cache: &mut FrameCache) -> Result<Band> {
        let (frames, height, width, c) = x.x.dims4()?;
        if !height.is_multiple_of(2) || !width.is_multiple_of(2) {
            return Err(Error::Shard(format!(
                "VAE encoder: a downsampler halves {height} × {width}; both must be even"
            )));
        }
        let full = self.conv.forward(x, x.rows, cache, None)?.x;
        let y = full
            .reshape((frames, height / 2, 2, width / 2, 2, c))?
            .narrow(2, 1, 1)?
            .narrow(4, 1, 1)?
            .reshape((frames, height / 2, width / 2, c))?
            .contiguous()?;
        drop(full);
        let rows = Rows::all(y.dim(1)?);
        let y = match &self.time {
            Some(time) => time.forward(y, cache)?,
            None => y,
        };
        Ok(Band { x: y, rows })
    }
}

impl TimeDown {
    fn forward(&self, x: Tensor, cache: &mut FrameCache) -> Result<Tensor> {
        let frames = x.dim(0)?;
        let last = x.narrow(0, frames - 1, 1)?.force_contiguous()?;
        let held = cache
            .get_mut(self.slot)
            .ok_or_else(|| Error::Shard(format!("VAE encoder: no cache slot {}", self.slot)))?;
        let Some(before) = held.replace(last) else {
            // The first chunk: its frame passes as it is.
            return Ok(x);
        };
        let input = cat_frames(0, &[&before, &x])?;
        drop(x);
        let y = conv_frames_bias(&input, &self.filter, self.shape, &self.bias, None, [0, 0])?;
        // Stride 2: the outputs at every other frame.
        let kept = (0..y.dim(0)?)
            .step_by(2)
            .map(|t| y.narrow(0, t, 1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&kept, 0)?)
    }
}

impl WanVaeEncoder {
    /// Loads the encoder's weights from `store` onto `device`, in `dtype`.
    pub fn load(config: &WanVaeConfig, store: &dyn WeightStore, dtype: DType, device: &Device) -> Result<Self> {
        let (middle, moments) = middle_and_moments(config);
        let decls = encoder_weight_decls(config);
        let mut w = ShardLoader::new(store, &decls, dtype, device);
        let mut slots = Slots::default();
        let conv_in = Conv::load(
            &mut w,
            &format!("{ENCODER}.conv_in"),
            ConvShape::causal(3, config.encoder_base_dim, 3, 3),
            &mut slots,
        )?;
        let path = named_path(config)
            .into_iter()
            .map(|(prefix, step)| {
                Ok(match step {
                    StepShape::Res { inp, out } => Step::Res(ResBlock::load(&mut w, &prefix, inp, out, &mut slots)?),
                    StepShape::Down { c, temporal } => {
                        Step::Down(Downsample::load(&mut w, &prefix, c, temporal, &mut slots)?)
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let res = |i: usize, w: &mut ShardLoader, slots: &mut Slots| {
            ResBlock::load(w, &format!("{ENCODER}.mid_block.resnets.{i}"), middle, middle, slots)
        };
        let first = res(0, &mut w, &mut slots)?;
        let attention = FrameAttention::load(&mut w, &format!("{ENCODER}.mid_block.attentions.0"), middle, &mut slots)?;
        let second = res(1, &mut w, &mut slots)?;
        let head = Head::load(&mut w, ENCODER, middle, moments, &mut slots)?;
        let quant = Conv::load(&mut w, QUANT, ConvShape::causal(moments, moments, 1, 1), &mut slots)?;
        Ok(Self {
            conv_in,
            path,
            middle: [first, second],
            attention,
            head,
            quant,
            slots,
            config: config.clone(),
            dtype,
            device: device.clone(),
            bytes_loaded: w.bytes_read(),
        })
    }

    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    /// Encodes `pixels` `[3, frames, height, width]` in [−1, 1] (any device and float type;
    /// frames 1 + 4k, height and width multiples of 8) to the posterior's mean, normalised
    /// as the DiT reads latents, `(z − mean) / std`: `[z, 1 + k, height / 8, width / 8]`, f32
    /// on this rank's device.
    pub fn encode(&self, pixels: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let (channels, frames, height, width) = pixels.dims4()?;
        let factor = c.spatial_factor();
        if channels != 3
            || frames == 0
            || !(frames - 1).is_multiple_of(FRAMES_PER_CHUNK)
            || height == 0
            || width == 0
            || !height.is_multiple_of(factor)
            || !width.is_multiple_of(factor)
        {
            return Err(Error::Shard(format!(
                "VAE encoder: pixels {:?}; it encodes [3, 1 + 4k frames, height, width] with height and width multiples of {factor}",
                pixels.dims()
            )));
        }
        // Channels last, as the layers keep them.
        let x = pixels
            .to_device(&self.device)?
            .to_dtype(self.dtype)?
            .permute((1, 2, 3, 0))?
            .contiguous()?;
        let mut cache = self.slots.cache();
        let chunks =
            std::iter::once((0, 1)).chain((1..frames).step_by(FRAMES_PER_CHUNK).map(|f| (f, FRAMES_PER_CHUNK)));
        let latents = chunks
            .map(|(first, n)| self.encode_chunk(&x.narrow(0, first, n)?, &mut cache))
            .collect::<Result<Vec<_>>>()?;
        drop((x, cache));
        let moments = Tensor::cat(&latents, 0)?;
        let z = c.z_dim;
        let per_channel = |values: &[f32]| Tensor::from_slice(values, z, &self.device);
        // The posterior's mode is its mean, the first z channels.
        let mean = moments
            .narrow(3, 0, z)?
            .to_dtype(DType::F32)?
            .broadcast_sub(&per_channel(&c.latents_mean)?)?
            .broadcast_div(&per_channel(&c.latents_std)?)?;
        Ok(mean.permute((3, 0, 1, 2))?.contiguous()?)
    }

    /// One chunk of frames `[frames, height, width, 3]` to its latent frame's moments `[1,
    /// height / 8, width / 8, 2z]`, continuing from `cache`.
    fn encode_chunk(&self, frames: &Tensor, cache: &mut FrameCache) -> Result<Tensor> {
        let all = |x: &Tensor| -> Result<Rows> { Ok(Rows::all(x.dim(1)?)) };
        let rows = all(frames)?;
        let mut x = self.conv_in.forward(
            &Band {
                x: frames.contiguous()?,
                rows,
            },
            rows,
            cache,
            None,
        )?;
        for step in &self.path {
            x = match step {
                Step::Res(block) => block.forward(&x, x.rows, cache)?,
                Step::Down(down) => down.forward(&x, cache)?,
            };
        }
        let x = self.middle[0].forward(&x, x.rows, cache)?;
        let x = self.attention.forward(&x, cache)?;
        let x = self.middle[1].forward(&x, x.rows, cache)?;
        let x = self.head.forward(&x, x.rows, cache)?;
        let rows = all(&x.x)?;
        Ok(self.quant.forward(&x, rows, cache, None)?.x)
    }
}
