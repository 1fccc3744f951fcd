//! The index of each row's largest value, the greedy token of a decode step's logits
//! (cuda/argmax.cu). candle's CUDA argmax gives a whole row to one CTA, 2% of a Llama-3-8B
//! step on an H200; here CTAs split the row. Ties go to the first index, as candle's CPU
//! argmax, which CPU tensors run.

use candle_core::{Result, Tensor, D};

/// `x`'s argmax over its last dim, kept as a dim of 1 (u32), as `argmax_keepdim(D::Minus1)`.
pub fn argmax(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if cuda::covers(x) {
        return cuda::argmax(x);
    }
    x.argmax_keepdim(D::Minus1)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CpuStorage, CudaStorage, DType, Layout, Result, Shape};
    use half::{bf16, f16};

    use crate::launch::{suffix, THREADS};

    /// A CUDA tensor in f32, bf16 or f16 with at most [`MAX_ROWS`] rows: more go to candle's
    /// argmax (a grid's y extent is the limit).
    pub(super) fn covers(x: &candle_core::Tensor) -> bool {
        let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
        x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) && rows <= MAX_ROWS
    }

    pub(super) fn argmax(x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let mut shape = x.dims().to_vec();
        let n = shape.pop().unwrap_or(1);
        if n == 0 || x.elem_count() == 0 {
            candle_core::bail!("argmax of an empty tensor {:?}", x.dims());
        }
        shape.push(1);
        x.contiguous()?
            .reshape((x.elem_count() / n, n))?
            .apply_op1_no_bwd(&Argmax)?
            .reshape(shape)
    }

    /// Rows one launch takes (a grid's y extent).
    const MAX_ROWS: usize = 65_535;
    /// Values per CTA of the first pass: 8 per thread, about 63 CTAs for a 128K vocabulary.
    const CHUNK: usize = 8 * THREADS as usize;

    /// Over `[rows, n]`, contiguous.
    struct Argmax;

    impl candle_core::CustomOp1 for Argmax {
        fn name(&self) -> &'static str {
            "argmax"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("argmax: the CUDA op was given a CPU tensor")
        }

        fn cuda_fwd(&self, x: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
            let (rows, n) = layout.shape().dims2()?;
            let out = match x.dtype() {
                DType::F32 => typed::<f32>(x, layout, rows, n)?,
                DType::BF16 => typed::<bf16>(x, layout, rows, n)?,
                DType::F16 => typed::<f16>(x, layout, rows, n)?,
                other => candle_core::bail!("argmax: unsupported dtype {other:?}"),
            };
            Ok((out, Shape::from((rows, 1))))
        }
    }

    fn typed<T: CudaDType + DeviceRepr>(
        x: &CudaStorage,
        layout: &Layout,
        rows: usize,
        n: usize,
    ) -> Result<CudaStorage> {
        let dev = x.device();
        let xs = x.as_cuda_slice::<T>()?.slice(layout.start_offset()..);
        let parts = n.div_ceil(CHUNK);
        // SAFETY: the first pass writes every (row, part) winner; the second every row's index.
        let (values, indices, out): (CudaSlice<f32>, CudaSlice<u32>, CudaSlice<u32>) =
            unsafe { (dev.alloc(rows * parts)?, dev.alloc(rows * parts)?, dev.alloc(rows)?) };
        let (n_i, chunk_i, parts_i) = (n as i32, CHUNK as i32, parts as i32);
        let first = crate::module::ARGMAX.kernel(dev, &format!("argmax_parts_{}", suffix(x.dtype())?))?;
        let mut b = first.builder();
        b.arg(&xs).arg(&n_i).arg(&chunk_i).arg(&values).arg(&indices);
        let cfg = LaunchConfig {
            grid_dim: (parts as u32, rows as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; xs holds rows × n values.
        unsafe { b.launch(cfg) }.w()?;
        let join = crate::module::ARGMAX.kernel(dev, "argmax_join")?;
        let mut b = join.builder();
        b.arg(&values).arg(&indices).arg(&parts_i).arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; values and indices hold rows × parts winners.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}
