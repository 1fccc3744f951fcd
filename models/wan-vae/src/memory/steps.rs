//! The bytes of each layer of the decoder's path, as `blocks.rs` and `conv.rs` allocate them.

use tpinfer_kernels::{cudnn_workspace_bound, ConvPath};

use super::{Bytes, ConvCall, Model};
use crate::rows::Rows;

impl Model {
    /// `ChannelNorm::forward` (and `forward_silu`) of `n` elements: one fused pass that
    /// allocates only its output.
    pub(super) fn norm(&self, n: usize) -> usize {
        self.e * n
    }

    /// `ResBlock::forward` of `frames` frames writing `rows` (of width `w`) from an input
    /// holding `held` rows, not counting the input: the skip (through a 1×1 convolution where
    /// the width changes), each half's norm and convolution, the second adding the skip.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn res(
        &self,
        frames: usize,
        inp: usize,
        out: usize,
        rows: Rows,
        held: Rows,
        w: usize,
        history: usize,
    ) -> Bytes {
        let e = self.e;
        let mid = rows.grown(1);
        let read = mid.grown(1);
        // The skip's rows of the input are packed where they are all of them or of one frame.
        let skip_packed = frames == 1 || rows == held;
        let (skip, shortcut) = match inp != out {
            true => (
                frames * out * rows.len() * w * e,
                self.conv(ConvCall::new(frames, inp, out, 1, 1, 0).packed(skip_packed), rows, w),
            ),
            false => (0, Bytes::default()),
        };
        let normed1 = frames * inp * read.len() * w * e;
        let conv1 = self.conv(ConvCall::new(frames, inp, out, 3, 3, history), mid, w);
        let h = frames * out * mid.len() * w * e;
        let conv2 = self.conv(
            ConvCall::new(frames, out, out, 3, 3, history).residual(inp != out || skip_packed),
            rows,
            w,
        );
        let normed = |n: usize| Bytes {
            peak: self.norm(n / e),
            largest: 0,
        };
        shortcut
            .max(normed(normed1).on(skip))
            .max(conv1.on(skip + normed1))
            .max(normed(h).on(skip + h))
            .max(conv2.on(skip + h))
    }

    /// `Upsample::forward` of `frames` frames at the lower resolution (width `w`), writing
    /// `out` rows of the frame twice as tall: the time convolution's doubled frames and their
    /// reordered copy, the upsampled copy and the convolution.
    pub(super) fn up(&self, frames: usize, c: usize, temporal: bool, out: Rows, w: usize) -> Bytes {
        let e = self.e;
        let low = out.grown(1).halved();
        let (time, doubled, after) = match temporal && self.video.latent_frames > 1 {
            true => (
                self.conv(ConvCall::new(frames, c, 2 * c, 3, 1, self.history()), low, w),
                2 * frames * c * low.len() * w * e,
                2 * frames,
            ),
            false => (Bytes::default(), 0, frames),
        };
        let up = after * c * 2 * low.len() * 2 * w * e;
        let up_rows = Rows {
            start: 2 * low.start,
            end: 2 * low.end,
            height: out.height,
        };
        let packed = after == 1 || up_rows == out.grown(1);
        let conv = self.conv(ConvCall::new(after, c, c / 2, 1, 3, 0).packed(packed), out, 2 * w);
        time.max(Bytes {
            peak: 2 * doubled,
            largest: doubled,
        })
        .max(Bytes {
            peak: doubled + up,
            largest: up,
        })
        .max(conv.on(up))
    }

    /// `Head::forward` and `clamp_pixels`: the norm, the convolution to the pixels' channels,
    /// and the clamped f32 copy (through an f32 cast of another dtype).
    pub(super) fn head(&self, frames: usize, c: usize, out: usize, rows: Rows, w: usize) -> Bytes {
        let read = rows.grown(1);
        let normed = frames * c * read.len() * w * self.e;
        let conv = self.conv(ConvCall::new(frames, c, out, 3, 3, self.history()), rows, w);
        let pixels = frames * out * rows.len() * w;
        let cast = match self.e {
            4 => 0,
            _ => pixels * 4,
        };
        let clamp = pixels * self.e + cast + 2 * pixels * 4;
        Bytes {
            peak: self.norm(normed / self.e),
            largest: 0,
        }
        .max(conv.on(normed))
        .max(Bytes {
            peak: clamp,
            largest: pixels * 4,
        })
    }

    /// `Conv::forward` writing `rows` (of width `w`), not counting its input or residual,
    /// counting its output: zero rows where the rows have the frame's edge on one side only,
    /// the history joined with the input; then the convolution of the device's path.
    pub(super) fn conv(&self, call: ConvCall, rows: Rows, w: usize) -> Bytes {
        let ConvCall {
            frames,
            inp,
            taps,
            k,
            history,
            ..
        } = call;
        let reach = k / 2;
        let (top, bottom) = rows.edge_padding(reach);
        let frame = self.held_frame(inp, rows, reach, w);
        let padded = match top != bottom {
            true => frames * frame,
            false => 0,
        };
        // The history and the input joined, after zero frames while the history is short
        // (on CPU ranks a tensor of them, joined by candle's `cat`); the new cache copy
        // replaces the old one, which the caches' term counts.
        let zeros = (taps - 1).saturating_sub(history);
        let joined = match taps {
            1 => 0,
            _ => (taps - 1 + frames) * frame,
        };
        let zero_frames = match (self.cuda, taps) {
            (false, 2..) => zeros * frame,
            _ => 0,
        };
        let joining = Bytes {
            peak: padded + joined + zero_frames,
            largest: 0,
        };
        // What the convolution reads, if it is a new tensor: the joined frames; else the
        // padded input; else the caller's rows, a view (packed or not).
        let (read, view) = match (joined, padded) {
            (0, 0) => (0, true),
            (0, input) => (input, false),
            (joined, _) => (joined, false),
        };
        let convolution = match (self.cuda, self.conv) {
            (true, ConvPath::Cudnn) => self.cudnn_conv(call, rows, w, view, frame),
            _ => self.taps_conv(call, rows, w, view, frame),
        };
        joining.max(convolution.on(read))
    }

    /// `conv_frames_bias` through cuDNN: a packed copy of an unpacked input view (and of an
    /// unpacked residual), then the output, with the algorithm's workspace beside it.
    fn cudnn_conv(&self, call: ConvCall, rows: Rows, w: usize, view: bool, frame: usize) -> Bytes {
        let e = self.e;
        let input = (call.taps - 1 + call.frames) * frame;
        let copy = match view && !call.packed {
            true => input,
            false => 0,
        };
        let written = call.frames * rows.len() * w * call.out * e;
        let residual = match call.residual {
            Some(false) => written,
            _ => 0,
        };
        let workspace = cudnn_workspace_bound(input / e, written / e, self.dtype);
        Bytes {
            peak: copy + residual + written + workspace,
            largest: written.max(workspace),
        }
    }

    /// `conv_frames_bias` as one product per tap: the input zero-padded (rows, then columns),
    /// then per tap its window's packed copy (none for a 1×1 convolution of a packed input),
    /// the product and the running sum; the padded input freed, the bias added, the residual.
    fn taps_conv(&self, call: ConvCall, rows: Rows, w: usize, view: bool, frame: usize) -> Bytes {
        let ConvCall {
            frames,
            inp,
            out,
            taps,
            k,
            ..
        } = call;
        let e = self.e;
        let reach = k / 2;
        let (top, bottom) = rows.edge_padding(reach);
        let even = top.min(bottom);
        let input_frames = taps - 1 + frames;
        let held_rows = frame / (inp * w * e);
        let rows_padded = match even {
            0 => 0,
            _ => input_frames * inp * (held_rows + 2 * even) * w * e,
        };
        let cols_padded = match reach {
            0 => 0,
            _ => input_frames * inp * (held_rows + 2 * even) * (w + 2 * reach) * e,
        };
        let padded = match (rows_padded, cols_padded) {
            (r, 0) => r,
            (_, c) => c,
        };
        // A 1×1 window is a run of whole frames: packed where its input is.
        let window = match k > 1 || (view && !call.packed) {
            true => frames * rows.len() * w * inp * e,
            false => 0,
        };
        let written = frames * rows.len() * w * out * e;
        let taps_of = taps * k * k;
        let products = match taps_of {
            1 => window + written,
            _ => 2 * written + window.max(written),
        };
        // The bias added beside the sum, then the residual beside that.
        Bytes {
            peak: (rows_padded + cols_padded).max(padded + products).max(2 * written),
            largest: written,
        }
    }
}
