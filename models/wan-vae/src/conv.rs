//! The decoder's convolutions and norms on a window of rows, channels last (`[frames, rows,
//! width, channels]`), the layout cuDNN's tensor-core convolutions read and write, so that no
//! layer transposes.
//!
//! A causal 3-D convolution reads its three time taps (the frame two back, one back, and now)
//! from the frames themselves, padding the frame's edges as it reads where it can. Its frame
//! cache holds the last two frames it read, so a video decodes one latent frame at a time, as
//! diffusers' does, with the zero frames of causal padding before the first.

use candle_core::{DType, Tensor};
use tpinfer_kernels::{cat_frames, channel_rms_norm, conv_filter, conv_frames_bias, conv_path, write_frames};
use tpinfer_layers::Result;
use tpinfer_weights::{ShardLoader, ShardSpec, WeightDecl};

use crate::rows::Rows;
/// Each causal convolution's last frames read, by slot.
pub(crate) type FrameCache = Vec<Option<Tensor>>;

/// Activations of some rows of a frame.
#[derive(Clone)]
pub(crate) struct Band {
    /// `[frames, rows, width, channels]`.
    pub x: Tensor,
    pub rows: Rows,
}

impl Band {
    /// The rows `rows` of this band, which must hold them.
    pub fn narrowed(&self, rows: Rows) -> Result<Band> {
        if !rows.within(&self.rows) {
            return Err(tpinfer_layers::Error::Shard(format!(
                "VAE window: rows {:?} of {} are not within the band {:?}",
                rows.range(),
                rows.height,
                self.rows.range()
            )));
        }
        Ok(Band {
            x: self.x.narrow(1, rows.start - self.rows.start, rows.len())?,
            rows,
        })
    }

    /// This band's activations through `f`, on the same rows.
    pub fn map(&self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Band> {
        Ok(Band {
            x: f(&self.x)?,
            rows: self.rows,
        })
    }
}

/// Hands out frame-cache slots as the causal convolutions are loaded.
#[derive(Default)]
pub(crate) struct Slots(usize);

impl Slots {
    pub fn next(&mut self) -> usize {
        self.0 += 1;
        self.0 - 1
    }

    /// A cache with an empty slot for each convolution handed one.
    pub fn cache(&self) -> FrameCache {
        vec![None; self.0]
    }
}

/// A convolution over `taps` frames (1, or 3 causal) and `k`×`k` pixels (k = 1 or 3).
pub(crate) struct Conv {
    /// [`conv_filter`]'s, for the device's path.
    filter: Tensor,
    /// `[out, taps, k, k, in]`.
    shape: [usize; 5],
    /// `[out]`.
    bias: Tensor,
    slot: Option<usize>,
}

/// A convolution's shape: `[out, in, taps, k, k]` in the checkpoint, or `[out, in, k, k]`
/// for a 2-D one (`taps` 0).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvShape {
    pub out: usize,
    pub inp: usize,
    pub taps: usize,
    pub k: usize,
}

impl ConvShape {
    pub fn causal(inp: usize, out: usize, taps: usize, k: usize) -> Self {
        Self { out, inp, taps, k }
    }

    pub fn flat(inp: usize, out: usize, k: usize) -> Self {
        Self { out, inp, taps: 0, k }
    }

    fn weight(&self) -> Vec<usize> {
        match self.taps {
            0 => vec![self.out, self.inp, self.k, self.k],
            t => vec![self.out, self.inp, t, self.k, self.k],
        }
    }
}

impl Conv {
    pub fn decls(prefix: &str, shape: ConvShape, out: &mut Vec<WeightDecl>) {
        out.push(WeightDecl::new(
            format!("{prefix}.weight"),
            &shape.weight(),
            ShardSpec::Replicated,
        ));
        out.push(WeightDecl::new(
            format!("{prefix}.bias"),
            &[shape.out],
            ShardSpec::Replicated,
        ));
    }

    pub fn load(w: &mut ShardLoader, prefix: &str, shape: ConvShape, slots: &mut Slots) -> Result<Self> {
        let weight = w.take(&format!("{prefix}.weight"))?;
        let taps = shape.taps.max(1);
        let filter = conv_filter(&weight, conv_path(weight.device()))?;
        Ok(Self {
            filter,
            shape: [shape.out, taps, shape.k, shape.k, shape.inp],
            bias: w.take(&format!("{prefix}.bias"))?,
            slot: (taps > 1).then(|| slots.next()),
        })
    }

