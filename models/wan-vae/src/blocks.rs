//! The decoder's layers on a window of rows, frames first (`[frames, channels, rows, width]`).
//!
//! A causal 3-D convolution runs as one 2-D convolution: its three time taps (the frame two
//! back, one back, and now) are stacked along the input channels, so the kernel
//! `[out, in, 3, k, k]` becomes `[out, 3·in, k, k]`. Its frame cache holds the last two
//! frames it read, so a video decodes one latent frame at a time, as diffusers' does, with the
//! zero frames of causal padding before the first.

use candle_core::{DType, Tensor};
use tpinfer_layers::Result;
use tpinfer_weights::{ShardLoader, ShardSpec, WeightDecl};

use crate::rows::Rows;

/// Each causal convolution's last frames read, by slot.
pub(crate) type FrameCache = Vec<Option<Tensor>>;

/// Queries per block of the middle attention: its scores stay a few tens of MiB at 720p.
const QUERY_BLOCK: usize = 1024;

/// Activations of some rows of a frame.
#[derive(Clone)]
pub(crate) struct Band {
    /// `[frames, channels, rows, width]`.
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
            x: self.x.narrow(2, rows.start - self.rows.start, rows.len())?,
            rows,
        })
    }

    fn map(&self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Band> {
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
    fn next(&mut self) -> usize {
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
    /// `[out, taps·in, k, k]`, the oldest tap's input channels first.
    weight: Tensor,
    /// `[1, out, 1, 1]`.
    bias: Tensor,
    taps: usize,
    /// Rows (and columns) read on each side of a written one: k / 2.
    reach: usize,
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
        let weight = match shape.taps {
            0 => weight,
            _ => weight
                .permute((0, 2, 1, 3, 4))?
                .reshape((shape.out, taps * shape.inp, shape.k, shape.k))?
                .contiguous()?,
        };
        Ok(Self {
            weight,
            bias: w.take(&format!("{prefix}.bias"))?.reshape((1, shape.out, 1, 1))?,
            taps,
            reach: shape.k / 2,
            slot: (taps > 1).then(|| slots.next()),
        })
    }

    /// Writes `out` from `x`, which holds the rows it reads; a causal one continues from the
    /// frames its slot of `cache` holds, and leaves the last two it read there.
    pub fn forward(&self, x: &Band, out: Rows, cache: &mut FrameCache) -> Result<Band> {
        let read = x.narrowed(out.grown(self.reach))?;
        let (top, bottom) = out.edge_padding(self.reach);
        let mut input = read.x;
        if top + bottom > 0 {
            input = input.pad_with_zeros(2, top, bottom)?;
        }
        if self.reach > 0 {
            input = input.pad_with_zeros(3, self.reach, self.reach)?;
        }
        if let Some(slot) = self.slot {
            let frames = input.dim(0)?;
            let seen = match cache[slot].take() {
                Some(history) => Tensor::cat(&[&history, &input], 0)?,
                None => input,
            };
            let n = seen.dim(0)?;
            let history = self.taps - 1;
            // A compact copy: a view (or candle's `copy`, which clones the whole storage) would
            // keep all of `seen` alive in the cache.
            cache[slot] = Some(
                seen.narrow(0, n.saturating_sub(history), n.min(history))?
                    .force_contiguous()?,
            );
            // Before the first frame, the causal padding's zero frames.
            let padded = seen.pad_with_zeros(0, (history + frames).saturating_sub(n), 0)?;
            let taps: Vec<Tensor> = (0..self.taps)
                .map(|t| padded.narrow(0, t, frames))
                .collect::<candle_core::Result<_>>()?;
            input = Tensor::cat(&taps, 1)?;
        }
        let y = input.conv2d(&self.weight, 0, 1, 1, 1)?.broadcast_add(&self.bias)?;
        Ok(Band { x: y, rows: out })
    }
}

/// Wan's RMS norm over channels: `x / max(‖x‖, 1e-12) · √C · γ`, normalised in f32.
pub(crate) struct ChannelNorm {
    /// `[1, C, 1, 1]`: γ·√C in the compute dtype.
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
        let gamma = w.take(&format!("{prefix}.gamma"))?.reshape((1, channels, 1, 1))?;
        Ok(Self {
            scale: (gamma * (channels as f64).sqrt())?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let norm = x32.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?;
        Ok(x32.broadcast_div(&norm)?.to_dtype(dtype)?.broadcast_mul(&self.scale)?)
    }

    /// The norm, then SiLU: how every residual block and the head enter a convolution.
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::silu(&self.forward(x)?)?)
    }
}

