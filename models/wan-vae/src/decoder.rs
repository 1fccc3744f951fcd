//! The Wan2.1 VAE's decoder (diffusers' `WanDecoder3d` with `post_quant_conv` before it),
//! decoding one latent frame at a time over a window of rows.
//!
//! It runs in two parts. The *middle* (`conv_in`, the middle block with its attention) works
//! at latent resolution on whole frames, since the attention reads every pixel; it is cheap
//! and every rank runs it, keeping each frame's rows its band needs. The *path* (the up
//! blocks and the output layers) does nearly all the work at 2× to 8× resolution; it runs one
//! tile of the band's rows at a time, each layer on exactly the rows the next one reads.

use candle_core::{DType, Device, Tensor};
use tpinfer_kernels::PoolHold;
use tpinfer_layers::Result;
use tpinfer_weights::{ShardLoader, WeightDecl};

use crate::blocks::{FrameAttention, Head, ResBlock, Upsample};
use crate::conv::{clamp_pixels, Band, Conv, ConvShape, FrameCache, Slots};
use crate::layout::{Layout, PathStep};
use crate::memory::Tiling;
use crate::rows::{tiles, Rows};
use crate::WanVaeConfig;

/// One layer of the path, loaded.
enum Step {
    Res(ResBlock),
    Up(Upsample),
    Out(Head),
}

impl Step {
    fn forward(&self, x: &Band, out: Rows, first: bool, cache: &mut FrameCache) -> Result<Band> {
        match self {
            Self::Res(block) => block.forward(x, out, cache),
            Self::Up(up) => up.forward(x, out, first, cache),
            Self::Out(head) => head.forward(x, out, cache),
        }
    }
}

const POST_QUANT: &str = "post_quant_conv";
const CONV_IN: &str = "decoder.conv_in";
const MIDDLE: &str = "decoder.mid_block";
const UP: &str = "decoder.up_blocks";
const DECODER: &str = "decoder";

/// The decoder of one rank: every weight (a VAE is small; ranks split its rows, not its
/// weights).
pub struct Decoder {
    post_quant: Conv,
    conv_in: Conv,
    middle: [ResBlock; 2],
    attention: FrameAttention,
    middle_slots: Slots,
    path: Vec<Step>,
    path_slots: Slots,
    layout: Layout,
    config: WanVaeConfig,
}

/// Every tensor the decoder reads, in diffusers' names, with its full shape.
pub fn weight_decls(c: &WanVaeConfig) -> Vec<WeightDecl> {
    let l = Layout::of(c);
    let mut decls = Vec::new();
    Conv::decls(POST_QUANT, ConvShape::causal(l.z, l.z, 1, 1), &mut decls);
    Conv::decls(CONV_IN, ConvShape::causal(l.z, l.middle, 3, 3), &mut decls);
    for i in 0..2 {
        ResBlock::decls(&format!("{MIDDLE}.resnets.{i}"), l.middle, l.middle, &mut decls);
    }
    FrameAttention::decls(&format!("{MIDDLE}.attentions.0"), l.middle, &mut decls);
    for (prefix, step) in named_path(&l) {
        match step {
            PathStep::Res { inp, out } => ResBlock::decls(&prefix, inp, out, &mut decls),
            PathStep::Up { c, temporal } => Upsample::decls(&prefix, c, temporal, &mut decls),
            PathStep::Out { c, out } => Head::decls(&prefix, c, out, &mut decls),
        }
    }
    decls
}

/// The path's steps with their checkpoint prefixes: `decoder.up_blocks.{i}.resnets.{j}`,
/// `decoder.up_blocks.{i}.upsamplers.0` (which ends block i), then `decoder`'s own output
/// layers.
fn named_path(l: &Layout) -> Vec<(String, PathStep)> {
    let (mut block, mut res) = (0, 0);
    l.path
        .iter()
        .map(|&step| {
            let prefix = match step {
                PathStep::Res { .. } => {
                    res += 1;
                    format!("{UP}.{block}.resnets.{}", res - 1)
                }
                PathStep::Up { .. } => {
                    let prefix = format!("{UP}.{block}.upsamplers.0");
                    (block, res) = (block + 1, 0);
                    prefix
                }
                PathStep::Out { .. } => DECODER.to_string(),
            };
            (prefix, step)
        })
        .collect()
}

/// Whether a checkpoint tensor belongs to the encoder half, which decoding never reads.
pub fn is_encoder_tensor(name: &str) -> bool {
    name.starts_with("encoder.") || name.starts_with("quant_conv.")
}

