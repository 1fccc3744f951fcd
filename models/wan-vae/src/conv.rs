//! The decoder's convolutions and norms on a window of rows, frames first
//! (`[frames, channels, rows, width]`).
//!
//! On CUDA with cuDNN a causal 3-D convolution runs as cuDNN's, which reads its three time
//! taps (the frame two back, one back, and now) from the frames themselves and pads the
//! frame's edges as it reads. Elsewhere it runs as one 2-D convolution of candle's: the taps
//! stacked along the input channels, so the kernel `[out, in, 3, k, k]` becomes
//! `[out, 3·in, k, k]`, on a zero-padded copy. Its frame cache holds the last two frames it
//! read, so a video decodes one latent frame at a time, as diffusers' does, with the zero
//! frames of causal padding before the first.

use candle_core::{DType, Tensor};
use tpinfer_kernels::{channel_rms_norm, channels_last_filter, conv_frames_bias, conv_path, ConvPath};
use tpinfer_layers::Result;
use tpinfer_weights::{ShardLoader, ShardSpec, WeightDecl};

use crate::rows::Rows;
/// Each causal convolution's last frames read, by slot.
pub(crate) type FrameCache = Vec<Option<Tensor>>;

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
    /// Through cuDNN, `[out, taps, k, k, in]` (channels last); unfolded, `[out, taps·in, k, k]`, the oldest tap's input channels first.
    weight: Tensor,
    /// `[out]` through cuDNN, `[1, out, 1, 1]` unfolded.
    bias: Tensor,
    path: ConvPath,
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
        let path = conv_path(weight.device());
        let weight = match (path, shape.taps) {
            (ConvPath::Cudnn, _) => channels_last_filter(&weight)?,
            (ConvPath::Unfolded, 0) => weight,
            (ConvPath::Unfolded, _) => weight
                .permute((0, 2, 1, 3, 4))?
                .reshape((shape.out, taps * shape.inp, shape.k, shape.k))?
                .contiguous()?,
        };
        let bias = w.take(&format!("{prefix}.bias"))?;
        let bias = match path {
            ConvPath::Cudnn => bias,
            ConvPath::Unfolded => bias.reshape((1, shape.out, 1, 1))?,
        };
        Ok(Self {
            weight,
            bias,
            path,
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
        let y = match self.path {
            ConvPath::Cudnn => {
                // cuDNN pads as it reads, alike on both sides: a tile with the frame's edge on
                // one side only gets its zero rows here.
                let even = top.min(bottom);
                if top + bottom > 2 * even {
                    input = input.pad_with_zeros(2, top - even, bottom - even)?;
                }
                let input = self.after_history(input, cache)?;
                conv_frames_bias(&input, &self.weight, &self.bias, [even, self.reach])?
            }
            ConvPath::Unfolded => {
                if top + bottom > 0 {
                    input = input.pad_with_zeros(2, top, bottom)?;
                }
                if self.reach > 0 {
                    input = input.pad_with_zeros(3, self.reach, self.reach)?;
                }
                let input = self.stacked_taps(self.after_history(input, cache)?)?;
                self.convolve(&input)?
            }
        };
        Ok(Band { x: y, rows: out })
    }

    /// `padded` `[taps − 1 + frames, in, rows, width]` as `[frames, taps·in, rows, width]`,
    /// each frame's taps side by side (`padded` is freed before the convolution).
    fn stacked_taps(&self, padded: Tensor) -> Result<Tensor> {
        if self.taps == 1 {
            return Ok(padded);
        }
        let frames = padded.dim(0)? + 1 - self.taps;
        let taps: Vec<Tensor> = (0..self.taps)
            .map(|t| padded.narrow(0, t, frames))
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&taps, 1)?)
    }

    /// A causal convolution's input: `input`'s frames after the last ones its slot of `cache`
    /// holds (zero frames before the first frame of the video), leaving the last ones it read
    /// in the cache. A convolution within frames reads `input` alone.
    fn after_history(&self, input: Tensor, cache: &mut FrameCache) -> Result<Tensor> {
        let Some(slot) = self.slot else {
            return Ok(input);
        };
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
        Ok(seen.pad_with_zeros(0, (history + frames).saturating_sub(n), 0)?)
    }

    /// candle's convolution of the padded `input` `[frames, taps·in, rows, width]`, plus the
    /// bias. On CUDA it unfolds its whole input first (im2col, k²·taps copies of every
    /// pixel), so there it runs on chunks of output rows whose unfolding stays under
    /// [`UNFOLD_BYTES`], each written into the output in place.
    fn convolve(&self, input: &Tensor) -> Result<Tensor> {
        let (frames, channels, _, padded_width) = input.dims4()?;
        let k = 2 * self.reach + 1;
        let unfolded_row = frames * (padded_width - 2 * self.reach) * channels * k * k * input.dtype().size_in_bytes();
        match input.device().is_cuda() {
            true => self.convolve_rows(input, unfold_chunk_rows(unfolded_row)),
            false => self.convolve_rows(input, usize::MAX),
        }
    }

    /// [`Self::convolve`] in chunks of `chunk` output rows.
    fn convolve_rows(&self, input: &Tensor, chunk: usize) -> Result<Tensor> {
        let (frames, _, padded_rows, padded_width) = input.dims4()?;
        let (rows, width) = (padded_rows - 2 * self.reach, padded_width - 2 * self.reach);
        let part = |start: usize, len: usize| -> Result<Tensor> {
            let read = input.narrow(2, start, len + 2 * self.reach)?;
            Ok(read.conv2d(&self.weight, 0, 1, 1, 1)?.broadcast_add(&self.bias)?)
        };
        if chunk >= rows {
            return part(0, rows);
        }
        let out = self.weight.dims()[0];
        let y = Tensor::zeros((frames, out, rows, width), input.dtype(), input.device())?;
        for start in (0..rows).step_by(chunk) {
            y.slice_set(&part(start, chunk.min(rows - start))?, 2, start)?;
        }
        Ok(y)
    }
}

