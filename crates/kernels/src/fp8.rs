//! Linear products with FP8 E4M3 weights `[n, k]` and one f32 scale per output row
//! (cuda/fp8.cu). On GPUs with FP8 tensor cores (compute capability 8.9 and later: the RTX
//! 4090, the H100/H200) several rows run W8A8: the activations quantized per token as the
//! weights are per row, through cuBLASLt's FP8 GEMM with both scale vectors applied in it.
//! One row (a decode step's product) runs W8A16, through a GEMV that reads the FP8 weight and
//! dequantizes it in registers. Elsewhere the weight is expanded to the compute dtype for
//! each product: that saves memory, not time, and leaves the activations as they are, so a CPU
//! rank at any TP width gives the dequantized model's output.

use candle_core::{DType, Device, Result, Tensor};

/// How a product with FP8 weights runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Path {
    /// FP8 kernels: the W8A8 GEMM for several rows, the W8A16 GEMV for one.
    Fp8Kernels,
    /// The weight expanded to the compute dtype for the product; the activations unquantized.
    Expanded,
}

/// The path of `x · wᵀ` for a weight of `k` columns and `n` rows on `device` in `dtype`: FP8
/// kernels on CUDA from compute capability 8.9, in f32, bf16 or f16, with `k` and `n`
/// multiples of 16 (cuBLASLt's FP8 GEMM needs 16-byte aligned rows of every operand).
pub fn fp8_path(device: &Device, dtype: DType, n: usize, k: usize) -> Fp8Path {
    match fp8_kernels_take(dtype, n, k) && fp8_tensor_cores_on(device) {
        true => Fp8Path::Fp8Kernels,
        false => Fp8Path::Expanded,
    }
}

/// Whether `device` is a GPU with FP8 tensor cores ([`fp8_tensor_cores`]); elsewhere (CPU
/// ranks, older GPUs) FP8 weights are expanded for each product, which saves memory, not time.
pub fn fp8_tensor_cores_on(device: &Device) -> bool {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => cuda::has_fp8_tensor_cores(dev),
        _ => false,
    }
}

/// Whether a GPU of compute capability `capability` has FP8 tensor cores, which the FP8
/// products run on (cuBLASLt's FP8 GEMM and the W8A16 GEMV): Ada (8.9) and newer.
pub fn fp8_tensor_cores(capability: (i32, i32)) -> bool {
    capability >= (8, 9)
}

/// Whether the FP8 kernels take a product of `n` rows and `k` columns in `dtype` on a GPU
/// with FP8 tensor cores (the device apart from [`fp8_path`]; a plan asks it of a GPU it
/// has not opened).
pub fn fp8_kernels_take(dtype: DType, n: usize, k: usize) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && k.is_multiple_of(16) && n.is_multiple_of(16)
}

/// `x · (values · scales)ᵀ (+ bias)`, then GELU (tanh approximation) when `gelu`, for `x`
/// `[.., k]`, E4M3 `values` `[n, k]`, f32 `scales` `[n]` and a `bias` `[n]` in `x`'s dtype:
/// `[.., n]` in `x`'s dtype, by [`fp8_path`].
pub fn fp8_linear(x: &Tensor, values: &Tensor, scales: &Tensor, bias: Option<&Tensor>, gelu: bool) -> Result<Tensor> {
    let (n, k) = values.dims2()?;
    if values.dtype() != DType::F8E4M3
        || scales.dims() != [n]
        || scales.dtype() != DType::F32
        || x.dims().last() != Some(&k)
        || bias.is_some_and(|b| b.dims() != [n] || b.dtype() != x.dtype())
    {
        candle_core::bail!(
            "fp8 linear: x {:?} {:?}, values {:?} {:?}, scales {:?} {:?} and bias {:?} do not fit",
            x.dims(),
            x.dtype(),
            values.dims(),
            values.dtype(),
            scales.dims(),
            scales.dtype(),
            bias.map(|b| (b.dims().to_vec(), b.dtype()))
        );
    }
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    let x2 = x.reshape((x.elem_count() / k, k))?.contiguous()?;
    let y = match fp8_path(x.device(), x.dtype(), n, k) {
        #[cfg(feature = "cuda")]
        Fp8Path::Fp8Kernels => cuda::product(&x2, values, scales, bias, gelu)?,
        _ => expanded_product(&x2, values, scales, bias, gelu)?,
    };
    y.reshape(shape)
}

