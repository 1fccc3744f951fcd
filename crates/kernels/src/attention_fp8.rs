//! Attention with E4M3 products, FlashAttention-3's FP8 path: Q with one scale per 64 rows of
//! a head, K with one per 128 (a tile of keys), V with one per channel of a head, the
//! softmax's P rounded to E4M3, both products at twice bf16's tensor-core rate. On Hopper
//! through wgmma (cuda/flash_attention_sm90.cu's `flash_attention_sm90_e4m3_d128`), on Ada
//! (the RTX 4090) through mma.sync (cuda/attention_fp8.cu's `flash_attention_e4m3_d128`), both
//! on the same quantized operands and with the same errors. A numerics choice of the
//! caller's: E4M3 keeps 4 significant bits, and on random inputs the output is about 5% from
//! bf16 attention's.
//!
//! Elsewhere [`flash_attention_fp8_supported`] is false and [`flash_attention_fp8`] refuses,
//! so that a caller asks once and says which path runs.

use candle_core::{DType, Device, Result, Tensor};

/// The head size the kernel is compiled for.
const HEAD_DIM: usize = 128;

/// Whether [`flash_attention_fp8`] runs on `device` for `dtype` queries of `head_dim`: bf16
/// with head size 128, on a GPU of compute capability 9.0 (the Hopper kernel) or 8.9 (Ada,
/// the RTX 4090: the mma.sync kernel), in a build with that GPU's machine code.
pub fn flash_attention_fp8_supported(device: &Device, dtype: DType, head_dim: usize) -> bool {
    dtype == DType::BF16 && head_dim == HEAD_DIM && kernel_for(device).is_some()
}

/// The FP8 attention kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8AttentionKernel {
    /// wgmma and TMA (`flash_attention_sm90_e4m3_d128`).
    Hopper,
    /// mma.sync m16n8k32 (`flash_attention_e4m3_d128`).
    MmaSync,
}

/// The FP8 attention kernel for a GPU of compute capability `capability`, where this build
/// has its machine code: the mma.sync kernel's e4m3 products exist from sm_89 on, and the PTX
/// other GPUs compile from (compute_80 by default) has none.
pub fn fp8_attention_kernel(capability: (i32, i32)) -> Option<Fp8AttentionKernel> {
    match capability {
        (9, 0) if cfg!(tpinfer_sm90) => Some(Fp8AttentionKernel::Hopper),
        (8, 9) if cfg!(tpinfer_sm89) => Some(Fp8AttentionKernel::MmaSync),
        _ => None,
    }
}

/// [`fp8_attention_kernel`] of `device`.
fn kernel_for(device: &Device) -> Option<Fp8AttentionKernel> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return dev
            .cuda_stream()
            .context()
            .compute_capability()
            .ok()
            .and_then(fp8_attention_kernel);
    }
    let _ = device;
    None
}

