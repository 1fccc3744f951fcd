//! `x · wᵀ + b`, optionally followed by GELU (tanh approximation), in one op that allocates
//! only its output. On CUDA that is one cuBLASLt call with the bias and the activation in the
//! GEMM's epilogue: candle adds a bias with a broadcast kernel that took about 2 ms per
//! 32,760 × 5,120 bf16 output on an H200 (PyTorch's add 0.4 ms), and its matmul with the add
//! ran at half cuBLASLt's speed (benches/RESULTS.md). On CPU in f32 the GEMM accumulates into
//! the broadcast bias, so that the DiT's memory model holds on both.

use candle_core::{DType, Layout, Result, Shape, Tensor};

/// cuBLASLt's workspace for the fused linears, held from a rank's first product on, from the
/// device's pool (cudarc allocates 32 MiB on Hopper and 4 MiB before it; plans take the
/// larger).
const FUSED_LINEAR_WORKSPACE: usize = 32 << 20;

/// Whether [`linear_bias`] runs fused in `dtype` on CUDA (`cuda`) or CPU ranks: the dtype
/// half of [`fused_linear_covers`], for memory plans.
pub fn fused_linear_runs(cuda: bool, dtype: DType) -> bool {
    match cuda {
        true => matches!(dtype, DType::BF16 | DType::F16),
        false => dtype == DType::F32,
    }
}

/// What the fused linears keep on the device from a rank's first product on: cuBLASLt's
/// workspace where they run fused on CUDA, none elsewhere.
pub fn fused_linear_workspace(cuda: bool, dtype: DType) -> usize {
    match cuda && fused_linear_runs(cuda, dtype) {
        true => FUSED_LINEAR_WORKSPACE,
        false => 0,
    }
}

/// Whether [`linear_bias`] runs as one fused op for `x` and `w`: on CUDA in bf16 or f16 (a
/// build with the `cuda` feature) with more than one row (one row goes through
/// [`crate::gemv`]), or on CPU in f32. Elsewhere it runs as candle's matmul and add.
pub fn fused_linear_covers(x: &Tensor, w: &Tensor) -> bool {
    let k = w.dims().get(1).copied().unwrap_or(0);
    let dtype_ok = match x.device() {
        candle_core::Device::Cpu => fused_linear_runs(false, x.dtype()),
        candle_core::Device::Cuda(_) => cfg!(feature = "cuda") && fused_linear_runs(true, x.dtype()),
        _ => false,
    };
    dtype_ok && w.dtype() == x.dtype() && x.dims().last() == Some(&k) && x.elem_count() > k
}

/// `x · wᵀ + b` for `x` `[.., k]`, `w` `[n, k]` and `b` `[n]`, then GELU with the tanh
/// approximation when `gelu`: `[.., n]`.
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor, gelu: bool) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    if x.dims().last() != Some(&k) || b.dims() != [n] || w.dtype() != x.dtype() || b.dtype() != x.dtype() {
        candle_core::bail!(
            "linear: x {:?} {:?}, w {:?} {:?} and b {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype(),
            b.dims(),
            b.dtype()
        );
    }
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    let rows = x.elem_count() / k;
    let x2 = x.reshape((rows, k))?;
    let y = if fused_linear_covers(x, w) {
        let op = FusedLinear { rows, n, k, gelu };
        aligned(&x2)?.apply_op3_no_bwd(&aligned(w)?, &aligned(b)?, &op)?
    } else {
        let y = x2.matmul(&w.t()?)?.broadcast_add(b)?;
        match gelu {
            true => y.gelu()?,
            false => y,
        }
    };
    y.reshape(shape)
}

/// [`linear_bias`] of `x` `[rows, k]` written into rows `first_row..first_row + rows` of `out`
/// `[.., n]` (contiguous, from its buffer's start): sequence parallelism's column-parallel
/// products, one GEMM per rank's rows as they arrive, into one output. Where the fused linear
/// covers `x`, the GEMM writes there itself; elsewhere the product is copied in.
pub fn linear_bias_into(out: &Tensor, first_row: usize, x: &Tensor, w: &Tensor, b: &Tensor, gelu: bool) -> Result<()> {
    let (n, k) = w.dims2()?;
    let (rows, x_k) = x.dims2()?;
    let (out_rows, out_n) = out.dims2()?;
    if x_k != k || out_n != n || first_row + rows > out_rows || out.dtype() != x.dtype() {
        candle_core::bail!(
            "linear_bias_into: x {:?} {:?} at row {first_row} of out {:?} {:?} with w {:?}",
            x.dims(),
            x.dtype(),
            out.dims(),
            out.dtype(),
            w.dims()
        );
    }
    if fused_linear_covers(x, w) && out.is_contiguous() && out.layout().start_offset() == 0 {
        let op = FusedLinearInto {
            dims: FusedLinear { rows, n, k, gelu },
            first_row,
            bias: aligned(b)?,
        };
        return out.inplace_op3(&aligned(x)?, &aligned(w)?, &op);
    }
    out.slice_set(&linear_bias(x, w, b, gelu)?, 0, first_row)
}

