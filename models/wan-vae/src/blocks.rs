//! The decoder's blocks, made of `conv`'s layers: residual blocks, the middle attention, the
//! upsamplers and the output layers.

use candle_core::{DType, Tensor};
use tpinfer_kernels::upsample_nearest2x;
use tpinfer_layers::Result;
use tpinfer_weights::{ShardLoader, WeightDecl};

use crate::conv::{Band, ChannelNorm, Conv, ConvShape, FrameCache, Slots};
use crate::rows::Rows;

/// Queries per block of the middle attention: its scores stay a few tens of MiB at 720p.
const QUERY_BLOCK: usize = 1024;

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
            Some(conv) => conv.forward(x, out, cache, None)?.x,
            None => x.narrowed(out)?.x,
        };
        // Each temporary is dropped as soon as the next exists: these are the decoder's
        // largest tensors.
        let h = {
            let normed = x.narrowed(mid.grown(1))?.map(|x| self.norm1.forward_silu(x))?;
            self.conv1.forward(&normed, mid, cache, None)?
        };
        let normed = h.map(|x| self.norm2.forward_silu(x))?;
        drop(h);
        // The sum with the skip in the convolution's epilogue.
        self.conv2.forward(&normed, out, cache, Some(&skip))
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
        let (frames, h, w, c) = x.x.dims4()?;
        let all = Rows::all(x.rows.height);
        if x.rows != all {
            return Err(tpinfer_layers::Error::Shard(
                "the VAE's middle attention reads whole frames".into(),
            ));
        }
        let o = {
            let qkv = self.qkv.forward(&x.map(|x| self.norm.forward(x))?, all, cache, None)?.x;
            // [frames, pixels, 3C]: q, k and v are its channel thirds.
            let qkv = qkv.reshape((frames, h * w, 3 * c))?;
            let part = |i: usize| qkv.narrow(2, i * c, c).and_then(|t| t.contiguous());
            let (q, k, v) = (part(0)?, part(1)?, part(2)?);
            drop(qkv);
            let k_t = k.t()?;
            let scale = 1.0 / (self.channels as f64).sqrt();
            let mut blocks = Vec::with_capacity((h * w).div_ceil(QUERY_BLOCK));
            for start in (0..h * w).step_by(QUERY_BLOCK) {
                let q = q.narrow(1, start, QUERY_BLOCK.min(h * w - start))?;
                let scores = (q.matmul(&k_t)? * scale)?.to_dtype(DType::F32)?;
                let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
                blocks.push(p.matmul(&v)?);
            }
            Tensor::cat(&blocks, 1)?.reshape((frames, h, w, c))?
        };
        // The residual in the projection's epilogue.
        self.proj.forward(&Band { x: o, rows: all }, all, cache, Some(&x.x))
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
            let doubled = time.forward(&x, low, cache, None)?.x;
            // Channel halves become frames 2t and 2t + 1, as diffusers' reshape and stack.
            let (frames, rows, w, c2) = doubled.dims4()?;
            x.x = doubled
                .reshape((frames, rows, w, 2, c2 / 2))?
                .permute((0, 3, 1, 2, 4))?
                .reshape((2 * frames, rows, w, c2 / 2))?;
        }
        let up = upsample_nearest2x(&x.x)?;
        drop(x);
        let up = Band {
            x: up,
            rows: Rows {
                start: 2 * low.start,
                end: 2 * low.end,
                height: out.height,
            },
        };
        self.conv.forward(&up, out, cache, None)
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
        self.conv.forward(&h, out, cache, None)
    }
}
