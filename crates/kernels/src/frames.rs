//! Whole-frame copies for the video VAE, which keeps its activations channels last and frames
//! first (`[frames, rows, width, channels]`): joining a causal convolution's history with its
//! input, packing a view of some rows of each frame, and nearest 2× upsampling. candle runs
//! the first two with a kernel that moves one element per thread (`copy2d`, `ucopy`), and
//! the third through its strided copy: a quarter of a decode's time went to them. Here they
//! are memcpys, 2-D memcpys, and a kernel moving 16 bytes per thread.

use candle_core::{Result, Tensor};

/// `zeros` zero frames, then the frames of each of `parts` (alike but for their first
/// dimension), in one new tensor.
pub fn cat_frames(zeros: usize, parts: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        candle_core::bail!("cat_frames: no parts");
    };
    let frame = &first.dims()[1..];
    if parts
        .iter()
        .any(|p| p.rank() == 0 || &p.dims()[1..] != frame || p.dtype() != first.dtype())
    {
        candle_core::bail!(
            "cat_frames: parts {:?} differ in more than their frames",
            parts.iter().map(|p| p.dims().to_vec()).collect::<Vec<_>>()
        );
    }
    match first.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => cuda::cat_frames(zeros, parts),
        _ => {
            let padding = match zeros {
                0 => None,
                _ => {
                    let mut dims = first.dims().to_vec();
                    dims[0] = zeros;
                    Some(Tensor::zeros(dims, first.dtype(), first.device())?)
                }
            };
            let all: Vec<&Tensor> = padding.iter().chain(parts.iter().copied()).collect();
            Tensor::cat(&all, 0)
        }
    }
}

/// Overwrites the frames of `dst` (contiguous) with those of `src` (alike in shape and
/// dtype, each frame packed): a frame cache rewritten where it is, so that it keeps its
/// block of a stream-ordered pool from one chunk of frames to the next.
pub fn write_frames(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dims() != src.dims() || dst.dtype() != src.dtype() || !dst.is_contiguous() {
        candle_core::bail!(
            "write_frames: {:?} {:?} into {:?} {:?} (contiguous: {})",
            src.dims(),
            src.dtype(),
            dst.dims(),
            dst.dtype(),
            dst.is_contiguous()
        );
    }
    match dst.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => cuda::write_frames(dst, src),
        _ => dst.slice_set(&src.contiguous()?, 0, 0),
    }
}

/// `t` with its elements packed: itself where they are, else a copy (on CUDA a 2-D memcpy
/// where each frame is packed, as in a view of some rows of each).
pub fn packed_frames(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    match t.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) if cuda::packed_within_frames(t) => cuda::cat_frames(0, &[t]),
        _ => t.contiguous(),
    }
}

