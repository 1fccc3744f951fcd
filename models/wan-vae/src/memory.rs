//! The bytes one rank of [`crate::WanVaeRank`] holds besides its weights while it decodes, as
//! the memory planner counts them, and the tile height that keeps them in bounds. Each term
//! names the code in `decoder.rs` and `blocks.rs` it models; keep them in step (the counting
//! allocator of `tests/tests/activation_memory.rs` holds them together).

use candle_core::DType;

use crate::layout::{Layout, PathStep};
use crate::rows::{tiles, Rows};
use crate::WanVaeConfig;

/// The temporaries a tile's path may take: the tile is the tallest whose path peak stays
/// under this (or one latent row's worth, if none does).
pub const TILE_TEMPORARIES: usize = 1 << 30;

/// Queries per block of the middle attention (`blocks::QUERY_BLOCK`).
const QUERY_BLOCK: usize = 1024;

/// Output pixels per tile of candle's CPU convolution (its `TILE_SIZE`).
const CPU_CONV_TILE: usize = 512;

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
    /// The decode of `band` (rows of the output frame) with the tallest tile, in whole latent
    /// rows, that keeps the path's temporaries under [`TILE_TEMPORARIES`].
    pub fn new(c: &WanVaeConfig, device: DecodeDevice, video: DecodeShape, band: Rows) -> Self {
        let factor = c.spatial_factor();
        let model = Model::new(c, device, video);
        let mut tile = band.len().div_ceil(factor) * factor;
        while tile > factor && model.path_peak(band, tile).0.peak > TILE_TEMPORARIES {
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
        let (f, z, c, e) = (self.video.latent_frames, self.layout.z, self.layout.middle, self.e);
        // `Decoder::decode`: the latents on the device, their de-normalised product in f32,
        // its cast, and `post_quant_conv`'s output, alive until the middles are made.
        let latents = f * z * h * w * (4 + 4 + e + e);
        // The middles: every latent frame's middle output, the band's window of rows.
        let (window, _) = self.layout.windows(band);
        let middles = f * c * window.len() * w * e;
        let middle = self.middle(h, w);
        let path = self.path_peak(band, tile_rows);
        // CPU ranks keep the decoded frames in their own memory, f32: while a tile decodes,
        // the tiles before it and its own frames so far (at most the band), and at the end
        // the band's joined copy beside them; GPU ranks copy them to the host.
        let band_frames = match self.cuda {
            true => 0,
            false => self.frames(f) * 3 * band.len() * self.video.width * 4,
        };
        DecodeMemory {
            peak: middles
                + (latents + middle.peak)
                    .max(path.0.peak + band_frames)
                    .max(2 * band_frames),
            pool_slack: if self.cuda {
                middle.largest.max(path.0.largest)
            } else {
                0
            },
            tile_rows,
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
        let (z, c, e) = (self.layout.z, self.layout.middle, self.e);
        let history = self.history();
        let caches = self.cached() * (z + 4 * c) * (h + 2) * (w + 2) * e;
        let all = Rows::all(h);
        let conv_in = self.conv(
            ConvCall {
                frames: 1,
                inp: z,
                out: c,
                taps: 3,
                k: 3,
                history,
            },
            all,
            w,
        );
        let res = self.res(1, c, c, all, w, history);
        // `FrameAttention::forward`: the norm, q/k/v from the 1×1 convolution (and its bias
        // add) with their contiguous copies, one query block's scores (scaled, in f32,
        // softmaxed, cast back) and every block's output, then the joined and transposed
        // output, the projection and the residual.
        let pixels = h * w;
        let block = pixels.min(QUERY_BLOCK);
        let input = c * pixels * e;
        let norm = self.norm(c * pixels, false);
        let qkv = 3 * c * pixels * e;
        let scores = block * pixels * (2 * e + 2 * 4);
        let attention = Bytes {
            peak: input + norm.max(qkv + 3 * input + scores + input).max(qkv + 5 * input),
            largest: scores.max(qkv),
        };
        // Each block beside its input: conv_in's output onward.
        let steps = conv_in.max(res.on(input)).max(attention);
        Bytes {
            peak: caches + steps.peak,
            largest: steps.largest,
        }
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

    /// The tallest of `band`'s tiles of `tile_rows` rows, for a chunk after the first (whose
    /// frames are the most): its peak with the path's frame caches.
    fn path_peak(&self, band: Rows, tile_rows: usize) -> (Bytes, usize) {
        tiles(band, tile_rows)
            .into_iter()
            .map(|tile| (self.path(tile), tile.len()))
            .fold((Bytes::default(), 0), |(a, rows), (b, r)| (a.max(b), rows.max(r)))
    }

    /// One tile's path, every step on the rows the decoder gives it.
    fn path(&self, tile: Rows) -> Bytes {
        let (_, outs) = self.layout.windows(tile);
        let levels = self
            .layout
            .path
            .iter()
            .filter(|s| matches!(s, PathStep::Up { .. }))
            .count();
        let (history, cached) = (self.history(), self.cached());
        // Chunks after the first decode `chunk_frames` frames at each step, the first one.
        let chunk = |step: usize| match self.video.latent_frames {
            1 => 1,
            _ => self.chunk_frames(step),
        };
        // Each step runs beside its input, the step before it's output (the first reads a
        // view of the middles).
        let (mut caches, mut steps, mut input) = (0, Bytes::default(), 0);
        let mut level = 0;
        for (i, step) in self.layout.path.iter().enumerate() {
            let out = outs[i];
            let w = self.video.width >> (levels - level);
            let frames = chunk(i);
            let (bytes, cache, output) = match *step {
                PathStep::Res { inp, out: o } => {
                    let mid = out.grown(1);
                    let cache = cached * (inp * (mid.len() + 2) + o * (out.len() + 2)) * (w + 2) * self.e;
                    let output = frames * o * out.len() * w * self.e;
                    (self.res(frames, inp, o, out, w, history), cache, output)
                }
                PathStep::Up { c, temporal } => {
                    level += 1;
                    let low = out.grown(1).halved();
                    let cache = match temporal {
                        true => cached * c * low.len() * w * self.e,
                        false => 0,
                    };
                    let output = chunk(i + 1) * (c / 2) * out.len() * 2 * w * self.e;
                    (self.up(frames, c, temporal, out, w), cache, output)
                }
                PathStep::Out { c, out: o } => {
                    let cache = cached * c * (out.len() + 2) * (w + 2) * self.e;
                    (self.head(frames, c, o, out, w), cache, 0)
                }
            };
            caches += cache;
            steps = steps.max(bytes.on(input));
            input = output;
        }
        steps.on(caches)
    }

    /// `ChannelNorm::forward` (and `forward_silu`) of `n` elements: in f32 the quotient and
    /// product (the input is its own f32 view); in 16 bits the f32 copy, quotient, cast and
    /// product, alive to the statement's end; then the SiLU's output beside the product.
    fn norm(&self, n: usize, silu: bool) -> usize {
        let product = match self.e {
            4 => 2 * 4 * n,
            e => 2 * 4 * n + 2 * e * n,
        };
        match silu {
            true => product.max(2 * self.e * n),
            false => product,
        }
    }

    /// `ResBlock::forward` of `frames` frames writing `out` (of width `w`), not counting its
    /// input: the skip (through a 1×1 convolution where the width changes), each half's norm
    /// and convolution, and the sum.
    fn res(&self, frames: usize, inp: usize, out: usize, rows: Rows, w: usize, history: usize) -> Bytes {
        let e = self.e;
        let mid = rows.grown(1);
        let read = mid.grown(1);
        let skip = match inp != out {
            true => frames * out * rows.len() * w * e,
            false => 0,
        };
        let shortcut = match inp != out {
            true => self.conv(
                ConvCall {
                    frames,
                    inp,
                    out,
                    taps: 1,
                    k: 1,
                    history: 0,
                },
                rows,
                w,
            ),
            false => Bytes::default(),
        };
        let normed1 = frames * inp * read.len() * w;
        let conv1 = self.conv(
            ConvCall {
                frames,
                inp,
                out,
                taps: 3,
                k: 3,
                history,
            },
            mid,
            w,
        );
        let h = frames * out * mid.len() * w;
        let conv2 = self.conv(
            ConvCall {
                frames,
                inp: out,
                out,
                taps: 3,
                k: 3,
                history,
            },
            rows,
            w,
        );
        let written = frames * out * rows.len() * w * e;
        shortcut
            .max(
                Bytes {
                    peak: self.norm(normed1, true),
                    largest: 0,
                }
                .on(skip),
            )
            .max(conv1.on(skip + normed1 * e))
            .max(
                Bytes {
                    peak: self.norm(h, true),
                    largest: 0,
                }
                .on(skip + h * e),
            )
            .max(conv2.on(skip + h * e))
            .max(
                Bytes {
                    peak: 2 * written,
                    largest: written,
                }
                .on(skip),
            )
    }

    /// `Upsample::forward` of `frames` frames at the lower resolution (width `w`), writing
    /// `out` rows of the frame twice as tall: the time convolution's doubled frames, the
    /// upsampled input and the convolution.
    fn up(&self, frames: usize, c: usize, temporal: bool, out: Rows, w: usize) -> Bytes {
        let e = self.e;
        let low = out.grown(1).halved();
        let (time, doubled, after) = match temporal && self.video.latent_frames > 1 {
            true => (
                self.conv(
                    ConvCall {
                        frames,
                        inp: c,
                        out: 2 * c,
                        taps: 3,
                        k: 1,
                        history: self.history(),
                    },
                    low,
                    w,
                ),
                2 * frames * c * low.len() * w * e,
                2 * frames,
            ),
            false => (Bytes::default(), 0, frames),
        };
        let up = after * c * 2 * low.len() * 2 * w * e;
        let conv = self.conv(
            ConvCall {
                frames: after,
                inp: c,
                out: c / 2,
                taps: 1,
                k: 3,
                history: 0,
            },
            out,
            2 * w,
        );
        time.max(conv.on(doubled + up)).max(Bytes {
            peak: doubled + up,
            largest: up,
        })
    }

    /// `Head::forward` and `clamp_pixels`: the norm, the convolution to the pixels' channels,
    /// and the clamped f32 copy.
    fn head(&self, frames: usize, c: usize, out: usize, rows: Rows, w: usize) -> Bytes {
        let read = rows.grown(1);
        let normed = frames * c * read.len() * w;
        let conv = self.conv(
            ConvCall {
                frames,
                inp: c,
                out,
                taps: 3,
                k: 3,
                history: self.history(),
            },
            rows,
            w,
        );
        let pixels = frames * out * rows.len() * w;
        let clamp = pixels * self.e + 2 * pixels * 4;
        Bytes {
            peak: self.norm(normed, true),
            largest: 0,
        }
        .max(conv.on(normed * self.e))
        .max(Bytes {
            peak: clamp,
            largest: pixels * 4,
        })
    }

    /// `Conv::forward` writing `rows` (of width `w`), not counting its input: the rows' and
    /// columns' zero padding, the frames before them with the causal taps stacked along the
    /// channels, candle's convolution, and the bias.
    fn conv(&self, call: ConvCall, rows: Rows, w: usize) -> Bytes {
        let ConvCall {
            frames,
            inp,
            out,
            taps,
            k,
            history,
        } = call;
        let e = self.e;
        let reach = k / 2;
        let (top, bottom) = rows.edge_padding(reach);
        let padded_rows = rows.len() + 2 * reach;
        let area = padded_rows * (w + 2 * reach);
        let frame = inp * area * e;
        // Each pad is a new tensor, made while the one before it lives.
        let rows_padded = frames * inp * padded_rows * w * e;
        let pads = match (top + bottom > 0, reach > 0) {
            (true, true) => rows_padded + frames * frame,
            (true, false) => rows_padded,
            (false, true) => frames * frame,
            (false, false) => 0,
        };
        let input = match reach {
            0 => 0,
            _ => frames * frame,
        };
        // The history joined with the input (`seen`), zero frames before it while the history
        // is short, and the taps stacked; the new cache replaces the old.
        let stacked = match taps {
            1 => input,
            _ => taps * frames * frame,
        };
        let taps_phase = match taps {
            1 => 0,
            _ => {
                // Without history `seen` is the input itself.
                let seen = match history {
                    0 => 0,
                    _ => (history + frames) * frame,
                };
                let zeros = taps - 1 - history.min(taps - 1);
                let padded = match zeros {
                    0 => 0,
                    _ => (zeros + history + frames) * frame,
                };
                input + seen + padded + stacked
            }
        };
        let written = frames * rows.len() * w * out * e;
        // candle's CUDA convolution unfolds the input (im2col), multiplies, and transposes
        // the product into place; its CPU one copies the input pixel-major and unfolds one
        // tile of output pixels at a time beside the output; a 1×1 one copies one frame.
        let convolution = match (self.cuda, k) {
            (true, _) => {
                let unfolded = frames * rows.len() * w * k * k * taps * inp * e;
                Bytes {
                    peak: stacked + unfolded + 2 * written,
                    largest: unfolded,
                }
            }
            (false, 1) => Bytes {
                peak: stacked + inp * rows.len() * w * e + written,
                largest: written,
            },
            (false, _) => {
                let unfolded = CPU_CONV_TILE * k * k * taps * inp * e;
                Bytes {
                    peak: 2 * stacked + out * k * k * taps * inp * e + unfolded + written,
                    largest: written,
                }
            }
        };
        let bias = Bytes {
            peak: stacked + 2 * written,
            largest: written,
        };
        Bytes {
            peak: pads.max(taps_phase),
            largest: 0,
        }
        .max(convolution)
        .max(bias)
    }
}
