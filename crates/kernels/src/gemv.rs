//! One input row through a linear layer: `x · wᵀ` for `x` holding a single row of `k` and `w`
//! `[n, k]` (cuda/gemv.cu). A decode step's weight products all have this shape, and they
//! are bound by reading `w` once; see the kernel for why it beats the general GEMM there.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use crate::fp8::{fp8_linear, fp8_path, Fp8Path};

/// Outputs per CTA that the CUDA kernel is compiled for ([`gemv_tiled`]).
pub const GEMV_TILES: [usize; 3] = [2, 4, 8];

/// A GEMV's weight `[n, k]`.
#[derive(Debug, Clone, Copy)]
pub enum RowWeight<'a> {
    /// In the input's dtype.
    Dense(&'a Tensor),
    /// E4M3 `values` `[n, k]` and f32 `scales` `[n]`, one per row ([`fp8_linear`]'s layout),
    /// dequantized in registers: a 16-byte load holds twice the values of a dense one.
    Fp8 { values: &'a Tensor, scales: &'a Tensor },
}

impl<'a> From<&'a Tensor> for RowWeight<'a> {
    fn from(w: &'a Tensor) -> Self {
        Self::Dense(w)
    }
}

impl RowWeight<'_> {
    /// The tensor whose shape `[n, k]` is the product's.
    fn matrix(&self) -> &Tensor {
        match self {
            Self::Dense(w) => w,
            Self::Fp8 { values, .. } => values,
        }
    }

    /// The tile [`gemv`] and [`gemv_gate_up_silu`] use. FP8 takes twice the dense rows per
    /// CTA, so that a thread keeps as many bytes in flight (cuda/gemv.cu), except where that
    /// measured slower on an H200 (`tpinfer-bench decode-profile`, Llama-3-8B): with `gate_up`
    /// (each output reads two rows) and for rows of 8,192 values or more (the down
    /// projection's 14,336: 0.0160 ms at 4 against 0.0184 at 8).
    fn default_tile(&self, gate_up: bool) -> usize {
        match self {
            Self::Dense(_) => 4,
            Self::Fp8 { values, .. } if gate_up || values.dim(1).is_ok_and(|k| k >= 8192) => 4,
            Self::Fp8 { .. } => 8,
        }
    }
}

/// The floats [`gemv_residual_into`] may write for a product of `n` outputs: one sum of
/// squares per CUDA thread block, of at least [`GEMV_TILES`]`[0]` outputs each.
pub fn gemv_residual_squares(n: usize) -> usize {
    n.div_ceil(GEMV_TILES[0])
}

/// A GEMV's input row.
#[derive(Debug, Clone)]
pub enum GemvRow {
    /// The row as it is.
    Given(Tensor),
    /// The RMSNorm times a weight of a residual stream `s`, as [`gemv_residual_into`] leaves
    /// it: `u` = s · weight rounded to the row's dtype and partial sums of s² (`squares`, f32,
    /// one per thread block that made them). On CUDA the product multiplies `u` and scales its
    /// sums by rsqrt(Σ s² / k + eps) (cuda/gemv.cu, NORMED); elsewhere
    /// [`GemvRow::materialize`] scales `u` first.
    Normed { u: Tensor, squares: Tensor, eps: f64 },
}

impl From<&Tensor> for GemvRow {
    fn from(x: &Tensor) -> Self {
        Self::Given(x.clone())
    }
}

impl GemvRow {
    /// A tensor of the row's shape, dtype and device.
    pub fn like(&self) -> &Tensor {
        match self {
            Self::Given(x) | Self::Normed { u: x, .. } => x,
        }
    }

    /// The row itself: a [`GemvRow::Normed`] one scaled here, in f32 on its device (no
    /// copy to the host), then rounded.
    pub fn materialize(&self) -> Result<Tensor> {
        match self {
            Self::Given(x) => Ok(x.clone()),
            Self::Normed { u, squares, eps } => {
                let mean = squares.sum_all()?.affine(1.0 / u.elem_count() as f64, *eps)?;
                let scale = mean.sqrt()?.recip()?;
                u.to_dtype(DType::F32)?.broadcast_mul(&scale)?.to_dtype(u.dtype())
            }
        }
    }
}

