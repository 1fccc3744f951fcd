//! The video VAE's RMS norm over channels, with its SiLU, in one pass over a channels-last
//! activation: candle runs it as ten kernels (casts, square, sum, square root, maximum,
//! divide, multiply, SiLU), which took a quarter of a VAE decode's time.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// `x / max(‖x‖, 1e-12) · scale`, the norm taken over the channels of each pixel of `x`
/// `[n, rows, width, c]` (any strides along the first two dimensions, each row of pixels
/// packed), `scale` `[c]` in f32; then SiLU where `silu`. Computed in f32 and rounded once;
/// returns a contiguous tensor of `x`'s shape and dtype.
pub fn channel_rms_norm(x: &Tensor, scale: &Tensor, silu: bool) -> Result<Tensor> {
    let (_, _, width, c) = x.dims4()?;
    if scale.dims() != [c] || scale.dtype() != DType::F32 {
        candle_core::bail!(
            "channel_rms_norm: scale {:?} {:?} for {c} channels (f32)",
            scale.dims(),
            scale.dtype()
        );
    }
    let x = match packed_rows(x.stride(), width, c) {
        true => x.clone(),
        false => x.contiguous()?,
    };
    x.apply_op2_no_bwd(&scale.contiguous()?, &ChannelRmsNorm { silu })
}

/// Whether each row of pixels of a `[n, rows, width, c]` layout is packed.
fn packed_rows(stride: &[usize], width: usize, c: usize) -> bool {
    (stride[3] == 1 || c == 1) && (stride[2] == c || width == 1)
}

struct ChannelRmsNorm {
    silu: bool,
}

