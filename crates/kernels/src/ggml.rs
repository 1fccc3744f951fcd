//! One input row's products of GGML-block weights on CUDA, written into buffers that outlive a
//! decode step: candle's own MMVQ kernels (`candle_kernels::ffi`, what `QMatMul` runs for up to
//! 8 rows), called with the row quantized to Q8_1 once for every product that reads it.
//! Through `QMatMul::forward` each product quantizes its input again and allocates its output
//! (a memory node between two kernels of a captured step), which is then copied into place: a
//! Q4_K_M layer whose Q and K are one product and V another took seven kernels for its QKV
//! row where these take three.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor};

/// Values a Q8_1 row is padded to, as candle pads it (`MATRIX_ROW_PADDING`).
const ROW_PADDING: usize = 512;
/// Values in one Q8_1 block, and its bytes (two halves, then 32 int8).
const Q8_1_BLOCK: (usize, usize) = (32, 36);

/// Bytes of one row of `k` values quantized to Q8_1 as candle's MMVQ kernels read it.
pub fn q8_1_row_bytes(k: usize) -> usize {
    k.next_multiple_of(ROW_PADDING) / Q8_1_BLOCK.0 * Q8_1_BLOCK.1
}

/// Whether candle's MMVQ kernels take `w`'s blocks where it lies: a CUDA build, `w` on a CUDA
/// device, a block type they have a kernel for.
pub fn mmvq_takes(w: &QTensor) -> bool {
    use GgmlDType::*;
    cfg!(feature = "cuda")
        && w.device().is_cuda()
        && w.shape().dims2().is_ok()
        && matches!(
            w.dtype(),
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
        )
}

/// Whether [`mmvq_row_into`] runs for `w` (`[n, k]` blocks) and the row `x`: [`mmvq_takes`]
/// `w`, and `x` one contiguous row of `k` values on `w`'s device in bf16, f16 or f32.
pub fn mmvq_covers(w: &QTensor, x: &Tensor) -> bool {
    mmvq_takes(w)
        && x.device().same_device(&w.device())
        && matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && x.is_contiguous()
        && w.shape()
            .dims2()
            .is_ok_and(|(_, k)| x.elem_count() == k && x.dims().last() == Some(&k))
}

/// A buffer for one row of `k` values in Q8_1 on `device`, for [`quantize_row_q8_1`].
pub fn q8_1_row(k: usize, device: &Device) -> Result<Tensor> {
    Tensor::zeros(q8_1_row_bytes(k), DType::U8, device)
}

/// Quantizes the row `x` (`k` values, contiguous, bf16, f16 or f32) into `q8` (a u8 buffer of
/// at least [`q8_1_row_bytes`]`(k)`), with candle's kernel.
pub fn quantize_row_q8_1(x: &Tensor, q8: &Tensor) -> Result<()> {
    let k = x.elem_count();
    if !x.is_contiguous() || !q8.is_contiguous() || q8.dtype() != DType::U8 || q8.elem_count() < q8_1_row_bytes(k) {
        candle_core::bail!(
            "quantize_row_q8_1: a contiguous row of {k} values needs a contiguous u8 buffer of {} bytes, got {:?} {:?}",
            q8_1_row_bytes(k),
            q8.dtype(),
            q8.dims()
        );
    }
    #[cfg(feature = "cuda")]
    {
        cuda::quantize_row(x, q8, k)
    }
    #[cfg(not(feature = "cuda"))]
    {
        candle_core::bail!("quantize_row_q8_1 needs a CUDA build")
    }
}