/// Where [`gemv_residual_into`] puts a row-parallel product of a decode step at TP 1: added
/// to the residual `stream` (`[n]`, in place), and the next input norm's `u` and partial sums
/// of squares ([`GemvRow::Normed`]) for its `weight` and `eps` written to `normed` and the
/// first floats of `squares` (f32, at least [`gemv_residual_squares`] of them).
#[derive(Debug, Clone, Copy)]
pub struct ResidualNorm<'a> {
    pub stream: &'a Tensor,
    pub weight: &'a Tensor,
    pub eps: f64,
    pub normed: &'a Tensor,
    pub squares: &'a Tensor,
}

/// The product of one row `x` and `w` added to the residual stream, s = stream + x · wᵀ
/// (each rounded as [`gemv`] then [`crate::add_rms_norm`] round them), with the next input
/// norm's `u` = s · weight and Σ s² written as `out` says: on CUDA in 16 bits one kernel, a
/// chain link (cuda/gemv.cu, gemv_residual), so that the norm needs none of its own; elsewhere
/// the same values, the squares' sum in the first float. Returns that norm as the next
/// product's row.
pub fn gemv_residual_into<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>, out: ResidualNorm) -> Result<GemvRow> {
    let w = w.into();
    let op = Gemv::checked(x, w, w.default_tile(false), false)?;
    let (n, blocks) = (op.n, op.n.div_ceil(op.tile));
    let typed = |t: &Tensor, dtype: DType, len: usize| t.dtype() == dtype && t.elem_count() == len && t.is_contiguous();
    if !(typed(out.stream, x.dtype(), n)
        && typed(out.weight, x.dtype(), n)
        && typed(out.normed, x.dtype(), n)
        && out.squares.dtype() == DType::F32
        && out.squares.is_contiguous()
        && out.squares.elem_count() >= gemv_residual_squares(n))
    {
        candle_core::bail!(
            "gemv_residual_into: the stream {:?}, the norm's weight {:?} and its output {:?} are not {n} contiguous \
             {:?} values each, or the squares {:?} not {} contiguous f32",
            out.stream.dims(),
            out.weight.dims(),
            out.normed.dims(),
            x.dtype(),
            out.squares.dims(),
            gemv_residual_squares(n)
        );
    }
    let squares = out.squares.flatten_all()?.narrow(0, 0, blocks)?;
    let row = GemvRow::Normed {
        u: out.normed.clone(),
        squares: squares.clone(),
        eps: out.eps,
    };
    #[cfg(feature = "cuda")]
    if gemv_16_bit_on_cuda(x, w) {
        cuda::gemv_residual_into(&op, x, w, out)?;
        return Ok(row);
    }
    let y = apply(x, w, op.tile, false)?.reshape(out.stream.shape())?;
    let s = (out.stream + y)?;
    out.stream.slice_set(&s, 0, 0)?;
    out.normed.slice_set(&(&s * out.weight.reshape(s.shape())?)?, 0, 0)?;
    let total = s.to_dtype(DType::F32)?.sqr()?.sum_all()?.reshape(1)?;
    let rest = Tensor::zeros(blocks - 1, DType::F32, s.device())?;
    squares.slice_set(&Tensor::cat(&[total, rest], 0)?, 0, 0)?;
    Ok(row)
}

/// Values in one 16-byte load of a weight row (cuda/gemv.cu), FP8 or 16-bit: `k` and the
/// offsets are whole loads of them.
fn values_per_load(fp8: bool) -> usize {
    if fp8 {
        16
    } else {
        8
    }
}

/// Whether [`gemv`] runs on CUDA for `x` and `w`: one row, `k` a whole number of 16-byte
/// loads; a dense `w` in `x`'s dtype, bf16 or f16; an FP8 `w` on a GPU of FP8 tensor cores
/// ([`fp8_path`]), with `x` in f32, bf16 or f16. On CPU a dense product always runs (the twin
/// that the tests check the kernel's math with); an FP8 one expands its weight.
pub fn gemv_on_cuda<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>) -> bool {
    let w = w.into();
    let Ok((n, k)) = w.matrix().dims2() else {
        return false;
    };
    let one_row = x.dims().last() == Some(&k) && x.elem_count() == k;
    let typed = match w {
        RowWeight::Dense(w) => matches!(x.dtype(), DType::BF16 | DType::F16) && w.dtype() == x.dtype(),
        RowWeight::Fp8 { values, scales } => {
            values.dtype() == DType::F8E4M3
                && scales.dtype() == DType::F32
                && scales.dims() == [n]
                && fp8_path(x.device(), x.dtype(), n, k) == Fp8Path::Fp8Kernels
        }
    };
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && typed
        && one_row
        && k.is_multiple_of(values_per_load(matches!(w, RowWeight::Fp8 { .. })))
}