/// Two causal 3×3×3 convolutions, each after a norm and SiLU, added to the input (through a
/// 1×1×1 convolution where the width changes).
pub(crate) struct ResBlock {
    norm1: ChannelNorm,
    conv1: Conv,
    norm2: ChannelNorm,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl ResBlock {
    /// Rows read on each side of a written one: two 3×3 convolutions.
    const REACH: usize = 2;

    pub fn decls(prefix: &str, inp: usize, out: usize, decls: &mut Vec<WeightDecl>) {
        ChannelNorm::decls(&format!("{prefix}.norm1"), inp, false, decls);
        Conv::decls(&format!("{prefix}.conv1"), ConvShape::causal(inp, out, 3, 3), decls);
        ChannelNorm::decls(&format!("{prefix}.norm2"), out, false, decls);
        Conv::decls(&format!("{prefix}.conv2"), ConvShape::causal(out, out, 3, 3), decls);
        if inp != out {
            Conv::decls(
                &format!("{prefix}.conv_shortcut"),
                ConvShape::causal(inp, out, 1, 1),
                decls,
            );
        }
    }

    pub fn load(w: &mut ShardLoader, prefix: &str, inp: usize, out: usize, slots: &mut Slots) -> Result<Self> {
        Ok(Self {
            norm1: ChannelNorm::load(w, &format!("{prefix}.norm1"), inp)?,
            conv1: Conv::load(w, &format!("{prefix}.conv1"), ConvShape::causal(inp, out, 3, 3), slots)?,
            norm2: ChannelNorm::load(w, &format!("{prefix}.norm2"), out)?,
            conv2: Conv::load(w, &format!("{prefix}.conv2"), ConvShape::causal(out, out, 3, 3), slots)?,
            shortcut: match inp != out {
                true => Some(Conv::load(
                    w,
                    &format!("{prefix}.conv_shortcut"),
                    ConvShape::causal(inp, out, 1, 1),
                    slots,
                )?),
                false => None,
            },
        })
    }

    pub fn input_rows(out: Rows) -> Rows {
        out.grown(Self::REACH)
    }

    pub fn forward(&self, x: &Band, out: Rows, cache: &mut FrameCache) -> Result<Band> {
        let mid = out.grown(1);
        let skip = match &self.shortcut {
            Some(conv) => conv.forward(x, out, cache)?,
            None => x.narrowed(out)?,
        };
        // Each temporary is dropped as soon as the next exists: these are the decoder's
        // largest tensors.
        let h = {
            let normed = x.narrowed(mid.grown(1))?.map(|x| self.norm1.forward_silu(x))?;
            self.conv1.forward(&normed, mid, cache)?
        };
        let h = {
            let normed = h.map(|x| self.norm2.forward_silu(x))?;
            drop(h);
            self.conv2.forward(&normed, out, cache)?
        };
        Ok(Band {
            x: (h.x + skip.x)?,
            rows: out,
        })
    }
}

/// Single-head self-attention over each frame's pixels (the middle block's): it reads every
/// row, so it runs on whole frames only.
pub(crate) struct FrameAttention {
    norm: ChannelNorm,
    qkv: Conv,
    proj: Conv,
    channels: usize,
}

impl FrameAttention {
    pub fn decls(prefix: &str, c: usize, decls: &mut Vec<WeightDecl>) {
        ChannelNorm::decls(&format!("{prefix}.norm"), c, true, decls);
        Conv::decls(&format!("{prefix}.to_qkv"), ConvShape::flat(c, 3 * c, 1), decls);
        Conv::decls(&format!("{prefix}.proj"), ConvShape::flat(c, c, 1), decls);
    }

    pub fn load(w: &mut ShardLoader, prefix: &str, c: usize, slots: &mut Slots) -> Result<Self> {
        Ok(Self {
            norm: ChannelNorm::load(w, &format!("{prefix}.norm"), c)?,
            qkv: Conv::load(w, &format!("{prefix}.to_qkv"), ConvShape::flat(c, 3 * c, 1), slots)?,
            proj: Conv::load(w, &format!("{prefix}.proj"), ConvShape::flat(c, c, 1), slots)?,
            channels: c,
        })
    }