/// The weight expanded to `x`'s dtype, then the dense product, with the bias and GELU in the
/// GEMM where [`crate::linear_bias`] fuses them: beside the expanded weight, only the output
/// is allocated (added after the GEMM, the bias and GELU each held another output-sized
/// tensor).
fn expanded_product(x: &Tensor, values: &Tensor, scales: &Tensor, bias: Option<&Tensor>, gelu: bool) -> Result<Tensor> {
    let dense = expand(values, scales, x.dtype())?;
    match bias {
        Some(b) => crate::linear_bias(x, &dense, b, gelu),
        None => {
            let y = x.matmul(&dense.t()?)?;
            match gelu {
                true => y.gelu(),
                false => Ok(y),
            }
        }
    }
}

/// [`fp8_linear`] of `x` `[rows, k]` written into rows `first_row..first_row + rows` of `out`
/// (`[.., n]`, contiguous, in `x`'s dtype): a part of a product over gathered rows. The W8A8
/// GEMM writes there itself; other paths copy their result in.
pub fn fp8_linear_into(
    out: &Tensor,
    first_row: usize,
    x: &Tensor,
    values: &Tensor,
    scales: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<()> {
    let (n, k) = values.dims2()?;
    let (rows, x_k) = x.dims2()?;
    let (out_rows, out_n) = out.dims2()?;
    if x_k != k || out_n != n || first_row + rows > out_rows || out.dtype() != x.dtype() || !out.is_contiguous() {
        candle_core::bail!(
            "fp8_linear_into: x {:?} {:?} at row {first_row} of out {:?} {:?} (contiguous: {}) with values {:?}",
            x.dims(),
            x.dtype(),
            out.dims(),
            out.dtype(),
            out.is_contiguous(),
            values.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if rows > 1 && cuda::epilogue_in_gemm(x.dtype()) && fp8_path(x.device(), x.dtype(), n, k) == Fp8Path::Fp8Kernels {
        return cuda::product_into(
            &x.contiguous()?,
            values,
            scales,
            bias,
            gelu,
            &out.narrow(0, first_row, rows)?,
        );
    }
    match bias {
        // The expanded product writes into `out` itself where the fused linear covers it.
        Some(b) if fp8_path(x.device(), x.dtype(), n, k) != Fp8Path::Fp8Kernels => {
            crate::linear_bias_into(out, first_row, x, &expand(values, scales, x.dtype())?, b, gelu)
        }
        _ => out.slice_set(&fp8_linear(x, values, scales, bias, gelu)?, 0, first_row),
    }
}

/// The fewest rows for which [`fp8_linear_of_silu_mul`] makes and quantizes the hidden in one
/// pass (one CTA a row). On an H200 (8B shape, 14,336 → 4,096), against `silu_mul` and then
/// the product, that pass and its GEMM ran 0.95× as fast at 64 rows, 1.25× at 512 and 1.16×
/// at 2,048.
const SILU_MUL_FUSED_MIN_ROWS: usize = 256;

/// The down projection of a gated MLP's hidden: `silu(gate) · up` of its fused gate/up output
/// `gate_up` `[rows, 2n]` (gate, then up) times `(values · scales)ᵀ` (`values` `[m, n]`),
/// `[rows, m]` in `gate_up`'s dtype. On the W8A8 path, from `SILU_MUL_FUSED_MIN_ROWS` rows,
/// the hidden is made and quantized in one pass and never written; elsewhere
/// [`crate::silu_mul`], then [`fp8_linear`]. The same values either way: the fused pass
/// rounds the hidden to the dtype as `silu_mul` does.
pub fn fp8_linear_of_silu_mul(gate_up: &Tensor, values: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let (rows, cols) = gate_up.dims2()?;
    let (m, n) = values.dims2()?;
    if cols != 2 * n || values.dtype() != DType::F8E4M3 || scales.dims() != [m] {
        candle_core::bail!(
            "fp8 linear of silu_mul: gate/up {:?}, values {:?} {:?} and scales {:?} do not fit",
            gate_up.dims(),
            values.dims(),
            values.dtype(),
            scales.dims()
        );
    }
    // One row runs the W8A16 GEMV, which takes the hidden as it is; fewer rows than
    // `SILU_MUL_FUSED_MIN_ROWS` leave the fused pass's one CTA a row too few.
    if rows >= SILU_MUL_FUSED_MIN_ROWS && fp8_path(gate_up.device(), gate_up.dtype(), m, n) == Fp8Path::Fp8Kernels {
        #[cfg(feature = "cuda")]
        return cuda::silu_mul_product(&gate_up.contiguous()?, values, scales);
    }
    fp8_linear(&crate::silu_mul(gate_up)?, values, scales, None, false)
}

/// `values · scales` (each row by its scale) in `dtype`: the weight a product expands.
pub fn expand(values: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
    match values.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::dequantize_rows(values, scales, dtype),
        // In the compute dtype: the transient copy stays at two of its values per weight.
        _ => values
            .to_dtype(dtype)?
            .broadcast_mul(&scales.to_dtype(dtype)?.unsqueeze(1)?),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::cublaslt::{result, sys, MatmulShared};
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaDevice, DType, Device, Result, Tensor};

    use crate::launch::{addresses, elementwise, suffix, THREADS};

    /// cuBLASLt's workspace for the FP8 GEMMs, per stream, from the pool: 4 MiB of the 32 a
    /// Hopper handle keeps for bf16 GEMMs (the 8B plan held within 1% with it).
    const WORKSPACE_BYTES: usize = 4 << 20;
    /// E4M3 in cuBLASLt's enum (cudaDataType CUDA_R_8F_E4M3).
    const E4M3: sys::cudaDataType = sys::cudaDataType::CUDA_R_8F_E4M3;

    /// A stream and the FP8 GEMMs' workspace on it.
    type Workspace = (Arc<CudaStream>, Arc<CudaSlice<u8>>);

    /// An FP8 GEMM's rows, output and input widths, output dtype, epilogue and the output's
    /// alignment in bytes.
    type GemmShape = (usize, usize, usize, DType, u32, u32);

    thread_local! {
        /// The FP8 GEMMs' workspace for each stream this thread launches on.
        static WORKSPACES: RefCell<Vec<Workspace>> = const { RefCell::new(Vec::new()) };
        /// cuBLASLt's algorithm for each FP8 GEMM shape this rank's thread has run: the
        /// heuristic query is host work that every prefill product and batched step would
        /// otherwise repeat (a rank's thread drives one device).
        static ALGOS: RefCell<HashMap<GemmShape, sys::cublasLtMatmulHeuristicResult_t>> =
            RefCell::new(HashMap::new());
    }

    pub(super) fn has_fp8_tensor_cores(dev: &CudaDevice) -> bool {
        dev.cuda_stream()
            .context()
            .compute_capability()
            .is_ok_and(super::fp8_tensor_cores)
    }

    fn cublas_error(what: &str) -> impl Fn(result::CublasError) -> candle_core::Error + '_ {
        move |e| candle_core::Error::Msg(format!("cuBLASLt FP8 GEMM, {what}: {e:?}"))
    }

    fn workspace(stream: &Arc<CudaStream>) -> Result<Arc<CudaSlice<u8>>> {
        WORKSPACES.with_borrow_mut(|spaces| {
            if let Some((_, w)) = spaces.iter().find(|(s, _)| Arc::ptr_eq(s, stream)) {
                return Ok(w.clone());
            }
            // SAFETY: cuBLASLt writes its workspace before it reads it.
            let w = Arc::new(unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }.w()?);
            spaces.push((stream.clone(), w.clone()));
            Ok(w)
        })
    }

    fn cuda_device(t: &Tensor) -> Result<&CudaDevice> {
        match t.device() {
            Device::Cuda(dev) => Ok(dev),
            other => candle_core::bail!("fp8: a tensor on {:?}, not CUDA", other.location()),
        }
    }

    /// `x` `[rows, k]` (contiguous, `k` a multiple of 16) as E4M3 bytes `[rows, k]` and f32
    /// scales `[rows]`.
    fn quantize_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = x.dim(1)?;
        quantize_with(x, "fp8_quantize_rows", k)
    }

    /// Rows of `k` values made from rows of `x` (contiguous) by `kernel` (fp8.cu), quantized
    /// as [`quantize_rows`] quantizes: E4M3 bytes `[rows, k]` and f32 scales `[rows]`.
    fn quantize_with(x: &Tensor, kernel: &str, k: usize) -> Result<(Tensor, Tensor)> {
        let dev = cuda_device(x)?;
        let rows = x.dim(0)?;
        if !k.is_multiple_of(16) {
            candle_core::bail!("fp8: quantizing rows of {k} values, not a multiple of 16");
        }
        // The kernels read 16-byte vectors: a view that starts between them is copied.
        let copied;
        let x = match crate::launch::device_address(x)?.is_multiple_of(16) {
            true => x,
            false => {
                copied = x.copy()?;
                &copied
            }
        };
        let q = crate::linear::empty(&[rows, k], DType::U8, x.device())?;
        let s = crate::linear::empty(&[rows], DType::F32, x.device())?;
        let func = crate::module::FP8.kernel(dev, &format!("{kernel}_{}", suffix(x.dtype())?))?;
        let a = addresses(&[x, &q, &s])?;
        let k = k as i32;
        let mut b = func.builder();
        for address in &a {
            b.arg(address);
        }
        b.arg(&k);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds rows contiguous rows of its dtype from a 16-byte aligned address,
        // each k (quantize_rows) or 2k (silu_mul_quantize_rows, checked by its caller) values,
        // k a multiple of 16, so the kernels' 16-byte loads stay within aligned rows; q
        // rows · k bytes and s rows floats, fresh; one CTA a row.
        unsafe { b.launch(cfg) }.w()?;
        Ok((q, s))
    }

    /// [`super::fp8_linear_of_silu_mul`] on the W8A8 path: the hidden made and quantized in
    /// one pass over `gate_up` `[rows, 2n]` (contiguous; its width checked by the caller),
    /// then the GEMM.
    pub(super) fn silu_mul_product(gate_up: &Tensor, values: &Tensor, scales: &Tensor) -> Result<Tensor> {
        let rows = gate_up.dim(0)?;
        let (m, n) = values.dims2()?;
        let (qx, sx) = quantize_with(gate_up, "fp8_silu_mul_quantize_rows", n)?;
        let y = crate::linear::empty(&[rows, m], gate_up.dtype(), gate_up.device())?;
        let (values, scales) = (values.contiguous()?, scales.contiguous()?);
        gemm(&qx, &sx, &values, &scales, None, false, &y, (rows, m, n))?;
        Ok(y)
    }

    pub(super) fn dequantize_rows(values: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
        let dev = cuda_device(values)?;
        let (n, k) = values.dims2()?;
        let (values, scales) = (values.contiguous()?, scales.contiguous()?);
        let out = crate::linear::empty(&[n, k], dtype, values.device())?;
        let func = crate::module::FP8.kernel(dev, &format!("fp8_dequantize_rows_{}", suffix(dtype)?))?;
        let a = addresses(&[&values, &scales, &out])?;
        let (elements, k32) = ((n * k) as i64, k as i32);
        let mut b = func.builder();
        for address in &a {
            b.arg(address);
        }
        b.arg(&elements).arg(&k32);
        // SAFETY: values holds n · k bytes and scales n floats, contiguous; out is fresh, n · k
        // elements of `dtype`.
        unsafe { b.launch(elementwise(n * k)) }.w()?;
        Ok(out)
    }

    /// The product of `x` `[rows, k]` (contiguous) with `values` `[n, k]`: W8A16 for one row,
    /// W8A8 for more.
    pub(super) fn product(
        x: &Tensor,
        values: &Tensor,
        scales: &Tensor,
        bias: Option<&Tensor>,
        gelu: bool,
    ) -> Result<Tensor> {
        let (rows, n) = (x.dim(0)?, values.dim(0)?);
        let epilogue_in_gemm = rows > 1 && epilogue_in_gemm(x.dtype());
        let y = match rows {
            1 => crate::gemv(
                x,
                crate::RowWeight::Fp8 {
                    values: &values.contiguous()?,
                    scales: &scales.contiguous()?,
                },
            )?,
            _ => {
                let y = crate::linear::empty(&[rows, n], x.dtype(), x.device())?;
                let bias = bias.filter(|_| epilogue_in_gemm);
                product_into(x, values, scales, bias, gelu && epilogue_in_gemm, &y)?;
                y
            }
        };
        if epilogue_in_gemm {
            return Ok(y);
        }
        let y = match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        match gelu {
            true => y.gelu(),
            false => Ok(y),
        }
    }

    /// Whether the W8A8 GEMM applies the bias and GELU itself for an output in `dtype`:
    /// cuBLASLt has no FP8 epilogue with an f32 output, so there they follow it.
    pub(super) fn epilogue_in_gemm(dtype: DType) -> bool {
        dtype != DType::F32
    }

    /// [`product`] of several rows `x` (contiguous) written into `y` (`[rows, n]`,
    /// contiguous; a view into a larger output): `x` quantized per row, then the FP8 GEMM with
    /// the bias and GELU in its epilogue ([`epilogue_in_gemm`]).
    pub(super) fn product_into(
        x: &Tensor,
        values: &Tensor,
        scales: &Tensor,
        bias: Option<&Tensor>,
        gelu: bool,
        y: &Tensor,
    ) -> Result<()> {
        let ((rows, n), k) = (y.dims2()?, x.dim(1)?);
        let (values, scales) = (values.contiguous()?, scales.contiguous()?);
        let (qx, sx) = quantize_rows(x)?;
        let bias = bias.map(|b| b.contiguous()).transpose()?;
        gemm(&qx, &sx, &values, &scales, bias.as_ref(), gelu, y, (rows, n, k))
    }

    fn out_type(dtype: DType) -> Result<sys::cudaDataType> {
        Ok(match dtype {
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType::CUDA_R_16F,
            other => candle_core::bail!("fp8 GEMM: no output in {other:?}"),
        })
    }

    /// A cuBLASLt object destroyed when dropped, whatever happens between.
    struct Owned<T: Copy> {
        handle: T,
        destroy: unsafe fn(T) -> std::result::Result<(), result::CublasError>,
    }

    impl<T: Copy> Drop for Owned<T> {
        fn drop(&mut self) {
            // SAFETY: created by cuBLASLt and destroyed once, here.
            let _ = unsafe { (self.destroy)(self.handle) };
        }
    }

    fn layout(dtype: sys::cudaDataType, rows: usize, cols: usize) -> Result<Owned<sys::cublasLtMatrixLayout_t>> {
        let handle = result::create_matrix_layout(dtype, rows as u64, cols as u64, rows as i64)
            .map_err(cublas_error("layout"))?;
        Ok(Owned {
            handle,
            destroy: result::destroy_matrix_layout,
        })
    }

    fn set<V>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, value: &V) -> Result<()> {
        // SAFETY: `value` is the attribute's type, read for its size.
        unsafe {
            result::set_matmul_desc_attribute(desc, attr, value as *const V as *const c_void, std::mem::size_of::<V>())
        }
        .map_err(cublas_error("descriptor"))
    }

    fn prefer<V>(
        pref: sys::cublasLtMatmulPreference_t,
        attr: sys::cublasLtMatmulPreferenceAttributes_t,
        value: &V,
    ) -> Result<()> {
        // SAFETY: `value` is the attribute's type, read for its size.
        unsafe {
            result::set_matmul_pref_attribute(pref, attr, value as *const V as *const c_void, std::mem::size_of::<V>())
        }
        .map_err(cublas_error("preference"))
    }

    /// cuBLASLt's algorithm for descriptor `d` on layouts A, B and C (= D), within the
    /// workspace, for a C and D aligned to `c_alignment` bytes.
    fn choose_algorithm(
        handle: sys::cublasLtHandle_t,
        d: sys::cublasLtMatmulDesc_t,
        [a, b, c]: [sys::cublasLtMatrixLayout_t; 3],
        c_alignment: u32,
    ) -> Result<sys::cublasLtMatmulHeuristicResult_t> {
        let pref = result::create_matmul_pref().map_err(cublas_error("preference"))?;
        let pref = Owned {
            handle: pref,
            destroy: result::destroy_matmul_pref,
        };
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        prefer(
            pref.handle,
            Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(WORKSPACE_BYTES as u64),
        )?;
        prefer(
            pref.handle,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &c_alignment,
        )?;
        prefer(
            pref.handle,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &c_alignment,
        )?;
        // SAFETY: the descriptors are live; cuBLASLt reads them only.
        unsafe { result::get_matmul_algo_heuristic(handle, d, a, b, c, c, pref.handle) }
            .map_err(cublas_error("no algorithm for these shapes"))
    }

    /// yᵀ `[n, rows]` = (s_w ⊙ q_w) `[k, n]`ᵀ · (s_x ⊙ q_x)ᵀ `[k, rows]` in cuBLASLt's
    /// column-major terms: the weight is A (transposed), the activations B, and their scale
    /// vectors are A's (one per output feature) and B's (one per token), applied inside the
    /// GEMM; the bias (and GELU) in its epilogue.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        qx: &Tensor,
        sx: &Tensor,
        values: &Tensor,
        scales: &Tensor,
        bias: Option<&Tensor>,
        gelu: bool,
        y: &Tensor,
        (rows, n, k): (usize, usize, usize),
    ) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let dev = cuda_device(qx)?;
        let stream = dev.cuda_stream();
        let lt = crate::linear::cublaslt_handle(&stream)?;
        let space = workspace(&stream)?;
        let dtype = y.dtype();
        let out = out_type(dtype)?;

        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(cublas_error("descriptor"))?;
        let desc = Owned {
            handle: desc,
            destroy: result::destroy_matmul_desc,
        };
        let d = desc.handle;
        // cublasOperation_t: 1 transposes, 0 does not.
        set(d, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
        set(d, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
        let outer = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
        set(d, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
        set(d, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
        let [x_address, sx_address, w_address, sw_address, y_address] = addresses(&[qx, sx, values, scales, y])?[..]
        else {
            candle_core::bail!("fp8 GEMM: operand addresses");
        };
        set(d, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw_address)?;
        set(d, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx_address)?;
        let epilogue = match (bias.is_some(), gelu) {
            (false, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            (true, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
            (true, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        set(d, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        if let Some(b) = bias {
            let b_address = crate::launch::device_address(b)?;
            set(d, Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b_address)?;
            set(d, Attr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out)?;
        }

        let (a, b, c) = (layout(E4M3, k, n)?, layout(E4M3, k, rows)?, layout(out, n, rows)?);
        let handle = *lt.handle();
        // A part written into a larger output may start off cuBLASLt's assumed 256-byte
        // alignment: the algorithm is chosen for the alignment the output has.
        let y_alignment = 1u32 << y_address.trailing_zeros().min(8);
        let shape = (rows, n, k, dtype, epilogue as u32, y_alignment);
        let heuristic = match ALGOS.with_borrow(|algos| algos.get(&shape).copied()) {
            Some(chosen) => chosen,
            None => {
                let chosen = choose_algorithm(handle, d, [a.handle, b.handle, c.handle], y_alignment)?;
                ALGOS.with_borrow_mut(|algos| algos.insert(shape, chosen));
                chosen
            }
        };
        let (alpha, beta) = (1f32, 0f32);
        let (space_address, _guard) = space.device_ptr(&stream);
        // SAFETY: the weight holds n rows of k E4M3 bytes, the activations rows rows of k, the
        // scales n and rows floats, the bias n elements of `dtype`, all contiguous from their
        // addresses (16-byte aligned: k and n are multiples of 16 and the buffers fresh or
        // whole); y holds rows · n of `dtype` from its address (checked by the callers), at
        // the alignment the algorithm was chosen for; the workspace is this stream's own.
        unsafe {
            result::matmul(
                handle,
                d,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w_address as *const c_void,
                a.handle,
                x_address as *const c_void,
                b.handle,
                y_address as *const c_void,
                c.handle,
                y_address as *mut c_void,
                c.handle,
                &heuristic.algo,
                space_address as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(cublas_error("matmul"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random `[n, k]` E4M3 weight of large values and small row scales, on the CPU.
    fn random_weight(n: usize, k: usize) -> Result<(Tensor, Tensor)> {
        let values = Tensor::randn(0f32, 100.0, (n, k), &Device::Cpu)?.to_dtype(DType::F8E4M3)?;
        Ok((values, Tensor::rand(0.001f32, 0.01, n, &Device::Cpu)?))
    }

    /// The CPU path is the weight expanded row by row: checked against the product written
    /// out element by element, with the bias and GELU after it.
    #[test]
    fn expanded_product_is_the_dequantized_weights_product() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, k, n) = (3, 32, 16);
        let (values, scales) = random_weight(n, k)?;
        let x = Tensor::randn(0f32, 1.0, (1, rows, k), &dev)?;
        let bias = Tensor::randn(0f32, 1.0, n, &dev)?;
        let y = fp8_linear(&x, &values, &scales, Some(&bias), true)?;
        assert_eq!(y.dims(), [1, rows, n]);
        let (w, s) = (values.to_dtype(DType::F32)?.to_vec2::<f32>()?, scales.to_vec1::<f32>()?);
        let (xs, b, y) = (
            x.squeeze(0)?.to_vec2::<f32>()?,
            bias.to_vec1::<f32>()?,
            y.squeeze(0)?.to_vec2::<f32>()?,
        );
        for r in 0..rows {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|i| xs[r][i] as f64 * w[j][i] as f64 * s[j] as f64)
                    .sum::<f64>()
                    + b[j] as f64;
                let gelu =
                    0.5 * dot * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (dot + 0.044715 * dot.powi(3))).tanh());
                assert!(
                    (y[r][j] as f64 - gelu).abs() < 1e-4 * (1.0 + gelu.abs()),
                    "{r},{j}: {} vs {gelu}",
                    y[r][j]
                );
            }
        }
        Ok(())
    }

    #[test]
    fn mismatched_operands_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let values = Tensor::zeros((16, 32), DType::F8E4M3, &dev)?;
        let x = Tensor::zeros((2, 32), DType::F32, &dev)?;
        let short_scales = Tensor::ones(8, DType::F32, &dev)?;
        assert!(fp8_linear(&x, &values, &short_scales, None, false).is_err());
        let scales = Tensor::ones(16, DType::F32, &dev)?;
        let wide_x = Tensor::zeros((2, 48), DType::F32, &dev)?;
        assert!(fp8_linear(&wide_x, &values, &scales, None, false).is_err());
        let dense = Tensor::zeros((16, 32), DType::F32, &dev)?;
        assert!(fp8_linear(&x, &dense, &scales, None, false).is_err());
        assert_eq!(fp8_path(&dev, DType::BF16, 16, 32), Fp8Path::Expanded);
        Ok(())
    }

    /// Rows written into a larger output are the plain product's rows; the rows around them
    /// stay as they were; an output that cannot hold them is refused.
    #[test]
    fn a_product_written_into_rows_is_the_plain_product() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, k, n) = (3, 32, 16);
        let (values, scales) = random_weight(n, k)?;
        let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
        let bias = Tensor::randn(0f32, 1.0, n, &dev)?;
        let out = Tensor::full(7f32, (rows + 3, n), &dev)?;
        fp8_linear_into(&out, 2, &x, &values, &scales, Some(&bias), true)?;
        let y = fp8_linear(&x, &values, &scales, Some(&bias), true)?;
        assert_eq!(out.narrow(0, 2, rows)?.to_vec2::<f32>()?, y.to_vec2::<f32>()?);
        for r in [0, 1, rows + 2] {
            assert_eq!(out.get(r)?.to_vec1::<f32>()?, vec![7f32; n], "row {r}");
        }
        assert!(fp8_linear_into(&out, 4, &x, &values, &scales, None, false).is_err());
        let narrow = Tensor::zeros((rows, n / 2), DType::F32, &dev)?;
        assert!(fp8_linear_into(&narrow, 0, &x, &values, &scales, None, false).is_err());
        Ok(())
    }

    /// The down projection of a gated MLP's fused gate/up output is `silu_mul`'s hidden times
    /// the weight; a gate/up output of the wrong width is refused.
    #[test]
    fn the_silu_product_projection_is_the_product_of_silu_mul() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, n, m) = (4, 32, 16);
        let (values, scales) = random_weight(m, n)?;
        let gate_up = Tensor::randn(0f32, 2.0, (rows, 2 * n), &dev)?;
        let y = fp8_linear_of_silu_mul(&gate_up, &values, &scales)?;
        let apart = fp8_linear(&crate::silu_mul(&gate_up)?, &values, &scales, None, false)?;
        assert_eq!(y.to_vec2::<f32>()?, apart.to_vec2::<f32>()?);
        let wrong = Tensor::zeros((rows, n), DType::F32, &dev)?;
        assert!(fp8_linear_of_silu_mul(&wrong, &values, &scales).is_err());
        Ok(())
    }
}
