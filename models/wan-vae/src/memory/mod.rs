//! The bytes one rank of [`crate::WanVaeRank`] holds besides its weights while it decodes, as
//! the memory planner counts them, and the tile height that keeps them in bounds. Each term
//! names the code in `decoder.rs` and `blocks.rs` it models; keep them in step (the counting
//! allocator of `tests/tests/activation_memory.rs` holds them together).

use candle_core::DType;
pub use tpinfer_kernels::ConvPath;

mod encode;
mod steps;

pub use encode::EncodeMemory;

use crate::layout::{Layout, PathStep};
use crate::rows::{tiles, Rows};
use crate::WanVaeConfig;

/// The bytes a decode may hold besides its weights: it takes the fewest tiles, and then the
/// most frames at once after the last temporal upsampling ([`Tiling`]), that keep its peak
/// under this (or one latent row's worth of rows and one frame, if none does). Each tile
/// recomputes the halo its convolutions read (a 480p video decodes 20% faster in one tile than
/// in two), while fewer frames at once cost next to nothing. This keeps a decode's tensors near
/// 2 GiB in bf16, beside a DiT shard on a 24 GiB card: 480p in two tiles of four frames, 720p
/// in four tiles of two (2.0 and 2.1 GiB with the weights, 1.33 and 3.07 s on an H200,
/// benches/RESULTS.md).
pub const DECODE_TEMPORARIES: usize = 2400 << 20;

/// The decode's pool slack, in largest temporaries. Its steps free and make buffers of many
/// sizes, level after level, so the largest one's block, once freed, is split by smaller ones
/// and the next of its size is mapped anew: the pool held 1.4 to 2.3 of them beyond the live
/// tensors, and with one counted a card of the plan's size ran out of memory (the least card
/// was 2–10% past it; with two, within 1.5% at 720p and in f32, 4–7% under it at 480p:
/// `scripts/gpu/least-card.sh`, benches/RESULTS.md).
const POOL_SLACK_LARGEST: usize = 2;

/// Queries per block of the middle attention (`blocks::QUERY_BLOCK`).
const QUERY_BLOCK: usize = 1024;

/// How a decode bounds its temporaries: tiles of `rows` rows of the output frame, each
/// decoding every latent frame in turn; and within a latent frame, `frames` of its frames at a
/// time through the layers after the last temporal upsampling, which do most of the work.
/// Those frames meet only through their causal convolutions' caches, so running them a few at
/// a time recomputes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    pub rows: usize,
    pub frames: usize,
}

/// One decode's bytes on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeMemory {
    /// The most bytes alive at once.
    pub peak: usize,
    /// What a stream-ordered pool holds beyond them: twice the largest temporary (the
    /// module's `POOL_SLACK_LARGEST` says why).
    pub pool_slack: usize,
    pub tiling: Tiling,
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
    /// GPU ranks copy decoded frames to the host; CPU ranks keep them.
    pub cuda: bool,
    /// How its convolutions run: cuDNN's on CUDA where it is installed.
    pub conv: ConvPath,
}

impl DecodeDevice {
    /// A GPU (`cuda`) with cuDNN, as `doctor` checks for, or a CPU rank.
    pub fn new(dtype: DType, cuda: bool) -> Self {
        Self {
            dtype,
            cuda,
            conv: match cuda {
                true => ConvPath::Cudnn,
                false => ConvPath::Taps,
            },
        }
    }
}

impl DecodeMemory {
    /// The decode of `band` (rows of the output frame) in the fewest tiles, each of whole
    /// latent rows, and then the most frames at once, that keep its peak under
    /// [`DECODE_TEMPORARIES`].
    pub fn new(c: &WanVaeConfig, device: DecodeDevice, video: DecodeShape, band: Rows) -> Self {
        let factor = c.spatial_factor();
        let model = Model::new(c, device, video);
        let rows = band.len().max(1);
        let most = model.chunk_frames(model.layout.full_rate_start());
        let mut tile = rows.div_ceil(factor) * factor;
        loop {
            let mut frames = most;
            loop {
                let decode = model.decode(
                    band,
                    Tiling {
                        rows: tile.min(rows),
                        frames,
                    },
                );
                if decode.peak <= DECODE_TEMPORARIES || (tile <= factor && frames == 1) {
                    return decode;
                }
                if frames == 1 {
                    break;
                }
                frames = frames.div_ceil(2);
            }
            // One tile more: the tallest tiles of whole latent rows that make that many.
            let count = rows.div_ceil(tile) + 1;
            tile = (rows.div_ceil(count).div_ceil(factor) * factor).min(tile - factor);
        }
    }

    /// The decode of `band` split as `tiling` says (at least one latent row's worth of rows
    /// and one frame).
    pub fn with_tiling(c: &WanVaeConfig, device: DecodeDevice, video: DecodeShape, band: Rows, tiling: Tiling) -> Self {
        let tiling = Tiling {
            rows: tiling.rows.max(c.spatial_factor()).min(band.len().max(1)),
            frames: tiling.frames.max(1),
        };
        Model::new(c, device, video).decode(band, tiling)
    }
}

