//! What the CUDA launchers of this crate share: kernel-name suffixes and grid shapes.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{DType, Result};

/// Threads per block of the element-wise and row-wise kernels (THREADS in cuda/rowwise.cu).
pub(crate) const THREADS: u32 = 256;

/// The suffix of a kernel's name for `dtype`, as in `silu_mul_bf16`.
pub(crate) fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("tpinfer's kernels: unsupported dtype {other:?}"),
    })
}

/// A grid-stride launch over `n` elements: blocks of [`THREADS`], at most 2¹⁶ of them.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device address of `t`'s first element, for kernels that take raw pointers (a chain's
/// links write into buffers that outlive the step); `t` must be on CUDA, and contiguous from
/// there for whatever the kernel reads or writes.
pub fn device_address(t: &candle_core::Tensor) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else {
        candle_core::bail!("a device address of a {:?} tensor", t.device().location());
    };
    use candle_core::cuda_backend::CudaStorageSlice as Slice;
    let stream = s.device.cuda_stream();
    let base = match &s.slice {
        Slice::BF16(slice) => slice.device_ptr(&stream).0,
        Slice::F16(slice) => slice.device_ptr(&stream).0,
        Slice::F32(slice) => slice.device_ptr(&stream).0,
        Slice::U32(slice) => slice.device_ptr(&stream).0,
        Slice::U8(slice) => slice.device_ptr(&stream).0,
        Slice::F8E4M3(slice) => slice.device_ptr(&stream).0,
        _ => candle_core::bail!("a device address of a {:?} tensor", t.dtype()),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

/// The device addresses of `tensors`, a kernel's pointer arguments in order.
pub(crate) fn addresses(tensors: &[&candle_core::Tensor]) -> Result<Vec<u64>> {
    tensors.iter().map(|t| device_address(t)).collect()
}

/// Checks that `t` is a contiguous `dtype` tensor of `len` elements on CUDA: an output a
/// chain link writes in place.
pub(crate) fn check_output(t: &candle_core::Tensor, dtype: DType, len: usize, op: &str) -> Result<()> {
    if !t.is_contiguous() || t.dtype() != dtype || t.elem_count() != len || !t.device().is_cuda() {
        candle_core::bail!(
            "{op}: the output {:?} {:?} on {:?} is not a contiguous {dtype:?} CUDA tensor of {len} elements",
            t.dims(),
            t.dtype(),
            t.device().location()
        );
    }
    Ok(())
}
