use std::ops::Range;
use std::sync::Arc;

use candle_core::{Module, Tensor};
use candle_nn::Linear;
use tpinfer_comm::Communicator;
use tpinfer_weights::{ShardLoader, ShardSpec, WeightDecl};

use crate::Result;

/// `x · wᵀ (+ b)` through `linear`: one input row on CUDA in 16 bits (a decode step's
/// products) through the GEMV kernel; more rows with a bias through the fused linear (one
/// cuBLASLt GEMM with the bias in its epilogue on CUDA); everything else through candle's
/// matmul.
fn apply(linear: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
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

/// One row's product written into `out`: the GEMV in place where it runs (a kernel chain's
/// link on CUDA), elsewhere the product copied in.
fn apply_row_into(linear: &Linear, x: &Tensor, out: &Tensor) -> candle_core::Result<()> {
    let w = linear.weight();
    if linear.bias().is_none() && tpinfer_kernels::gemv_on_cuda(x, w) {
        return tpinfer_kernels::gemv_into(x, w, out);
    }
    out.slice_set(&apply(linear, x)?.reshape(out.shape())?, 0, 0)
}

/// An uninitialized `[rows, out]` output of `linear` for [`apply_into`], in `x`'s type and
/// on its device.
fn empty_output(linear: &Linear, rows: usize, x: &Tensor) -> Result<Tensor> {
    Ok(tpinfer_kernels::empty(
        &[rows, linear.weight().dim(0)?],
        x.dtype(),
        x.device(),
    )?)
}

/// [`apply`] (then GELU, tanh approximation, when `gelu`) of rows `x` written into rows
/// `first_row..` of `out`: a part of a product over gathered rows. With a bias, through the
/// fused linear, which writes in place on CUDA.
fn apply_into(linear: &Linear, out: &Tensor, first_row: usize, x: &Tensor, gelu: bool) -> candle_core::Result<()> {
    match linear.bias() {
        Some(b) => tpinfer_kernels::linear_bias_into(out, first_row, x, linear.weight(), b, gelu),
        None => {
            let y = apply(linear, x)?;
            out.slice_set(&if gelu { y.gelu()? } else { y }, 0, first_row)
        }
    }
}

/// `y = x Aᵀ + b` with `A` split along its output rows: the rank holds `A[out_range, :]` and
/// produces its slice of `y`. No communication.
pub struct ColumnParallelLinear {
    linear: Linear,
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
        let weight = weights.take(&format!("{prefix}.weight"))?;
        let bias = bias.then(|| weights.take(&format!("{prefix}.bias"))).transpose()?;
        Ok(Self {
            linear: Linear::new(weight, bias),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(apply(&self.linear, x)?)
    }

    /// An output of `rows` rows for [`Self::forward_into`], like `x`.
    pub fn empty_output(&self, rows: usize, x: &Tensor) -> Result<Tensor> {
        empty_output(&self.linear, rows, x)
    }

    /// [`Self::forward`] (or [`Self::forward_gelu`] when `gelu`) of rows `x`, written into rows
    /// `first_row..` of `out`.
    pub fn forward_into(&self, out: &Tensor, first_row: usize, x: &Tensor, gelu: bool) -> candle_core::Result<()> {
        apply_into(&self.linear, out, first_row, x, gelu)
    }

    /// GELU (tanh approximation) of [`Self::forward`]: with a bias, inside the fused linear
    /// (on CUDA, the GEMM's epilogue).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.linear.weight();
        match self.linear.bias() {
            Some(b) if tpinfer_kernels::fused_linear_covers(x, w) => Ok(tpinfer_kernels::linear_bias(x, w, b, true)?),
            _ => Ok(apply(&self.linear, x)?.gelu()?),
        }
    }
}

/// Several column-parallel linears on the same input (Q/K/V, or gate/up) fused into one
/// GEMM: their local slices are concatenated at load time and split after the product.
pub struct MergedColumnParallelLinear {
    linear: Linear,
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
        let weight = weights.take_concat(&weight_names.iter().map(String::as_str).collect::<Vec<_>>(), 0)?;
        let bias = match bias {
            true => {
                let bias_names = names("bias");
                Some(weights.take_concat(&bias_names.iter().map(String::as_str).collect::<Vec<_>>(), 0)?)
            }
            false => None,
        };
        Ok(Self {
            linear: Linear::new(weight, bias),
            out_sizes,
        })
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
        Ok(apply(&self.linear, x)?)
    }

    /// [`Self::forward_merged`] of one row `x`, written into `out` (all outputs, contiguous):
    /// a decode step's product into a buffer that outlives the step.
    pub fn forward_row_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        Ok(apply_row_into(&self.linear, x, out)?)
    }

    /// The merged weight, where one row `x`'s product runs as the bias-free GEMV kernel on
    /// CUDA: for kernels that fuse what follows the product into it.
    pub fn gemv_weight(&self, x: &Tensor) -> Option<&Tensor> {
        let w = self.linear.weight();
        (self.linear.bias().is_none() && tpinfer_kernels::gemv_on_cuda(x, w)).then_some(w)
    }

    /// An output of `rows` rows for [`Self::forward_merged_into`], like `x`.
    pub fn empty_output(&self, rows: usize, x: &Tensor) -> Result<Tensor> {
        empty_output(&self.linear, rows, x)
    }

    /// [`Self::forward_merged`] of rows `x`, written into rows `first_row..` of `out`.
    pub fn forward_merged_into(&self, out: &Tensor, first_row: usize, x: &Tensor) -> candle_core::Result<()> {
        apply_into(&self.linear, out, first_row, x, false)
    }

    /// [`Self::forward_silu_product`] of one row `x` written into `out` (`[.., n]`,
    /// contiguous), with the SiLU product computed apart where the fused kernel does not run.
    pub fn forward_silu_product_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let w = self.linear.weight();
        if self.silu_product_covers(x) {
            return Ok(tpinfer_kernels::gemv_gate_up_silu_into(x, w, out)?);
        }
        let gate_up = self.forward_merged(x)?;
        let cols = gate_up.dims().last().copied().unwrap_or(0);
        let product = tpinfer_kernels::silu_mul(&gate_up.reshape(((), cols))?)?;
        Ok(out.slice_set(&product.reshape(out.shape())?, 0, 0)?)
    }

    fn silu_product_covers(&self, x: &Tensor) -> bool {
        matches!(self.out_sizes[..], [gate, up] if gate == up)
            && self.linear.bias().is_none()
            && tpinfer_kernels::gemv_gate_up_silu_on_cuda(x, self.linear.weight())
    }

    /// For a gated MLP's `[gate | up]` (two merged linears of one size, no bias) and one
    /// input row on CUDA in 16 bits, a decode step's: `silu(gate) · up` from one kernel, with
    /// the bits of [`Self::forward_merged`] and `silu_mul`. `None` where it does not cover `x`.
    pub fn forward_silu_product(&self, x: &Tensor) -> Result<Option<Tensor>> {
        Ok(match self.silu_product_covers(x) {
            true => Some(tpinfer_kernels::gemv_gate_up_silu(x, self.linear.weight())?),
            false => None,
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
    linear: Linear,
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
        let weight = weights.take(&format!("{prefix}.weight"))?;
        let bias = bias.then(|| weights.take(&format!("{prefix}.bias"))).transpose()?;
        Ok(Self {
            linear: Linear::new(weight, None),
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
        apply_row_into(&self.linear, x, out)?;
        Ok(self.comm.all_reduce_sum_in_place(out)?)
    }

    /// [`Self::forward`] of `silu(gate) · up` for a gated MLP's fused gate/up output
    /// `[.., 2n]` (gate, then up), through one `silu_mul` pass. Takes `gate_up` to free it
    /// before the product, as the activation model in the Llama crate counts.
    pub fn forward_silu_mul(&self, gate_up: Tensor) -> Result<Tensor> {
        let mut dims = gate_up.dims().to_vec();
        let cols = dims.pop().unwrap_or(0);
        let rows = dims.iter().product::<usize>();
        let hidden = tpinfer_kernels::silu_mul(&gate_up.reshape((rows, cols))?)?;
        drop(gate_up);
        dims.push(cols / 2);
        let partial = apply(&self.linear, &hidden.reshape(dims)?)?;
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
    /// GEMM covers `x`, rank 0 adds it in the epilogue, before the sum (still once).
    fn partial(&self, x: &Tensor) -> candle_core::Result<(Tensor, bool)> {
        let w = self.linear.weight();
        match &self.bias {
            Some(b) if tpinfer_kernels::fused_linear_covers(x, w) => Ok((
                match self.comm.rank() {
                    0 => tpinfer_kernels::linear_bias(x, w, b, false)?,
                    _ => apply(&self.linear, x)?,
                },
                true,
            )),
            _ => Ok((apply(&self.linear, x)?, false)),
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