/// Nearest 2× upsampling of `x` `[n, rows, width, c]`: `[n, 2·rows, 2·width, c]`, each pixel
/// repeated in a 2 × 2 square.
pub fn upsample_nearest2x(x: &Tensor) -> Result<Tensor> {
    let (n, rows, width, c) = x.dims4()?;
    match x.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => cuda::upsample_nearest2x(&packed_frames(x)?, [n, rows, width, c]),
        _ => x
            .unsqueeze(2)?
            .unsqueeze(4)?
            .broadcast_as((n, rows, 2, width, 2, c))?
            .reshape((n, 2 * rows, 2 * width, c)),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{result, sys, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Device, Result, Shape, Tensor};

    use crate::launch::device_address;

    /// Whether every frame of `t` (its first dimension) is one packed run of elements.
    pub(super) fn packed_within_frames(t: &Tensor) -> bool {
        let dims = t.dims();
        !dims.is_empty() && Shape::from(&dims[1..]).is_contiguous(&t.stride()[1..])
    }

    /// [`super::cat_frames`], into a new tensor.
    pub(super) fn cat_frames(zeros: usize, parts: &[&Tensor]) -> Result<Tensor> {
        let first = parts[0];
        let frames = zeros + parts.iter().map(|p| p.dim(0)).sum::<Result<usize>>()?;
        let mut dims = first.dims().to_vec();
        dims[0] = frames;
        let out = crate::linear::empty(&dims, first.dtype(), first.device())?;
        copy_frames(&out, zeros, parts)?;
        Ok(out)
    }

    /// [`super::write_frames`]: `src`'s frames copied over `dst`'s.
    pub(super) fn write_frames(dst: &Tensor, src: &Tensor) -> Result<()> {
        copy_frames(dst, 0, &[src])
    }

    /// Writes `zeros` zero frames, then each part's frames, from the start of `out`
    /// (contiguous, of their frames in all): a memset for the zeros, then per part a memcpy (a
    /// 2-D one, row by frame, where its frames are packed runs apart).
    fn copy_frames(out: &Tensor, zeros: usize, parts: &[&Tensor]) -> Result<()> {
        let Device::Cuda(dev) = out.device() else {
            candle_core::bail!("copy_frames: not a CUDA tensor");
        };
        let size = out.dtype().size_in_bytes();
        let frame_bytes = out.dims()[1..].iter().product::<usize>() * size;
        let stream = dev.cuda_stream().cu_stream();
        let mut at = device_address(out)?;
        // SAFETY: `out` holds `zeros` and the parts' frames, of `frame_bytes` each, written
        // here in order; each part's frames lie at its address, `stride[0]` elements apart;
        // all on `stream`.
        unsafe {
            if zeros > 0 {
                result::memset_d8_async(at, 0, zeros * frame_bytes, stream).w()?;
                at += (zeros * frame_bytes) as u64;
            }
            for part in parts {
                let count = part.dim(0)?;
                let pitch = part.stride()[0] * size;
                let part = match packed_within_frames(part) && pitch <= i32::MAX as usize {
                    true => (*part).clone(),
                    false => part.contiguous()?,
                };
                let src = device_address(&part)?;
                match part.is_contiguous() || count == 1 {
                    true => result::memcpy_dtod_async(at, src, count * frame_bytes, stream).w()?,
                    false => {
                        let copy = sys::CUDA_MEMCPY2D {
                            srcXInBytes: 0,
                            srcY: 0,
                            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                            srcHost: std::ptr::null(),
                            srcDevice: src,
                            srcArray: std::ptr::null_mut(),
                            srcPitch: pitch,
                            dstXInBytes: 0,
                            dstY: 0,
                            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                            dstHost: std::ptr::null_mut(),
                            dstDevice: at,
                            dstArray: std::ptr::null_mut(),
                            dstPitch: frame_bytes,
                            WidthInBytes: frame_bytes,
                            Height: count,
                        };
                        sys::cuMemcpy2DAsync_v2(&copy, stream).result().w()?;
                    }
                }
                at += (count * frame_bytes) as u64;
            }
        }
        Ok(())
    }

    /// [`super::upsample_nearest2x`] of a packed `x`: one thread per 16 bytes of output where
    /// a pixel's channels are whole 16-byte units, else per element.
    pub(super) fn upsample_nearest2x(x: &Tensor, [n, rows, width, c]: [usize; 4]) -> Result<Tensor> {
        let Device::Cuda(dev) = x.device() else {
            candle_core::bail!("upsample_nearest2x: not a CUDA tensor");
        };
        let out = crate::linear::empty(&[n, 2 * rows, 2 * width, c], x.dtype(), x.device())?;
        let pixel_bytes = c * x.dtype().size_in_bytes();
        let aligned = (x.layout().start_offset() * x.dtype().size_in_bytes()).is_multiple_of(16);
        let (name, units) = match (pixel_bytes % 16, x.dtype().size_in_bytes()) {
            (0, _) if aligned => ("upsample_nearest2x_16", pixel_bytes / 16),
            (_, 2) => ("upsample_nearest2x_2", c),
            (_, 4) => ("upsample_nearest2x_4", c),
            (_, other) => candle_core::bail!("upsample_nearest2x: {other}-byte elements"),
        };
        let func = crate::module::ROWWISE.kernel(dev, name)?;
        let (src, dst) = (device_address(x)?, device_address(&out)?);
        let (image_rows, width_i, units_i) = ((n * rows) as i64, width as i32, units as i32);
        let mut builder = func.builder();
        builder.arg(&src).arg(&dst).arg(&image_rows).arg(&width_i).arg(&units_i);
        let cfg: LaunchConfig = crate::launch::elementwise(4 * n * rows * width * units);
        // SAFETY: the arguments match the kernel's signature; x holds n · rows · width pixels
        // of `units` units, out four times as many, both packed.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    #[test]
    fn frames_join_after_zeros() -> candle_core::Result<()> {
        let cpu = Device::Cpu;
        let a = Tensor::arange(0f32, 12., &cpu)?.reshape((1, 3, 2, 2))?;
        let b = Tensor::arange(12f32, 60., &cpu)?
            .reshape((2, 6, 2, 2))?
            .narrow(1, 1, 3)?;
        let joined = super::cat_frames(2, &[&a, &b])?;
        assert_eq!(joined.dims(), [5, 3, 2, 2]);
        let zeros = joined.narrow(0, 0, 2)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(zeros, 0.0);
        let rest = (joined.narrow(0, 2, 3)? - Tensor::cat(&[&a, &b], 0)?)?;
        assert_eq!(rest.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }

    #[test]
    fn upsampling_repeats_each_pixel_in_a_square() -> candle_core::Result<()> {
        let x = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((2, 2, 3, 2))?;
        let up = super::upsample_nearest2x(&x)?;
        assert_eq!(up.dims(), [2, 4, 6, 2]);
        for (r, c) in [(0, 0), (1, 1), (3, 5), (2, 4)] {
            let got = up.get(1)?.get(r)?.get(c)?.to_vec1::<f32>()?;
            let want = x.get(1)?.get(r / 2)?.get(c / 2)?.to_vec1::<f32>()?;
            assert_eq!(got, want, "pixel ({r}, {c})");
        }
        Ok(())
    }
}