/// A peak and the largest single buffer in it.
#[derive(Debug, Clone, Copy, Default)]
struct Bytes {
    peak: usize,
    largest: usize,
}

impl Bytes {
    fn max(self, other: Bytes) -> Bytes {
        Bytes {
            peak: self.peak.max(other.peak),
            largest: self.largest.max(other.largest),
        }
    }

    /// `self` with `live` bytes alive besides it.
    fn on(self, live: usize) -> Bytes {
        Bytes {
            peak: self.peak + live,
            ..self
        }
    }
}

/// One convolution call's shape.
#[derive(Debug, Clone, Copy)]
struct ConvCall {
    frames: usize,
    inp: usize,
    out: usize,
    taps: usize,
    k: usize,
    /// The frames of history in its cache (causal convolutions).
    history: usize,
    /// Whether the rows it reads of its input are packed (all of the input's rows, or those
    /// of one frame), where it reads them as a view.
    packed: bool,
    /// A residual added to its output, and whether that is packed.
    residual: Option<bool>,
}

impl ConvCall {
    fn new(frames: usize, inp: usize, out: usize, taps: usize, k: usize, history: usize) -> Self {
        Self {
            frames,
            inp,
            out,
            taps,
            k,
            history,
            packed: true,
            residual: None,
        }
    }

    fn packed(self, packed: bool) -> Self {
        Self { packed, ..self }
    }

    fn residual(self, packed: bool) -> Self {
        Self {
            residual: Some(packed),
            ..self
        }
    }
}

struct Model {
    layout: Layout,
    dtype: DType,
    /// Bytes per element of the compute dtype.
    e: usize,
    cuda: bool,
    conv: ConvPath,
    video: DecodeShape,
    factor: usize,
}

impl Model {
    fn new(c: &WanVaeConfig, device: DecodeDevice, video: DecodeShape) -> Self {
        Self {
            layout: Layout::of(c),
            dtype: device.dtype,
            e: device.dtype.size_in_bytes(),
            cuda: device.cuda,
            conv: device.conv,
            video,
            factor: c.spatial_factor(),
        }
    }

    fn decode(&self, band: Rows, tiling: Tiling) -> DecodeMemory {
        let (h, w) = (self.video.height / self.factor, self.video.width / self.factor);
        let (f, z, c, e) = (self.video.latent_frames, self.layout.z, self.layout.middle, self.e);
        // `Decoder::decode`: the latents on the device, their de-normalised product in f32,
        // its cast, and `post_quant_conv`'s output, alive until the middles are made.
        let latents = f * z * h * w * (4 + 4 + e + e);
        // The middles: every latent frame's middle output, the band's window of rows.
        let (window, _) = self.layout.windows(band);
        let middles = f * c * window.len() * w * e;
        let middle = self.middle(h, w);
        let path = self.path_peak(band, tiling);
        // CPU ranks keep the decoded frames in their own memory, f32: the band's buffer, made
        // before the first tile, which each chunk is copied into; GPU ranks copy them to the
        // host.
        let band_frames = match self.cuda {
            true => 0,
            false => self.frames(f) * 3 * band.len() * self.video.width * 4,
        };
        DecodeMemory {
            peak: middles + (latents + middle.peak).max(path.peak + band_frames),
            pool_slack: match self.cuda {
                true => POOL_SLACK_LARGEST * middle.largest.max(path.largest),
                false => 0,
            },
            tiling,
        }
    }

    /// The frames `latent` latent frames decode to.
    fn frames(&self, latent: usize) -> usize {
        1 + latent.saturating_sub(1) * self.chunk_frames(self.layout.path.len())
    }

    /// The frames a chunk after the first holds before path step `step`.
    fn chunk_frames(&self, step: usize) -> usize {
        let doublings = self.layout.path[..step]
            .iter()
            .filter(|s| matches!(s, PathStep::Up { temporal: true, .. }))
            .count();
        1 << doublings
    }

    /// `Decoder::middle` on one whole latent frame, with its five frame caches.
    fn middle(&self, h: usize, w: usize) -> Bytes {
        let (z, c) = (self.layout.z, self.layout.middle);
        let history = self.history();
        let caches = self.cached() * self.held_frame(z + 4 * c, Rows::all(h), 1, w);
        let all = Rows::all(h);
        let conv_in = self.conv(ConvCall::new(1, z, c, 3, 3, history), all, w);
        let res = self.res(1, c, c, all, all, w, history);
        let input = c * h * w * self.e;
        let attention = self.attention(c, h, w).on(input);
        // Each block beside its input: conv_in's output onward.
        let steps = conv_in.max(res.on(input)).max(attention);
        Bytes {
            peak: caches + steps.peak,
            largest: steps.largest,
        }
    }

