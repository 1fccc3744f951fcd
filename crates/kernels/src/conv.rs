//! The video VAE's convolutions, on its channels-last frames (`[frames, h, w, c]`): cuDNN's
//! where it is installed, else a matrix product per tap. candle's own CUDA convolution
//! unfolds its input first (im2col, k² copies of every pixel) with 64-bit index arithmetic
//! per copied element, which took 30 s for a 480p VAE decode that cuDNN (through PyTorch)
//! runs in under 2; and it takes NCHW, which would cost a transposed copy of every input and
//! output.

use candle_core::{DType, Device, Result, Tensor};

/// How a device runs the VAE's convolutions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// cuDNN's, reading the causal taps from the frames themselves, padding as it reads, with
    /// the bias and a residual added in its epilogue.
    Cudnn,
    /// One matrix product per tap (time, row, column) over a copy of the input shifted by it,
    /// summed: candle's CPU and CUDA matmuls.
    Taps,
}

/// The path on `device`: cuDNN's on CUDA where it is installed (opening it on the first call).
pub fn conv_path(device: &Device) -> ConvPath {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if crate::cudnn::available() => ConvPath::Cudnn,
        _ => ConvPath::Taps,
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
/// output: its algorithm's workspace, which the algorithm choice keeps within this. In bf16
/// and f16 that is the implicit GEMMs' index tables, all of which the convolution allocates
/// whatever its algorithm takes; in f32 the fastest algorithm also takes
/// the size of the input and output (on an H200 with cuDNN 9.19: at most 16 MiB + 415 bytes in
/// bf16 at 480p, and up to 640 MiB in f32, scripts/gpu/vae-workspaces.sh).
pub fn cudnn_workspace_bound(input: usize, output: usize, dtype: DType) -> usize {
    match dtype.size_in_bytes() {
        4.. => (input + output) * dtype.size_in_bytes() + INDEX_TABLE_BYTES,
        _ => INDEX_TABLE_BYTES,
    }
}

/// The workspace a cuDNN convolution of `input` elements into `output` allocates when its
/// algorithm takes `needed` bytes: in 16 bits its whole [`cudnn_workspace_bound`], whatever
/// the algorithm takes (0 to 16 MiB in a 480p VAE decode, 0 to 7 MiB in an encode), so that
/// the pool hands one block size from each convolution to the next and the plan's count is
/// the allocation; in f32 what the algorithm takes, as its bound grows with the input and
/// output, to hundreds of MiB.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cudnn_workspace_allocation(needed: usize, input: usize, output: usize, dtype: DType) -> usize {
    match dtype.size_in_bytes() {
        4.. => needed,
        _ => needed.max(cudnn_workspace_bound(input, output, dtype)),
    }
}

/// Workspace a cuDNN algorithm may take besides the size of its input and output: the
/// implicit GEMMs' index tables.
const INDEX_TABLE_BYTES: usize = 32 << 20;

/// A checkpoint's filter `[o, c, kt, kh, kw]` (over `kt` consecutive frames) or `[o, c, kh,
/// kw]` (within each frame) as [`conv_frames_bias`] takes it on `path`: channels last, `[o,
/// kt, kh, kw, c]`, for cuDNN; for the taps path one `[c, o]` matrix per tap, `[kt·kh·kw, c,
/// o]`, each tap's product then reading a packed matrix.
pub fn conv_filter(w: &Tensor, path: ConvPath) -> Result<Tensor> {
    let w = match *w.dims() {
        [_, _, _, _, _] => w.clone(),
        [o, c, kh, kw] => w.reshape((o, c, 1, kh, kw))?,
        _ => candle_core::bail!("conv_filter: filter {:?} is neither 4-D nor 5-D", w.dims()),
    };
    let (o, c, kt, kh, kw) = w.dims5()?;
    match path {
        ConvPath::Cudnn => w.permute((0, 2, 3, 4, 1))?.contiguous(),
        ConvPath::Taps => w.reshape((o, c, kt * kh * kw))?.permute((2, 1, 0))?.contiguous(),
    }
}