/// Whether `x` and `w` run as a 16-bit GEMV kernel on CUDA, as [`gemv_on_cuda`] with `x` in
/// bf16 or f16: the products whose kernels exist only in 16 bits (rotary, SiLU product, a
/// normed row, [`gemv_residual_into`]).
pub fn gemv_16_bit_on_cuda<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>) -> bool {
    gemv_on_cuda(x, w) && matches!(x.dtype(), DType::BF16 | DType::F16)
}

/// Whether [`gemv_gate_up_silu`] runs on CUDA, as [`gemv_16_bit_on_cuda`], with `w`'s rows
/// even.
pub fn gemv_gate_up_silu_on_cuda<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>) -> bool {
    let w = w.into();
    gemv_16_bit_on_cuda(x, w) && w.matrix().dim(0).is_ok_and(|rows| rows.is_multiple_of(2))
}

/// `x · wᵀ` for `x` `[.., k]` holding one row and `w` `[n, k]`: `[.., n]`, accumulated in f32.
pub fn gemv<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>) -> Result<Tensor> {
    let w = w.into();
    apply(x, w, w.default_tile(false), false)
}

/// [`gemv`] with `tile` outputs per CUDA thread block, one of [`GEMV_TILES`] (the tile is
/// a speed choice only: every tile gives the same bits). For benchmarks.
pub fn gemv_tiled<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>, tile: usize) -> Result<Tensor> {
    apply(x, w.into(), tile, false)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` for `x` `[.., k]` holding one row and a gated MLP's merged
/// weight `w` `[gate (n) | up (n)]`, `[2n, k]`: `[.., n]`. The bits of [`gemv`] followed by
/// [`crate::silu_mul`] (each product rounded to the dtype, then the SiLU product), in one
/// pass.
pub fn gemv_gate_up_silu<'a>(x: &Tensor, w: impl Into<RowWeight<'a>>) -> Result<Tensor> {
    let w = w.into();
    apply(x, w, w.default_tile(true), true)
}

/// [`gemv`] of the row `x` written into `out` (`[n]` elements, contiguous), as a link of a
/// kernel chain ([`crate::chained`]) on CUDA; elsewhere the product is copied in.
pub fn gemv_into<'a>(x: impl Into<GemvRow>, w: impl Into<RowWeight<'a>>, out: &Tensor) -> Result<()> {
    apply_into(x.into(), w.into(), false, out)
}

/// [`gemv_gate_up_silu`] written into `out`, as [`gemv_into`].
pub fn gemv_gate_up_silu_into<'a>(x: impl Into<GemvRow>, w: impl Into<RowWeight<'a>>, out: &Tensor) -> Result<()> {
    apply_into(x.into(), w.into(), true, out)
}

/// [`crate::rotary_qkv_into`] of the product of one row `x` and a fused QKV weight `w`
/// `[(q_heads + 2 · kv_heads) · d, k]`, plus its `bias` `[(q_heads + 2 · kv_heads) · d]` where
/// there is one (Qwen2's), in one CUDA kernel that computes each pair of rows that rotate
/// together and writes them rotated: the bits of [`gemv`], the bias added in `x`'s type, then
/// [`crate::rotary_qkv_into`], without the product's round trip through memory. A chain link.
/// Only where [`gemv_gate_up_silu_on_cuda`] holds for `x` and `w` (a 16-bit `x`); the caller
/// has checked that the position fits the table and the cache.
#[allow(clippy::too_many_arguments)]
pub fn gemv_rotary_qkv_into<'a>(
    cache: &Tensor,
    x: impl Into<GemvRow>,
    w: impl Into<RowWeight<'a>>,
    bias: Option<&Tensor>,
    table: &Tensor,
    position: &Tensor,
    q_heads: usize,
    queries: &Tensor,
) -> Result<()> {
    let (x, w) = (x.into(), w.into());
    #[cfg(feature = "cuda")]
    if gemv_16_bit_on_cuda(x.like(), w) {
        let rows = cuda::CacheRows::own(cache, position)?;
        return cuda::gemv_rotary_qkv_into(rows, &x, w, bias, table, position, q_heads, queries);
    }
    let _ = (cache, bias, table, position, q_heads, queries);
    not_a_16_bit_gemv("gemv_rotary_qkv_into", x.like(), w)
}

/// [`gemv_rotary_qkv_into`] with the key and value written into a paged pool `[2, slots,
/// kv_heads, d]` ([`crate::rotary_qkv_paged`]'s) at the one-element u32 `slot`, rotated for
/// `position`: a lone sequence's decode row in a batched rank. The caller has checked that
/// the position fits the table and the slot the pool.
#[allow(clippy::too_many_arguments)]
pub fn gemv_rotary_qkv_paged_into<'a>(
    pool: &Tensor,
    x: impl Into<GemvRow>,
    w: impl Into<RowWeight<'a>>,
    bias: Option<&Tensor>,
    table: &Tensor,
    position: &Tensor,
    slot: &Tensor,
    q_heads: usize,
    queries: &Tensor,
) -> Result<()> {
    let (x, w) = (x.into(), w.into());
    #[cfg(feature = "cuda")]
    if gemv_16_bit_on_cuda(x.like(), w) {
        let rows = cuda::CacheRows::paged(pool, slot)?;
        return cuda::gemv_rotary_qkv_into(rows, &x, w, bias, table, position, q_heads, queries);
    }
    let _ = (pool, bias, table, position, slot, q_heads, queries);
    not_a_16_bit_gemv("gemv_rotary_qkv_paged_into", x.like(), w)
}

fn not_a_16_bit_gemv(op: &str, x: &Tensor, w: RowWeight) -> Result<()> {
    candle_core::bail!(
        "{op}: x {:?} {:?} and w {:?} are not a 16-bit GEMV on CUDA",
        x.dims(),
        x.dtype(),
        w.matrix().dims()
    )
}

fn apply_into(x: GemvRow, w: RowWeight, gate_up: bool, out: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        let covered = match &x {
            GemvRow::Given(x) => x.device().is_cuda() && (matches!(w, RowWeight::Dense(_)) || gemv_on_cuda(x, w)),
            // The normed kernels exist for the products that follow a step's norms
            // (cuda/gemv.cu): gate/up here; elsewhere the row is made first.
            GemvRow::Normed { u, .. } => gate_up && gemv_16_bit_on_cuda(u, w),
        };
        if covered {
            let op = Gemv::checked(x.like(), w, w.default_tile(gate_up), gate_up)?;
            return cuda::gemv_into(&op, &x, w, out);
        }
    }
    let y = apply(&x.materialize()?, w, w.default_tile(gate_up), gate_up)?;
    out.slice_set(&y.reshape(out.shape())?, 0, 0)
}

