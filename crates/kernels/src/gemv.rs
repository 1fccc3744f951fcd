//! One input row through a linear layer: `x · wᵀ` for `x` holding a single row of `k` and `w`
//! `[n, k]` (cuda/gemv.cu). A decode step's weight products all have this shape, and they
//! are bound by reading `w` once; see the kernel for why it beats the general GEMM there.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

/// Outputs per CTA that the CUDA kernel is compiled for ([`gemv_tiled`]).
pub const GEMV_TILES: [usize; 3] = [2, 4, 8];
/// The tile [`gemv`] and [`gemv_gate_up_silu`] use.
const DEFAULT_TILE: usize = 4;

/// Whether [`gemv`] runs on CUDA for `x` and `w`: one row, bf16 or f16 on both, `k` a multiple
/// of 8. On CPU it always runs (the twin that the tests check the kernel's math with).
pub fn gemv_on_cuda(x: &Tensor, w: &Tensor) -> bool {
    let k = w.dims().get(1).copied().unwrap_or(0);
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && x.dims().last() == Some(&k)
        && x.elem_count() == k
        && k.is_multiple_of(8)
}

/// Whether [`gemv_gate_up_silu`] runs on CUDA, as [`gemv_on_cuda`], with `w`'s rows even.
pub fn gemv_gate_up_silu_on_cuda(x: &Tensor, w: &Tensor) -> bool {
    gemv_on_cuda(x, w) && w.dim(0).is_ok_and(|rows| rows.is_multiple_of(2))
}

/// `x · wᵀ` for `x` `[.., k]` holding one row and `w` `[n, k]`: `[.., n]`, accumulated in f32.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    apply(x, w, DEFAULT_TILE, false)
}