/// `out[column..column + n] = w · x` for the `[n, k]` blocks `w` and a row `x` of `k` values
/// quantized into `q8` by [`quantize_row_q8_1`]; `out` contiguous, in the row's dtype (bf16,
/// f16 or f32). Needs [`mmvq_takes`] `w`.
pub fn mmvq_row_into(w: &QTensor, q8: &Tensor, out: &Tensor, column: usize) -> Result<()> {
    let (n, k) = w.shape().dims2()?;
    if !mmvq_takes(w)
        || !out.device().same_device(&w.device())
        || !matches!(out.dtype(), DType::BF16 | DType::F16 | DType::F32)
        || !out.is_contiguous()
        || column + n > out.elem_count()
        || q8.dtype() != DType::U8
        || q8.elem_count() < q8_1_row_bytes(k)
    {
        candle_core::bail!(
            "mmvq_row_into: {:?} [{n}, {k}] into columns {column}..{} of {:?} {:?}, Q8_1 row {:?} {:?}",
            w.dtype(),
            column + n,
            out.dtype(),
            out.dims(),
            q8.dtype(),
            q8.dims()
        );
    }
    #[cfg(feature = "cuda")]
    {
        cuda::mmvq_row(w, q8, out, column, (n, k))
    }
    #[cfg(not(feature = "cuda"))]
    {
        candle_core::bail!("mmvq_row_into needs a CUDA build")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::ffi::c_void;

    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Device, Result, Tensor};
    use candle_kernels::ffi;

    use crate::launch::device_address;

    fn stream(device: &Device) -> Result<*mut c_void> {
        match device {
            Device::Cuda(cuda) => Ok(cuda.cuda_stream().cu_stream() as *mut c_void),
            _ => candle_core::bail!("a GGML row product on {:?}", device.location()),
        }
    }

    pub(super) fn quantize_row(x: &Tensor, q8: &Tensor, k: usize) -> Result<()> {
        let quantize = match x.dtype() {
            DType::BF16 => ffi::launch_mmvq_gguf_quantize_q8_1_bf16,
            DType::F16 => ffi::launch_mmvq_gguf_quantize_q8_1_f16,
            DType::F32 => ffi::launch_mmvq_gguf_quantize_q8_1_f32,
            other => candle_core::bail!("quantize_row_q8_1: {other:?} rows"),
        };
        let (from, to) = (device_address(x)?, device_address(q8)?);
        let padded = k.next_multiple_of(super::ROW_PADDING);
        // SAFETY: x holds k values and q8 the padded row's blocks (checked by the caller), both
        // on the device whose stream the kernel runs on.
        unsafe {
            quantize(
                from as *const c_void,
                to as *mut c_void,
                k as i32,
                padded as i32,
                1,
                stream(x.device())?,
            )
        };
        Ok(())
    }

    type Launcher =
        unsafe extern "C" fn(*const c_void, *const c_void, *mut c_void, i32, i32, i32, i32, i32, *mut c_void);

    /// candle's MMVQ kernel for `blocks` with output elements of `dtype`.
    fn launcher(blocks: GgmlDType, dtype: DType) -> Option<Launcher> {
        use GgmlDType::*;
        Some(match (dtype, blocks) {
            (DType::BF16, Q4_0) => ffi::launch_mmvq_gguf_q4_0_bf16_plain,
            (DType::BF16, Q4_1) => ffi::launch_mmvq_gguf_q4_1_bf16_plain,
            (DType::BF16, Q5_0) => ffi::launch_mmvq_gguf_q5_0_bf16_plain,
            (DType::BF16, Q5_1) => ffi::launch_mmvq_gguf_q5_1_bf16_plain,
            (DType::BF16, Q8_0) => ffi::launch_mmvq_gguf_q8_0_bf16_plain,
            (DType::BF16, Q2K) => ffi::launch_mmvq_gguf_q2_k_bf16_plain,
            (DType::BF16, Q3K) => ffi::launch_mmvq_gguf_q3_k_bf16_plain,
            (DType::BF16, Q4K) => ffi::launch_mmvq_gguf_q4_k_bf16_plain,
            (DType::BF16, Q5K) => ffi::launch_mmvq_gguf_q5_k_bf16_plain,
            (DType::BF16, Q6K) => ffi::launch_mmvq_gguf_q6_k_bf16_plain,
            (DType::F16, Q4_0) => ffi::launch_mmvq_gguf_q4_0_f16_plain,
            (DType::F16, Q4_1) => ffi::launch_mmvq_gguf_q4_1_f16_plain,
            (DType::F16, Q5_0) => ffi::launch_mmvq_gguf_q5_0_f16_plain,
            (DType::F16, Q5_1) => ffi::launch_mmvq_gguf_q5_1_f16_plain,
            (DType::F16, Q8_0) => ffi::launch_mmvq_gguf_q8_0_f16_plain,
            (DType::F16, Q2K) => ffi::launch_mmvq_gguf_q2_k_f16_plain,
            (DType::F16, Q3K) => ffi::launch_mmvq_gguf_q3_k_f16_plain,
            (DType::F16, Q4K) => ffi::launch_mmvq_gguf_q4_k_f16_plain,
            (DType::F16, Q5K) => ffi::launch_mmvq_gguf_q5_k_f16_plain,
            (DType::F16, Q6K) => ffi::launch_mmvq_gguf_q6_k_f16_plain,
            (DType::F32, Q4_0) => ffi::launch_mmvq_gguf_q4_0_f32_plain,
            (DType::F32, Q4_1) => ffi::launch_mmvq_gguf_q4_1_f32_plain,
            (DType::F32, Q5_0) => ffi::launch_mmvq_gguf_q5_0_f32_plain,
            (DType::F32, Q5_1) => ffi::launch_mmvq_gguf_q5_1_f32_plain,
            (DType::F32, Q8_0) => ffi::launch_mmvq_gguf_q8_0_f32_plain,
            (DType::F32, Q2K) => ffi::launch_mmvq_gguf_q2_k_f32_plain,
            (DType::F32, Q3K) => ffi::launch_mmvq_gguf_q3_k_f32_plain,
            (DType::F32, Q4K) => ffi::launch_mmvq_gguf_q4_k_f32_plain,
            (DType::F32, Q5K) => ffi::launch_mmvq_gguf_q5_k_f32_plain,
            (DType::F32, Q6K) => ffi::launch_mmvq_gguf_q6_k_f32_plain,
            _ => return None,
        })
    }

    pub(super) fn mmvq_row(
        w: &QTensor,
        q8: &Tensor,
        out: &Tensor,
        column: usize,
        (n, k): (usize, usize),
    ) -> Result<()> {
        let Some(launch) = launcher(w.dtype(), out.dtype()) else {
            candle_core::bail!(
                "mmvq_row_into: no MMVQ kernel for {:?} into {:?}",
                w.dtype(),
                out.dtype()
            );
        };
        let weight = w.device_ptr()?;
        let to = device_address(out)? + (column * out.dtype().size_in_bytes()) as u64;
        let blocks_per_row = k.next_multiple_of(super::ROW_PADDING) / super::Q8_1_BLOCK.0;
        // SAFETY: the weight holds n rows of k values in its blocks, q8 one quantized row of k
        // (checked by the caller), and out the n elements from `column`; candle launches these
        // kernels with the same arguments for one row (its `fast_mmvq`).
        unsafe {
            launch(
                weight as *const c_void,
                device_address(q8)? as *const c_void,
                to as *mut c_void,
                k as i32,
                n as i32,
                blocks_per_row as i32,
                n as i32,
                1,
                stream(out.device())?,
            )
        };
        Ok(())
    }
}