/// The most bytes candle's CUDA convolution may unfold at once: its im2col buffer, which
/// also bounds its element count far under the u32 its kernel indexes with.
pub(crate) const UNFOLD_BYTES: usize = 256 << 20;

/// The output rows per chunk of a CUDA convolution that unfolds `per_row` bytes for each.
pub(crate) fn unfold_chunk_rows(per_row: usize) -> usize {
    (UNFOLD_BYTES / per_row.max(1)).max(1)
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

/// Clamps decoded pixels to [−1, 1], as diffusers does, in f32.
pub(crate) fn clamp_pixels(x: &Tensor) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F32)?.clamp(-1f32, 1f32)?)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};
    use tpinfer_kernels::ConvPath;

    use super::Conv;

    /// The chunks that CUDA's convolution runs in join into the whole convolution.
    #[test]
    fn a_convolution_in_chunks_of_rows_is_the_whole() {
        let cpu = Device::Cpu;
        let conv = Conv {
            weight: Tensor::randn(0f32, 1.0, (4, 6, 3, 3), &cpu).expect("weight"),
            bias: Tensor::randn(0f32, 1.0, (1, 4, 1, 1), &cpu).expect("bias"),
            path: ConvPath::Unfolded,
            taps: 1,
            reach: 1,
            slot: None,
        };
        let input = Tensor::randn(0f32, 1.0, (2, 6, 11, 7), &cpu).expect("input");
        let whole = conv.convolve_rows(&input, usize::MAX).expect("whole");
        assert_eq!(whole.dims(), [2, 4, 9, 5]);
        for chunk in [1, 2, 4, 8] {
            let chunks = conv.convolve_rows(&input, chunk).expect("chunks");
            let diff = (chunks - &whole).and_then(|d| d.abs()).and_then(|d| d.max_all());
            assert_eq!(
                diff.and_then(|d| d.to_scalar::<f32>()).expect("max"),
                0.0,
                "chunks of {chunk}"
            );
        }
    }
}
