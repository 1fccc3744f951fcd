//! Sequence positions in device memory. Kernels read the position at run time rather than
//! take it as a launch argument, so that a decode step captured once as a CUDA graph replays
//! at every position: the host only rewrites the one-element tensor between replays.

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

/// Checks that `position` is a one-element u32 tensor on `like`'s device.
pub(crate) fn check(position: &Tensor, like: &Tensor, op: &str) -> Result<()> {
    if position.dtype() != DType::U32 || position.elem_count() != 1 || !position.device().same_device(like.device()) {
        candle_core::bail!(
            "{op}: the position must be one u32 on {:?}, got {:?} {:?} on {:?}",
            like.device().location(),
            position.dtype(),
            position.dims(),
            position.device().location()
        );
    }
    Ok(())
}

/// The value of a (CPU) position tensor.
pub(crate) fn on_host(position: &Tensor) -> Result<usize> {
    Ok(position.flatten_all()?.to_vec1::<u32>()?[0] as usize)
}

/// Runs `f` with the device view of a CUDA position tensor, for a kernel launch.
#[cfg(feature = "cuda")]
pub(crate) fn with_device_view<R>(
    position: &Tensor,
    f: impl FnOnce(&candle_core::cuda_backend::cudarc::driver::CudaView<'_, u32>) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = position.storage_and_layout();
    let candle_core::Storage::Cuda(storage) = &*storage else {
        candle_core::bail!("the position is not a CUDA tensor");
    };
    let view = storage.as_cuda_slice::<u32>()?.slice(layout.start_offset()..);
    f(&view)
}

/// Overwrites the u32 tensor `dst` (contiguous, `values.len()` elements) with `values` from the
/// host, in place: on CUDA an asynchronous copy ordered on the device's stream, so a buffer
/// that a captured graph reads keeps its address.
pub fn write_u32s(dst: &Tensor, values: &[u32]) -> Result<()> {
    if dst.dtype() != DType::U32 || dst.elem_count() != values.len() || !dst.is_contiguous() {
        candle_core::bail!(
            "write_u32s: {} values do not fit a {:?} {:?} tensor",
            values.len(),
            dst.dtype(),
            dst.dims()
        );
    }
    dst.inplace_op1(&WriteU32s(values))
}

struct WriteU32s<'a>(&'a [u32]);

impl candle_core::InplaceOp1 for WriteU32s<'_> {
    fn name(&self) -> &'static str {
        "write_u32s"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let CpuStorage::U32(all) = storage else {
            candle_core::bail!("write_u32s: not a u32 tensor");
        };
        let start = layout.start_offset();
        all[start..start + self.0.len()].copy_from_slice(self.0);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        let stream = storage.device().cuda_stream();
        let start = layout.start_offset();
        let mut dst = storage
            .as_cuda_slice_mut::<u32>()?
            .slice_mut(start..start + self.0.len());
        stream.memcpy_htod(self.0, &mut dst).w()
    }
}
