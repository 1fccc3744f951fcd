use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};
use candle_nn::Linear;
use tpinfer_comm::Communicator;
use tpinfer_kernels::{GemvRow, ResidualNorm, RowWeight};
use tpinfer_weights::{ShardLoader, ShardSpec, Weight, WeightDecl};

use crate::Result;

/// A linear layer's weight and bias as a rank holds them: dense, where the fused kernels of
/// `tpinfer_kernels` apply; in GGML blocks, multiplied by candle's quantized matmul (MMVQ
/// for a few rows, MMQ for more on CUDA) with the bias added after; or FP8 E4M3 with row
/// scales, through `tpinfer_kernels::fp8_linear` (FP8 kernels on GPUs with FP8 tensor cores,
/// the weight expanded for each product elsewhere).
enum Product {
    Dense(Linear),
    Quantized {
        weight: QMatMul,
        out_dim: usize,
        bias: Option<Tensor>,
        /// One input row in Q8_1, where candle's MMVQ kernels take the blocks (a CUDA device):
        /// a decode step's products of the row run through it in place ([`mmvq_row`]).
        row_q8: Option<Tensor>,
    },
    Fp8 {
        values: Tensor,
        scales: Tensor,
        bias: Option<Tensor>,
    },
}

impl Product {
    fn new(weight: Weight, bias: Option<Tensor>) -> Result<Self> {
        Ok(match weight {
            Weight::Dense(w) => Self::Dense(Linear::new(w, bias)),
            Weight::Quantized(q) => {
                let (out_dim, k) = q.shape().dims2()?;
                let row_q8 = match tpinfer_kernels::mmvq_takes(&q) {
                    true => Some(tpinfer_kernels::q8_1_row(k, &q.device())?),
                    false => None,
                };
                Self::Quantized {
                    out_dim,
                    weight: QMatMul::from_arc(q)?,
                    bias,
                    row_q8,
                }
            }
            Weight::Fp8 { values, scales } => Self::Fp8 { values, scales, bias },
        })
    }

    /// The dense layer, where the fused kernels may apply.
    fn dense(&self) -> Option<&Linear> {
        match self {
            Self::Dense(linear) => Some(linear),
            Self::Quantized { .. } | Self::Fp8 { .. } => None,
        }
    }

    /// The weight as the GEMV kernels take it, where the product has no bias: dense or FP8.
    fn row_weight(&self) -> Option<RowWeight<'_>> {
        match self.row_weight_and_bias()? {
            (w, None) => Some(w),
            (_, Some(_)) => None,
        }
    }

    /// The weight as the GEMV kernels take it, dense or FP8, and its bias if it has one.
    fn row_weight_and_bias(&self) -> Option<(RowWeight<'_>, Option<&Tensor>)> {
        match self {
            Self::Dense(linear) => Some((RowWeight::Dense(linear.weight()), linear.bias())),
            Self::Fp8 { values, scales, bias } => Some((RowWeight::Fp8 { values, scales }, bias.as_ref())),
            Self::Quantized { .. } => None,
        }
    }

    fn out_dim(&self) -> candle_core::Result<usize> {
        match self {
            Self::Dense(linear) => linear.weight().dim(0),
            Self::Quantized { out_dim, .. } => Ok(*out_dim),
            Self::Fp8 { values, .. } => values.dim(0),
        }
    }
}

/// Input rows that candle's MMVQ kernels (a product of GGML blocks with few rows) take at
/// most; more go to its MMQ kernels, whose scratch is apart (candle 0.11's `fast_mmvq`).
const MMVQ_MAX_ROWS: usize = 8;

