//! The bytes one rank of [`crate::WanVaeEncoder`] holds besides its weights while it encodes,
//! as `encoder.rs` allocates them (the counting allocator of `tests/tests/activation_memory.rs`
//! holds them together). Every rank encodes whole frames.

use super::{Bytes, ConvCall, DecodeDevice, DecodeShape, Model};
use crate::rows::Rows;
use crate::WanVaeConfig;

/// Pixel frames per latent frame after the first (`encoder.rs`'s chunks).
const FRAMES_PER_CHUNK: usize = 4;

/// One encode's bytes on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeMemory {
    /// The most bytes alive at once.
    pub peak: usize,
    /// What a stream-ordered pool may hold beyond them: the largest temporary.
    pub pool_slack: usize,
}

impl EncodeMemory {
    /// Encoding `frames` (1 + 4k) of `height × width` pixels (multiples of 8) on `device`.
    pub fn new(c: &WanVaeConfig, device: DecodeDevice, frames: usize, height: usize, width: usize) -> Self {
        let latent_frames = 1 + frames.saturating_sub(1) / FRAMES_PER_CHUNK;
        let model = Model::new(
            c,
            device,
            DecodeShape {
                latent_frames,
                height,
                width,
            },
        );
        model.encode(c, frames, height, width)
    }
}

impl Model {
    fn encode(&self, c: &WanVaeConfig, frames: usize, height: usize, width: usize) -> EncodeMemory {
        let e = self.e;
        // `WanVaeEncoder::encode`: the pixels on the device (an f32 copy where they come from
        // the host), cast, and their channels-last copy, which stays for the whole encode.
        let pixels = frames * 3 * height * width;
        let x = pixels * e;
        let upload = match self.cuda {
            true => pixels * 4,
            false => 0,
        };
        let cast = match e {
            4 => 0,
            _ => pixels * e,
        };
        let setup = upload + cast + x;
        // The chunks after the first hold the most (four frames, two of history each).
        let chunk = match frames {
            1 => 1,
            _ => FRAMES_PER_CHUNK,
        };
        let path = self.encode_chunk(c, chunk, height, width);
        // Every chunk's moments, kept until they are joined.
        let (h8, w8) = (height / 8, width / 8);
        let latent_frames = self.video.latent_frames;
        let moments = latent_frames * h8 * w8 * 2 * c.z_dim * e;
        // The end: the moments joined beside the list, the mean in f32 (cast where it was
        // not), normalised in two steps, and its channels-first copy.
        let mean = latent_frames * h8 * w8 * c.z_dim * 4;
        let widened = match e {
            4 => 0,
            _ => mean,
        };
        let end = 2 * moments + widened + 2 * mean;
        EncodeMemory {
            peak: setup.max(x + path.peak + moments).max(end),
            pool_slack: match self.cuda {
                true => path.largest,
                false => 0,
            },
        }
    }

    /// `encode_chunk` on `n` frames, with the causal caches: in the steady state (a video's
    /// chunks after the first) every convolution's, held from the chunk before; in an image's
    /// only chunk, those of the convolutions it has passed (each writes its cache as it runs).
    fn encode_chunk(&self, c: &WanVaeConfig, n: usize, h: usize, w: usize) -> Bytes {
        let layers = self.encode_layers(c, n, h, w);
        let steady = self.video.latent_frames > 1;
        let all: usize = layers.iter().map(|(cache, _)| cache).sum();
        let mut passed = 0;
        layers.into_iter().fold(Bytes::default(), |peak, (cache, bytes)| {
            passed += cache;
            peak.max(bytes.on(if steady { all } else { passed }))
        })
    }

    /// Each layer of `encode_chunk` on `n` frames: the cache it holds, and its bytes beside
    /// its input (counted) without the caches.
    fn encode_layers(&self, c: &WanVaeConfig, mut n: usize, mut h: usize, mut w: usize) -> Vec<(usize, Bytes)> {
        let e = self.e;
        let (history, cached) = (self.history(), self.cached());
        let held = |channels: usize, h: usize, w: usize| self.held_frame(channels, Rows::all(h), 1, w);
        let widths: Vec<usize> = std::iter::once(1)
            .chain(c.dim_mult.iter().copied())
            .map(|m| c.encoder_base_dim * m)
            .collect();
        let base = c.encoder_base_dim;
        // conv_in reads the pixels' chunk, a view.
        let mut layers = vec![(
            cached * held(3, h, w),
            self.conv(ConvCall::new(n, 3, base, 3, 3, history), Rows::all(h), w),
        )];
        let mut input = n * base * h * w * e;
        let levels = c.dim_mult.len();
        for level in 0..levels {
            let (mut inp, out) = (widths[level], widths[level + 1]);
            for _ in 0..c.num_res_blocks {
                let res = self.res(n, inp, out, Rows::all(h), Rows::all(h), w, history);
                layers.push((cached * (held(inp, h, w) + held(out, h, w)), res.on(input)));
                input = n * out * h * w * e;
                inp = out;
            }
            if level + 1 == levels {
                break;
            }
            // `Downsample::forward` beside its input: the convolution at stride 1, then its
            // outputs at odd rows and columns copied out.
            let full = self.conv(ConvCall::new(n, out, out, 1, 3, 0), Rows::all(h), w);
            let strided = n * out * (h / 2) * (w / 2) * e;
            let subsample = Bytes {
                peak: input + n * out * h * w * e + strided,
                largest: strided,
            };
            layers.push((0, full.on(input).max(subsample)));
            let before_down = input;
            (h, w) = (h / 2, w / 2);
            input = strided;
            let temporal = c.temperal_downsample.get(level).copied().unwrap_or(false);
            if temporal && n > 1 {
                // `TimeDown::forward`: the last frame kept in the cache (and the one it
                // replaces, read first), the frames joined after it, the convolution over
                // three frames of stride 1, and every other output copied out.
                let frame = out * h * w * e;
                let kept = (n - 1).div_ceil(2);
                let join = self.conv(ConvCall::new(n - 1, out, out, 3, 1, history), Rows::all(h), w);
                let time = Bytes {
                    peak: (n + 1) * frame + n * frame + frame,
                    largest: (n + 1) * frame,
                }
                .max(join.on(frame))
                .max(Bytes {
                    peak: (n + 1) * frame + (n - 1) * frame + kept * frame + frame,
                    largest: kept * frame,
                });
                layers.push((frame, time.on(before_down)));
                n = kept;
                input = n * frame;
            }
        }
        // The middle at the last level's width: residual, attention (frame by frame),
        // residual; then the head's norm and convolution to the moments, and `quant_conv`.
        let middle = widths[levels];
        let moments = 2 * c.z_dim;
        let all = Rows::all(h);
        let res = self.res(n, middle, middle, all, all, w, history).on(input);
        let res_cache = 2 * cached * held(middle, h, w);
        let attention = Bytes {
            peak: n * self.attention(middle, h, w).peak,
            largest: self.attention(middle, h, w).largest,
        }
        .on(input);
        let normed = n * middle * all.grown(1).len() * w * e;
        let head = Bytes {
            peak: self.norm(normed / e),
            largest: 0,
        }
        .max(
            self.conv(ConvCall::new(n, middle, moments, 3, 3, history), all, w)
                .on(normed),
        )
        .on(input);
        let head_out = n * moments * h * w * e;
        let quant = self
            .conv(ConvCall::new(n, moments, moments, 1, 1, 0), all, w)
            .on(head_out);
        layers.extend([
            (res_cache, res),
            (0, attention),
            (res_cache, res),
            (cached * held(middle, h, w), head),
            (0, quant),
        ]);
        layers
    }
}