/// Non-causal softmax attention of `q` `[q_len, heads, 128]` over `k`, `v` `[kv_len,
/// kv_heads, 128]` (bf16, `d` contiguous, strides multiples of 8; query head `h` reads KV head
/// `h / (heads / kv_heads)`) with scores scaled by `scale`, both products on E4M3 operands;
/// returns bf16 `[q_len, heads, 128]`. Besides its output it holds, while it runs, E4M3
/// copies of Q, K and V (V padded to 64 keys), their f32 scales and V's channel maxima:
/// [`flash_attention_fp8_bytes`].
#[cfg_attr(not(tpinfer_sm90), allow(unused_variables))]
pub fn flash_attention_fp8(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (q_len, heads, d) = q.dims3()?;
    let (kv_len, kv_heads, kd) = k.dims3()?;
    if v.dims() != k.dims() || kd != d || kv_heads == 0 || heads % kv_heads != 0 {
        candle_core::bail!(
            "FP8 attention: q {:?}, k {:?}, v {:?} do not fit (same head size, heads a multiple of KV heads)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let kernel = kernel_for(q.device());
    if q.dtype() != DType::BF16
        || d != HEAD_DIM
        || kernel.is_none()
        || k.dtype() != DType::BF16
        || v.dtype() != DType::BF16
    {
        candle_core::bail!(
            "FP8 attention runs on Hopper (compute capability 9.0) and Ada (8.9) GPUs, bf16 with head size {HEAD_DIM}; \
             got {:?} {:?} on {:?}",
            q.dtype(),
            q.dims(),
            q.device().location()
        );
    }
    if q_len == 0 || kv_len == 0 {
        return Tensor::zeros((q_len, heads, d), DType::BF16, q.device());
    }
    match kernel {
        #[cfg(tpinfer_sm90)]
        Some(Fp8AttentionKernel::Hopper) => cuda::launch_hopper(q, k, v, scale),
        #[cfg(feature = "cuda")]
        Some(Fp8AttentionKernel::MmaSync) => cuda::launch_mma(q, k, v, scale),
        _ => candle_core::bail!(
            "FP8 attention: this build has no kernel for {:?}",
            q.device().location()
        ),
    }
}

/// [`flash_attention_fp8`] through the mma.sync kernel, the one it runs on compute
/// capability 8.9 (the RTX 4090), on 8.9 or 9.0: the same passes and operands. For
/// `tpinfer-bench attention`, which sets it beside the Hopper kernel on an H100/H200.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn flash_attention_fp8_mma(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (q_len, heads, d) = q.dims3()?;
    let (kv_len, kv_heads, kd) = k.dims3()?;
    let dtypes = [q.dtype(), k.dtype(), v.dtype()];
    if v.dims() != k.dims()
        || kd != d
        || d != HEAD_DIM
        || kv_heads == 0
        || heads % kv_heads != 0
        || dtypes != [DType::BF16; 3]
    {
        candle_core::bail!(
            "FP8 attention: q {:?}, k {:?}, v {:?} ({dtypes:?}) do not fit (bf16, head size {HEAD_DIM}, heads a multiple of KV heads)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if q_len == 0 || kv_len == 0 {
        return Tensor::zeros((q_len, heads, d), DType::BF16, q.device());
    }
    #[cfg(feature = "cuda")]
    return cuda::launch_mma(q, k, v, scale);
    #[cfg(not(feature = "cuda"))]
    candle_core::bail!("FP8 attention: this build has no CUDA kernels")
}

/// The bytes [`flash_attention_fp8`] holds beside its inputs and output while it runs, for
/// `q_len` queries of `heads` heads over `kv_len` keys of `kv_heads`: the E4M3 copies (V's
/// keys padded to 64), their scales, and V's channel maxima.
pub fn flash_attention_fp8_bytes(q_len: usize, heads: usize, kv_len: usize, kv_heads: usize) -> usize {
    let copies = (q_len * heads + kv_len * kv_heads + kv_len.next_multiple_of(QUANT_ROWS) * kv_heads) * HEAD_DIM;
    let scales =
        4 * (q_len.div_ceil(QUANT_ROWS) * heads + kv_len.div_ceil(KEY_ROWS) * kv_heads + 2 * kv_heads * HEAD_DIM);
    copies + scales
}

/// Rows of a head under one Q scale (QUANT_ROWS in the kernel), and the padding of V's keys.
const QUANT_ROWS: usize = 64;
/// Keys of a tile, and rows of a head under one K scale (KEYS_FP8 in the kernel).
const KEY_ROWS: usize = 128;

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Result, Tensor};

    use super::{HEAD_DIM, KEY_ROWS, QUANT_ROWS};
    use crate::cuda::strides;
    use crate::launch::device_address;
    use crate::module::ATTENTION_FP8;

    /// Q, K and V as both FP8 kernels read them (cuda/fp8_attention.cuh): Q and K E4M3 `[len,
    /// heads, 128]`, V E4M3 transposed to `[KV heads, 128, padded]`, and their f32 scales.
    pub(super) struct Operands {
        pub q8: Tensor,
        pub k8: Tensor,
        pub vt8: Tensor,
        pub q_scale: Tensor,
        pub k_scale: Tensor,
        pub v_scale: Tensor,
        /// V's keys rounded up to 64.
        pub padded: usize,
    }

    /// cuda/attention_fp8.cu's passes: Q and K by blocks of rows, V's channel maxima, then V
    /// transposed by its channels' scales.
    pub(super) fn quantize(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Operands> {
        let (q_len, heads, d) = q.dims3()?;
        let (kv_len, kv_heads, _) = k.dims3()?;
        let candle_core::Device::Cuda(dev) = q.device() else {
            candle_core::bail!("FP8 attention: q is not on a CUDA device");
        };
        let device = q.device();
        let empty = |shape: &[usize], dtype: DType| crate::empty(shape, dtype, device);
        let (q_blocks, k_blocks) = (q_len.div_ceil(QUANT_ROWS), kv_len.div_ceil(KEY_ROWS));
        let padded = kv_len.next_multiple_of(QUANT_ROWS);
        let operands = Operands {
            q8: empty(&[q_len, heads, d], DType::U8)?,
            k8: empty(&[kv_len, kv_heads, d], DType::U8)?,
            vt8: empty(&[kv_heads, d, padded], DType::U8)?,
            q_scale: empty(&[heads, q_blocks], DType::F32)?,
            k_scale: empty(&[kv_heads, k_blocks], DType::F32)?,
            v_scale: empty(&[kv_heads, d], DType::F32)?,
            padded,
        };
        // Maxed into by atomics: zeros first.
        let v_absmax = Tensor::zeros((kv_heads, d), DType::U32, device)?;
        let len = kv_len as i32;
        for (x, x8, scales, rows, n_heads, blocks, kernel) in [
            (
                q,
                &operands.q8,
                &operands.q_scale,
                q_len,
                heads,
                q_blocks,
                "quantize_query_blocks_e4m3",
            ),
            (
                k,
                &operands.k8,
                &operands.k_scale,
                kv_len,
                kv_heads,
                k_blocks,
                "quantize_key_blocks_e4m3",
            ),
        ] {
            let quantize = ATTENTION_FP8.kernel(dev, kernel)?;
            let (row, head) = strides(x.layout(), "FP8 attention's queries and keys")?;
            let (x, x8, scales) = (device_address(x)?, device_address(x8)?, device_address(scales)?);
            let rows = rows as i32;
            let mut b = quantize.builder();
            b.arg(&x).arg(&row).arg(&head).arg(&rows).arg(&x8).arg(&scales);
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, n_heads as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel; `x` covers `rows` rows of every head at
            // its strides, `x8` and `scales` hold `rows · n_heads · 128` and `blocks · n_heads`.
            unsafe { b.launch(cfg) }.w()?;
        }
        let (v_row, v_head) = strides(v.layout(), "FP8 attention's values")?;
        let (v_at, absmax_at, vt8_at, v_scale_at) = (
            device_address(v)?,
            device_address(&v_absmax)?,
            device_address(&operands.vt8)?,
            device_address(&operands.v_scale)?,
        );
        let absmax = ATTENTION_FP8.kernel(dev, "channel_absmax_bf16")?;
        let mut b = absmax.builder();
        b.arg(&v_at).arg(&v_row).arg(&v_head).arg(&len).arg(&absmax_at);
        let cfg = LaunchConfig {
            grid_dim: (kv_len.div_ceil(256) as u32, kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel; `v` covers `kv_len` rows of every KV head at
        // its strides and `absmax` holds `kv_heads · 128` zeros.
        unsafe { b.launch(cfg) }.w()?;
        let padded_i = padded as i32;
        let transpose = ATTENTION_FP8.kernel(dev, "transpose_values_e4m3")?;
        let mut b = transpose.builder();
        b.arg(&v_at)
            .arg(&v_row)
            .arg(&v_head)
            .arg(&len)
            .arg(&padded_i)
            .arg(&absmax_at)
            .arg(&vt8_at)
            .arg(&v_scale_at);
        let cfg = LaunchConfig {
            grid_dim: ((padded / QUANT_ROWS) as u32, kv_heads as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; `vt8` holds `kv_heads · 128 · padded` bytes, `v_scale` `kv_heads · 128`.
        unsafe { b.launch(cfg) }.w()?;
        // The maxima are freed in stream order after the transpose, which reads them.
        drop(v_absmax);
        Ok(operands)
    }

    /// The mma.sync kernel (`flash_attention_e4m3_d128`) on a GPU of compute capability 8.9 or
    /// 9.0.
    pub(super) fn launch_mma(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        /// Query rows per CTA (BLOCK_M_MMA in the kernel): four warps of 16.
        const QUERY_ROWS: usize = 64;
        let (q_len, heads, d) = q.dims3()?;
        let (kv_len, kv_heads, _) = k.dims3()?;
        let candle_core::Device::Cuda(dev) = q.device() else {
            candle_core::bail!("FP8 attention: q is not on a CUDA device");
        };
        // Its e4m3 products exist in the build's sm_89 and sm_90 machine code only, the GPUs
        // that have an FP8 attention kernel: the PTX others compile from (compute_80 by
        // default) traps there.
        let capability = dev.cuda_stream().context().compute_capability().w()?;
        if super::fp8_attention_kernel(capability).is_none() {
            candle_core::bail!(
                "FP8 attention's mma.sync kernel runs on compute capability 8.9 and 9.0 in a build with their \
                 machine code; this GPU has {}.{}",
                capability.0,
                capability.1
            );
        }
        let ops = quantize(q, k, v)?;
        let out = crate::empty(&[q_len, heads, d], DType::BF16, q.device())?;
        let at = |t: &Tensor| device_address(t);
        let (q8, q_scale, k8, k_scale, vt8, v_scale, out_at) = (
            at(&ops.q8)?,
            at(&ops.q_scale)?,
            at(&ops.k8)?,
            at(&ops.k_scale)?,
            at(&ops.vt8)?,
            at(&ops.v_scale)?,
            at(&out)?,
        );
        let (q_len_i, kv_len_i, padded_i, heads_i, group) = (
            q_len as i32,
            kv_len as i32,
            ops.padded as i32,
            heads as i32,
            (heads / kv_heads) as i32,
        );
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let func = ATTENTION_FP8.kernel(dev, "flash_attention_e4m3_d128")?;
        let mut b = func.builder();
        b.arg(&q8)
            .arg(&q_scale)
            .arg(&k8)
            .arg(&k_scale)
            .arg(&vt8)
            .arg(&v_scale)
            .arg(&out_at)
            .arg(&q_len_i)
            .arg(&kv_len_i)
            .arg(&padded_i)
            .arg(&heads_i)
            .arg(&group)
            .arg(&scale_log2);
        let cfg = LaunchConfig {
            grid_dim: (q_len.div_ceil(QUERY_ROWS) as u32, heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; the operands hold what
        // `quantize` made for these shapes; every output row below `q_len` of every head is
        // written.
        unsafe { b.launch(cfg) }.w()?;
        // The operands are freed in stream order after the kernel, which reads them.
        drop(ops);
        Ok(out)
    }

    /// The Hopper kernel (`flash_attention_sm90_e4m3_d128`).
    #[cfg(tpinfer_sm90)]
    pub(super) fn launch_hopper(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        use candle_core::cuda_backend::cudarc::driver::sys::{self, CUfunction_attribute_enum as Attr};

        use crate::cuda::hopper::TensorMap;
        use crate::module::FLASH_ATTENTION_SM90;

        /// Query rows per CTA: two consumer warpgroups of 64.
        const QUERY_ROWS: usize = 128;
        /// A producer warpgroup and the two consumers.
        const THREADS: u32 = 3 * 128;
        /// Dynamic shared memory: 1 KiB to align the swizzle atoms, six stages of a K and a V
        /// tile (128 × 128 bytes each), twelve mbarriers.
        const SMEM_BYTES: u32 = 1024 + 6 * 2 * 128 * 128 + 12 * 8;

        let (q_len, heads, d) = q.dims3()?;
        let (kv_len, kv_heads, _) = k.dims3()?;
        let candle_core::Device::Cuda(dev) = q.device() else {
            candle_core::bail!("FP8 attention: q is not on a CUDA device");
        };
        let ops = quantize(q, k, v)?;
        let out = crate::empty(&[q_len, heads, d], DType::BF16, q.device())?;
        let padded = ops.padded;
        let u8_map = sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
        let k_map = TensorMap::tiled(
            device_address(&ops.k8)?,
            u8_map,
            [HEAD_DIM as u64, kv_len as u64, kv_heads as u64],
            [(kv_heads * HEAD_DIM) as u64, HEAD_DIM as u64],
            [HEAD_DIM as u32, KEY_ROWS as u32, 1],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        );
        // Keys past `padded` (the last tile's second half) arrive as zeros.
        let v_map = TensorMap::tiled(
            device_address(&ops.vt8)?,
            u8_map,
            [padded as u64, HEAD_DIM as u64, kv_heads as u64],
            [padded as u64, (HEAD_DIM * padded) as u64],
            [KEY_ROWS as u32, HEAD_DIM as u32, 1],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        );
        let (Some(k_map), Some(v_map)) = (k_map, v_map) else {
            candle_core::bail!(
                "FP8 attention: the driver refused the tensor maps of {kv_len} keys of {kv_heads} heads"
            );
        };
        let func = FLASH_ATTENTION_SM90.kernel(dev, "flash_attention_sm90_e4m3_d128")?;
        func.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM_BYTES as i32)
            .w()?;
        let (q8_at, q_scale_at, k_scale_at, v_scale_at, out_at) = (
            device_address(&ops.q8)?,
            device_address(&ops.q_scale)?,
            device_address(&ops.k_scale)?,
            device_address(&ops.v_scale)?,
            device_address(&out)?,
        );
        let (q_len_i, len, heads_i, group) = (q_len as i32, kv_len as i32, heads as i32, (heads / kv_heads) as i32);
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let mut b = func.builder();
        b.arg(&k_map)
            .arg(&v_map)
            .arg(&q8_at)
            .arg(&q_scale_at)
            .arg(&k_scale_at)
            .arg(&v_scale_at)
            .arg(&out_at)
            .arg(&q_len_i)
            .arg(&len)
            .arg(&heads_i)
            .arg(&group)
            .arg(&scale_log2);
        let cfg = LaunchConfig {
            grid_dim: (q_len.div_ceil(QUERY_ROWS) as u32, heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SMEM_BYTES,
        };
        // SAFETY: the arguments match the kernel's signature; the maps span K's `kv_len` rows
        // and V's `padded` keys of every KV head; the scales hold the blocks the kernel reads;
        // every output row below `q_len` of every head is written.
        unsafe { b.launch(cfg) }.w()?;
        // The operands are freed in stream order after the kernel, which reads them.
        drop(ops);
        Ok(out)
    }
}
