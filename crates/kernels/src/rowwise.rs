//! One-pass row-wise ops for activations `[rows, cols]`, computed in f32 and returned in the
//! input's dtype: one kernel on CUDA (cuda/rowwise.cu), one pass on CPU (`crate::cpu`).
//! Either way the op allocates only its output.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

/// Per-column f32 values (a gate, a norm's weight or bias) for the rows of a `[rows, cols]`
/// activation: `[cols]` for every row, or `[2, cols]` whose first row serves the rows before
/// `split` and whose second the rest (S2V's video rows, then its reference and motion rows at
/// timestep 0): one pass over the activation either way.
#[derive(Clone, Copy)]
pub struct ColumnTable<'a> {
    values: &'a Tensor,
    /// The rows the first of two rows serves; `None` for one row.
    split: Option<usize>,
}

impl<'a> ColumnTable<'a> {
    /// `values` `[cols]` for every row.
    pub fn every_row(values: &'a Tensor) -> Self {
        Self { values, split: None }
    }

    /// `values` `[2, cols]`: the first row for rows before `split`, the second for the rest.
    pub fn split_at(values: &'a Tensor, split: usize) -> Self {
        Self {
            values,
            split: Some(split),
        }
    }

    /// The table as a contiguous f32 `[k, cols]` and the rows its first row serves, for `x`
    /// `[rows, cols]`.
    fn prepared(&self, rows: usize, cols: usize, op: &str) -> Result<(Tensor, usize)> {
        let fits = match (self.values.dims(), self.split) {
            (&[c], None) | (&[2, c], Some(_)) => c == cols,
            _ => false,
        };
        if !fits {
            candle_core::bail!(
                "{op}: a table {:?} (split at {:?}) does not serve an activation [{rows}, {cols}]",
                self.values.dims(),
                self.split
            );
        }
        let values = self.values.to_dtype(DType::F32)?.contiguous()?;
        Ok((values.reshape(((), cols))?, self.split.unwrap_or(rows).min(rows)))
    }
}

/// Whether the kernels read or write `other` beside `x`'s dtype: the same dtype, or an f32
/// stream's bf16 or f16 products (one pass, where widening them first took two more).
fn pairs_with(x: &Tensor, other: DType) -> bool {
    other == x.dtype() || (x.dtype() == DType::F32 && matches!(other, DType::BF16 | DType::F16))
}

/// `x + y · gate`: a gated residual, in `x`'s dtype (`y` may be narrower).
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: ColumnTable) -> Result<Tensor> {
    residual_sum(x, std::slice::from_ref(y), Some(gate))
}

/// `x + Σ parts · gate`, or `x + Σ parts` without: a residual update from the ranks' rows of a
/// row-parallel output under sequence parallelism, summed in part order and rounded as
/// separate adds would be, in `x`'s dtype. Parts narrower than a wider stream's `x` are
/// widened to it as they are read. One kernel for one part, or two on CUDA; more are widened
/// and added first.
pub fn residual_sum(x: &Tensor, parts: &[Tensor], gate: Option<ColumnTable>) -> Result<Tensor> {
    check(x, "residual_sum")?;
    if let Some(p) = parts.iter().find(|p| p.dims() != x.dims()) {
        candle_core::bail!("residual_sum: a part {:?} does not match x {:?}", p.dims(), x.dims());
    }
    let (rows, cols) = x.dims2()?;
    let gate = gate.map(|g| g.prepared(rows, cols, "residual_sum")).transpose()?;
    let one_kernel = match parts.len() {
        1 => true,
        2 => x.device().is_cuda(),
        _ => false,
    };
    let as_read = one_kernel
        && parts
            .iter()
            .all(|p| pairs_with(x, p.dtype()) && p.dtype() == parts[0].dtype());
    let parts = match as_read {
        true => parts.to_vec(),
        false => parts
            .iter()
            .map(|p| p.to_dtype(x.dtype()))
            .collect::<Result<Vec<_>>>()?,
    };
    let x = x.contiguous()?;
    match parts.as_slice() {
        [] => candle_core::bail!("residual_sum of no parts"),
        [y] => x.apply_op2_no_bwd(&y.contiguous()?, &Residual { gate }),
        #[cfg(feature = "cuda")]
        [y0, y1] if x.device().is_cuda() => {
            x.apply_op3_no_bwd(&y0.contiguous()?, &y1.contiguous()?, &ResidualPair { gate })
        }
        _ => x.apply_op2_no_bwd(&sum_in_order(&parts)?, &Residual { gate }),
    }
}

/// `Σ parts`, added in order (each add rounded in the parts' type): what [`residual_sum`] adds.
pub fn sum_in_order(parts: &[Tensor]) -> Result<Tensor> {
    let (first, rest) = parts
        .split_first()
        .ok_or_else(|| candle_core::Error::Msg("sum of no parts".into()))?;
    rest.iter().try_fold(first.clone(), |sum, part| sum + part)
}

/// [`residual_sum`]'s op for one part: the gate table `[k, cols]` and the rows its first row
/// serves.
struct Residual {
    gate: Option<(Tensor, usize)>,
}

