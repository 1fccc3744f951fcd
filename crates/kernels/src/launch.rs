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