fn apply(x: &Tensor, w: RowWeight, tile: usize, gate_up: bool) -> Result<Tensor> {
    let op = Gemv::checked(x, w, tile, gate_up)?;
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = op.n;
    }
    let y = match w {
        RowWeight::Dense(w) => x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)?,
        #[cfg(feature = "cuda")]
        RowWeight::Fp8 { .. } if gemv_on_cuda(x, w) => {
            let y = crate::linear::empty(&[op.n], x.dtype(), x.device())?;
            cuda::gemv_into(&op, &GemvRow::Given(x.clone()), w, &y)?;
            y
        }
        // Elsewhere the products of fp8_linear, which expands the weight.
        RowWeight::Fp8 { values, scales } => {
            let y = fp8_linear(&x.reshape((1, op.k))?, values, scales, None, false)?;
            match gate_up {
                true => crate::silu_mul(&y)?,
                false => y,
            }
        }
    };
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
    fn checked(x: &Tensor, w: RowWeight, tile: usize, gate_up: bool) -> Result<Self> {
        let width = x.dims().last().copied().unwrap_or(0);
        let (rows, k) = w.matrix().dims2()?;
        let typed = match w {
            RowWeight::Dense(w) => w.dtype() == x.dtype(),
            RowWeight::Fp8 { values, scales } => {
                values.dtype() == DType::F8E4M3 && scales.dtype() == DType::F32 && scales.dims() == [rows]
            }
        };
        if x.elem_count() != width || width != k || !typed || (gate_up && rows % 2 != 0) {
            candle_core::bail!(
                "gemv: x {:?} {:?} is not one row of w {:?} {:?}'s input{}",
                x.dims(),
                x.dtype(),
                w.matrix().dims(),
                w.matrix().dtype(),
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

    use super::{Gemv, GemvRow, RowWeight};
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
        let weight = Weight {
            values: ws.device_ptr(&stream).0,
            scales: 0,
            offset: wl.start_offset(),
            fp8: false,
            _held: Vec::new(),
        };
        let (x_at, y) = (xs.device_ptr(&stream).0, out.device_ptr(&stream).0);
        weight.check_loads(op.k, xl.start_offset(), "gemv")?;
        launch(op, dev, x.dtype(), &RowArgs::Given(x_at), weight, y)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// A weight as the kernels take it: its values' and scales' addresses (0: dense), and
    /// the values' offset in elements, which must keep their rows on 16 bytes.
    struct Weight {
        values: u64,
        scales: u64,
        offset: usize,
        fp8: bool,
        /// What the addresses point into, alive until the launch.
        _held: Vec<Tensor>,
    }

    impl Weight {
        fn of(w: RowWeight) -> Result<Self> {
            Ok(match w {
                RowWeight::Dense(w) => {
                    let w = w.contiguous()?;
                    Self {
                        values: device_address(&w)?,
                        scales: 0,
                        offset: w.layout().start_offset(),
                        fp8: false,
                        _held: vec![w],
                    }
                }
                RowWeight::Fp8 { values, scales } => {
                    let (values, scales) = (values.contiguous()?, scales.contiguous()?);
                    Self {
                        values: device_address(&values)?,
                        scales: device_address(&scales)?,
                        offset: values.layout().start_offset(),
                        fp8: true,
                        _held: vec![values, scales],
                    }
                }
            })
        }

        /// The kernel name's infix (cuda/gemv.cu).
        fn format(&self) -> &'static str {
            if self.fp8 {
                "fp8_"
            } else {
                ""
            }
        }

        /// Fails unless `k` and the offsets of x (`x_offset`) and of the values are whole
        /// 16-byte loads of values.
        fn check_loads(&self, k: usize, x_offset: usize, kernel: &str) -> Result<()> {
            let load = super::values_per_load(self.fp8);
            if !(k.is_multiple_of(load) && [x_offset, self.offset].iter().all(|o| o.is_multiple_of(load))) {
                candle_core::bail!(
                    "{kernel}: k = {k} and the offsets of x and w {:?} must be multiples of {load}",
                    [x_offset, self.offset]
                );
            }
            Ok(())
        }
    }

    /// An input row as the kernels take it: x's address, or a normed row's u, squares, their
    /// count and eps (cuda/gemv.cu, NORMED).
    enum RowArgs {
        Given(u64),
        Normed { u: u64, squares: u64, slots: i32, eps: f32 },
    }

    impl RowArgs {
        /// Checks `row` against `k` and `weight`'s loads; returns its arguments and the
        /// contiguous tensors they point into, which must live until the launch.
        fn of(row: &GemvRow, k: usize, weight: &Weight, kernel: &str) -> Result<(Self, Vec<Tensor>)> {
            let x = row.like().contiguous()?;
            weight.check_loads(k, x.layout().start_offset(), kernel)?;
            let at = device_address(&x)?;
            match row {
                GemvRow::Given(_) => Ok((Self::Given(at), vec![x])),
                GemvRow::Normed { squares, eps, .. } => {
                    if squares.dtype() != DType::F32 || squares.elem_count() == 0 {
                        candle_core::bail!(
                            "{kernel}: the normed row's squares {:?} {:?} are not f32 sums",
                            squares.dims(),
                            squares.dtype()
                        );
                    }
                    let squares = squares.contiguous()?;
                    let row = Self::Normed {
                        u: at,
                        squares: device_address(&squares)?,
                        slots: squares.elem_count() as i32,
                        eps: *eps as f32,
                    };
                    Ok((row, vec![x, squares]))
                }
            }
        }

        /// The kernel name's infix.
        fn name(&self) -> &'static str {
            match self {
                Self::Given(_) => "",
                Self::Normed { .. } => "normed_",
            }
        }

        fn push(&self, launch: &mut Launch) {
            match self {
                Self::Given(x) => {
                    launch.arg(*x);
                }
                Self::Normed { u, squares, slots, eps } => {
                    launch.arg(*u).arg(*squares).arg(*slots).arg(*eps);
                }
            }
        }
    }

    /// [`super::gemv_residual_into`] on CUDA (its shapes checked): a chain link.
    pub(super) fn gemv_residual_into(op: &Gemv, x: &Tensor, w: RowWeight, out: super::ResidualNorm) -> Result<()> {
        let candle_core::Device::Cuda(dev) = x.device() else {
            candle_core::bail!("gemv_residual: x is not on CUDA");
        };
        let weight = Weight::of(w)?;
        let (row, _held) = RowArgs::of(&GemvRow::Given(x.clone()), op.k, &weight, "gemv_residual")?;
        let name = format!("gemv_residual_{}{}_r{}", weight.format(), suffix(x.dtype())?, op.tile);
        let func = crate::module::GEMV.kernel(dev, &name)?;
        let cfg = LaunchConfig {
            grid_dim: (op.n.div_ceil(op.tile) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let norm = out.weight.contiguous()?;
        let mut launch = Launch::default();
        row.push(&mut launch);
        launch.arg(weight.values).arg(weight.scales);
        for t in [out.stream, &norm, out.normed, out.squares] {
            launch.arg(device_address(t)?);
        }
        launch.arg(op.n as i32).arg(op.k as i32);
        // SAFETY: the arguments match the kernel's signature; x holds k values, w n rows of k
        // (and an FP8 w as many scales); the stream, the norm's weight and its output hold n
        // values each and the squares a float per CTA (all contiguous, checked by the caller).
        unsafe { launch.launch(dev, &func, cfg) }
    }

    /// The product written into `out`: a chain link.
    pub(super) fn gemv_into(op: &Gemv, x: &GemvRow, w: RowWeight, out: &Tensor) -> Result<()> {
        let like = x.like();
        check_output(out, like.dtype(), op.n, "gemv")?;
        let candle_core::Device::Cuda(dev) = like.device() else {
            candle_core::bail!("gemv: x is not on CUDA");
        };
        let weight = Weight::of(w)?;
        let (row, _held) = RowArgs::of(x, op.k, &weight, "gemv")?;
        launch(op, dev, like.dtype(), &row, weight, device_address(out)?)
    }

    /// Where the rotary GEMV writes a row's key and value heads: key head `h`'s element `c`
    /// at `cache[row · row_stride + h · head_stride + c]`, the value's `values` elements
    /// further, the row read from the one-element u32 `row` when the kernel runs.
    pub(super) struct CacheRows<'a> {
        cache: &'a Tensor,
        row: &'a Tensor,
        kv_heads: usize,
        d: usize,
        rows: usize,
        row_stride: usize,
        head_stride: usize,
        values: usize,
    }

    impl<'a> CacheRows<'a> {
        /// A sequence's own cache `[2, kv_heads, capacity, d]`: the position is the row.
        pub(super) fn own(cache: &'a Tensor, position: &'a Tensor) -> Result<Self> {
            let (two, kv_heads, capacity, d) = cache.dims4()?;
            Self::check(cache, two, "[2, kv_heads, capacity, d]")?;
            Ok(Self {
                cache,
                row: position,
                kv_heads,
                d,
                rows: capacity,
                row_stride: d,
                head_stride: capacity * d,
                values: kv_heads * capacity * d,
            })
        }

        /// A paged pool `[2, slots, kv_heads, d]`, the row at `slot`.
        pub(super) fn paged(pool: &'a Tensor, slot: &'a Tensor) -> Result<Self> {
            crate::position::check(slot, pool, "gemv_rotary_qkv (the slot)")?;
            let (two, slots, kv_heads, d) = pool.dims4()?;
            Self::check(pool, two, "[2, slots, kv_heads, d]")?;
            Ok(Self {
                cache: pool,
                row: slot,
                kv_heads,
                d,
                rows: slots,
                row_stride: kv_heads * d,
                head_stride: d,
                values: slots * kv_heads * d,
            })
        }

        fn check(cache: &Tensor, two: usize, layout: &str) -> Result<()> {
            if two != 2 || !cache.is_contiguous() {
                candle_core::bail!(
                    "gemv_rotary_qkv: the cache {:?} is not a contiguous {layout}",
                    cache.dims()
                );
            }
            Ok(())
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv_rotary_qkv_into(
        cache: CacheRows,
        x: &GemvRow,
        w: RowWeight,
        bias: Option<&Tensor>,
        table: &Tensor,
        position: &Tensor,
        q_heads: usize,
        queries: &Tensor,
    ) -> Result<()> {
        let (row, x) = (x, x.like());
        crate::position::check(position, x, "gemv_rotary_qkv")?;
        let (kv_heads, d) = (cache.kv_heads, cache.d);
        let (rows, k) = w.matrix().dims2()?;
        let (table_two, positions, half) = table.dims3()?;
        let dtype = x.dtype();
        if table_two != 2
            || 2 * half != d
            || rows != (q_heads + 2 * kv_heads) * d
            || !table.is_contiguous()
            || cache.cache.dtype() != dtype
            || table.dtype() != dtype
        {
            candle_core::bail!(
                "gemv_rotary_qkv: w {:?}, the cache {:?} and the table {:?} are not [({q_heads} + 2 · kv_heads) · d, k], \
                 a cache of kv_heads heads of d and [2, positions, d / 2] in {dtype:?}",
                w.matrix().dims(),
                cache.cache.dims(),
                table.dims()
            );
        }
        check_output(queries, dtype, q_heads * d, "gemv_rotary_qkv")?;
        if let Some(b) = bias {
            if b.dtype() != dtype || b.elem_count() != rows || !b.is_contiguous() {
                candle_core::bail!(
                    "gemv_rotary_qkv: the bias {:?} {:?} is not {rows} contiguous {dtype:?} values",
                    b.dtype(),
                    b.dims()
                );
            }
        }
        let candle_core::Device::Cuda(dev) = x.device() else {
            candle_core::bail!("gemv_rotary_qkv: x is not on CUDA");
        };
        let weight = Weight::of(w)?;
        let (row, _held) = RowArgs::of(row, k, &weight, "gemv_rotary_qkv")?;
        let name = format!("gemv_rotary_{}{}{}", row.name(), weight.format(), suffix(dtype)?);
        let func = crate::module::GEMV.kernel(dev, &name)?;
        let cfg = LaunchConfig {
            grid_dim: ((rows / 2) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = Launch::default();
        row.push(&mut launch);
        launch.arg(weight.values).arg(weight.scales);
        // A null bias: none.
        launch.arg(bias.map(device_address).transpose()?.unwrap_or(0));
        for t in [table, queries, cache.cache] {
            launch.arg(device_address(t)?);
        }
        for v in [cache.values, cache.row_stride, cache.head_stride] {
            launch.arg(v as i64);
        }
        for v in [q_heads, kv_heads, d, k] {
            launch.arg(v as i32);
        }
        launch
            .arg(device_address(position)?)
            .arg(device_address(cache.row)?)
            .arg(positions as i32)
            .arg(cache.rows as i64);
        // SAFETY: the arguments match the kernel's signature; w holds the (q_heads + 2 ·
        // kv_heads) · d rows of k (and an FP8 w as many scales, a bias as many values) that the
        // rows / 2 CTAs read in pairs, x k values (a normed row's squares beside, RowArgs::of),
        // queries q_heads · d; the cache is contiguous, its strides and
        // value offset those of its layout (CacheRows), and the kernel skips a position past
        // the table or a row past the cache's rows.
        unsafe { launch.launch(dev, &func, cfg) }
    }

    /// Launches the kernel on the row `x` (checked against `w`'s loads), `w` and `y`.
    fn launch(op: &Gemv, dev: &CudaDevice, dtype: DType, x: &RowArgs, w: Weight, y: u64) -> Result<()> {
        let (n, k) = (op.n, op.k);
        let kernel = if op.gate_up { "gemv_gate_up_silu" } else { "gemv" };
        let name = format!("{kernel}_{}{}{}_r{}", x.name(), w.format(), suffix(dtype)?, op.tile);
        let func = crate::module::GEMV.kernel(dev, &name)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(op.tile) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; x holds k values (a normed row
        // its squares beside), w n rows of k (2n with gate_up), and as many scales where it is
        // FP8, and y n values.
        let mut launch = Launch::default();
        x.push(&mut launch);
        unsafe {
            launch
                .arg(w.values)
                .arg(w.scales)
                .arg(y)
                .arg(n as i32)
                .arg(k as i32)
                .launch(dev, &func, cfg)
        }
    }
}