    pub fn forward(&self, x: &Band, cache: &mut FrameCache) -> Result<Band> {
        let (frames, c, h, w) = x.x.dims4()?;
        let all = Rows::all(x.rows.height);
        if x.rows != all {
            return Err(tpinfer_layers::Error::Shard(
                "the VAE's middle attention reads whole frames".into(),
            ));
        }
        let qkv = self.qkv.forward(&x.map(|x| self.norm.forward(x))?, all, cache)?.x;
        // [frames, pixels, 3C]: q, k and v are its channel thirds.
        let qkv = qkv.reshape((frames, 3 * c, h * w))?.transpose(1, 2)?;
        let part = |i: usize| qkv.narrow(2, i * c, c).and_then(|t| t.contiguous());
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let k_t = k.t()?;
        let scale = 1.0 / (self.channels as f64).sqrt();
        let mut blocks = Vec::with_capacity((h * w).div_ceil(QUERY_BLOCK));
        for start in (0..h * w).step_by(QUERY_BLOCK) {
            let q = q.narrow(1, start, QUERY_BLOCK.min(h * w - start))?;
            let scores = (q.matmul(&k_t)? * scale)?.to_dtype(DType::F32)?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
            blocks.push(p.matmul(&v)?);
        }
        let o = Tensor::cat(&blocks, 1)?.transpose(1, 2)?.reshape((frames, c, h, w))?;
        let o = self.proj.forward(&Band { x: o, rows: all }, all, cache)?;
        Ok(Band {
            x: (o.x + &x.x)?,
            rows: all,
        })
    }
}

/// Nearest-neighbour 2× upsampling in height and width, then a 3×3 convolution to half the
/// width; the temporal kind first doubles the frames with a causal convolution over time
/// whose two halves of output channels become two frames. The first latent frame is not
/// doubled: it decodes to one frame.
pub(crate) struct Upsample {
    time: Option<Conv>,
    conv: Conv,
}

impl Upsample {
    pub fn decls(prefix: &str, c: usize, temporal: bool, decls: &mut Vec<WeightDecl>) {
        Conv::decls(&format!("{prefix}.resample.1"), ConvShape::flat(c, c / 2, 3), decls);
        if temporal {
            Conv::decls(&format!("{prefix}.time_conv"), ConvShape::causal(c, 2 * c, 3, 1), decls);
        }
    }

    pub fn load(w: &mut ShardLoader, prefix: &str, c: usize, temporal: bool, slots: &mut Slots) -> Result<Self> {
        Ok(Self {
            time: match temporal {
                true => Some(Conv::load(
                    w,
                    &format!("{prefix}.time_conv"),
                    ConvShape::causal(c, 2 * c, 3, 1),
                    slots,
                )?),
                false => None,
            },
            conv: Conv::load(w, &format!("{prefix}.resample.1"), ConvShape::flat(c, c / 2, 3), slots)?,
        })
    }

    /// The rows of the half-height input that `out` (of the upsampled frame) needs.
    pub fn input_rows(out: Rows) -> Rows {
        out.grown(1).halved()
    }

    /// `first`: the video's first latent frame, which the time convolution skips (diffusers'
    /// "Rep" cache): it neither doubles nor enters the time convolution's history.
    pub fn forward(&self, x: &Band, out: Rows, first: bool, cache: &mut FrameCache) -> Result<Band> {
        let low = Self::input_rows(out);
        let mut x = x.narrowed(low)?;
        if let (Some(time), false) = (&self.time, first) {
            let doubled = time.forward(&x, low, cache)?.x;
            let (frames, c2, h, w) = doubled.dims4()?;
            x.x = doubled.reshape((2 * frames, c2 / 2, h, w))?;
        }
        let (_, _, h, w) = x.x.dims4()?;
        let up = Band {
            x: x.x.upsample_nearest2d(2 * h, 2 * w)?,
            rows: Rows {
                start: 2 * low.start,
                end: 2 * low.end,
                height: out.height,
            },
        };
        self.conv.forward(&up, out, cache)
    }
}

/// The last layers: norm, SiLU, and a causal 3×3×3 convolution to the pixels' channels.
pub(crate) struct Head {
    norm: ChannelNorm,
    conv: Conv,
}

impl Head {
    pub fn decls(prefix: &str, c: usize, out: usize, decls: &mut Vec<WeightDecl>) {
        ChannelNorm::decls(&format!("{prefix}.norm_out"), c, false, decls);
        Conv::decls(&format!("{prefix}.conv_out"), ConvShape::causal(c, out, 3, 3), decls);
    }

    pub fn load(w: &mut ShardLoader, prefix: &str, c: usize, out: usize, slots: &mut Slots) -> Result<Self> {
        Ok(Self {
            norm: ChannelNorm::load(w, &format!("{prefix}.norm_out"), c)?,
            conv: Conv::load(w, &format!("{prefix}.conv_out"), ConvShape::causal(c, out, 3, 3), slots)?,
        })
    }

    pub fn input_rows(out: Rows) -> Rows {
        out.grown(1)
    }

    pub fn forward(&self, x: &Band, out: Rows, cache: &mut FrameCache) -> Result<Band> {
        let h = x.narrowed(out.grown(1))?.map(|x| self.norm.forward_silu(x))?;
        self.conv.forward(&h, out, cache)
    }
}

/// Clamps decoded pixels to [−1, 1], as diffusers does, in f32.
pub(crate) fn clamp_pixels(x: &Tensor) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?.clamp(-1f32, 1f32)?)
}
