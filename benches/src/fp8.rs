//! `tpinfer-bench fp8`: a linear product with FP8 weights (`tpinfer_kernels::fp8_linear`:
//! W8A8 through cuBLASLt's FP8 GEMM, or the W8A16 GEMV for one row) against the same product
//! with the dequantized weight in the compute dtype (the fused bf16 linear, or the bf16 GEMV
//! for one row), in the same call: time per call, and each one's error against the same
//! quantization computed on the host in f32, several rows' activations quantized per token as
//! the kernel does (amax / 448, rounded to E4M3). The FP8 product is also written into rows
//! of a larger output (`fp8_linear_into`, a part of gathered rows) and checked the same way.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;

#[derive(Args)]
pub struct Fp8Args {
    /// Cases `ROWS:IN:OUT[:bias][:gelu]`.
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
    /// Cases `ROWS:N:OUT` of a gated MLP's down projection: the hidden `silu(gate) · up` of a
    /// random gate/up output `[ROWS, 2N]` quantized as it is made (`fp8_linear_of_silu_mul`,
    /// which fuses from 256 rows), against `silu_mul` and then the product.
    #[arg(long, value_delimiter = ',')]
    silu_mul_cases: Vec<String>,
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: crate::DtypeArg,
    /// Timed calls per case, after one warm-up.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
    /// The rows of each output checked against the host's reference (the first ones).
    #[arg(long, default_value_t = 32)]
    check_rows: usize,
    /// SMs held busy while each plain case is timed (`tpinfer_kernels::SmHold`), so that the
    /// products run on the rest: 40 of an H100's 132 ask of each SM an H200's bytes a second.
    #[arg(long, default_value_t = 0)]
    hold_sms: usize,
}

/// How long `--hold-sms` holds its SMs for each case: far more than a case's timed calls.
const HOLD_TIME: std::time::Duration = std::time::Duration::from_secs(2);

pub fn run(args: Fp8Args) -> Result<()> {
    let device = crate::gpu().context("the FP8 benchmark needs a CUDA build and a GPU")?;
    let dtype = crate::dtype_of(args.dtype);
    products(&args, &device, dtype)?;
    silu_mul_products(&args, &device, dtype)
}

/// The fused down projection of a gated MLP against its two steps: time per call, and the
/// largest difference between their outputs (the same hidden, rounded alike, so none).
fn silu_mul_products(args: &Fp8Args, device: &Device, dtype: DType) -> Result<()> {
    if args.silu_mul_cases.is_empty() {
        return Ok(());
    }
    println!("\n| rows × 2n → out | fused: ms | silu_mul, then the product: ms | speedup | max abs difference |");
    println!("|---|---:|---:|---:|---:|");
    for text in &args.silu_mul_cases {
        let ((rows, n, out), flags) = crate::linear::product_case(text)?;
        if !flags.is_empty() {
            bail!("{text}: a silu_mul case takes no flags");
        }
        let host = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0 / (n as f32).sqrt(), (out, n), &host)?.to_dtype(DType::BF16)?;
        let (values, scales) = tpinfer_weights::quantize_rows(&w)?;
        let (values, scales) = (values.to_device(device)?, scales.to_device(device)?);
        let gate_up = Tensor::randn(0f32, 2.0, (rows, 2 * n), &host)?
            .to_dtype(dtype)?
            .to_device(device)?;
        let fused = || -> Result<Tensor> { Ok(tpinfer_kernels::fp8_linear_of_silu_mul(&gate_up, &values, &scales)?) };
        let apart = || -> Result<Tensor> {
            let hidden = tpinfer_kernels::silu_mul(&gate_up)?;
            Ok(tpinfer_kernels::fp8_linear(&hidden, &values, &scales, None, false)?)
        };
        let (y_fused, ms_fused) = time_calls(device, args.repeats, &fused)?;
        let (y_apart, ms_apart) = time_calls(device, args.repeats, &apart)?;
        let diff = (y_fused.to_dtype(DType::F32)? - y_apart.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        println!(
            "| {rows} × {} → {out} | {ms_fused:.4} | {ms_apart:.4} | {:.2}× | {diff:.3e} |",
            2 * n,
            ms_apart / ms_fused
        );
    }
    Ok(())
}