/// An uninitialized tensor on CUDA (zeros elsewhere), for outputs whose every element is
/// written before it is read: [`linear_bias_into`]'s parts.
pub fn empty(shape: &[usize], dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => cuda::empty(shape, dtype, dev),
        _ => Tensor::zeros(shape, dtype, device),
    }
}

/// `t` contiguous and, on CUDA, starting on a 256-byte boundary of its buffer: cuBLASLt's
/// heuristic assumes operands aligned so (fresh allocations are); a view at another offset
/// is copied.
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    match t.device().is_cuda() && !(t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(256) {
        true => t.copy(),
        false => Ok(t),
    }
}

#[derive(Clone, Copy)]
struct FusedLinear {
    rows: usize,
    n: usize,
    k: usize,
    gelu: bool,
}

impl candle_core::CustomOp3 for FusedLinear {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        x: &candle_core::CpuStorage,
        xl: &Layout,
        w: &candle_core::CpuStorage,
        wl: &Layout,
        b: &candle_core::CpuStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        let dims = (self.rows, self.n, self.k);
        Ok((
            crate::cpu::linear_bias((x, xl), (w, wl), (b, bl), dims, self.gelu)?,
            Shape::from((self.rows, self.n)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::linear(self, (x, xl), (w, wl), (b, bl))?,
            Shape::from((self.rows, self.n)),
        ))
    }
}

/// [`FusedLinear`] into rows of an existing output, the bias held by the op (candle's
/// in-place ops take two operands besides the output).
struct FusedLinearInto {
    dims: FusedLinear,
    first_row: usize,
    bias: Tensor,
}