impl Decoder {
    /// Takes every declared tensor from `w`.
    pub fn load(c: &WanVaeConfig, w: &mut ShardLoader) -> Result<Self> {
        let l = Layout::of(c);
        let (mut middle_slots, mut path_slots) = (Slots::default(), Slots::default());
        let post_quant = Conv::load(w, POST_QUANT, ConvShape::causal(l.z, l.z, 1, 1), &mut middle_slots)?;
        let conv_in = Conv::load(w, CONV_IN, ConvShape::causal(l.z, l.middle, 3, 3), &mut middle_slots)?;
        let res = |i: usize, w: &mut ShardLoader, slots: &mut Slots| {
            ResBlock::load(w, &format!("{MIDDLE}.resnets.{i}"), l.middle, l.middle, slots)
        };
        let first = res(0, w, &mut middle_slots)?;
        let attention = FrameAttention::load(w, &format!("{MIDDLE}.attentions.0"), l.middle, &mut middle_slots)?;
        let second = res(1, w, &mut middle_slots)?;
        let path = named_path(&l)
            .into_iter()
            .map(|(prefix, step)| {
                Ok(match step {
                    PathStep::Res { inp, out } => Step::Res(ResBlock::load(w, &prefix, inp, out, &mut path_slots)?),
                    PathStep::Up { c, temporal } => Step::Up(Upsample::load(w, &prefix, c, temporal, &mut path_slots)?),
                    PathStep::Out { c, out } => Step::Out(Head::load(w, &prefix, c, out, &mut path_slots)?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            post_quant,
            conv_in,
            middle: [first, second],
            attention,
            middle_slots,
            path,
            path_slots,
            layout: l,
            config: c.clone(),
        })
    }

    /// Decodes normalised latents `[z, latent frames, h, w]` (the DiT's, f32, on any device)
    /// to the pixels of rows `band` of every frame, `[frames, channels, band rows, width]` in
    /// [−1, 1], f32 on the CPU. The rows are decoded `tiling.rows` at a time (at least one
    /// latent row's worth), each tile streaming every latent frame, whose frames run through
    /// the layers after the last temporal upsampling `tiling.frames` at a time; `on_chunk`
    /// hears each (tile, latent frame) done, out of how many.
    pub fn decode(
        &self,
        latents: &Tensor,
        band: Rows,
        tiling: Tiling,
        dtype: DType,
        device: &Device,
        on_chunk: &mut dyn FnMut(usize, usize),
    ) -> Result<Tensor> {
        let c = &self.config;
        let (z, latent_frames, h, _) = latents.dims4()?;
        let factor = c.spatial_factor();
        if z != c.z_dim || latent_frames == 0 || band.height != h * factor || band.is_empty() {
            return Err(tpinfer_layers::Error::Shard(format!(
                "VAE: latents {:?} with rows {:?} of {}: expected [{}, frames, h, w] and rows of h × {factor}",
                latents.dims(),
                band.range(),
                band.height,
                c.z_dim
            )));
        }
        let per_channel = |values: &[f32]| Tensor::from_slice(values, z, device);
        // [frames, h, w, z], as the DiT's latents were before normalising: z · std + mean.
        let x = latents
            .to_device(device)?
            .to_dtype(DType::F32)?
            .permute((1, 2, 3, 0))?
            .broadcast_mul(&per_channel(&c.latents_std)?)?
            .broadcast_add(&per_channel(&c.latents_mean)?)?
            .to_dtype(dtype)?;
        let latent_rows = Rows::all(h);
        let mut cache = self.middle_slots.cache();
        let x = self
            .post_quant
            .forward(&Band { x, rows: latent_rows }, latent_rows, &mut cache, None)?;
        let (middle_rows, _) = self.layout.windows(band);
        let middles = (0..latent_frames)
            .map(|f| {
                let frame = Band {
                    x: x.x.narrow(0, f, 1)?,
                    rows: latent_rows,
                };
                let y = self.middle(&frame, &mut cache)?.narrowed(middle_rows)?;
                // A copy of the window alone: a view would keep the whole frame alive.
                Ok(Band {
                    x: y.x.force_contiguous()?,
                    rows: middle_rows,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // The middle's frame caches and its input are done with: the path holds its own.
        drop((x, cache));
        let tiles = tiles(band, tiling.rows.max(factor));
        let (split, at_once) = (self.layout.full_rate_start(), tiling.frames.max(1));
        let chunks = tiles.len() * latent_frames;
        // The band's pixels, each (tile, latent frame) copied into place as it is decoded:
        // joining them as tensors took longer than a tenth of the decode.
        let width = latents.dim(3)? * factor;
        let pixels = Pixels::new(c.frames(latent_frames), band, width);
        // Frees queued on the stream become reusable blocks once the device has run them: a
        // host far ahead of the device makes the pool map new memory for each step's
        // temporaries (1.4 GiB beyond the live tensors at 480p, 0.5 GiB with a
        // synchronisation after each step, which the pool then keeps rather than mapping its
        // blocks again: benches/RESULTS.md).
        let _hold = PoolHold::new(device);
        let mut decode = |write: &mut dyn FnMut(Chunk) -> Result<()>| -> Result<()> {
            for (t, &tile) in tiles.iter().enumerate() {
                let (rows, outs) = self.layout.windows(tile);
                let mut cache = self.path_slots.cache();
                for (f, middle) in middles.iter().enumerate() {
                    let mut x = middle.narrowed(rows)?;
                    for (step, &out) in self.path[..split].iter().zip(&outs) {
                        x = step.forward(&x, out, f == 0, &mut cache)?;
                        device.synchronize()?;
                    }
                    let frames = x.x.dim(0)?;
                    for first in (0..frames).step_by(at_once) {
                        let mut y = Band {
                            x: x.x.narrow(0, first, at_once.min(frames - first))?,
                            rows: x.rows,
                        };
                        for (step, &out) in self.path[split..].iter().zip(&outs[split..]) {
                            y = step.forward(&y, out, f == 0, &mut cache)?;
                            device.synchronize()?;
                        }
                        let pixels = clamp_pixels(&y.x)?.to_device(&Device::Cpu)?;
                        drop(y);
                        write(Chunk {
                            first: c.frames(f) + first,
                            tile,
                            pixels,
                        })?;
                    }
                    drop(x);
                    on_chunk(t * latent_frames + f + 1, chunks);
                }
            }
            Ok(())
        };
        let pixels = match device.is_cuda() {
            // The host copies each chunk into place on a thread of its own while the device
            // decodes the next: done in turn, the copies left the device idle for a sixth of
            // the decode.
            true => std::thread::scope(|scope| {
                let (send, receive) = std::sync::mpsc::sync_channel::<Chunk>(2);
                let writer = scope.spawn(move || {
                    let mut pixels = pixels;
                    receive.into_iter().try_for_each(|chunk| pixels.write(&chunk))?;
                    Ok(pixels)
                });
                let decoded = decode(&mut |chunk| {
                    send.send(chunk)
                        .map_err(|_| tpinfer_layers::Error::Shard("VAE: the pixel writer has stopped".into()))
                });
                drop(send);
                let written = writer
                    .join()
                    .unwrap_or_else(|_| Err(tpinfer_layers::Error::Shard("VAE: the pixel writer panicked".into())));
                // The writer's own error explains a decode that found it gone.
                written.and_then(|pixels| decoded.map(|()| pixels))
            }),
            false => {
                let mut pixels = pixels;
                decode(&mut |chunk| pixels.write(&chunk)).map(|()| pixels)
            }
        }?;
        pixels.into_tensor()
    }

    /// `conv_in` and the middle block on one whole latent frame.
    fn middle(&self, frame: &Band, cache: &mut FrameCache) -> Result<Band> {
        let all = frame.rows;
        let x = self.conv_in.forward(frame, all, cache, None)?;
        let x = self.middle[0].forward(&x, all, cache)?;
        let x = self.attention.forward(&x, cache)?;
        self.middle[1].forward(&x, all, cache)
    }
}

/// Decoded pixels `[frames, 3, tile rows, width]` on the host, in [−1, 1], from frame
/// `first`.
struct Chunk {
    first: usize,
    tile: Rows,
    pixels: Tensor,
}

/// A band of decoded frames on the host, `[frames, 3, band rows, width]` f32, filled chunk by
/// chunk.
struct Pixels {
    values: Vec<f32>,
    frames: usize,
    band: Rows,
    width: usize,
}

impl Pixels {
    fn new(frames: usize, band: Rows, width: usize) -> Self {
        Self {
            values: vec![0f32; frames * 3 * band.len() * width],
            frames,
            band,
            width,
        }
    }

    /// Copies a chunk's pixels (f32 on the CPU) into place.
    fn write(&mut self, chunk: &Chunk) -> Result<()> {
        let &Chunk {
            first,
            tile,
            ref pixels,
        } = chunk;
        let (count, channels, rows, width) = pixels.dims4()?;
        if first + count > self.frames || channels != 3 || rows != tile.len() || width != self.width {
            return Err(tpinfer_layers::Error::Shard(format!(
                "VAE: decoded chunk {:?} from frame {first} does not fit {} frames of {} × {width}",
                pixels.dims(),
                self.frames,
                self.band.len()
            )));
        }
        let pixels = pixels.contiguous()?;
        let (storage, layout) = pixels.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(values)) = &*storage else {
            return Err(tpinfer_layers::Error::Shard(
                "VAE: decoded pixels are not f32 on the CPU".into(),
            ));
        };
        let values = &values[layout.start_offset()..];
        let run = rows * width;
        let skip = (tile.start - self.band.start) * width;
        for (plane, source) in values.chunks_exact(run).take(count * channels).enumerate() {
            let at = (first * channels + plane) * self.band.len() * width + skip;
            self.values[at..at + run].copy_from_slice(source);
        }
        Ok(())
    }

    fn into_tensor(self) -> Result<Tensor> {
        let shape = (self.frames, 3, self.band.len(), self.width);
        Ok(Tensor::from_vec(self.values, shape, &Device::Cpu)?)
    }
}
