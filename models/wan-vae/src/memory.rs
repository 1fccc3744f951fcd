//! The bytes one rank of [`crate::WanVaeRank`] holds besides its weights while it decodes, as
//! the memory planner counts them, and the tile height that keeps them in bounds. Each term
//! names the code in `decoder.rs` and `blocks.rs` it models; keep them in step. The model is
//! an upper bound: where the code frees a temporary early, it is counted until the step's end.

use candle_core::DType;

use crate::blocks::ConvShape;
use crate::layout::{Layout, PathStep};
use crate::rows::Rows;
use crate::WanVaeConfig;

/// The temporaries a tile's path may take: the tile is the tallest whose path peak stays
/// under this (or one latent row's worth, if none does).
pub const TILE_TEMPORARIES: usize = 1 << 30;

/// One decode's bytes on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeMemory {
    /// The most bytes alive at once.
    pub peak: usize,
    /// What a stream-ordered pool may hold beyond them: the largest temporary, freed and
    /// split by smaller allocations.
    pub pool_slack: usize,
    /// The rows a tile decodes at once (of the output frame).
    pub tile_rows: usize,
}

/// A video to decode: its latent frames and pixel size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub latent_frames: usize,
    pub height: usize,
    pub width: usize,
}

/// What the decode runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeDevice {
    pub dtype: DType,
    /// CUDA's convolution unfolds its input whole (im2col) before its GEMM; the CPU's works
    /// through it in small tiles.
    pub cuda: bool,
}

impl DecodeMemory {
    /// The decode of `band` (rows of the output frame) with the tallest tile that keeps the
    /// path's temporaries under [`TILE_TEMPORARIES`].
    pub fn new(c: &WanVaeConfig, device: DecodeDevice, video: DecodeShape, band: Rows) -> Self {
        let factor = c.spatial_factor();
        let model = Model::new(c, device, video);
        let mut tile = band.len().div_ceil(factor) * factor;
        while tile > factor && model.path(band, tile).0 > TILE_TEMPORARIES {
            tile -= factor;
        }
        model.decode(band, tile.clamp(1, band.len().max(1)))
    }

    /// The decode of `band` in tiles of `tile_rows` rows.
    pub fn with_tiles(
        c: &WanVaeConfig,
        device: DecodeDevice,
        video: DecodeShape,
        band: Rows,
        tile_rows: usize,
    ) -> Self {
        Model::new(c, device, video).decode(band, tile_rows.max(c.spatial_factor()).min(band.len().max(1)))
    }
}

struct Model {
    layout: Layout,
    /// Bytes per element of the compute dtype.
    e: usize,
    cuda: bool,
    video: DecodeShape,
    factor: usize,
}

impl Model {
    fn new(c: &WanVaeConfig, device: DecodeDevice, video: DecodeShape) -> Self {
        Self {
            layout: Layout::of(c),
            e: device.dtype.size_in_bytes(),
            cuda: device.cuda,
            video,
            factor: c.spatial_factor(),
        }
    }

    fn decode(&self, band: Rows, tile_rows: usize) -> DecodeMemory {
        let (h, w) = (self.video.height / self.factor, self.video.width / self.factor);
        let (f, z, c) = (self.video.latent_frames, self.layout.z, self.layout.middle);
        // `Decoder::decode`: the latents on the device in f32, their de-normalised product
        // and its cast, then `post_quant_conv`'s output, alive until the middles are made.
        let latents = f * z * h * w * (3 * 4 + self.e);
        // The middles: every latent frame's middle output, the band's window of rows.
        let (window, _) = self.layout.windows(band);
        let middles = f * c * window.len() * w * self.e;
        let middle = self.middle(h, w);
        // The tallest tile decides: tiles run one after another.
        let mut path = (0, 0);
        let mut start = band.start;
        while start < band.end {
            let end = (start + tile_rows).min(band.end);
            let tile = self.path(
                Rows {
                    start,
                    end,
                    height: band.height,
                },
                tile_rows,
            );
            path = (path.0.max(tile.0), path.1.max(tile.1));
            start = end;
        }
        // CPU ranks keep the decoded frames in their own memory, f32, each tile's and then
        // the band's joined copy; GPU ranks copy them to the host.
        let output = match self.cuda {
            true => 0,
            false => 2 * self.frames(f) * 3 * band.len() * self.video.width * 4,
        };
        DecodeMemory {
            peak: middles + output + (latents + middle.0).max(path.0),
            pool_slack: if self.cuda { middle.1.max(path.1) } else { 0 },
            tile_rows,
        }
    }