impl candle_core::InplaceOp3 for FusedLinearInto {
    fn name(&self) -> &'static str {
        "fused-linear-into"
    }

    fn cpu_fwd(
        &self,
        out: &mut candle_core::CpuStorage,
        _: &Layout,
        x: &candle_core::CpuStorage,
        xl: &Layout,
        w: &candle_core::CpuStorage,
        wl: &Layout,
    ) -> Result<()> {
        let candle_core::CpuStorage::F32(out) = out else {
            candle_core::bail!("fused-linear-into: f32 only on CPU");
        };
        let (b, bl) = self.bias.storage_and_layout();
        let candle_core::Storage::Cpu(b) = &*b else {
            candle_core::bail!("fused-linear-into: the bias is not on the CPU");
        };
        let FusedLinear { rows, n, k, gelu } = self.dims;
        let rows_out = out
            .get_mut(self.first_row * n..(self.first_row + rows) * n)
            .ok_or_else(|| candle_core::Error::Msg("fused-linear-into: rows overrun the output".into()))?;
        crate::cpu::linear_bias_into(rows_out, (x, xl), (w, wl), (b, bl), (rows, n, k), gelu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &mut candle_core::CudaStorage,
        _: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<()> {
        let (b, bl) = self.bias.storage_and_layout();
        let candle_core::Storage::Cuda(b) = &*b else {
            candle_core::bail!("fused-linear-into: the bias is not on the GPU");
        };
        let offset = self.first_row * self.dims.n;
        cuda::linear_into(&self.dims, (x, xl), (w, wl), (b, bl), out, offset)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::handle as cublaslt_handle;

#[cfg(feature = "cuda")]
mod cuda {
    use std::cell::RefCell;
    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublaslt::result::CublasError;
    use candle_core::cuda_backend::cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};
    use half::{bf16, f16};

    use super::FusedLinear;

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    thread_local! {
        /// One cuBLASLt handle (and its 32 MiB workspace on Hopper) per stream this thread
        /// launches on: a rank's thread has one.
        static HANDLES: RefCell<Vec<(Arc<CudaStream>, Arc<CudaBlasLT>)>> = const { RefCell::new(Vec::new()) };
    }

    fn cublas_error(e: CublasError) -> candle_core::Error {
        candle_core::Error::Msg(format!("cuBLASLt: {e:?}"))
    }

    /// This thread's cuBLASLt handle for `stream`, made at first use.
    pub(crate) fn handle(stream: &Arc<CudaStream>) -> Result<Arc<CudaBlasLT>> {
        HANDLES.with(|handles| {
            let mut handles = handles.borrow_mut();
            if let Some((_, lt)) = handles.iter().find(|(s, _)| Arc::ptr_eq(s, stream)) {
                return Ok(lt.clone());
            }
            let lt = Arc::new(CudaBlasLT::new(stream.clone()).map_err(cublas_error)?);
            handles.push((stream.clone(), lt.clone()));
            Ok(lt)
        })
    }

    pub(super) fn linear(op: &FusedLinear, x: Input, w: Input, b: Input) -> Result<CudaStorage> {
        let dev = x.0.device().clone();
        let mut out = match x.0.dtype() {
            DType::BF16 => CudaStorage::wrap_cuda_slice(unsafe_alloc::<bf16>(&dev, op.rows * op.n)?, dev.clone()),
            DType::F16 => CudaStorage::wrap_cuda_slice(unsafe_alloc::<f16>(&dev, op.rows * op.n)?, dev.clone()),
            other => candle_core::bail!("fused-linear: unsupported dtype {other:?} on CUDA"),
        };
        linear_into(op, x, w, b, &mut out, 0)?;
        Ok(out)
    }

    /// The GEMM's output written at element `offset` of `out`.
    pub(super) fn linear_into(
        op: &FusedLinear,
        x: Input,
        w: Input,
        b: Input,
        out: &mut CudaStorage,
        offset: usize,
    ) -> Result<()> {
        match x.0.dtype() {
            DType::BF16 => typed::<bf16>(op, x, w, b, out, offset),
            DType::F16 => typed::<f16>(op, x, w, b, out, offset),
            other => candle_core::bail!("fused-linear: unsupported dtype {other:?} on CUDA"),
        }
    }

    fn unsafe_alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every caller writes all `n` elements before they are read.
        unsafe { dev.alloc::<T>(n) }
    }

    /// An uninitialized tensor (see [`super::empty`]).
    pub(super) fn empty(shape: &[usize], dtype: DType, dev: &CudaDevice) -> Result<Tensor> {
        let n = shape.iter().product();
        let storage = match dtype {
            DType::BF16 => CudaStorage::wrap_cuda_slice(unsafe_alloc::<bf16>(dev, n)?, dev.clone()),
            DType::F16 => CudaStorage::wrap_cuda_slice(unsafe_alloc::<f16>(dev, n)?, dev.clone()),
            DType::F32 => CudaStorage::wrap_cuda_slice(unsafe_alloc::<f32>(dev, n)?, dev.clone()),
            DType::U8 => CudaStorage::wrap_cuda_slice(unsafe_alloc::<u8>(dev, n)?, dev.clone()),
            other => return Tensor::zeros(shape, other, &candle_core::Device::Cuda(dev.clone())),
        };
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(storage),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }

    fn typed<T: CudaDType + DeviceRepr>(
        op: &FusedLinear,
        (x, xl): Input,
        (w, wl): Input,
        (b, bl): Input,
        out: &mut CudaStorage,
        offset: usize,
    ) -> Result<()>
    where
        CudaBlasLT: Matmul<T>,
    {
        let dev = x.device();
        let lt = handle(&dev.cuda_stream())?;
        let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
        let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
        let bs = b.as_cuda_slice::<T>()?.slice(bl.start_offset()..);
        let out = out.as_cuda_slice_mut::<T>()?;
        if offset + op.rows * op.n > out.len() {
            candle_core::bail!(
                "fused-linear: {} rows of {} at element {offset} overrun the output",
                op.rows,
                op.n
            );
        }
        let mut out = out.slice_mut(offset..offset + op.rows * op.n);
        // Column-major, as cuBLAS sees row-major data: yᵀ [n, rows] = w [k, n]ᵀ · xᵀ [k, rows];
        // the epilogue adds b along yᵀ's rows, i.e. per output feature.
        let (n, rows, k) = (op.n as u64, op.rows as u64, op.k as u64);
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: n,
            n: rows,
            k,
            alpha: 1.0,
            lda: k as i64,
            ldb: k as i64,
            beta: 0.0,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        let act = op.gelu.then_some(Activation::Gelu);
        // SAFETY: w holds n rows of k, x rows of k, b n values, all contiguous from their
        // offsets (the caller made them so); out holds rows × n from `offset`, checked above.
        unsafe { lt.matmul(cfg, &ws, &xs, &mut out, Some(&bs), act.as_ref()) }.map_err(cublas_error)?;
        Ok(())
    }
}