/// [`gemv`] with `tile` outputs per CUDA thread block, one of [`GEMV_TILES`] (the tile is
/// a speed choice only: every tile gives the same bits). For benchmarks.
pub fn gemv_tiled(x: &Tensor, w: &Tensor, tile: usize) -> Result<Tensor> {
    apply(x, w, tile, false)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` for `x` `[.., k]` holding one row and a gated MLP's merged
/// weight `w` `[gate (n) | up (n)]`, `[2n, k]`: `[.., n]`. The bits of [`gemv`] followed by
/// [`crate::silu_mul`] (each product rounded to the dtype, then the SiLU product), in one
/// pass.
pub fn gemv_gate_up_silu(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    apply(x, w, DEFAULT_TILE, true)
}

/// [`gemv`] written into `out` (`[n]` elements, contiguous), as a link of a kernel chain
/// ([`crate::chained`]) on CUDA; elsewhere the product is copied in.
pub fn gemv_into(x: &Tensor, w: &Tensor, out: &Tensor) -> Result<()> {
    apply_into(x, w, false, out)
}

/// [`gemv_gate_up_silu`] written into `out`, as [`gemv_into`].
pub fn gemv_gate_up_silu_into(x: &Tensor, w: &Tensor, out: &Tensor) -> Result<()> {
    apply_into(x, w, true, out)
}

/// [`crate::rotary_qkv_into`] of the product of one row `x` and a fused QKV weight `w`
/// `[(q_heads + 2 · kv_heads) · d, k]`, in one CUDA kernel that computes each pair of rows
/// that rotate together and writes them rotated: the bits of [`gemv`] then
/// [`crate::rotary_qkv_into`], without the product's round trip through memory. A chain link.
/// Only where [`gemv_on_cuda`] holds for `x` and `w`; the caller has checked that the position
/// fits the table and the cache.
pub fn gemv_rotary_qkv_into(
    cache: &Tensor,
    x: &Tensor,
    w: &Tensor,
    table: &Tensor,
    position: &Tensor,
    q_heads: usize,
    queries: &Tensor,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if gemv_on_cuda(x, w) {
        return cuda::gemv_rotary_qkv_into(cache, x, w, table, position, q_heads, queries);
    }
    let _ = (cache, table, position, q_heads, queries);
    candle_core::bail!(
        "gemv_rotary_qkv_into: x {:?} and w {:?} are not a 16-bit GEMV on CUDA",
        x.dims(),
        w.dims()
    )
}

fn apply_into(x: &Tensor, w: &Tensor, gate_up: bool, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let op = Gemv::checked(x, w, DEFAULT_TILE, gate_up)?;
        return cuda::gemv_into(&op, x, w, out);
    }
    let y = apply(x, w, DEFAULT_TILE, gate_up)?;
    out.slice_set(&y.reshape(out.shape())?, 0, 0)
}

fn apply(x: &Tensor, w: &Tensor, tile: usize, gate_up: bool) -> Result<Tensor> {
    let op = Gemv::checked(x, w, tile, gate_up)?;
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = op.n;
    }
    let y = x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)?;
    y.reshape(shape)
}

struct Gemv {
    n: usize,
    k: usize,
    /// Outputs per CUDA thread block.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tile: usize,
    /// `w` is `[gate | up]` and the output silu(gate) · up.
    gate_up: bool,
}

impl Gemv {
    /// The product of one row `x` and `w`, checked.
    fn checked(x: &Tensor, w: &Tensor, tile: usize, gate_up: bool) -> Result<Self> {
        let width = x.dims().last().copied().unwrap_or(0);
        let (rows, k) = w.dims2()?;
        if x.elem_count() != width || width != k || w.dtype() != x.dtype() || (gate_up && rows % 2 != 0) {
            candle_core::bail!(
                "gemv: x {:?} {:?} is not one row of w {:?} {:?}'s input{}",
                x.dims(),
                x.dtype(),
                w.dims(),
                w.dtype(),
                if gate_up {
                    " (or w's rows are not [gate | up])"
                } else {
                    ""
                }
            );
        }
        if !GEMV_TILES.contains(&tile) {
            candle_core::bail!("gemv: no kernel for {tile} outputs per block (tiles: {GEMV_TILES:?})");
        }
        let n = if gate_up { rows / 2 } else { rows };
        Ok(Gemv { n, k, tile, gate_up })
    }
}

impl candle_core::CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "gemv"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((
            crate::cpu::gemv((x, xl), (w, wl), self.n, self.k, self.gate_up)?,
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
        Ok((cuda::gemv(self, (x, xl), (w, wl))?, Shape::from(self.n)))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};
    use half::{bf16, f16};

    use super::Gemv;
    use crate::chain::Launch;
    use crate::launch::{check_output, device_address, suffix};

    /// Threads per CTA (cuda/gemv.cu).
    const THREADS: u32 = 256;

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn gemv(op: &Gemv, x: Input, w: Input) -> Result<CudaStorage> {
        match x.0.dtype() {
            DType::BF16 => typed::<bf16>(op, x, w),
            DType::F16 => typed::<f16>(op, x, w),
            other => candle_core::bail!("gemv: unsupported dtype {other:?} on CUDA"),
        }
    }

    fn typed<T: CudaDType + DeviceRepr>(op: &Gemv, (x, xl): Input, (w, wl): Input) -> Result<CudaStorage> {
        let dev = x.device();
        let stream = dev.cuda_stream();
        let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
        let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
        // SAFETY: every output is written by the CTA that owns it.
        let out = unsafe { dev.alloc::<T>(op.n)? };
        let addresses = [
            xs.device_ptr(&stream).0,
            ws.device_ptr(&stream).0,
            out.device_ptr(&stream).0,
        ];
        let offsets = [xl.start_offset(), wl.start_offset()];
        launch(op, dev, x.dtype(), addresses, offsets)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// The product written into `out`: a chain link.
    pub(super) fn gemv_into(op: &Gemv, x: &Tensor, w: &Tensor, out: &Tensor) -> Result<()> {
        check_output(out, x.dtype(), op.n, "gemv")?;
        let candle_core::Device::Cuda(dev) = x.device() else {
            candle_core::bail!("gemv: x is not on CUDA");
        };
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let addresses = [device_address(&x)?, device_address(&w)?, device_address(out)?];
        let offsets = [x.layout().start_offset(), w.layout().start_offset()];
        launch(op, dev, x.dtype(), addresses, offsets)
    }

    pub(super) fn gemv_rotary_qkv_into(
        cache: &Tensor,
        x: &Tensor,
        w: &Tensor,
        table: &Tensor,
        position: &Tensor,
        q_heads: usize,
        queries: &Tensor,
    ) -> Result<()> {
        crate::position::check(position, x, "gemv_rotary_qkv")?;
        let (two, kv_heads, capacity, d) = cache.dims4()?;
        let (rows, k) = w.dims2()?;
        let (table_two, positions, half) = table.dims3()?;
        let dtype = x.dtype();
        if two != 2
            || table_two != 2
            || 2 * half != d
            || rows != (q_heads + 2 * kv_heads) * d
            || !cache.is_contiguous()
            || !table.is_contiguous()
            || cache.dtype() != dtype
            || table.dtype() != dtype
        {
            candle_core::bail!(
                "gemv_rotary_qkv: w {:?}, the cache {:?} and the table {:?} are not [({q_heads} + 2 · kv_heads) · d, k], \
                 a contiguous [2, kv_heads, capacity, d] and [2, positions, d / 2] in {dtype:?}",
                w.dims(),
                cache.dims(),
                table.dims()
            );
        }
        check_output(queries, dtype, q_heads * d, "gemv_rotary_qkv")?;
        let candle_core::Device::Cuda(dev) = x.device() else {
            candle_core::bail!("gemv_rotary_qkv: x is not on CUDA");
        };
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        if !(k.is_multiple_of(8) && [&x, &w].iter().all(|t| t.layout().start_offset().is_multiple_of(8))) {
            candle_core::bail!("gemv_rotary_qkv: k = {k} and the offsets of x and w must be multiples of 8");
        }
        let func = crate::module::GEMV.kernel(dev, &format!("gemv_rotary_{}", suffix(dtype)?))?;
        let cfg = LaunchConfig {
            grid_dim: ((rows / 2) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = Launch::default();
        for t in [&x, &w, table, queries, cache] {
            launch.arg(device_address(t)?);
        }
        for v in [q_heads, kv_heads, d, k] {
            launch.arg(v as i32);
        }
        launch
            .arg(device_address(position)?)
            .arg(positions as i32)
            .arg(capacity as i32);
        // SAFETY: the arguments match the kernel's signature; w holds the (q_heads + 2 ·
        // kv_heads) · d rows of k that the rows / 2 CTAs read in pairs, x k values, queries
        // q_heads · d, the cache is a contiguous [2, kv_heads, capacity, d], and the kernel
        // skips a position past the table or the cache.
        unsafe { launch.launch(dev, &func, cfg) }
    }

    /// Launches the kernel on x, w and y at `addresses`; `offsets` are x's and w's in
    /// elements, which must keep their rows on 16 bytes.
    fn launch(op: &Gemv, dev: &CudaDevice, dtype: DType, [x, w, y]: [u64; 3], offsets: [usize; 2]) -> Result<()> {
        let (n, k) = (op.n, op.k);
        if !(k.is_multiple_of(8) && offsets.iter().all(|o| o.is_multiple_of(8))) {
            candle_core::bail!("gemv: k = {k} and the offsets {offsets:?} must be multiples of 8");
        }
        let kernel = if op.gate_up { "gemv_gate_up_silu" } else { "gemv" };
        let name = format!("{kernel}_{}_r{}", suffix(dtype)?, op.tile);
        let func = crate::module::GEMV.kernel(dev, &name)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(op.tile) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; x holds k values, w n rows of k
        // (2n with gate_up) and y n values.
        unsafe {
            Launch::default()
                .arg(x)
                .arg(w)
                .arg(y)
                .arg(n as i32)
                .arg(k as i32)
                .launch(dev, &func, cfg)
        }
    }
}
