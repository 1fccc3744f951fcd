//! One input row through a linear layer: `x · wᵀ` for `x` holding a single row of `k` and `w`
//! `[n, k]` (cuda/gemv.cu). A decode step's weight products all have this shape, and they
//! are bound by reading `w` once; see the kernel for why it beats the general GEMM there.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

/// Whether [`gemv`] runs on CUDA for `x` and `w`: one row, bf16 or f16 on both, `k` a multiple
/// of 8. On CPU it always runs (the twin that the tests check the kernel's math with).
pub fn gemv_on_cuda(x: &Tensor, w: &Tensor) -> bool {
    one_row_on_cuda(x, w, 1)
}

/// Whether [`gemv_silu_mul`] runs on CUDA for `gate_up` and `w`, as [`gemv_on_cuda`].
pub fn gemv_silu_mul_on_cuda(gate_up: &Tensor, w: &Tensor) -> bool {
    one_row_on_cuda(gate_up, w, 2)
}

/// `x` holds `parts` rows' worth of `w`'s input and lives on CUDA in 16 bits.
fn one_row_on_cuda(x: &Tensor, w: &Tensor, parts: usize) -> bool {
    let k = w.dims().get(1).copied().unwrap_or(0);
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && x.dims().last() == Some(&(parts * k))
        && x.elem_count() == parts * k
        && k.is_multiple_of(8)
}

/// `x · wᵀ` for `x` `[.., k]` holding one row and `w` `[n, k]`: `[.., n]`, accumulated in f32.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    apply(x, w, false)
}

/// `(silu(gate) · up) · wᵀ` for a gated MLP's fused output `gate_up` `[.., 2k]` holding one
/// row (gate, then up) and `w` `[n, k]`: [`crate::silu_mul`] and [`gemv`] in one pass, with the
/// same rounding of the product as `silu_mul`, so the same result.
pub fn gemv_silu_mul(gate_up: &Tensor, w: &Tensor) -> Result<Tensor> {
    apply(gate_up, w, true)
}

fn apply(x: &Tensor, w: &Tensor, gated: bool) -> Result<Tensor> {
    let width = x.dims().last().copied().unwrap_or(0);
    let (n, k) = w.dims2()?;
    let parts = if gated { 2 } else { 1 };
    if x.elem_count() != width || width != parts * k || w.dtype() != x.dtype() {
        candle_core::bail!(
            "gemv: x {:?} {:?} is not one row of {parts} × w {:?} {:?}'s input",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n;
    }
    let y = x
        .contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &Gemv { n, k, gated })?;
    y.reshape(shape)
}

struct Gemv {
    n: usize,
    k: usize,
    /// The input is `[gate | up]`, multiplied as silu(gate) · up.
    gated: bool,
}

impl candle_core::CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "gemv"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((
            crate::cpu::gemv((x, xl), (w, wl), self.n, self.k, self.gated)?,
            Shape::from(self.n),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::gemv((x, xl), (w, wl), self.n, self.k, self.gated)?,
            Shape::from(self.n),
        ))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result};
    use half::{bf16, f16};

    use crate::launch::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
    /// Outputs per CTA and threads per CTA (cuda/gemv.cu).
    const ROWS: usize = 4;
    const THREADS: u32 = 256;

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn gemv(x: Input, w: Input, n: usize, k: usize, gated: bool) -> Result<CudaStorage> {
        match x.0.dtype() {
            DType::BF16 => typed::<bf16>(x, w, n, k, gated),
            DType::F16 => typed::<f16>(x, w, n, k, gated),
            other => candle_core::bail!("gemv: unsupported dtype {other:?} on CUDA"),
        }
    }

    fn typed<T: CudaDType + DeviceRepr>(
        (x, xl): Input,
        (w, wl): Input,
        n: usize,
        k: usize,
        gated: bool,
    ) -> Result<CudaStorage> {
        // Rows are read in 16-byte pieces.
        if !(k.is_multiple_of(8) && xl.start_offset().is_multiple_of(8) && wl.start_offset().is_multiple_of(8)) {
            candle_core::bail!(
                "gemv: k = {k} and the offsets {} and {} must be multiples of 8",
                xl.start_offset(),
                wl.start_offset()
            );
        }
        let dev = x.device();
        let kernel = if gated { "gemv_silu_mul" } else { "gemv" };
        let func = dev.get_or_load_custom_func(&format!("{kernel}_{}", suffix(x.dtype())?), "tpinfer_gemv", PTX)?;
        let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
        let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
        // SAFETY: every output is written by the CTA that owns it.
        let out = unsafe { dev.alloc::<T>(n)? };
        let (n_i, k_i) = (n as i32, k as i32);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(ROWS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&xs).arg(&ws).arg(&out).arg(&n_i).arg(&k_i);
        // SAFETY: the arguments match the kernel's signature; x holds k values (2k gated) and w
        // n rows of k.
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}