/// The shape of `x` `[n, rows, width, c]`, its strides per image and row, and its offset.
fn strides(l: &Layout) -> Result<([usize; 4], [usize; 2], usize)> {
    let (n, rows, width, c) = l.shape().dims4()?;
    let s = l.stride();
    if !packed_rows(s, width, c) {
        candle_core::bail!("channel_rms_norm: rows of pixels must be packed, got strides {s:?}");
    }
    Ok(([n, rows, width, c], [s[0], s[1]], l.start_offset()))
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// The CPU twin, over f32 values read through `to`.
fn cpu_norm<T: Copy + Send + Sync>(
    x: &[T],
    l: &Layout,
    scale: &[f32],
    silu_after: bool,
    to: impl Fn(T) -> f32 + Sync,
    from: impl Fn(f32) -> T + Sync,
) -> Result<Vec<T>> {
    let ([n, rows, width, c], [image, row], start) = strides(l)?;
    let mut out = vec![from(0.0); n * rows * width * c];
    out.par_chunks_mut(width * c).enumerate().for_each(|(r, o)| {
        let at = start + (r / rows) * image + (r % rows) * row;
        for (pixel, o) in x[at..at + width * c].chunks(c).zip(o.chunks_mut(c)) {
            let sum: f32 = pixel.iter().map(|&v| to(v) * to(v)).sum();
            let inv = 1.0 / sum.sqrt().max(1e-12);
            for ((d, &v), s) in o.iter_mut().zip(pixel).zip(scale) {
                let y = to(v) * inv * s;
                *d = from(if silu_after { silu(y) } else { y });
            }
        }
    });
    Ok(out)
}

impl candle_core::CustomOp2 for ChannelRmsNorm {
    fn name(&self) -> &'static str {
        "channel-rms-norm"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, scale: &CpuStorage, sl: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(scale) = scale else {
            candle_core::bail!("channel_rms_norm: the scale must be f32");
        };
        let scale = &scale[sl.start_offset()..];
        let out = match x {
            CpuStorage::F32(x) => CpuStorage::F32(cpu_norm(x, xl, scale, self.silu, |v| v, |v| v)?),
            CpuStorage::BF16(x) => {
                CpuStorage::BF16(cpu_norm(x, xl, scale, self.silu, |v| v.to_f32(), half::bf16::from_f32)?)
            }
            CpuStorage::F16(x) => {
                CpuStorage::F16(cpu_norm(x, xl, scale, self.silu, |v| v.to_f32(), half::f16::from_f32)?)
            }
            other => candle_core::bail!(
                "channel_rms_norm: unsupported dtype {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        scale: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::norm(self.silu, (x, xl), (scale, sl))?, xl.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result};
    use half::{bf16, f16};

    use crate::launch::{suffix, THREADS};

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn norm(silu: bool, x: Input, scale: Input) -> Result<CudaStorage> {
        match x.0.dtype() {
            DType::F32 => typed::<f32>(silu, x, scale),
            DType::BF16 => typed::<bf16>(silu, x, scale),
            DType::F16 => typed::<f16>(silu, x, scale),
            other => candle_core::bail!("channel_rms_norm: unsupported dtype {other:?}"),
        }
    }

    fn typed<T: CudaDType + DeviceRepr>(silu: bool, (x, xl): Input, (s, sl): Input) -> Result<CudaStorage> {
        let ([n, rows, width, c], [image, row], start) = super::strides(xl)?;
        let dev = x.device();
        // Whole 16-byte units per pixel, on 16 bytes: one thread per unit.
        let size = x.dtype().size_in_bytes();
        let per_unit = 16 / size;
        let units = (c * size).is_multiple_of(16)
            && [start, image, row].iter().all(|v| (v * size).is_multiple_of(16))
            && c / per_unit <= THREADS as usize;
        let name = match units {
            true => format!("channel_rms_norm_units_{}", suffix(x.dtype())?),
            false => format!("channel_rms_norm_{}", suffix(x.dtype())?),
        };
        let func = crate::module::ROWWISE.kernel(dev, &name)?;
        let xs = x.as_cuda_slice::<T>()?.slice(start..);
        let ss = s.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
        let pixels = n * rows * width;
        // SAFETY: every element is written by the kernel.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(pixels * c)? };
        let (c_i, rows_i, width_i, silu_i) = (c as i32, rows as i32, width as i32, silu as i32);
        let (images_i, image_i, row_i) = (n as i64, image as i64, row as i64);
        let mut builder = func.builder();
        builder
            .arg(&xs)
            .arg(&ss)
            .arg(&out)
            .arg(&c_i)
            .arg(&rows_i)
            .arg(&width_i)
            .arg(&images_i)
            .arg(&image_i)
            .arg(&row_i)
            .arg(&silu_i);
        // A warp per pixel, or a pixel per `c / per_unit` threads.
        let per_block = match units {
            true => THREADS as usize / (c / per_unit),
            false => (THREADS / 32) as usize,
        };
        let cfg = LaunchConfig {
            grid_dim: (pixels.div_ceil(per_block) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; x's layout covers the strides
        // the kernel reads through, scale holds c values, out pixels · c.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    /// The fused norm equals the norm written out with candle's ops, on a view of some rows.
    #[test]
    fn the_fused_channel_norm_is_the_chain_of_ops() -> candle_core::Result<()> {
        let cpu = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 7, 6, 5), &cpu)?;
        let view = x.narrow(1, 2, 4)?;
        let scale = Tensor::randn(0f32, 1.0, 5, &cpu)?;
        let norm = view.sqr()?.sum_keepdim(3)?.sqrt()?.maximum(1e-12)?;
        let expected = view.broadcast_div(&norm)?.broadcast_mul(&scale)?;
        for silu in [false, true] {
            let expected = match silu {
                true => candle_nn::ops::silu(&expected)?,
                false => expected.clone(),
            };
            let fused = super::channel_rms_norm(&view, &scale, silu)?;
            assert_eq!(fused.dims(), [2, 4, 6, 5]);
            let diff = (fused - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "silu {silu}: largest difference {diff}");
        }
        let bf16 = super::channel_rms_norm(&view.to_dtype(DType::BF16)?, &scale, true)?;
        assert_eq!(bf16.dtype(), DType::BF16);
        Ok(())
    }
}