    /// The frames `latent` latent frames decode to.
    fn frames(&self, latent: usize) -> usize {
        let doublings = self
            .layout
            .path
            .iter()
            .filter(|s| matches!(s, PathStep::Up { temporal: true, .. }))
            .count();
        1 + latent.saturating_sub(1) * (1 << doublings)
    }

    /// `Decoder::middle` on one whole latent frame: its peak with the frame caches of its
    /// five causal convolutions, and its largest temporary.
    fn middle(&self, h: usize, w: usize) -> (usize, usize) {
        let (z, c, e) = (self.layout.z, self.layout.middle, self.e);
        let all = Rows::all(h);
        let caches = 2 * (z + 4 * c) * (h + 2) * (w + 2) * e;
        let conv_in = self.conv(1, ConvShape::causal(z, c, 3, 3), all, w);
        let res = self.res(1, c, c, all, w);
        // `FrameAttention::forward`: q/k/v after the 1×1 convolution, their contiguous
        // copies, one query block's scores (in the dtype, scaled, in f32, softmaxed and cast
        // back) and every block's output, then the joined and transposed output.
        let pixels = h * w;
        let block = pixels.min(1024);
        let attention = 2 * 3 * c * pixels * e + block * pixels * (2 * e + 2 * 4) + 3 * c * pixels * e;
        let peak = caches + conv_in.0.max(res.0).max(attention + c * pixels * e);
        (peak, conv_in.1.max(res.1).max(block * pixels * 4))
    }

    /// One tile's path of `out` rows (`tile_rows` at most) for a chunk after the first, whose
    /// frames are the most: its peak with the path's frame caches, and its largest
    /// temporary.
    fn path(&self, out: Rows, tile_rows: usize) -> (usize, usize) {
        let full = Rows::all(out.height);
        let tile = Rows {
            start: 0,
            end: tile_rows.min(out.height),
            ..full
        };
        // The first tile's windows are the tallest but at the frame's edge; a middle tile
        // reads halos on both sides. Take the larger rows of either at each step.
        let (_, outs_edge) = self.layout.windows(tile);
        let mid = Rows {
            start: out.start,
            end: out.end,
            ..full
        };
        let (_, outs_mid) = self.layout.windows(mid);
        let w_out = self.video.width;
        let mut frames = 1;
        let (mut caches, mut peak, mut largest) = (0, 0, 0);
        let levels_up: usize = self
            .layout
            .path
            .iter()
            .filter(|s| matches!(s, PathStep::Up { .. }))
            .count();
        let mut level = 0;
        for (i, step) in self.layout.path.iter().enumerate() {
            let rows = outs_edge[i].len().max(outs_mid[i].len());
            let height = outs_edge[i].height;
            let w = w_out >> (levels_up - level);
            let step_rows = Rows {
                start: 0,
                end: rows,
                height,
            };
            let (step_peak, step_largest, step_caches, out_frames) = match *step {
                PathStep::Res { inp, out } => {
                    let (p, l) = self.res(frames, inp, out, step_rows, w);
                    let caches = 2 * (inp * (rows + 4) + out * (rows + 2)) * (w + 2) * self.e;
                    (p, l, caches, frames)
                }
                PathStep::Up { c, temporal } => {
                    level += 1;
                    let low = (rows + 2).div_ceil(2) + 1;
                    let doubled = if temporal { 2 * frames } else { frames };
                    let input = frames * c * low * w * self.e;
                    let time = match temporal {
                        true => self.conv(
                            frames,
                            ConvShape::causal(c, 2 * c, 3, 1),
                            Rows { end: low, ..step_rows },
                            w,
                        ),
                        false => (0, 0),
                    };
                    let up = doubled * c * 2 * low * 2 * w * self.e;
                    let conv = self.conv(doubled, ConvShape::causal(c, c / 2, 1, 3), step_rows, 2 * w);
                    let caches = match temporal {
                        true => 2 * c * low * w * self.e,
                        false => 0,
                    };
                    let peak = input + time.0.max(doubled * c * low * w * self.e + up + conv.0);
                    (peak, time.1.max(conv.1), caches, doubled)
                }
                PathStep::Out { c, out } => {
                    let input = frames * c * (rows + 2) * w * self.e;
                    let normed = self.norm(frames * c * (rows + 2) * w);
                    let conv = self.conv(frames, ConvShape::causal(c, out, 3, 3), step_rows, w);
                    let caches = 2 * c * (rows + 2) * (w + 2) * self.e;
                    // `clamp_pixels`: f32 copy and its clamp, then the CPU copy.
                    let pixels = 3 * frames * out * rows * w * 4;
                    (input + normed.max(conv.0) + pixels, conv.1, caches, frames)
                }
            };
            caches += step_caches;
            peak = peak.max(step_peak);
            largest = largest.max(step_largest);
            frames = out_frames;
        }
        (caches + peak, largest)
    }