/// The bytes candle's MMQ kernels take beyond a dense product's on CUDA, for a rank whose
/// products of GGML blocks have `products` `(k, n)` (input, output widths) and run `rows`
/// input rows in `dtype` (candle 0.11's `fast_mmq`). While one runs: its input as f32 and its
/// output in f32 before the cast to `dtype` (neither in f32). Kept from the first on: the input
/// quantized to Q8_1 blocks (144 bytes a 128 values, the row padded to 512), grown to the
/// largest, and the stream-k fixup buffer of 256 × 128 × 128 floats. None for
/// `MMVQ_MAX_ROWS` rows or fewer.
pub fn mmq_product_bytes(products: &[(usize, usize)], dtype: DType, rows: usize) -> usize {
    if rows <= MMVQ_MAX_ROWS {
        return 0;
    }
    let f32_copy = |width: usize| if dtype == DType::F32 { 0 } else { rows * width * 4 };
    let transient = products
        .iter()
        .map(|&(k, n)| f32_copy(k) + f32_copy(n))
        .max()
        .unwrap_or(0);
    let q8_1 = |k: usize| k.next_multiple_of(512) / 128 * 144;
    let workspace = products.iter().map(|&(k, _)| rows * q8_1(k)).max().unwrap_or(0) + 128 * 144;
    let fixup = 256 * 128 * 128 * 4;
    transient + workspace + fixup
}

/// The bytes a CUDA rank's decode-step products of GGML blocks keep beside their weights:
/// one Q8_1 row each ([`Product`]'s `row_q8`), counted for every GGML weight of `decls` (an
/// upper bound where weights of one form were joined into one product, which keeps one row).
pub fn mmvq_row_bytes(decls: &[WeightDecl]) -> usize {
    decls
        .iter()
        .filter(|d| matches!(d.quant, Some(tpinfer_weights::Quant::Ggml(_))))
        .filter_map(|d| match *d.spec.local_shape(&d.shape).ok()?.as_slice() {
            [_, k] => Some(tpinfer_kernels::q8_1_row_bytes(k)),
            _ => None,
        })
        .sum()
}

/// Grows candle's per-device MMVQ scratch (each input row quantized to Q8_1) to the size that
/// `MMVQ_MAX_ROWS` rows of `widest` values take, which no later product exceeds. A captured
/// CUDA graph holds that scratch's address, and candle replaces the buffer with a larger one
/// whenever a product needs more (a prompt of 2–8 tokens after the capture): the graph would
/// then write memory that has been freed. The scratch only grows, so a rank of GGML blocks
/// calls this once, with its widest input, before it captures.
#[cfg(feature = "cuda")]
pub fn reserve_quantized_product_scratch(device: &candle_core::Device, widest: usize) -> Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    // Padded as candle pads a row for the Q8_1 copy; Q8_0 blocks of 32 values.
    let k = widest.next_multiple_of(512);
    let w = Tensor::zeros((32, k), DType::F32, &candle_core::Device::Cpu)?;
    let w = QMatMul::from_arc(Arc::new(QTensor::quantize_onto(&w, GgmlDType::Q8_0, device)?))?;
    w.forward(&Tensor::zeros((MMVQ_MAX_ROWS, k), DType::F32, device)?)?;
    Ok(())
}

