//! cuDNN's convolution for the video VAE, on its frames-first activations. candle's own CUDA
//! convolution unfolds its input first (im2col, k² copies of every pixel) with 64-bit index
//! arithmetic per copied element, which took 30 s for a 480p VAE decode that cuDNN (through
//! PyTorch) runs in under 2.

use candle_core::{DType, Device, Result, Tensor};

/// How a device runs the VAE's convolutions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// [`conv_frames_bias`]: cuDNN's, reading the causal taps from the frames themselves,
    /// padding as it reads, on channels-last copies of its input and output.
    Cudnn,
    /// candle's, on the taps stacked along the channels and the frame padded: on CUDA it
    /// unfolds its whole input first (its callers bound that by running it on chunks).
    Unfolded,
}

/// The path on `device`: cuDNN's on CUDA where it is installed (opening it on the first call).
pub fn conv_path(device: &Device) -> ConvPath {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if crate::cudnn::available() => ConvPath::Cudnn,
        _ => ConvPath::Unfolded,
    }
}

/// The installed cuDNN's version (e.g. 91900 for 9.19.0), opening it on the first call;
/// `None` where it is not installed or in a build without CUDA.
pub fn cudnn_version() -> Option<usize> {
    #[cfg(feature = "cuda")]
    return crate::cudnn::version();
    #[cfg(not(feature = "cuda"))]
    None
}

/// The most a cuDNN convolution of `input` elements into `output` allocates besides its
/// output: channels-last copies of both, which its tensor-core kernels read and write, and
/// its algorithm's workspace, which may take as much again and 16 MiB more.
pub fn cudnn_workspace_bound(input: usize, output: usize, dtype: DType) -> usize {
    2 * (input + output) * dtype.size_in_bytes() + INDEX_TABLE_BYTES
}

/// Workspace a cuDNN algorithm may take besides the size of its input and output: the
/// implicit GEMMs' index tables.
pub(crate) const INDEX_TABLE_BYTES: usize = 16 << 20;

/// A filter `[o, c, kt, kh, kw]` (over `kt` consecutive frames) or `[o, c, kh, kw]` (within
/// each frame) as [`conv_frames_bias`] takes it: channels last, `[o, kt, kh, kw, c]`.
pub fn channels_last_filter(w: &Tensor) -> Result<Tensor> {
    match *w.dims() {
        [_, _, _, _, _] => w.permute((0, 2, 3, 4, 1))?.contiguous(),
        [o, c, kh, kw] => w.reshape((o, c, 1, kh, kw))?.permute((0, 2, 3, 4, 1))?.contiguous(),
        _ => candle_core::bail!("channels_last_filter: filter {:?} is neither 4-D nor 5-D", w.dims()),
    }
}

/// `x` `[frames, c, h, w]` convolved with `w` `[o, kt, kh, kw, c]` (over `kt` consecutive
/// frames, channels last: [`channels_last_filter`]) after `pad[0]` zero rows and `pad[1]`
/// zero columns on each side, plus `b` `[o]`: `[frames − kt + 1, o, h + 2·pad[0] − kh + 1,
/// w + 2·pad[1] − kw + 1]`. Cross-correlation, stride 1, on the [`ConvPath::Cudnn`] path only.
pub fn conv_frames_bias(x: &Tensor, w: &Tensor, b: &Tensor, pad: [usize; 2]) -> Result<Tensor> {
    let (frames, c, h, width) = x.dims4()?;
    let (o, kt, kh, kw, wc) = w.dims5()?;
    if wc != c
        || b.dims() != [o]
        || kt > frames
        || kh > h + 2 * pad[0]
        || kw > width + 2 * pad[1]
        || w.dtype() != x.dtype()
        || b.dtype() != x.dtype()
    {
        candle_core::bail!(
            "conv_frames_bias: input {:?} {:?}, filter {:?} {:?}, bias {:?} {:?} and padding {pad:?} do not fit",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype(),
            b.dims(),
            b.dtype()
        );
    }
    match conv_path(x.device()) {
        #[cfg(feature = "cuda")]
        ConvPath::Cudnn => cuda::conv_frames_bias(x, w, b, [o, wc, kt, kh, kw], pad),
        _ => candle_core::bail!(
            "conv_frames_bias runs on cuDNN, which {:?} does not have",
            x.device().location()
        ),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::{Device, Result, Tensor};

    use crate::cudnn::{convolve_into, ConvShape};
    use crate::launch::device_address;

    /// cuDNN indexes tensors with 32-bit integers: a larger video runs a few output frames
    /// at a time.
    const MAX_ELEMENTS: usize = i32::MAX as usize;

    pub(super) fn conv_frames_bias(
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        filter: [usize; 5],
        pad: [usize; 2],
    ) -> Result<Tensor> {
        let Device::Cuda(dev) = x.device() else {
            candle_core::bail!("conv_frames_bias: cuDNN runs on CUDA tensors");
        };
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let (frames, c, h, width) = x.dims4()?;
        let [o, _, kt, _, _] = filter;
        let whole = ConvShape {
            input: [frames, c, h, width],
            filter,
            pad,
            dtype: x.dtype(),
        };
        let out = whole.output();
        let bias = b.reshape((1, o, 1, 1))?.broadcast_as(out.as_slice())?;
        // A fresh buffer in every case: `contiguous` of an already contiguous view (a 1×1
        // output of one frame) would hand back the bias's own storage.
        let y = match bias.is_contiguous() {
            true => Tensor::zeros(out.as_slice(), b.dtype(), x.device())?.broadcast_add(&bias)?,
            false => bias.contiguous()?,
        };
        let (in_frame, out_frame) = (c * h * width, out[1] * out[2] * out[3]);
        // Output frames per call: their input frames (kt − 1 more) and their output within
        // cuDNN's indexing.
        let per_call = (MAX_ELEMENTS / in_frame.max(1))
            .saturating_sub(kt - 1)
            .min(MAX_ELEMENTS / out_frame.max(1))
            .min(out[0]);
        if per_call == 0 {
            candle_core::bail!(
                "conv_frames_bias: one frame of {:?} exceeds cuDNN's 2³¹ elements",
                x.dims()
            );
        }
        let (x_address, w_address, y_address) = (device_address(&x)?, device_address(&w)?, device_address(&y)?);
        let size = x.dtype().size_in_bytes() as u64;
        for first in (0..out[0]).step_by(per_call) {
            let count = per_call.min(out[0] - first);
            let shape = ConvShape {
                input: [count + kt - 1, c, h, width],
                ..whole
            };
            let (x_at, y_at) = ((first * in_frame) as u64, (first * out_frame) as u64);
            // SAFETY: x, w and y are contiguous CUDA tensors holding the frames described
            // (input frames `first..first + count + kt − 1`, output frames
            // `first..first + count`), and y is a fresh buffer.
            unsafe {
                convolve_into(dev, &shape, x_address + x_at * size, w_address, y_address + y_at * size)?;
            }
        }
        Ok(y)
    }
}