    /// Writes `out` from `x`, which holds the rows it reads, plus `residual` (`out`'s rows of
    /// this convolution's output shape) where given; a causal one continues from the frames
    /// its slot of `cache` holds, and leaves the last two it read there.
    pub fn forward(&self, x: &Band, out: Rows, cache: &mut FrameCache, residual: Option<&Tensor>) -> Result<Band> {
        // Rows (and columns) read on each side of a written one.
        let reach = self.shape[2] / 2;
        let read = x.narrowed(out.grown(reach))?;
        let (top, bottom) = out.edge_padding(reach);
        // The convolution pads alike on both sides: a tile with the frame's edge on one side
        // only gets its zero rows here.
        let even = top.min(bottom);
        let mut input = read.x;
        if top + bottom > 2 * even {
            input = input.pad_with_zeros(1, top - even, bottom - even)?;
        }
        let input = self.after_history(input, cache)?;
        let y = conv_frames_bias(&input, &self.filter, self.shape, &self.bias, residual, [even, reach])?;
        Ok(Band { x: y, rows: out })
    }

    /// A causal convolution's input: `input`'s frames after the last ones its slot of `cache`
    /// holds (zero frames before the first frame of the video), leaving the last ones it read
    /// in the cache. A convolution within frames reads `input` alone.
    fn after_history(&self, input: Tensor, cache: &mut FrameCache) -> Result<Tensor> {
        let Some(slot) = self.slot else {
            return Ok(input);
        };
        let history = self.shape[1] - 1;
        let held = cache[slot].take();
        let seen = held.as_ref().map_or(Ok(0), |h| h.dim(0))? + input.dim(0)?;
        // Before the first frame, the causal padding's zero frames.
        let zeros = (history + input.dim(0)?).saturating_sub(seen);
        let parts: Vec<&Tensor> = held.iter().chain([&input]).collect();
        let joined = cat_frames(zeros, &parts)?;
        // A compact copy of the last frames read (a view would keep all of `joined` alive),
        // written over the one held once it has their shape: no allocation per chunk. (It did
        // not measurably shrink the device pool's reserve, benches/RESULTS.md.)
        let keep = seen.min(history);
        let last = joined.narrow(0, joined.dim(0)? - keep, keep)?;
        cache[slot] = Some(match held {
            Some(held) if held.dims() == last.dims() => {
                write_frames(&held, &last)?;
                held
            }
            held => {
                drop(held);
                last.force_contiguous()?
            }
        });
        Ok(joined)
    }
}

/// Wan's RMS norm over channels: `x / max(‖x‖, 1e-12) · √C · γ`, in f32 (one fused pass).
pub(crate) struct ChannelNorm {
    /// `[C]`: γ·√C in f32.
    scale: Tensor,
}

impl ChannelNorm {
    /// `images`: the attention's norm, whose γ is `[C, 1, 1]` rather than `[C, 1, 1, 1]`.
    pub fn decls(prefix: &str, channels: usize, images: bool, out: &mut Vec<WeightDecl>) {
        let shape: &[usize] = match images {
            true => &[channels, 1, 1],
            false => &[channels, 1, 1, 1],
        };
        out.push(WeightDecl::new(format!("{prefix}.gamma"), shape, ShardSpec::Replicated));
    }

    pub fn load(w: &mut ShardLoader, prefix: &str, channels: usize) -> Result<Self> {
        let gamma = w.take(&format!("{prefix}.gamma"))?.reshape(channels)?;
        Ok(Self {
            scale: (gamma.to_dtype(DType::F32)? * (channels as f64).sqrt())?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(channel_rms_norm(x, &self.scale, false)?)
    }

    /// The norm, then SiLU: how every residual block and the head enter a convolution.
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(channel_rms_norm(x, &self.scale, true)?)
    }
}

/// Decoded pixels `[frames, rows, width, 3]` clamped to [−1, 1], as diffusers does, in f32
/// and channels first, `[frames, 3, rows, width]`.
pub(crate) fn clamp_pixels(x: &Tensor) -> Result<Tensor> {
    Ok(x.permute((0, 3, 1, 2))?.to_dtype(DType::F32)?.clamp(-1f32, 1f32)?)
}