    /// `FrameAttention::forward` on one frame of `h × w` at width `c`, not counting its input:
    /// the norm and q/k/v from the 1×1 convolution; their contiguous copies beside it; one
    /// query block's scores (scaled, in f32, softmaxed, cast back) beside q, k, v and the
    /// blocks' outputs; the joined output beside them; the projection adding the input.
    fn attention(&self, c: usize, h: usize, w: usize) -> Bytes {
        let e = self.e;
        let all = Rows::all(h);
        let pixels = h * w;
        let block = pixels.min(QUERY_BLOCK);
        let input = c * pixels * e;
        let qkv = 3 * input;
        let norm = self.norm(c * pixels);
        let projection = self.conv(ConvCall::new(1, c, 3 * c, 1, 1, 0), all, w);
        let scores = block * pixels * (2 * e + 2 * 4);
        let proj = self.conv(ConvCall::new(1, c, c, 1, 1, 0).residual(true), all, w);
        projection
            .on(norm)
            .max(Bytes {
                peak: qkv + 3 * input,
                largest: qkv,
            })
            .max(Bytes {
                peak: 3 * input + input + scores,
                largest: scores,
            })
            .max(Bytes {
                peak: 3 * input + 2 * input,
                largest: input,
            })
            .max(proj.on(input))
    }

    /// The bytes of one frame of `channels` that a convolution of reach `reach` writing `rows`
    /// (of width `w`) reads, as its frame cache holds it: with zero rows only where the rows
    /// have the frame's edge on one side (the convolution pads alike on both sides as it reads).
    fn held_frame(&self, channels: usize, rows: Rows, reach: usize, w: usize) -> usize {
        let (top, bottom) = rows.edge_padding(reach);
        channels * (rows.len() + 2 * reach - 2 * top.min(bottom)) * w * self.e
    }

    /// The frames of history a causal convolution finds in its cache in the steady state:
    /// two, once a second latent frame is decoded; none for a one-frame video.
    fn history(&self) -> usize {
        match self.video.latent_frames {
            1 => 0,
            _ => 2,
        }
    }

    /// The frames a causal convolution's cache holds once it has run: the last two it read
    /// (the first chunk's one, in a one-frame video).
    fn cached(&self) -> usize {
        match self.video.latent_frames {
            1 => 1,
            _ => 2,
        }
    }

    /// The largest peak of `band`'s tiles, for a chunk after the first (whose frames are the
    /// most): its peak with the path's frame caches.
    fn path_peak(&self, band: Rows, tiling: Tiling) -> Bytes {
        tiles(band, tiling.rows)
            .into_iter()
            .map(|tile| self.path(tile, tiling.frames))
            .fold(Bytes::default(), Bytes::max)
    }

    /// One tile's path, every step on the rows the decoder gives it, the steps after the last
    /// temporal upsampling on `at_once` frames at a time.
    fn path(&self, tile: Rows, at_once: usize) -> Bytes {
        let (_, outs) = self.layout.windows(tile);
        let levels = self
            .layout
            .path
            .iter()
            .filter(|s| matches!(s, PathStep::Up { .. }))
            .count();
        let (history, cached) = (self.history(), self.cached());
        let split = self.layout.full_rate_start();
        // Chunks after the first decode `chunk_frames` frames at each step, the first one;
        // from `split` on, `at_once` of them at a time.
        let chunk = |step: usize| match self.video.latent_frames {
            1 => 1,
            _ if step >= split => self.chunk_frames(step).min(at_once),
            _ => self.chunk_frames(step),
        };
        // Each step runs beside its input, the step before it's output (the first reads a
        // view of the middles); from `split` on, also beside the last temporal upsampling's
        // output, whose frames they take a few at a time (views).
        let (mut caches, mut steps, mut input, mut held) = (0, Bytes::default(), 0, 0);
        let mut level = 0;
        for (i, step) in self.layout.path.iter().enumerate() {
            let out = outs[i];
            let w = self.video.width >> (levels - level);
            let frames = chunk(i);
            let (bytes, cache, output) = match *step {
                PathStep::Res { inp, out: o } => {
                    let mid = out.grown(1);
                    let cache = cached * (self.held_frame(inp, mid, 1, w) + self.held_frame(o, out, 1, w));
                    let output = frames * o * out.len() * w * self.e;
                    let held = crate::blocks::ResBlock::input_rows(out);
                    (self.res(frames, inp, o, out, held, w, history), cache, output)
                }
                PathStep::Up { c, temporal } => {
                    level += 1;
                    let low = out.grown(1).halved();
                    let cache = match temporal {
                        true => cached * c * low.len() * w * self.e,
                        false => 0,
                    };
                    // The last temporal upsampling writes all its frames at once.
                    let written = match i + 1 == split && self.video.latent_frames > 1 {
                        true => self.chunk_frames(i + 1),
                        false => chunk(i + 1),
                    };
                    let output = written * (c / 2) * out.len() * 2 * w * self.e;
                    (self.up(frames, c, temporal, out, w), cache, output)
                }
                PathStep::Out { c, out: o } => {
                    let cache = cached * self.held_frame(c, out, 1, w);
                    (self.head(frames, c, o, out, w), cache, 0)
                }
            };
            caches += cache;
            steps = steps.max(bytes.on(input + held));
            match i + 1 == split {
                true => (held, input) = (output, 0),
                false => input = output,
            }
        }
        steps.on(caches)
    }
}
