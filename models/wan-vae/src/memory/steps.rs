//! The bytes of each layer of the decoder's path, as `blocks.rs` allocates them.

use tpinfer_kernels::{cudnn_workspace_bound, ConvPath};

use super::{Bytes, ConvCall, Model};
use crate::conv::unfold_chunk_rows;
use crate::rows::Rows;

/// Output pixels per tile of candle's CPU convolution (its `TILE_SIZE`).
const CPU_CONV_TILE: usize = 512;

impl Model {
    /// `ChannelNorm::forward` (and `forward_silu`) of `n` elements: one fused pass that
    /// allocates only its output.
    pub(super) fn norm(&self, n: usize) -> usize {
        self.e * n
    }

    /// `ResBlock::forward` of `frames` frames writing `out` (of width `w`), not counting its
    /// input: the skip (through a 1×1 convolution where the width changes), each half's norm
    /// and convolution, and the sum.
    pub(super) fn res(&self, frames: usize, inp: usize, out: usize, rows: Rows, w: usize, history: usize) -> Bytes {
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
                    peak: self.norm(normed1),
                    largest: 0,
                }
                .on(skip),
            )
            .max(conv1.on(skip + normed1 * e))
            .max(
                Bytes {
                    peak: self.norm(h),
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
    pub(super) fn up(&self, frames: usize, c: usize, temporal: bool, out: Rows, w: usize) -> Bytes {
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
    pub(super) fn head(&self, frames: usize, c: usize, out: usize, rows: Rows, w: usize) -> Bytes {
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
            peak: self.norm(normed),
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
    pub(super) fn conv(&self, call: ConvCall, rows: Rows, w: usize) -> Bytes {
        if self.cuda && self.conv == ConvPath::Cudnn {
            return self.cudnn_conv(call, rows, w);
        }
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
        // candle's CUDA convolution unfolds the input (im2col), multiplies, and transposes the
        // product into place; its CPU one copies the input pixel-major and unfolds one tile of
        // output pixels at a time beside the output; a 1×1 one copies one frame. On CUDA, in
        // chunks of rows where the whole would unfold more than `UNFOLD_BYTES`, each written
        // into the preallocated output. The bias is added after.
        let unfolded_row = frames * w * k * k * taps * inp * e;
        let chunk = unfold_chunk_rows(unfolded_row);
        let chunked = self.cuda && chunk < rows.len();
        let convolution = match (self.cuda, k) {
            (true, _) if chunked => {
                let (unfolded, part) = (chunk * unfolded_row, frames * chunk * w * out * e);
                Bytes {
                    peak: stacked + written + unfolded + 2 * part,
                    largest: unfolded.max(written),
                }
            }
            (true, _) => {
                let unfolded = rows.len() * unfolded_row;
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
        let bias = match chunked {
            true => Bytes::default(),
            false => Bytes {
                peak: stacked + 2 * written,
                largest: written,
            },
        };
        Bytes {
            peak: pads.max(taps_phase),
            largest: 0,
        }
        .max(convolution)
        .max(bias)
    }

    /// `Conv::forward` through cuDNN (see [`Self::conv`]): zero rows only where the tile has
    /// the frame's edge on one side; the history joined with the input (`seen`), its cache
    /// copy, zero frames before it while the history is short; a contiguous copy of an input
    /// that is a view of some rows; then cuDNN writing into a copy of the bias, with its
    /// workspace beside.
    fn cudnn_conv(&self, call: ConvCall, rows: Rows, w: usize) -> Bytes {
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
        let frame = self.held_frame(inp, rows, reach, w);
        let padded = match top != bottom {
            true => frames * frame,
            false => 0,
        };
        let zeros = (taps - 1).saturating_sub(history);
        let seen = match (taps, history) {
            (1, _) | (_, 0) => 0,
            _ => (history + frames) * frame,
        };
        let zero_padded = match (taps, zeros) {
            (1, _) | (_, 0) => 0,
            _ => (zeros + history + frames) * frame,
        };
        let joining = padded + seen + zero_padded;
        // What the convolution reads, if it is a new tensor: the joined frames; else the
        // padded input; else a contiguous copy of the caller's rows where they are a part of
        // its tensor (a 1×1 shortcut reads its block's output rows).
        let read = match (zero_padded, seen, padded) {
            (0, 0, 0) if reach == 0 && taps == 1 => frames * frame,
            (0, 0, input) => input,
            (0, seen, _) => seen,
            (zero_padded, _, _) => zero_padded,
        };
        let written = frames * rows.len() * w * out * e;
        let workspace = cudnn_workspace_bound((taps - 1 + frames) * frame / e, written / e, self.dtype);
        Bytes {
            peak: joining,
            largest: 0,
        }
        .max(Bytes {
            peak: read + written + workspace,
            largest: written.max(workspace),
        })
    }
}