/// `x` `[frames, h, w, c]` (channels last) convolved with `filter` ([`conv_filter`]'s for
/// `x`'s device: `[o, kt, kh, kw, c]` taken over `kt` consecutive frames) after `pad[0]`
/// zero rows and `pad[1]` zero columns on each side, plus `b` `[o]`, plus `residual` where
/// given: `[frames − kt + 1, h + 2·pad[0] − kh + 1, w + 2·pad[1] − kw + 1, o]`.
/// Cross-correlation, stride 1; `shape` is the filter's `[o, kt, kh, kw, c]` on both paths.
pub fn conv_frames_bias(
    x: &Tensor,
    filter: &Tensor,
    shape: [usize; 5],
    b: &Tensor,
    residual: Option<&Tensor>,
    pad: [usize; 2],
) -> Result<Tensor> {
    let (frames, h, width, c) = x.dims4()?;
    let [o, kt, kh, kw, wc] = shape;
    let out = [
        (frames + 1).saturating_sub(kt),
        (h + 2 * pad[0] + 1).saturating_sub(kh),
        (width + 2 * pad[1] + 1).saturating_sub(kw),
        o,
    ];
    let path = conv_path(x.device());
    let filter_dims = match path {
        ConvPath::Cudnn => vec![o, kt, kh, kw, c],
        ConvPath::Taps => vec![kt * kh * kw, c, o],
    };
    if wc != c
        || filter.dims() != filter_dims
        || b.dims() != [o]
        || out.contains(&0)
        || residual.is_some_and(|r| r.dims() != out || r.dtype() != x.dtype())
        || filter.dtype() != x.dtype()
        || b.dtype() != x.dtype()
    {
        candle_core::bail!(
            "conv_frames_bias: input {:?} {:?}, filter {:?} {:?} of {shape:?}, bias {:?} {:?}, residual {:?} \
             and padding {pad:?} do not fit",
            x.dims(),
            x.dtype(),
            filter.dims(),
            filter.dtype(),
            b.dims(),
            b.dtype(),
            residual.map(|r| r.dims().to_vec())
        );
    }
    match path {
        #[cfg(feature = "cuda")]
        ConvPath::Cudnn => cuda::conv_frames_bias(x, filter, b, residual, shape, pad),
        _ => conv_taps(x, filter, shape, b, residual, pad, out),
    }
}