/// `f`'s output and its time per call in ms: one warm-up, then `repeats` calls.
fn time_calls(device: &Device, repeats: usize, f: &dyn Fn() -> Result<Tensor>) -> Result<(Tensor, f64)> {
    let y = f()?;
    device.synchronize()?;
    let start = std::time::Instant::now();
    for _ in 0..repeats {
        f()?;
    }
    device.synchronize()?;
    Ok((y, start.elapsed().as_secs_f64() * 1e3 / repeats as f64))
}

/// The plain products (`--cases`), FP8 against the dequantized weight.
fn products(args: &Fp8Args, device: &Device, dtype: DType) -> Result<()> {
    if args.cases.is_empty() {
        return Ok(());
    }
    if args.hold_sms > 0 {
        println!("{} SMs held while each case is timed\n", args.hold_sms);
    }
    println!(
        "| rows × in → out | bias, GELU | path | FP8: ms | TFLOP/s or GB/s | {dtype:?}, dequantized: ms | speedup | FP8 error | FP8 into rows 3.., error | {dtype:?} error |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for text in &args.cases {
        let ((rows, k, out), flags) = crate::linear::product_case(text)?;
        let (mut bias, mut gelu) = (false, false);
        for flag in flags {
            match flag {
                "bias" => bias = true,
                "gelu" => gelu = true,
                other => bail!("unknown flag {other} in {text}"),
            }
        }
        let host = Device::Cpu;
        // Rows of magnitudes 2⁻⁴ to 2⁴ (tokens) and 2⁻² to 2² (weights), so that a scale
        // applied to the wrong row or column shows.
        let magnitudes = |n: usize, period: usize| -> Result<Tensor> {
            let m: Vec<f32> = (0..n)
                .map(|i| 2f32.powi((i % period) as i32 - (period / 2) as i32))
                .collect();
            Ok(Tensor::from_vec(m, (n, 1), &host)?)
        };
        let w = Tensor::randn(0f32, 1.0 / (k as f32).sqrt(), (out, k), &host)?
            .broadcast_mul(&magnitudes(out, 5)?)?
            .to_dtype(DType::BF16)?;
        let (values, scales) = tpinfer_weights::quantize_rows(&w)?;
        let x_host = Tensor::randn(0f32, 1.0, (rows, k), &host)?
            .broadcast_mul(&magnitudes(rows, 9)?)?
            .to_dtype(dtype)?;
        let b_host = Tensor::randn(0f32, 1.0, out, &host)?.to_dtype(dtype)?;
        let (x, values_dev, scales_dev) = (
            x_host.to_device(device)?,
            values.to_device(device)?,
            scales.to_device(device)?,
        );
        let b = bias.then(|| b_host.to_device(device)).transpose()?;
        let dense = tpinfer_kernels::expand_fp8(&values_dev, &scales_dev, dtype)?;
        let fp8 = || -> Result<Tensor> {
            Ok(tpinfer_kernels::fp8_linear(
                &x,
                &values_dev,
                &scales_dev,
                b.as_ref(),
                gelu,
            )?)
        };
        let baseline = || -> Result<Tensor> {
            let y = match (&b, rows) {
                (Some(b), _) if tpinfer_kernels::fused_linear_covers(&x, &dense) => {
                    return Ok(tpinfer_kernels::linear_bias(&x, &dense, b, gelu)?)
                }
                (_, 1) if tpinfer_kernels::gemv_on_cuda(&x, &dense) => tpinfer_kernels::gemv(&x, &dense)?,
                _ => x.matmul(&dense.t()?)?,
            };
            let y = match &b {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            };
            Ok(if gelu { y.gelu()? } else { y })
        };
        let hold = match args.hold_sms {
            0 => None,
            sms => {
                // Loading a module waits for the device to idle: load every kernel before the hold.
                fp8()?;
                baseline()?;
                device.synchronize()?;
                let held_at = std::time::Instant::now();
                Some((tpinfer_kernels::SmHold::start(device, sms, HOLD_TIME)?, held_at))
            }
        };
        let (y_fp8, ms_fp8) = time_calls(device, args.repeats, &fp8)?;
        let (y_base, ms_base) = time_calls(device, args.repeats, &baseline)?;
        if let Some((hold, held_at)) = hold {
            if !hold.holding()? {
                bail!(
                    "{text}: the SMs were held for {} s, and the case took {:.2} s to time; use fewer --repeats",
                    HOLD_TIME.as_secs(),
                    held_at.elapsed().as_secs_f64()
                );
            }
            hold.finish()?;
        }
        // The same product written into rows 3.. of a larger output, as a part of gathered
        // rows is: off cuBLASLt's assumed 256-byte alignment, with a row either side that it
        // must leave as it was.
        let first = 3;
        let into = Tensor::zeros((first + rows + 1, out), dtype, device)?;
        tpinfer_kernels::fp8_linear_into(&into, first, &x, &values_dev, &scales_dev, b.as_ref(), gelu)?;
        let untouched = Tensor::cat(&[into.narrow(0, 0, first)?, into.narrow(0, first + rows, 1)?], 0)?;
        if untouched.abs()?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? != 0.0 {
            bail!("{text}: fp8_linear_into wrote outside its rows");
        }
        let y_into = into.narrow(0, first, rows)?;

        let checked = rows.min(args.check_rows.max(1));
        let x32 = x_host.narrow(0, 0, checked)?.to_dtype(DType::F32)?;
        let w32 = values.to_dtype(DType::F32)?.broadcast_mul(&scales.unsqueeze(1)?)?;
        let epilogue = |y: Tensor| -> Result<Tensor> {
            let y = match bias {
                true => y.broadcast_add(&b_host.to_dtype(DType::F32)?)?,
                false => y,
            };
            Ok(if gelu { y.gelu()? } else { y })
        };
        // One row runs W8A16: its activations are not quantized.
        let x_ref = match rows {
            1 => x32.clone(),
            _ => quantize_tokens(&x32)?,
        };
        let quantized_ref = epilogue(x_ref.matmul(&w32.t()?)?)?;
        let dequantized_ref = epilogue(x32.matmul(&w32.t()?)?)?;
        let head = |y: &Tensor| -> Result<Tensor> { Ok(y.narrow(0, 0, checked)?.to_device(&host)?) };
        let err_fp8 = crate::relative_error(&head(&y_fp8)?, &quantized_ref)?;
        let err_into = crate::relative_error(&head(&y_into)?, &quantized_ref)?;
        let err_base = crate::relative_error(&head(&y_base)?, &dequantized_ref)?;
        let path = match tpinfer_kernels::fp8_path(device, dtype, out, k) {
            tpinfer_kernels::Fp8Path::Fp8Kernels if rows == 1 => "W8A16 GEMV",
            tpinfer_kernels::Fp8Path::Fp8Kernels => "W8A8 GEMM",
            tpinfer_kernels::Fp8Path::Expanded => "expanded",
        };
        // One row reads the weight once: its rate is bytes; more rows are counted in FLOPs.
        let rate = match rows {
            1 => format!("{:.0} GB/s", (out * k) as f64 / ms_fp8 / 1e6),
            _ => format!("{:.0} TFLOP/s", 2.0 * (rows * k * out) as f64 / ms_fp8 / 1e9),
        };
        println!(
            "| {rows} × {k} → {out} | {bias}, {gelu} | {path} | {ms_fp8:.4} | {rate} | {ms_base:.4} | {:.2}× | {err_fp8:.2e} | {err_into:.2e} | {err_base:.2e} |",
            ms_base / ms_fp8
        );
    }
    Ok(())
}

/// Each row of `x` (f32, host) quantized to E4M3 and back as the kernel does: scale = amax /
/// 448 (1 for an all-zero row), x / scale rounded to E4M3, times the scale.
fn quantize_tokens(x: &Tensor) -> Result<Tensor> {
    let amax = x.abs()?.max_keepdim(1)?;
    let scale = amax.broadcast_div(&Tensor::new(448f32, x.device())?)?;
    let scale = amax.eq(0f64)?.where_cond(&amax.ones_like()?, &scale)?;
    let q = x.broadcast_div(&scale)?.to_dtype(DType::F8E4M3)?.to_dtype(DType::F32)?;
    Ok(q.broadcast_mul(&scale)?)
}