/// The bytes the largest FP8 product among `decls` (this rank's slices) takes beyond a dense
/// product's while it runs, for `rows` input rows in `dtype`, by the path it takes
/// (`tpinfer_kernels::fp8_path`). With `fp8_tensor_cores` (a plan's CUDA GPU, compute
/// capability 8.9 or later) and 16-aligned sides, its input quantized: a byte a value and an
/// f32 scale a row. Otherwise the weight expanded to `dtype`: its values and their scaled copy,
/// `joined` weights at once where a layer joins several into one product.
pub fn fp8_product_bytes(
    decls: &[WeightDecl],
    dtype: DType,
    fp8_tensor_cores: bool,
    rows: usize,
    joined: usize,
) -> usize {
    decls
        .iter()
        .filter(|d| d.quant == Some(tpinfer_weights::Quant::Fp8))
        .filter_map(|d| match *d.spec.local_shape(&d.shape).ok()?.as_slice() {
            [n, k] => {
                let one = fp8_product_extra(n, k, dtype, fp8_tensor_cores, rows);
                Some(match fp8_product_quantizes_input(n, k, dtype, fp8_tensor_cores) {
                    true => one,
                    false => joined * one,
                })
            }
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// The bytes one FP8 product of an `[n, k]` weight slice takes beyond a dense product's while
/// it runs, for `rows` input rows in `dtype`: as [`fp8_product_bytes`] counts a product of its
/// own weight.
pub fn fp8_product_extra(n: usize, k: usize, dtype: DType, fp8_tensor_cores: bool, rows: usize) -> usize {
    match fp8_product_quantizes_input(n, k, dtype, fp8_tensor_cores) {
        true => rows * (k + 4),
        false => 2 * dtype.size_in_bytes() * n * k,
    }
}

fn fp8_product_quantizes_input(n: usize, k: usize, dtype: DType, fp8_tensor_cores: bool) -> bool {
    fp8_tensor_cores && tpinfer_kernels::fp8_kernels_take(dtype, n, k)
}

/// `x · wᵀ (+ b)` through `product`: dense, one input row on CUDA in 16 bits (a decode step's
/// products) through the GEMV kernel; more rows with a bias through the fused linear (one
/// cuBLASLt GEMM with the bias in its epilogue on CUDA); everything else through candle's
/// matmul, quantized or not.
fn apply(product: &Product, x: &Tensor) -> candle_core::Result<Tensor> {
    let linear = match product {
        Product::Dense(linear) => linear,
        Product::Quantized { weight, bias, .. } => return add_bias(quantized_product(weight, x)?, bias.as_ref()),
        Product::Fp8 { values, scales, bias } => {
            return tpinfer_kernels::fp8_linear(x, values, scales, bias.as_ref(), false);
        }
    };
    let w = linear.weight();
    if tpinfer_kernels::gemv_on_cuda(x, w) {
        let y = tpinfer_kernels::gemv(x, w)?;
        return Ok(match linear.bias() {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        });
    }
    match linear.bias() {
        Some(b) if tpinfer_kernels::fused_linear_covers(x, w) => tpinfer_kernels::linear_bias(x, w, b, false),
        _ => linear.forward(x),
    }
}

fn add_bias(y: Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `x · wᵀ` for a weight in GGML blocks. On CUDA: candle's quantized matmul (MMVQ for a few
/// rows, MMQ for more), which quantizes `x` to Q8 blocks. On the CPU: the blocks expanded to
/// `x`'s dtype for the one product, so that a row's result depends on nothing but the row.
/// candle's CPU kernels pick the activations' quantization by shape (Q8_K where its repacked
/// kernel suits the rows and width, Q8_0 or Q8_1 elsewhere), which would make a sequence's
/// tokens depend on its batch and TP width; CPU ranks are where TP correctness is checked.
pub(crate) fn quantized_product(weight: &QMatMul, x: &Tensor) -> candle_core::Result<Tensor> {
    // The quantized matmul reads its input as one contiguous block.
    let x = x.contiguous()?;
    if !x.device().is_cpu() {
        return weight.forward(&x);
    }
    let dense = match weight {
        QMatMul::QTensor(blocks) => blocks.dequantize(x.device())?,
        QMatMul::Tensor(w) | QMatMul::TensorF16(w) => w.clone(),
    };
    Linear::new(dense.to_dtype(x.dtype())?, None).forward(&x)
}

/// The blocks of `product` and its Q8_1 row where one row `x`'s product runs through
/// candle's MMVQ kernels in place ([`tpinfer_kernels::mmvq_row_into`]): GGML blocks without a
/// bias, on a CUDA device, the row as it is (a normed row is made first).
fn mmvq_row<'a>(product: &'a Product, x: &GemvRow) -> Option<(&'a QTensor, &'a Tensor)> {
    match (product, x) {
        (
            Product::Quantized {
                weight: QMatMul::QTensor(w),
                bias: None,
                row_q8: Some(q8),
                ..
            },
            GemvRow::Given(x),
        ) if tpinfer_kernels::mmvq_covers(w, x) => Some((w, q8)),
        _ => None,
    }
}

/// One row's product written into `out`: the GEMV in place where it runs (a kernel chain's
/// link on CUDA), GGML blocks through candle's MMVQ kernels in place where they run
/// ([`mmvq_row`]), elsewhere the product (of the row made first) copied in.
fn apply_row_into(product: &Product, x: GemvRow, out: &Tensor) -> candle_core::Result<()> {
    if let Some((w, q8)) = mmvq_row(product, &x) {
        tpinfer_kernels::quantize_row_q8_1(x.like(), q8)?;
        return tpinfer_kernels::mmvq_row_into(w, q8, out, 0);
    }
    if let Some(w) = product
        .row_weight()
        .filter(|&w| tpinfer_kernels::gemv_on_cuda(x.like(), w))
    {
        return tpinfer_kernels::gemv_into(x, w, out);
    }
    out.slice_set(&apply(product, &x.materialize()?)?.reshape(out.shape())?, 0, 0)
}

/// An uninitialized `[rows, out]` output of `product` for [`apply_into`], in `x`'s type and
/// on its device.
fn empty_output(product: &Product, rows: usize, x: &Tensor) -> Result<Tensor> {
    Ok(tpinfer_kernels::empty(
        &[rows, product.out_dim()?],
        x.dtype(),
        x.device(),
    )?)
}

/// [`apply`] (then GELU, tanh approximation, when `gelu`) of rows `x` written into rows
/// `first_row..` of `out`: a part of a product over gathered rows. Dense with a bias, through
/// the fused linear, and FP8 through its GEMM, which write in place on CUDA.
fn apply_into(product: &Product, out: &Tensor, first_row: usize, x: &Tensor, gelu: bool) -> candle_core::Result<()> {
    if let Some(linear) = product.dense() {
        if let Some(b) = linear.bias() {
            return tpinfer_kernels::linear_bias_into(out, first_row, x, linear.weight(), b, gelu);
        }
    }
    if let Product::Fp8 { values, scales, bias } = product {
        return tpinfer_kernels::fp8_linear_into(out, first_row, x, values, scales, bias.as_ref(), gelu);
    }
    let y = match product {
        _ if gelu => apply(product, x)?.gelu()?,
        _ => apply(product, x)?,
    };
    out.slice_set(&y, 0, first_row)
}

/// [`apply`] then GELU (tanh approximation): dense with a bias, inside the fused linear (on
/// CUDA, the GEMM's epilogue).
fn apply_gelu(product: &Product, x: &Tensor) -> candle_core::Result<Tensor> {
    if let Product::Fp8 { values, scales, bias } = product {
        return tpinfer_kernels::fp8_linear(x, values, scales, bias.as_ref(), true);
    }
    if let Some(linear) = product.dense() {
        if let Some(b) = linear.bias() {
            if tpinfer_kernels::fused_linear_covers(x, linear.weight()) {
                return tpinfer_kernels::linear_bias(x, linear.weight(), b, true);
            }
        }
    }
    apply(product, x)?.gelu()
}

/// `y = x Aᵀ + b` with `A` split along its output rows: the rank holds `A[out_range, :]` and
/// produces its slice of `y`. No communication.
pub struct ColumnParallelLinear {
    product: Product,
}

impl ColumnParallelLinear {
    /// The weight (and bias) slices this rank reads for a `[out, in]` weight named `prefix.weight`.
    pub fn decls(prefix: &str, in_dim: usize, out_dim: usize, out_range: Range<usize>, bias: bool) -> Vec<WeightDecl> {
        let spec = ShardSpec::range(0, out_range);
        let mut decls = vec![WeightDecl::new(format!("{prefix}.weight"), &[out_dim, in_dim], spec)];
        if bias {
            decls.push(WeightDecl::new(format!("{prefix}.bias"), &[out_dim], spec));
        }
        decls
    }

    pub fn load(weights: &mut ShardLoader, prefix: &str, bias: bool) -> Result<Self> {
        let weight = weights.take_weight(&format!("{prefix}.weight"))?;
        let bias = bias.then(|| weights.take(&format!("{prefix}.bias"))).transpose()?;
        Ok(Self {
            product: Product::new(weight, bias)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(apply(&self.product, x)?)
    }

    /// An output of `rows` rows for [`Self::forward_into`], like `x`.
    pub fn empty_output(&self, rows: usize, x: &Tensor) -> Result<Tensor> {
        empty_output(&self.product, rows, x)
    }

    /// [`Self::forward`] (or [`Self::forward_gelu`] when `gelu`) of rows `x`, written into rows
    /// `first_row..` of `out`.
    pub fn forward_into(&self, out: &Tensor, first_row: usize, x: &Tensor, gelu: bool) -> candle_core::Result<()> {
        apply_into(&self.product, out, first_row, x, gelu)
    }

    /// GELU (tanh approximation) of [`Self::forward`]: with a bias, inside the fused linear
    /// (on CUDA, the GEMM's epilogue).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(apply_gelu(&self.product, x)?)
    }
}

/// Several column-parallel linears on the same input (Q/K/V, or gate/up) fused into one
/// GEMM: their local slices are concatenated at load time and split after the product.
/// Quantized slices in different blocks cannot be joined: each run of one form is one product
/// (a Q4_K_M file's Q4_K Q and K one, its Q6_K V another), written side by side.
pub struct MergedColumnParallelLinear {
    /// One product, or one per run of linears whose weights could be joined.
    parts: Vec<Product>,
    out_sizes: Vec<usize>,
}

impl MergedColumnParallelLinear {
    /// Loads the local slices `prefixes[i].weight` (and biases) as one concatenated weight.
    pub fn load(weights: &mut ShardLoader, prefixes: &[&str], bias: bool) -> Result<Self> {
        let names = |suffix: &str| prefixes.iter().map(|p| format!("{p}.{suffix}")).collect::<Vec<_>>();
        let weight_names = names("weight");
        let out_sizes = weight_names
            .iter()
            .map(|n| weights.local_shape(n).map(|s| s[0]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let stacked = weights.take_stacked(&weight_names.iter().map(String::as_str).collect::<Vec<_>>())?;
        let bias_names = names("bias");
        let parts = stacked
            .into_iter()
            .map(|(w, run)| {
                let b = bias
                    .then(|| weights.take_concat(&bias_names[run].iter().map(String::as_str).collect::<Vec<_>>(), 0))
                    .transpose()?;
                Product::new(w, b)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { parts, out_sizes })
    }

    /// The single product, when the weights were joined.
    fn joined(&self) -> Option<&Product> {
        match &self.parts[..] {
            [one] => Some(one),
            _ => None,
        }
    }

    /// The outputs of the merged linears, in the order of their prefixes (views of
    /// [`Self::forward_merged`]'s output).
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.split(&self.forward_merged(x)?)
    }

    /// The merged output `y` as the merged linears' outputs (views), in the order of their
    /// prefixes.
    pub fn split(&self, y: &Tensor) -> Result<Vec<Tensor>> {
        let last = y.rank() - 1;
        let mut start = 0;
        let mut outs = Vec::with_capacity(self.out_sizes.len());
        for &size in &self.out_sizes {
            outs.push(y.narrow(last, start, size)?);
            start += size;
        }
        Ok(outs)
    }

    /// The outputs side by side in the last dim, for fused kernels that split them themselves.
    pub fn forward_merged(&self, x: &Tensor) -> Result<Tensor> {
        match self.joined() {
            Some(product) => Ok(apply(product, x)?),
            None => {
                let outs = self
                    .parts
                    .iter()
                    .map(|p| apply(p, x))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Tensor::cat(&outs, x.rank() - 1)?)
            }
        }
    }

    /// [`Self::forward_merged`] of one row `x`, written into `out` (all outputs, contiguous):
    /// a decode step's product into a buffer that outlives the step. Products in GGML blocks
    /// that could not be joined (a Q4_K_M file's Q4_K Q and K, its Q6_K V) take the row
    /// quantized once and write their columns in place where candle's MMVQ kernels take every
    /// part.
    pub fn forward_row_into(&self, x: impl Into<GemvRow>, out: &Tensor) -> Result<()> {
        let x = x.into();
        if let Some(product) = self.joined() {
            return Ok(apply_row_into(product, x, out)?);
        }
        let parts = self.parts.iter().map(|p| mmvq_row(p, &x)).collect::<Option<Vec<_>>>();
        if let Some(parts) = parts {
            if let Some(&(_, q8)) = parts.first() {
                tpinfer_kernels::quantize_row_q8_1(x.like(), q8)?;
                let mut column = 0;
                for (w, _) in parts {
                    tpinfer_kernels::mmvq_row_into(w, q8, out, column)?;
                    column += w.shape().dims2()?.0;
                }
                return Ok(());
            }
        }
        Ok(out.slice_set(&self.forward_merged(&x.materialize()?)?.reshape(out.shape())?, 0, 0)?)
    }

    /// The merged weight, dense or FP8, and its bias if it has one, where one row `x`'s
    /// product runs as the GEMV kernel on CUDA in 16 bits: for kernels that fuse the bias and
    /// what follows the product into it.
    pub fn gemv_weight(&self, x: &Tensor) -> Option<(RowWeight<'_>, Option<&Tensor>)> {
        self.joined()?
            .row_weight_and_bias()
            .filter(|&(w, _)| tpinfer_kernels::gemv_16_bit_on_cuda(x, w))
    }

    /// An output of `rows` rows for [`Self::forward_merged_into`], like `x`.
    pub fn empty_output(&self, rows: usize, x: &Tensor) -> Result<Tensor> {
        let cols = self.out_sizes.iter().sum::<usize>();
        Ok(tpinfer_kernels::empty(&[rows, cols], x.dtype(), x.device())?)
    }

    /// [`Self::forward_merged`] of rows `x`, written into rows `first_row..` of `out`.
    pub fn forward_merged_into(&self, out: &Tensor, first_row: usize, x: &Tensor) -> candle_core::Result<()> {
        match self.joined() {
            Some(product) => apply_into(product, out, first_row, x, false),
            None => out.slice_set(
                &self
                    .forward_merged(x)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?,
                0,
                first_row,
            ),
        }
    }

    /// [`Self::forward_silu_product`] of one row `x` written into `out` (`[.., n]`,
    /// contiguous), with the SiLU product computed apart where the fused kernel does not run.
    pub fn forward_silu_product_into(&self, x: impl Into<GemvRow>, out: &Tensor) -> Result<()> {
        let x = x.into();
        if let Some(w) = self.silu_product_weight(x.like()) {
            return Ok(tpinfer_kernels::gemv_gate_up_silu_into(x, w, out)?);
        }
        // GGML blocks through candle's MMVQ kernel, the SiLU product written in place.
        if let Some(product) = self.joined().filter(|p| mmvq_row(p, &x).is_some()) {
            let gate_up = empty_output(product, 1, x.like())?;
            apply_row_into(product, x, &gate_up)?;
            return Ok(tpinfer_kernels::silu_mul_into(&gate_up, &out.reshape((1, ()))?)?);
        }
        let gate_up = self.forward_merged(&x.materialize()?)?;
        let cols = gate_up.dims().last().copied().unwrap_or(0);
        let product = tpinfer_kernels::silu_mul(&gate_up.reshape(((), cols))?)?;
        Ok(out.slice_set(&product.reshape(out.shape())?, 0, 0)?)
    }

    /// Whether [`Self::forward_silu_product_into`] runs as the fused GEMV for `x`.
    pub fn covers_silu_product(&self, x: &Tensor) -> bool {
        self.silu_product_weight(x).is_some()
    }

    /// The `[gate | up]` weight, dense or FP8, where the fused SiLU-product GEMV covers `x`.
    fn silu_product_weight(&self, x: &Tensor) -> Option<RowWeight<'_>> {
        let w = self.joined()?.row_weight()?;
        let covered =
            matches!(self.out_sizes[..], [gate, up] if gate == up) && tpinfer_kernels::gemv_gate_up_silu_on_cuda(x, w);
        covered.then_some(w)
    }

    /// For a gated MLP's `[gate | up]` (two merged linears of one size, no bias) and one
    /// input row on CUDA in 16 bits, a decode step's: `silu(gate) · up` from one kernel, with
    /// the bits of [`Self::forward_merged`] and `silu_mul`. `None` where it does not cover `x`.
    pub fn forward_silu_product(&self, x: &Tensor) -> Result<Option<Tensor>> {
        Ok(match self.silu_product_weight(x) {
            Some(w) => Some(tpinfer_kernels::gemv_gate_up_silu(x, w)?),
            None => None,
        })
    }

    /// The local output size of each merged linear.
    pub fn out_sizes(&self) -> &[usize] {
        &self.out_sizes
    }
}

/// `y = x Aᵀ + b` with `A` split along its input columns: the rank holds `A[:, in_range]`, gets
/// its slice of `x` from a column-parallel layer before it, and its partial product is summed
/// over ranks by one all-reduce. The bias is added once, after the reduce.
pub struct RowParallelLinear {
    /// The weight alone: the bias is added once, after the sum.
    product: Product,
    bias: Option<Tensor>,
    comm: Arc<dyn Communicator>,
}

impl RowParallelLinear {
    pub fn decls(prefix: &str, in_dim: usize, out_dim: usize, in_range: Range<usize>, bias: bool) -> Vec<WeightDecl> {
        let mut decls = vec![WeightDecl::new(
            format!("{prefix}.weight"),
            &[out_dim, in_dim],
            ShardSpec::range(1, in_range),
        )];
        if bias {
            decls.push(WeightDecl::new(
                format!("{prefix}.bias"),
                &[out_dim],
                ShardSpec::Replicated,
            ));
        }
        decls
    }

    pub fn load(weights: &mut ShardLoader, prefix: &str, bias: bool, comm: Arc<dyn Communicator>) -> Result<Self> {
        let weight = weights.take_weight(&format!("{prefix}.weight"))?;
        let bias = bias.then(|| weights.take(&format!("{prefix}.bias"))).transpose()?;
        Ok(Self {
            product: Product::new(weight, None)?,
            bias,
            comm,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (partial, biased) = self.partial(x)?;
        let y = self.comm.all_reduce_sum(&partial)?;
        drop(partial);
        self.add_bias(y, biased)
    }

    /// [`Self::forward`] of one row `x`, summed in place in `out` (contiguous): a decode
    /// step's product and all-reduce into a buffer that outlives the step.
    pub fn forward_row_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        if self.bias.is_some() {
            return Ok(out.slice_set(&self.forward(x)?.reshape(out.shape())?, 0, 0)?);
        }
        apply_row_into(&self.product, x.into(), out)?;
        Ok(self.comm.all_reduce_sum_in_place(out)?)
    }

    /// The weight [`Self::forward_row_residual_into`] multiplies with: at TP 1, without a
    /// bias, dense or FP8 (not GGML blocks). `None` elsewhere.
    pub fn residual_weight(&self) -> Option<RowWeight<'_>> {
        match self.bias.is_none() && self.comm.world_size() == 1 {
            true => self.product.row_weight(),
            false => None,
        }
    }

    /// Whether [`Self::forward_row_residual_into`] of one row `x` runs as one CUDA kernel (a
    /// 16-bit GEMV), not as its parts.
    pub fn residual_kernel_covers(&self, x: &Tensor) -> bool {
        self.residual_weight()
            .is_some_and(|w| tpinfer_kernels::gemv_16_bit_on_cuda(x, w))
    }

    /// [`Self::forward`] of one row `x` added to a decode step's residual stream, with the
    /// next input norm's making, as `out` says ([`tpinfer_kernels::gemv_residual_into`]): one
    /// kernel where [`Self::residual_kernel_covers`] `x`. Needs [`Self::residual_weight`].
    /// Returns the norm as the next product's row.
    pub fn forward_row_residual_into(&self, x: &Tensor, out: ResidualNorm) -> Result<GemvRow> {
        let Some(w) = self.residual_weight() else {
            return Err(crate::Error::Shard(
                "a product added to the residual stream needs TP 1, no bias and dense or FP8 weights".into(),
            ));
        };
        Ok(tpinfer_kernels::gemv_residual_into(x, w, out)?)
    }

    /// [`Self::forward`] of `silu(gate) · up` for a gated MLP's fused gate/up output
    /// `[.., 2n]` (gate, then up), through one `silu_mul` pass. Takes `gate_up` to free it
    /// before the product, as the activation model in the Llama crate counts. FP8 weights
    /// take the hidden quantized as it is made (`fp8_linear_of_silu_mul`).
    pub fn forward_silu_mul(&self, gate_up: Tensor) -> Result<Tensor> {
        let mut dims = gate_up.dims().to_vec();
        let cols = dims.pop().unwrap_or(0);
        let rows = dims.iter().product::<usize>();
        if let Product::Fp8 { values, scales, .. } = &self.product {
            let partial = tpinfer_kernels::fp8_linear_of_silu_mul(&gate_up.reshape((rows, cols))?, values, scales)?;
            drop(gate_up);
            dims.push(values.dim(0)?);
            return self.reduce(partial.reshape(dims)?);
        }
        let hidden = tpinfer_kernels::silu_mul(&gate_up.reshape((rows, cols))?)?;
        drop(gate_up);
        dims.push(cols / 2);
        let partial = apply(&self.product, &hidden.reshape(dims)?)?;
        drop(hidden);
        self.reduce(partial)
    }

    /// [`Self::forward`] with the sum scattered by rows (sequence parallelism): this rank's
    /// `sizes[rank]` rows of the output, as [`Communicator::reduce_scatter_sum`] splits them,
    /// handed to `finish` as parts to add in order (see
    /// [`Communicator::reduce_scatter_rows`]), whose result is returned.
    pub fn forward_scattered(
        &self,
        x: &Tensor,
        sizes: &[usize],
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        // Every part is biased alike: the rank and the layer decide, not the rows.
        let biased = std::cell::Cell::new(false);
        Ok(self.comm.reduce_scatter_rows(
            sizes,
            &mut |rows| {
                let (partial, b) = self.partial(&x.narrow(0, rows.start, rows.len())?)?;
                biased.set(b);
                Ok(partial)
            },
            &mut |parts| match (&self.bias, biased.get()) {
                (Some(b), false) => finish(&[tpinfer_kernels::sum_in_order(parts)?.broadcast_add(b)?]),
                _ => finish(parts),
            },
        )?)
    }

    /// This rank's partial product of `x`, and whether it carries the bias: where the fused
    /// GEMM covers `x`, and always with FP8 weights (whose GEMM takes a bias in its epilogue
    /// and other paths add it after), rank 0 adds it to its partial, before the sum (still
    /// once). A separate add would pass over the whole output once more.
    fn partial(&self, x: &Tensor) -> candle_core::Result<(Tensor, bool)> {
        let carried = self.bias.is_some() && self.carries_bias(x);
        let y = match (&self.bias, &self.product) {
            (Some(b), Product::Dense(linear)) if carried && self.comm.rank() == 0 => {
                tpinfer_kernels::linear_bias(x, linear.weight(), b, false)?
            }
            (Some(b), Product::Fp8 { values, scales, .. }) if self.comm.rank() == 0 => {
                tpinfer_kernels::fp8_linear(x, values, scales, Some(b), false)?
            }
            _ => apply(&self.product, x)?,
        };
        Ok((y, carried))
    }

    /// Whether rank 0's partial product of `x` carries the bias ([`Self::partial`]): every
    /// rank must agree, so that none adds it again after the sum.
    fn carries_bias(&self, x: &Tensor) -> bool {
        match &self.product {
            Product::Dense(linear) => tpinfer_kernels::fused_linear_covers(x, linear.weight()),
            Product::Fp8 { .. } => true,
            Product::Quantized { .. } => false,
        }
    }

    /// The summed `y`, plus the bias unless a partial product carried it.
    fn add_bias(&self, y: Tensor, biased: bool) -> Result<Tensor> {
        Ok(match (&self.bias, biased) {
            (Some(b), false) => y.broadcast_add(b)?,
            _ => y,
        })
    }

    /// The sum of the ranks' partial products (none carrying the bias), plus the bias once.
    fn reduce(&self, partial: Tensor) -> Result<Tensor> {
        let y = self.comm.all_reduce_sum(&partial)?;
        drop(partial);
        self.add_bias(y, false)
    }
}