/// [`conv_frames_bias`] as a sum of one matrix product per tap: `x` zero-padded, then for
/// each tap the window it reads, copied packed, times that tap's `[c, o]`. Each temporary is
/// at most the size of the padded input or of the output.
fn conv_taps(
    x: &Tensor,
    filter: &Tensor,
    shape: [usize; 5],
    b: &Tensor,
    residual: Option<&Tensor>,
    pad: [usize; 2],
    out: [usize; 4],
) -> Result<Tensor> {
    let [o, kt, kh, kw, c] = shape;
    let [frames, rows, width, _] = out;
    let mut x = x.clone();
    if pad[0] > 0 {
        x = x.pad_with_zeros(1, pad[0], pad[0])?;
    }
    if pad[1] > 0 {
        x = x.pad_with_zeros(2, pad[1], pad[1])?;
    }
    let pixels = frames * rows * width;
    let mut sum: Option<Tensor> = None;
    for t in 0..kt {
        for i in 0..kh {
            for j in 0..kw {
                let window = x.narrow(0, t, frames)?.narrow(1, i, rows)?.narrow(2, j, width)?;
                let window = window.contiguous()?.reshape((pixels, c))?;
                let product = window.matmul(&filter.get((t * kh + i) * kw + j)?)?;
                drop(window);
                sum = Some(match sum {
                    Some(sum) => (sum + product)?,
                    None => product,
                });
            }
        }
    }
    drop(x);
    let Some(sum) = sum else {
        candle_core::bail!("conv_frames_bias: a filter of no taps");
    };
    let y = sum.broadcast_add(b)?.reshape((frames, rows, width, o))?;
    drop(sum);
    match residual {
        Some(r) => y + r,
        None => Ok(y),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::{Device, Result, Tensor};

    use crate::cudnn::{convolve_into, ConvShape};
    use crate::frames::packed_frames;
    use crate::launch::device_address;

    /// cuDNN indexes tensors with 32-bit integers: a larger video runs a few output frames
    /// at a time.
    const MAX_ELEMENTS: usize = i32::MAX as usize;

    pub(super) fn conv_frames_bias(
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        residual: Option<&Tensor>,
        filter: [usize; 5],
        pad: [usize; 2],
    ) -> Result<Tensor> {
        let Device::Cuda(dev) = x.device() else {
            candle_core::bail!("conv_frames_bias: cuDNN runs on CUDA tensors");
        };
        let (x, w, b) = (packed_frames(x)?, w.contiguous()?, b.contiguous()?);
        let residual = residual.map(packed_frames).transpose()?;
        let (frames, h, width, c) = x.dims4()?;
        let [_, kt, _, _, _] = filter;
        let whole = ConvShape {
            input: [frames, h, width, c],
            filter,
            pad,
            dtype: x.dtype(),
        };
        let out = whole.output();
        // Every element is written by the convolution.
        let y = crate::linear::empty(&out, x.dtype(), x.device())?;
        let (in_frame, out_frame) = (h * width * c, out[1] * out[2] * out[3]);
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
        let address = |t: &Tensor| device_address(t);
        let (x_address, w_address, b_address, y_address) = (address(&x)?, address(&w)?, address(&b)?, address(&y)?);
        let r_address = residual.as_ref().map(address).transpose()?;
        let size = x.dtype().size_in_bytes() as u64;
        for first in (0..out[0]).step_by(per_call) {
            let count = per_call.min(out[0] - first);
            let shape = ConvShape {
                input: [count + kt - 1, h, width, c],
                ..whole
            };
            let (x_at, y_at) = ((first * in_frame) as u64 * size, (first * out_frame) as u64 * size);
            // SAFETY: x, w, b, y and the residual are contiguous CUDA tensors holding the
            // frames described (input frames `first..first + count + kt − 1`, output frames
            // `first..first + count`), and y is a fresh buffer.
            unsafe {
                convolve_into(
                    dev,
                    &shape,
                    x_address + x_at,
                    w_address,
                    b_address,
                    r_address.map(|r| r + y_at),
                    y_address + y_at,
                )?;
            }
        }
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::{cudnn_workspace_allocation, cudnn_workspace_bound};

    /// The VAE's memory plan counts the bound at every convolution: a 16-bit one must allocate
    /// exactly that, whatever its algorithm takes; an f32 one takes its algorithm's need,
    /// within the bound.
    #[test]
    fn a_16_bit_convolution_allocates_the_bound_the_plan_counts() {
        let (input, output) = (3 * 480 * 832 * 96, 3 * 480 * 832 * 96);
        for dtype in [DType::BF16, DType::F16] {
            let bound = cudnn_workspace_bound(input, output, dtype);
            for needed in [0, 131, 7 << 20, bound] {
                assert_eq!(
                    cudnn_workspace_allocation(needed, input, output, dtype),
                    bound,
                    "{dtype:?}, {needed}"
                );
            }
        }
        let bound = cudnn_workspace_bound(input, output, DType::F32);
        assert_eq!(bound, (input + output) * 4 + (32 << 20));
        for needed in [0, 5 << 20, bound] {
            assert_eq!(cudnn_workspace_allocation(needed, input, output, DType::F32), needed);
        }
    }
}