    /// `ResBlock::forward` of `frames` frames writing `out` rows of width `w`, counting its
    /// input: peak and largest temporary.
    fn res(&self, frames: usize, inp: usize, out: usize, rows: Rows, w: usize) -> (usize, usize) {
        let e = self.e;
        let r = rows.len();
        let input = frames * inp * (r + 4) * w * e;
        let skip = frames * out * r * w * e;
        let shortcut = match inp != out {
            true => self.conv(frames, ConvShape::causal(inp, out, 1, 1), rows, w).0,
            false => 0,
        };
        let normed1 = frames * inp * (r + 4) * w;
        let conv1 = self.conv(
            frames,
            ConvShape::causal(inp, out, 3, 3),
            Rows { end: r + 2, ..rows },
            w,
        );
        let h1 = frames * out * (r + 2) * w;
        let conv2 = self.conv(frames, ConvShape::causal(out, out, 3, 3), rows, w);
        let phase1 = self.norm(normed1).max(normed1 * e + conv1.0);
        let phase2 = h1 * e + self.norm(h1).max(h1 * e + conv2.0);
        let sum = 2 * skip;
        (
            input + shortcut.max(skip + phase1.max(phase2).max(sum)),
            conv1.1.max(conv2.1),
        )
    }

    /// `ChannelNorm::forward_silu` of `n` elements: the f32 copy, its square or quotient,
    /// the cast, the product and the SiLU.
    fn norm(&self, n: usize) -> usize {
        3 * 4 * n + 2 * self.e * n
    }

    /// `Conv::forward` of `frames` frames writing `out` rows of width `w` with `taps` time taps
    /// and `k`×`k` pixels: peak and largest temporary (not counting its input).
    fn conv(&self, frames: usize, shape: ConvShape, rows: Rows, w: usize) -> (usize, usize) {
        let ConvShape { inp, out, taps, k } = shape;
        let e = self.e;
        let reach = k / 2;
        let area = (rows.len() + 2 * reach) * (w + 2 * reach);
        let written = frames * rows.len() * w;
        // The padded input, with the frames before it and the causal padding, and the taps
        // stacked along channels.
        let padded = frames * inp * area * e;
        let history = match taps {
            1 => padded,
            _ => 3 * (frames + taps - 1) * inp * area * e + taps * frames * inp * area * e,
        };
        let stacked = taps * frames * inp * area * e;
        // candle's CUDA convolution: the unfolded input, the GEMM's output and its transpose.
        // Its CPU one: a copy of the input in pixel-major order, of the kernel, and one tile
        // of 512 output pixels unfolded with its GEMM output, besides the output.
        let unfolded = match self.cuda {
            true => written * k * k * taps * inp * e,
            false => stacked + (out + 512) * k * k * taps * inp * e + 512 * out * e,
        };
        let output = 3 * written * out * e;
        let peak = history.max(stacked + unfolded + output);
        (peak, unfolded.max(written * out * e))
    }
}