impl candle_core::CustomOp2 for Residual {
    fn name(&self) -> &'static str {
        "gated_residual"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, y: &CpuStorage, yl: &Layout) -> Result<(CpuStorage, Shape)> {
        let gate = self.gate.as_ref().map(|(t, split)| (t.storage_and_layout(), *split));
        let gate = match &gate {
            Some(((storage, layout), split)) => match &**storage {
                candle_core::Storage::Cpu(s) => Some((s, *layout, *split)),
                _ => candle_core::bail!("gated_residual: the gate is not on the CPU"),
            },
            None => None,
        };
        Ok((crate::cpu::gated_residual((x, xl), (y, yl), gate)?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let gate = self.gate.as_ref().map(|(t, split)| (t.storage_and_layout(), *split));
        cuda::residual((x, xl), &[(y, yl)], cuda::gate_input(&gate)?)
    }
}

/// [`residual_sum`]'s kernel for two parts, the gate held by the op.
#[cfg(feature = "cuda")]
struct ResidualPair {
    gate: Option<(Tensor, usize)>,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp3 for ResidualPair {
    fn name(&self) -> &'static str {
        "residual_pair"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("residual_pair runs on CUDA (residual_sum adds the parts first elsewhere)")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y0: &candle_core::CudaStorage,
        y0l: &Layout,
        y1: &candle_core::CudaStorage,
        y1l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let gate = self.gate.as_ref().map(|(t, split)| (t.storage_and_layout(), *split));
        cuda::residual((x, xl), &[(y0, y0l), (y1, y1l)], cuda::gate_input(&gate)?)
    }
}

/// `Σ_j x[i, j]²` in f32, `[rows, 1]`. Rows may lie any distance apart (a view of some
/// columns of a wider matrix is read in place).
pub fn row_sum_squares(x: &Tensor) -> Result<Tensor> {
    check(x, "row_sum_squares")?;
    rows_in_place(x)?.apply_op1_no_bwd(&RowSumSquares)
}

/// `x[i, j] · rows[i] · cols[j]` with `rows` `[rows, 1]` and `cols` `[cols]`, both f32; with
/// `rope` (`[rows, 2, pairs]` f32: cos, then sin), each pair of values `(2p, 2p + 1)` of row i
/// is then rotated by row i's angle `p mod pairs`: interleaved RoPE of every head of width
/// `2 · pairs`, fused with the scaling (a QK RMSNorm) and rounded once. Rows of `x` may lie any
/// distance apart; the result is contiguous.
pub fn scale_rows_cols(x: &Tensor, rows: &Tensor, cols: &Tensor, rope: Option<&Tensor>) -> Result<Tensor> {
    check(x, "scale_rows_cols")?;
    let (r, c) = x.dims2()?;
    if rows.elem_count() != r || cols.dims() != [c] {
        candle_core::bail!(
            "scale_rows_cols: scales {:?}, {:?} do not match x {:?}",
            rows.dims(),
            cols.dims(),
            x.dims()
        );
    }
    let rope = match rope {
        None => None,
        Some(table) => match table.dims() {
            &[tr, 2, pairs]
                if tr == r && pairs > 0 && c % (2 * pairs) == 0 && table.dtype() == candle_core::DType::F32 =>
            {
                Some(table.contiguous()?)
            }
            _ => candle_core::bail!(
                "scale_rows_cols: rope table {:?} {:?} is not [{r}, 2, pairs] f32 with {c} a multiple of 2 · pairs",
                table.dims(),
                table.dtype()
            ),
        },
    };
    rows_in_place(x)?.apply_op3_no_bwd(
        &rows.contiguous()?,
        &cols.contiguous()?,
        &Rowwise::ScaleRowsCols { rope },
    )
}

/// `x` itself when its rows are contiguous (any distance apart), else a contiguous copy.
fn rows_in_place(x: &Tensor) -> Result<Tensor> {
    match row_stride(x.layout()) {
        Some(_) => Ok(x.clone()),
        None => x.contiguous(),
    }
}

/// The distance between the rows of a `[rows, cols]` layout whose columns are contiguous.
pub(crate) fn row_stride(layout: &Layout) -> Option<usize> {
    let (rows, cols) = layout.shape().dims2().ok()?;
    match layout.stride() {
        &[stride, 1] if stride >= cols || rows == 1 => Some(stride),
        _ => None,
    }
}

/// LayerNorm over each row in f32, then `· weight + bias` (f32 tables), written as `out`
/// (`x`'s dtype, or the products' narrower one for an f32 stream: rounded once, in the same
/// pass). With `weight = 1 + scale`, `bias = shift` this is the DiT's modulated norm.
pub fn layer_norm(x: &Tensor, weight: ColumnTable, bias: ColumnTable, eps: f64, out: DType) -> Result<Tensor> {
    check(x, "layer_norm")?;
    let (rows, cols) = x.dims2()?;
    let (weight, split) = weight.prepared(rows, cols, "layer_norm weight")?;
    let (bias, bias_split) = bias.prepared(rows, cols, "layer_norm bias")?;
    if bias_split != split {
        candle_core::bail!("layer_norm: the weight's table splits at row {split}, the bias's at {bias_split}");
    }
    let written = match pairs_with(x, out) {
        true => out,
        false => x.dtype(),
    };
    let op = Rowwise::LayerNorm {
        eps: eps as f32,
        split,
        out: written,
    };
    x.contiguous()?.apply_op3_no_bwd(&weight, &bias, &op)?.to_dtype(out)
}

/// The residual stream's next value `x + y` and its RMSNorm times `weight` (`[cols]`, `x`'s
/// dtype), in one pass; both are views of one `[2, rows, cols]` buffer, so the norm lives as
/// long as the sum does.
pub fn add_rms_norm(x: &Tensor, y: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    check(x, "add_rms_norm")?;
    let (rows, cols) = x.dims2()?;
    if y.dims() != x.dims() || weight.dims() != [cols] || y.dtype() != x.dtype() || weight.dtype() != x.dtype() {
        candle_core::bail!(
            "add_rms_norm: y {:?} {:?} and weight {:?} {:?} do not match x {:?} {:?}",
            y.dims(),
            y.dtype(),
            weight.dims(),
            weight.dtype(),
            x.dims(),
            x.dtype()
        );
    }
    let op = AddRmsNorm { rows, eps: eps as f32 };
    let both = x
        .contiguous()?
        .apply_op3_no_bwd(&y.contiguous()?, &weight.contiguous()?, &op)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// [`add_rms_norm`] on a residual stream kept in place: `stream` `[2, rows, cols]` (contiguous)
/// holds the stream in `stream[0]`, which becomes `stream[0] + y`, and the norm is written to
/// `stream[1]`. A link of a kernel chain ([`crate::chained`]) on CUDA.
pub fn add_rms_norm_into(stream: &Tensor, y: &Tensor, weight: &Tensor, eps: f64) -> Result<()> {
    let (two, rows, cols) = stream.dims3()?;
    if two != 2 || y.dims() != [rows, cols] || !stream.is_contiguous() {
        candle_core::bail!(
            "add_rms_norm_into: the stream {:?} is not a contiguous [2, rows, cols] for y {:?}",
            stream.dims(),
            y.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if stream.device().is_cuda() {
        if y.dtype() != stream.dtype() || weight.dtype() != stream.dtype() || weight.dims() != [cols] {
            candle_core::bail!(
                "add_rms_norm_into: y {:?} or weight {:?} do not match the stream",
                y.dtype(),
                weight.dims()
            );
        }
        let candle_core::Device::Cuda(dev) = stream.device() else {
            candle_core::bail!("add_rms_norm_into: the stream is not on CUDA");
        };
        let (y, weight) = (y.contiguous()?, weight.contiguous()?);
        let at = crate::launch::device_address;
        let s = at(stream)?;
        let addresses = [s, at(&y)?, at(&weight)?, s];
        return cuda::launch_add_rms_norm(dev, stream.dtype(), addresses, rows, cols, eps as f32);
    }
    let (sum, normed) = add_rms_norm(&stream.get(0)?, y, weight, eps)?;
    stream.slice_set(&Tensor::stack(&[sum, normed], 0)?, 0, 0)
}

/// `silu(x[:, j]) · x[:, n + j]` for `x` `[rows, 2n]`: a gated MLP's activation on its fused
/// gate/up output, `[rows, n]`.
pub fn silu_mul(x: &Tensor) -> Result<Tensor> {
    gate_mul(x, false, "silu_mul")
}

/// [`silu_mul`] of `x` `[rows, 2n]` written into `out` (`[rows, n]`, contiguous, x's dtype):
/// on CUDA in place, so that a decode step's buffer keeps its address.
pub fn silu_mul_into(x: &Tensor, out: &Tensor) -> Result<()> {
    check(x, "silu_mul_into")?;
    let (rows, cols) = x.dims2()?;
    if cols % 2 != 0 || out.dims() != [rows, cols / 2] || out.dtype() != x.dtype() || !out.is_contiguous() {
        candle_core::bail!(
            "silu_mul_into: [rows, 2n] {:?} {:?} into a contiguous [rows, n] of its dtype, got {:?} {:?}",
            x.dtype(),
            x.dims(),
            out.dtype(),
            out.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        let x = x.contiguous()?;
        let at = crate::launch::device_address;
        return cuda::launch_silu_mul_into(dev, x.dtype(), [at(&x)?, at(out)?], rows * cols / 2, cols / 2);
    }
    out.slice_set(&silu_mul(x)?, 0, 0)
}

/// `gelu(x[:, j]) · x[:, n + j]` for `x` `[rows, 2n]`, GELU's tanh approximation (T5's
/// `gelu_new`): a gated-GELU FFN's activation on its fused gate/up output, `[rows, n]`,
/// rounded once.
pub fn gelu_tanh_mul(x: &Tensor) -> Result<Tensor> {
    gate_mul(x, true, "gelu_tanh_mul")
}

fn gate_mul(x: &Tensor, gelu: bool, op: &str) -> Result<Tensor> {
    check(x, op)?;
    let (rows, cols) = x.dims2()?;
    if cols % 2 != 0 {
        candle_core::bail!("{op} takes [rows, 2n], got {:?}", x.dims());
    }
    x.contiguous()?.apply_op1_no_bwd(&GateMul {
        rows,
        half: cols / 2,
        gelu,
    })
}

/// `softmax(scores[h, q, :] + bias)` where the bias of key `k` is
/// `table[buckets[k − q + queries − 1], h]`: attention probabilities with T5's relative
/// position bias, looked up by each key's distance from its query. `scores` `[heads, queries,
/// keys]` (any float dtype), `table` `[buckets, heads]` f32, `buckets` u32 `[queries + keys −
/// 1]` (the bucket of each distance, nearest the far-left key first). Computed in f32 and
/// rounded once to the scores' dtype: one pass where candle takes a gather, a permuted add, a
/// softmax and two casts over score-sized buffers.
pub fn softmax_relative_bias(scores: &Tensor, table: &Tensor, buckets: &Tensor) -> Result<Tensor> {
    let (heads, queries, keys) = scores.dims3()?;
    let distances = queries + keys - 1;
    if table.rank() != 2 || table.dim(1)? != heads || table.dtype() != DType::F32 {
        candle_core::bail!(
            "softmax_relative_bias: the table must be f32 [buckets, {heads}], got {:?} {:?}",
            table.dtype(),
            table.dims()
        );
    }
    if buckets.dims() != [distances] || buckets.dtype() != DType::U32 {
        candle_core::bail!(
            "softmax_relative_bias: buckets must be u32 [{distances}], got {:?} {:?}",
            buckets.dtype(),
            buckets.dims()
        );
    }
    scores.contiguous()?.apply_op3_no_bwd(
        &table.contiguous()?,
        &buckets.contiguous()?,
        &SoftmaxRelativeBias {
            heads,
            queries,
            keys,
            buckets: table.dim(0)?,
        },
    )
}

/// The rows of a vocabulary-parallel embedding's slice `weight` `[vocab rows, hidden]`, which
/// holds the vocabulary's rows `first..first + vocab rows`, for the u32 token `ids` (any
/// shape): `[ids, hidden]`, zeros for the ids another rank holds (an all-reduce over the ranks
/// then assembles the embeddings). The ids are read on the device, so a captured CUDA graph
/// embeds whatever its input buffer holds.
pub fn embed_owned_rows(ids: &Tensor, weight: &Tensor, first: usize) -> Result<Tensor> {
    let (rows, _) = weight.dims2()?;
    let end = first + rows;
    if ids.dtype() != candle_core::DType::U32 || end > u32::MAX as usize {
        candle_core::bail!(
            "embed_owned_rows: ids must be u32 and rows {first}..{end} must fit u32, got {:?}",
            ids.dtype()
        );
    }
    let op = EmbedOwnedRows {
        first: first as u32,
        end: end as u32,
    };
    ids.flatten_all()?
        .contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &op)
}

fn check(x: &Tensor, op: &str) -> Result<()> {
    if x.rank() != 2 || x.elem_count() == 0 {
        candle_core::bail!("{op} takes a non-empty [rows, cols], got {:?}", x.dims());
    }
    Ok(())
}

enum Rowwise {
    /// With a RoPE table `[rows, 2, pairs]` f32, contiguous.
    ScaleRowsCols { rope: Option<Tensor> },
    /// The tables' first rows serve the rows before `split`; written as `out`.
    LayerNorm { eps: f32, split: usize, out: DType },
}

struct RowSumSquares;

struct AddRmsNorm {
    rows: usize,
    eps: f32,
}

struct GateMul {
    rows: usize,
    half: usize,
    gelu: bool,
}

struct SoftmaxRelativeBias {
    heads: usize,
    queries: usize,
    keys: usize,
    /// The table's rows: every bucket index must be below it.
    buckets: usize,
}

struct EmbedOwnedRows {
    first: u32,
    end: u32,
}

impl candle_core::CustomOp3 for Rowwise {
    fn name(&self) -> &'static str {
        match self {
            Self::ScaleRowsCols { .. } => "scale_rows_cols",
            Self::LayerNorm { .. } => "layer_norm",
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match self {
            Self::ScaleRowsCols { rope } => {
                let table = rope.as_ref().map(|t| t.storage_and_layout());
                let table = match &table {
                    Some((storage, layout)) => match &**storage {
                        candle_core::Storage::Cpu(s) => Some((s, *layout)),
                        _ => candle_core::bail!("scale_rows_cols: the rope table is not on the CPU"),
                    },
                    None => None,
                };
                crate::cpu::scale_rows_cols((x, xl), (a, al), (b, bl), table)?
            }
            Self::LayerNorm { eps, split, out } => {
                crate::cpu::layer_norm((x, xl), (a, al), (b, bl), *split, *eps, *out)?
            }
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::rowwise(self, (x, xl), (a, al), (b, bl))
    }
}

impl candle_core::CustomOp1 for RowSumSquares {
    fn name(&self) -> &'static str {
        "row_sum_squares"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((crate::cpu::row_sum_squares((x, xl))?, Shape::from((xl.dims()[0], 1))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::row_sum_squares(x, xl)
    }
}

impl candle_core::CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add_rms_norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        y: &CpuStorage,
        yl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = crate::cpu::add_rms_norm((x, xl), (y, yl), (w, wl), self.eps)?;
        Ok((out, Shape::from((2, self.rows, wl.shape().elem_count()))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let cols = wl.shape().elem_count();
        let out = cuda::add_rms_norm((x, xl), (y, yl), (w, wl), self.rows, cols, self.eps)?;
        Ok((out, Shape::from((2, self.rows, cols))))
    }
}

impl candle_core::CustomOp1 for GateMul {
    fn name(&self) -> &'static str {
        if self.gelu {
            "gelu_tanh_mul"
        } else {
            "silu_mul"
        }
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = crate::cpu::gate_mul((x, xl), self.half, self.gelu)?;
        Ok((out, Shape::from((self.rows, self.half))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::gate_mul(x, xl, self.rows * self.half, self.half, self.gelu)?;
        Ok((out, Shape::from((self.rows, self.half))))
    }
}

impl candle_core::CustomOp3 for SoftmaxRelativeBias {
    fn name(&self) -> &'static str {
        "softmax_relative_bias"
    }

    fn cpu_fwd(
        &self,
        scores: &CpuStorage,
        sl: &Layout,
        table: &CpuStorage,
        tl: &Layout,
        buckets: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.check_buckets(buckets.as_slice::<u32>()?, bl)?;
        let shape = [self.heads, self.queries, self.keys];
        let out = crate::cpu::softmax_relative_bias((scores, sl), (table, tl), (buckets, bl), shape)?;
        Ok((out, sl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        scores: &candle_core::CudaStorage,
        sl: &Layout,
        table: &candle_core::CudaStorage,
        tl: &Layout,
        buckets: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::softmax_relative_bias((scores, sl), (table, tl), (buckets, bl), self)?;
        Ok((out, sl.shape().clone()))
    }
}

impl SoftmaxRelativeBias {
    /// Every bucket names a row of the table (checked where the buckets are on the host).
    fn check_buckets(&self, all: &[u32], l: &Layout) -> Result<()> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("softmax_relative_bias: buckets must be contiguous");
        };
        if let Some(b) = all[start..end].iter().find(|&&b| b as usize >= self.buckets) {
            candle_core::bail!(
                "softmax_relative_bias: bucket {b} is outside the table's {} rows",
                self.buckets
            );
        }
        Ok(())
    }
}

impl candle_core::CustomOp2 for EmbedOwnedRows {
    fn name(&self) -> &'static str {
        "embed_owned_rows"
    }

    fn cpu_fwd(&self, ids: &CpuStorage, il: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = crate::cpu::embed_owned_rows((ids, il), (w, wl), self.first, self.end)?;
        Ok((out, Shape::from((il.shape().elem_count(), wl.shape().dims2()?.1))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        il: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let cols = wl.shape().dims2()?.1;
        let out = cuda::embed_owned_rows((ids, il), (w, wl), self.first, self.end, cols)?;
        Ok((out, Shape::from((il.shape().elem_count(), cols))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape};
    use half::{bf16, f16};

    use super::Rowwise;
    use crate::chain::Launch;
    use crate::launch::{elementwise, suffix, THREADS};

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    /// Runs `f::<T, P>` for the stream's dtype T and another P: the same, or an f32 stream's
    /// bf16 or f16 (the pairs cuda/rowwise.cu's mixed kernels take).
    macro_rules! with_pair {
        ($stream:expr, $other:expr, $f:ident($($arg:expr),*)) => {
            match ($stream, $other) {
                (DType::F32, DType::F32) => $f::<f32, f32>($($arg),*),
                (DType::BF16, DType::BF16) => $f::<bf16, bf16>($($arg),*),
                (DType::F16, DType::F16) => $f::<f16, f16>($($arg),*),
                (DType::F32, DType::BF16) => $f::<f32, bf16>($($arg),*),
                (DType::F32, DType::F16) => $f::<f32, f16>($($arg),*),
                (stream, other) => candle_core::bail!("row-wise kernels: no kernel for {stream:?} with {other:?}"),
            }
        };
    }

    fn view<'a, T: CudaDType>((s, l): Input<'a>) -> Result<CudaView<'a, T>> {
        match l.contiguous_offsets() {
            Some((start, end)) => Ok(s.as_cuda_slice::<T>()?.slice(start..end)),
            None => candle_core::bail!("row-wise kernels need contiguous inputs"),
        }
    }

    fn per_row(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Must match NORM_THREADS in cuda/rowwise.cu.
    const NORM_THREADS: u32 = 1024;

    pub(super) fn rowwise(op: &Rowwise, x: Input, a: Input, b: Input) -> Result<(CudaStorage, Shape)> {
        match (op, x.0.dtype()) {
            (&Rowwise::LayerNorm { eps, split, out }, dtype) => {
                with_pair!(dtype, out, layer_norm_typed(x, a, b, split, eps, out))
            }
            (Rowwise::ScaleRowsCols { .. }, DType::F32) => rowwise_typed::<f32>(op, x, a, b),
            (Rowwise::ScaleRowsCols { .. }, DType::BF16) => rowwise_typed::<bf16>(op, x, a, b),
            (Rowwise::ScaleRowsCols { .. }, DType::F16) => rowwise_typed::<f16>(op, x, a, b),
            (_, other) => candle_core::bail!("row-wise kernels: unsupported dtype {other:?}"),
        }
    }

    /// Values of T per 16-byte pack (the `_packed` kernels).
    fn pack<T>() -> usize {
        16 / std::mem::size_of::<T>()
    }

    /// The rows of a `[rows, cols]` input whose columns are contiguous: its elements from the
    /// first and the distance between rows.
    fn rows_view<'a, T: CudaDType>((s, l): Input<'a>) -> Result<(CudaView<'a, T>, usize)> {
        let (rows, cols) = l.shape().dims2()?;
        let Some(stride) = super::row_stride(l) else {
            candle_core::bail!(
                "row-wise kernels need rows of contiguous columns, got strides {:?}",
                l.stride()
            );
        };
        let all = s.as_cuda_slice::<T>()?;
        if l.start_offset() + (rows - 1) * stride + cols > all.len() {
            candle_core::bail!(
                "row-wise kernels: a [{rows}, {cols}] view with row stride {stride} overruns its buffer"
            );
        }
        Ok((all.slice(l.start_offset()..), stride))
    }

    /// The name of kernel `name` for `dtype`: its 16-byte-pack version when every row of every
    /// T input starts on a pack (`starts`: their element offsets and row strides).
    fn row_kernel<T>(name: &str, dtype: DType, cols: usize, starts: &[usize]) -> Result<String> {
        pair_kernel::<T>(name, (dtype, dtype), cols, starts)
    }

    /// [`row_kernel`]'s name for a kernel of two types, the stream's T and another: the
    /// stream's suffix alone when they agree, as in `layer_norm_bf16`, else both, as in
    /// `layer_norm_f32_bf16`. A pack holds 16 bytes of T.
    fn pair_kernel<T>(name: &str, (stream, other): (DType, DType), cols: usize, starts: &[usize]) -> Result<String> {
        let packed = cols.is_multiple_of(pack::<T>()) && starts.iter().all(|s| s.is_multiple_of(pack::<T>()));
        let types = match stream == other {
            true => suffix(stream)?.to_string(),
            false => format!("{}_{}", suffix(stream)?, suffix(other)?),
        };
        Ok(format!("{name}_{types}{}", if packed { "_packed" } else { "" }))
    }

    /// Values a table of `cols` columns must hold when its first row serves the rows before
    /// `split` of `rows`.
    fn table_len(rows: usize, cols: usize, split: usize) -> usize {
        match split < rows {
            true => 2 * cols,
            false => cols,
        }
    }

    fn layer_norm_typed<T: CudaDType + DeviceRepr, O: CudaDType + DeviceRepr>(
        x: Input,
        weight: Input,
        bias: Input,
        split: usize,
        eps: f32,
        out_dtype: DType,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = x.1.shape().dims2()?;
        let dev: &CudaDevice = x.0.device();
        let (xs, w, b) = (view::<T>(x)?, view::<f32>(weight)?, view::<f32>(bias)?);
        let needed = table_len(rows, cols, split);
        if w.len() < needed || b.len() < needed {
            candle_core::bail!("layer_norm: weight or bias do not serve x [{rows}, {cols}]");
        }
        let name = pair_kernel::<T>("layer_norm", (x.0.dtype(), out_dtype), cols, &[x.1.start_offset()])?;
        let func = crate::module::ROWWISE.kernel(dev, &name)?;
        // SAFETY: every element is written by the kernel.
        let out: CudaSlice<O> = unsafe { dev.alloc::<O>(rows * cols)? };
        let (split_i, cols_i) = (split as i32, cols as i32);
        let mut builder = func.builder();
        builder
            .arg(&xs)
            .arg(&w)
            .arg(&b)
            .arg(&split_i)
            .arg(&out)
            .arg(&cols_i)
            .arg(&eps);
        // SAFETY: the arguments match the kernel's signature and sizes were checked.
        unsafe { builder.launch(per_row(rows)) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, cols)),
        ))
    }

    fn rowwise_typed<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        op: &Rowwise,
        x: Input,
        a: Input,
        b: Input,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = x.1.shape().dims2()?;
        let n = rows * cols;
        let dev: &CudaDevice = x.0.device();
        let dtype = x.0.dtype();
        let name = candle_core::CustomOp3::name(op);
        // SAFETY: every element is written by the kernel.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
        let cols_i = cols as i32;
        match op {
            Rowwise::ScaleRowsCols { rope } => {
                let ((xs, stride), r, c) = (rows_view::<T>(x)?, view::<f32>(a)?, view::<f32>(b)?);
                if r.len() != rows || c.len() != cols {
                    candle_core::bail!("scale_rows_cols: scales do not match x [{rows}, {cols}]");
                }
                if [cols, stride, x.1.start_offset()].iter().any(|n| !n.is_multiple_of(2)) {
                    candle_core::bail!(
                        "scale_rows_cols on CUDA takes pairs: {cols} columns, row stride {stride} and offset {} must be even",
                        x.1.start_offset()
                    );
                }
                let starts = [x.1.start_offset(), stride];
                let func = crate::module::ROWWISE.kernel(dev, &row_kernel::<T>(name, dtype, cols, &starts)?)?;
                let (stride_i, null) = (stride as i64, 0u64);
                let table = rope.as_ref().map(|t| t.storage_and_layout());
                let table = match &table {
                    Some((storage, layout)) => {
                        let candle_core::Storage::Cuda(storage) = &**storage else {
                            candle_core::bail!("scale_rows_cols: the rope table is not on the GPU");
                        };
                        let pairs = layout.dims()[2] as i32;
                        Some((storage.as_cuda_slice::<f32>()?.slice(layout.start_offset()..), pairs))
                    }
                    None => None,
                };
                let no_pairs = 1i32;
                let mut builder = func.builder();
                builder.arg(&xs).arg(&stride_i).arg(&r).arg(&c);
                match &table {
                    Some((view, pairs)) => builder.arg(view).arg(pairs),
                    None => builder.arg(&null).arg(&no_pairs),
                };
                builder.arg(&out).arg(&cols_i);
                // SAFETY: as above; the table (checked by the caller) holds `2 · pairs` values a row.
                unsafe { builder.launch(per_row(rows)) }.w()?;
            }
            Rowwise::LayerNorm { .. } => candle_core::bail!("layer_norm has a kernel of two types"),
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, cols)),
        ))
    }

    /// A gate table an op holds, as the kernels read it: storage, layout and the rows its
    /// first row serves.
    pub(super) type Gate<'a> = Option<(&'a CudaStorage, &'a Layout, usize)>;

    /// The GPU storage of a gate table an op holds.
    pub(super) fn gate_input<'a, S: std::ops::Deref<Target = candle_core::Storage>>(
        gate: &'a Option<((S, &'a Layout), usize)>,
    ) -> Result<Gate<'a>> {
        match gate {
            None => Ok(None),
            Some(((storage, layout), split)) => match &**storage {
                candle_core::Storage::Cuda(s) => Ok(Some((s, *layout, *split))),
                _ => candle_core::bail!("residual_sum: the gate is not on the GPU"),
            },
        }
    }

    /// `x` plus one part (`gated_residual_*`) or the sum of two (`residual_pair_*`), gated
    /// where a gate is given.
    pub(super) fn residual(x: Input, parts: &[Input], gate: Gate) -> Result<(CudaStorage, Shape)> {
        let Some(first) = parts.first() else {
            candle_core::bail!("residual_sum of no parts");
        };
        with_pair!(x.0.dtype(), first.0.dtype(), residual_typed(x, parts, gate))
    }

    fn residual_typed<T: CudaDType + DeviceRepr, P: CudaDType + DeviceRepr>(
        x: Input,
        parts: &[Input],
        gate: Gate,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = x.1.shape().dims2()?;
        let n = rows * cols;
        let dev: &CudaDevice = x.0.device();
        let xs = view::<T>(x)?;
        let ys = parts.iter().map(|&p| view::<P>(p)).collect::<Result<Vec<_>>>()?;
        let (gate, split) = match gate {
            Some((storage, layout, split)) => (Some(view::<f32>((storage, layout))?), split.min(rows)),
            None => (None, rows),
        };
        let name = match parts.len() {
            1 => "gated_residual",
            2 => "residual_pair",
            more => candle_core::bail!("residual_sum: no kernel adds {more} parts"),
        };
        if ys.iter().any(|y| y.len() != n) || gate.as_ref().is_some_and(|g| g.len() < table_len(rows, cols, split)) {
            candle_core::bail!("{name}: parts or gate do not match x [{rows}, {cols}]");
        }
        let starts: Vec<usize> = std::iter::once(x)
            .chain(parts.iter().copied())
            .map(|i| i.1.start_offset())
            .collect();
        let dtypes = (x.0.dtype(), parts[0].0.dtype());
        let func = crate::module::ROWWISE.kernel(dev, &pair_kernel::<T>(name, dtypes, cols, &starts)?)?;
        // SAFETY: every element is written by the kernel.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
        let (split_i, cols_i, null) = (split as i32, cols as i32, 0u64);
        let mut builder = func.builder();
        builder.arg(&xs);
        for y in &ys {
            builder.arg(y);
        }
        match &gate {
            Some(g) => builder.arg(g),
            None => builder.arg(&null),
        };
        builder.arg(&split_i).arg(&out).arg(&cols_i);
        // SAFETY: the arguments match the kernel's signature and sizes were checked.
        unsafe { builder.launch(per_row(rows)) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((rows, cols)),
        ))
    }

    pub(super) fn add_rms_norm(
        x: Input,
        y: Input,
        w: Input,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<CudaStorage> {
        match x.0.dtype() {
            DType::F32 => add_rms_norm_typed::<f32>(x, y, w, rows, cols, eps),
            DType::BF16 => add_rms_norm_typed::<bf16>(x, y, w, rows, cols, eps),
            DType::F16 => add_rms_norm_typed::<f16>(x, y, w, rows, cols, eps),
            other => candle_core::bail!("add_rms_norm: unsupported dtype {other:?}"),
        }
    }

    fn add_rms_norm_typed<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        x: Input,
        y: Input,
        w: Input,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<CudaStorage> {
        let dev = x.0.device();
        let (xs, ys, ws) = (view::<T>(x)?, view::<T>(y)?, view::<T>(w)?);
        if xs.len() != rows * cols || ys.len() != rows * cols || ws.len() != cols {
            candle_core::bail!("add_rms_norm: inputs do not match [{rows}, {cols}]");
        }
        // SAFETY: every element of both halves is written by the kernel.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * rows * cols)? };
        let stream = dev.cuda_stream();
        let address = |v: &CudaView<T>| v.device_ptr(&stream).0;
        let addresses = [address(&xs), address(&ys), address(&ws), out.device_ptr(&stream).0];
        launch_add_rms_norm(dev, x.0.dtype(), addresses, rows, cols, eps)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// The kernel on x, y, the weight and the `[2, rows, cols]` output at `addresses` (for
    /// [`super::add_rms_norm_into`], x is the output's first half).
    pub(super) fn launch_add_rms_norm(
        dev: &CudaDevice,
        dtype: DType,
        [x, y, w, out]: [u64; 4],
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        let func = crate::module::ROWWISE.kernel(dev, &format!("add_rms_norm_{}", suffix(dtype)?))?;
        let cfg = LaunchConfig {
            block_dim: (NORM_THREADS, 1, 1),
            ..per_row(rows)
        };
        // SAFETY: the arguments match the kernel's signature; x and y hold rows × cols values,
        // w cols and out 2 × rows × cols (the callers checked).
        unsafe {
            Launch::default()
                .arg(x)
                .arg(y)
                .arg(w)
                .arg(out)
                .arg(rows as i32)
                .arg(cols as i32)
                .arg(eps)
                .launch(dev, &func, cfg)
        }
    }

    /// The SiLU product from x (`2 · half` values a row) into out (`half` a row, `n` in all)
    /// at raw addresses: a chain kernel.
    pub(super) fn launch_silu_mul_into(
        dev: &CudaDevice,
        dtype: DType,
        [x, out]: [u64; 2],
        n: usize,
        half: usize,
    ) -> Result<()> {
        let func = crate::module::ROWWISE.kernel(dev, &format!("silu_mul_into_{}", suffix(dtype)?))?;
        // SAFETY: the arguments match the kernel's signature; x holds 2n values of `dtype` and
        // out n (the caller checked).
        unsafe {
            Launch::default()
                .arg(x)
                .arg(out)
                .arg(n as i64)
                .arg(half as i32)
                .launch(dev, &func, elementwise(n))
        }
    }

    pub(super) fn gate_mul(x: &CudaStorage, xl: &Layout, n: usize, half: usize, gelu: bool) -> Result<CudaStorage> {
        match x.dtype() {
            DType::F32 => gate_mul_typed::<f32>((x, xl), n, half, gelu),
            DType::BF16 => gate_mul_typed::<bf16>((x, xl), n, half, gelu),
            DType::F16 => gate_mul_typed::<f16>((x, xl), n, half, gelu),
            other => candle_core::bail!("gate_mul: unsupported dtype {other:?}"),
        }
    }

    fn gate_mul_typed<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        x: Input,
        n: usize,
        half: usize,
        gelu: bool,
    ) -> Result<CudaStorage> {
        let dev = x.0.device();
        let func = crate::module::ROWWISE.kernel(dev, &format!("gate_mul_{}", suffix(x.0.dtype())?))?;
        let xs = view::<T>(x)?;
        // SAFETY: every element is written by the kernel.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
        let (n_i, half_i, gelu_i) = (n as i64, half as i32, gelu as i32);
        let mut builder = func.builder();
        builder.arg(&xs).arg(&out).arg(&n_i).arg(&half_i).arg(&gelu_i);
        // SAFETY: the arguments match the kernel's signature; `xs` holds 2n elements.
        unsafe { builder.launch(elementwise(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    pub(super) fn softmax_relative_bias(
        scores: Input,
        table: Input,
        buckets: Input,
        op: &super::SoftmaxRelativeBias,
    ) -> Result<CudaStorage> {
        match scores.0.dtype() {
            DType::F32 => softmax_relative_bias_typed::<f32>(scores, table, buckets, op),
            DType::BF16 => softmax_relative_bias_typed::<bf16>(scores, table, buckets, op),
            DType::F16 => softmax_relative_bias_typed::<f16>(scores, table, buckets, op),
            other => candle_core::bail!("softmax_relative_bias: unsupported dtype {other:?}"),
        }
    }

    fn softmax_relative_bias_typed<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        scores: Input,
        table: Input,
        buckets: Input,
        op: &super::SoftmaxRelativeBias,
    ) -> Result<CudaStorage> {
        let dev = scores.0.device();
        let func =
            crate::module::ROWWISE.kernel(dev, &format!("softmax_relative_bias_{}", suffix(scores.0.dtype())?))?;
        let (ss, ts, bs) = (view::<T>(scores)?, view::<f32>(table)?, view::<u32>(buckets)?);
        let rows = op.heads * op.queries;
        // SAFETY: every element is written by the kernel.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * op.keys)? };
        let (heads_i, queries_i, keys_i) = (op.heads as i32, op.queries as i32, op.keys as i32);
        let mut builder = func.builder();
        builder
            .arg(&ss)
            .arg(&ts)
            .arg(&bs)
            .arg(&out)
            .arg(&heads_i)
            .arg(&queries_i)
            .arg(&keys_i);
        let warps_per_block = THREADS as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(warps_per_block) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature: scores and out hold rows · keys
        // values, buckets queries + keys − 1 (checked by the caller), each below the table's
        // rows (the caller's promise: they are made on the host from the table's config).
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    pub(super) fn embed_owned_rows(ids: Input, w: Input, first: u32, end: u32, cols: usize) -> Result<CudaStorage> {
        match w.0.dtype() {
            DType::F32 => embed_typed::<f32>(ids, w, first, end, cols),
            DType::BF16 => embed_typed::<bf16>(ids, w, first, end, cols),
            DType::F16 => embed_typed::<f16>(ids, w, first, end, cols),
            other => candle_core::bail!("embed_owned_rows: unsupported dtype {other:?}"),
        }
    }

    fn embed_typed<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        ids: Input,
        w: Input,
        first: u32,
        end: u32,
        cols: usize,
    ) -> Result<CudaStorage> {
        let dev = w.0.device();
        let func = crate::module::ROWWISE.kernel(dev, &format!("embed_owned_rows_{}", suffix(w.0.dtype())?))?;
        let (ids, ws) = (view::<u32>(ids)?, view::<T>(w)?);
        let tokens = ids.len();
        if ws.len() != (end - first) as usize * cols {
            candle_core::bail!("embed_owned_rows: the weight does not hold rows {first}..{end} of {cols}");
        }
        // SAFETY: every token's row is written, copied or zeroed.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(tokens * cols)? };
        let cols_i = cols as i32;
        let mut builder = func.builder();
        builder.arg(&ids).arg(&ws).arg(&out).arg(&first).arg(&end).arg(&cols_i);
        // SAFETY: the arguments match the kernel's signature; ids hold `tokens` values and the
        // kernel reads only rows below `end - first`.
        unsafe { builder.launch(per_row(tokens)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    pub(super) fn row_sum_squares(x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        match x.dtype() {
            DType::F32 => row_sum_squares_typed::<f32>((x, xl)),
            DType::BF16 => row_sum_squares_typed::<bf16>((x, xl)),
            DType::F16 => row_sum_squares_typed::<f16>((x, xl)),
            other => candle_core::bail!("row_sum_squares: unsupported dtype {other:?}"),
        }
    }

    fn row_sum_squares_typed<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        x: Input,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = x.1.shape().dims2()?;
        let dev = x.0.device();
        let (xs, stride) = rows_view::<T>(x)?;
        let func = crate::module::ROWWISE.kernel(
            dev,
            &row_kernel::<T>("row_sum_squares", x.0.dtype(), cols, &[x.1.start_offset(), stride])?,
        )?;
        // SAFETY: one value per row, every row written.
        let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows)? };
        let (stride_i, cols_i) = (stride as i64, cols as i32);
        let mut builder = func.builder();
        builder.arg(&xs).arg(&stride_i).arg(&out).arg(&cols_i);
        // SAFETY: the arguments match the kernel's signature; the view covers every row.
        unsafe { builder.launch(per_row(rows)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from((rows, 1))))
    }
}
