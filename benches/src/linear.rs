//! `tpinfer-bench linear`: a biased linear layer (optionally with GELU) as one cuBLASLt GEMM
//! with the bias and activation in its epilogue (`tpinfer_kernels::linear_bias`), against
//! candle's matmul followed by its broadcast add (and GELU): time per call, and each one's
//! error against the same computed in f32 from the same bf16 inputs.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Args;

#[derive(Args)]
pub struct LinearArgs {
    /// Cases `ROWS:IN:OUT[:gelu]`.
    #[arg(long, value_delimiter = ',', required = true)]
    cases: Vec<String>,
    /// Timed calls per case, after one warm-up.
    #[arg(long, default_value_t = 10)]
    repeats: usize,
}

pub fn run(args: LinearArgs) -> Result<()> {
    let device = crate::gpu().context("the linear benchmark needs a CUDA build and a GPU")?;
    println!("| rows × in → out | GELU | candle: ms | TFLOP/s | fused: ms | TFLOP/s | candle error | fused error |");
    println!("|---|---|---|---|---|---|---|---|");
    for text in &args.cases {
        let ((rows, k, out), flags) = product_case(text)?;
        let gelu = match flags[..] {
            [] => false,
            ["gelu"] => true,
            _ => bail!("unknown flags {flags:?} in {text}"),
        };
        let randn = |shape: &[usize], std: f32| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, std, shape, &device)?.to_dtype(DType::BF16)?)
        };
        let x = randn(&[rows, k], 1.0)?;
        let w = randn(&[out, k], 1.0 / (k as f32).sqrt())?;
        let b = randn(&[out], 1.0)?;
        let unfused = |x: &Tensor| -> Result<Tensor> {
            let y = x.matmul(&w.t()?)?.broadcast_add(&b.to_dtype(x.dtype())?)?;
            Ok(if gelu { y.gelu()? } else { y })
        };
        let fused = |x: &Tensor| -> Result<Tensor> { Ok(tpinfer_kernels::linear_bias(x, &w, &b, gelu)?) };
        let time = |f: &dyn Fn(&Tensor) -> Result<Tensor>| -> Result<(Tensor, f64)> {
            let y = f(&x)?;
            device.synchronize()?;
            let start = std::time::Instant::now();
            for _ in 0..args.repeats {
                f(&x)?;
            }
            device.synchronize()?;
            Ok((y, start.elapsed().as_secs_f64() * 1e3 / args.repeats as f64))
        };
        let (y_candle, ms_candle) = time(&unfused)?;
        let (y_fused, ms_fused) = time(&fused)?;
        let reference = {
            let x32 = x.to_dtype(DType::F32)?;
            let y = x32
                .matmul(&w.to_dtype(DType::F32)?.t()?)?
                .broadcast_add(&b.to_dtype(DType::F32)?)?;
            if gelu {
                y.gelu()?
            } else {
                y
            }
        };
        let flops = 2.0 * (rows * k * out) as f64;
        println!(
            "| {rows} × {k} → {out} | {gelu} | {ms_candle:.3} | {:.0} | {ms_fused:.3} | {:.0} | {:.2e} | {:.2e} |",
            flops / ms_candle / 1e9,
            flops / ms_fused / 1e9,
            crate::relative_error(&y_candle, &reference)?,
            crate::relative_error(&y_fused, &reference)?
        );
    }
    Ok(())
}

/// A product's rows, input width and output width.
pub(crate) type ProductSizes = (usize, usize, usize);

/// A case `ROWS:IN:OUT[:FLAG...]` of a product: its sizes and its flags.
pub(crate) fn product_case(text: &str) -> Result<(ProductSizes, Vec<&str>)> {
    let parts: Vec<&str> = text.split(':').collect();
    let n = |i: usize| -> Result<usize> {
        parts
            .get(i)
            .context("too few fields")?
            .parse()
            .with_context(|| format!("case {text}"))
    };
    Ok(((n(0)?, n(1)?, n(2)?), parts.iter().skip(3).copied().collect()))
}
