//! `tpinfer-bench attention`: the fused flash-attention kernel against an f32 reference
//! computed from the same bf16 inputs (one head at a time, scores materialized), for numerics,
//! and its time per call in ms and TFLOP/s.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Args;

#[derive(Args)]
pub struct AttentionArgs {
    /// Cases `Q_LEN:KV_LEN:HEADS:KV_HEADS:HEAD_DIM[:causal]`.
    #[arg(long, value_delimiter = ',', required = true)]
    cases: Vec<String>,
    /// Timed calls per case, after one warm-up.
    #[arg(long, default_value_t = 10)]
    repeats: usize,
    /// Skip the f32 reference (it dominates the run at video lengths).
    #[arg(long)]
    no_reference: bool,
}

struct Case {
    q_len: usize,
    kv_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
}

fn parse(case: &str) -> Result<Case> {
    let parts: Vec<&str> = case.split(':').collect();
    let n = |i: usize| -> Result<usize> { parts.get(i).context("too few fields")?.parse().context("not a number") };
    let causal = match parts.get(5) {
        None => false,
        Some(&"causal") => true,
        Some(other) => bail!("unknown flag {other} in {case}"),
    };
    Ok(Case {
        q_len: n(0)?,
        kv_len: n(1)?,
        heads: n(2)?,
        kv_heads: n(3)?,
        head_dim: n(4)?,
        causal,
    })
}

pub fn run(args: AttentionArgs) -> Result<()> {
    let device = crate::gpu().context("the attention benchmark needs a CUDA build and a GPU")?;
    let attend = tpinfer_kernels::flash_attention;
    println!("| q × kv tokens | heads (KV) | d | causal | ms | TFLOP/s | ‖out−ref‖/‖ref‖ | bf16(ref) error |");
    println!("|---|---|---|---|---|---|---|---|");
    for text in &args.cases {
        let c = parse(text).with_context(|| format!("case {text}"))?;
        let randn = |len: usize, heads: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1.0, (len, heads, c.head_dim), &device)?.to_dtype(DType::BF16)?)
        };
        let (q, k, v) = (
            randn(c.q_len, c.heads)?,
            randn(c.kv_len, c.kv_heads)?,
            randn(c.kv_len, c.kv_heads)?,
        );
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let out = attend(&q, &k, &v, scale, c.causal)?;
        device.synchronize()?;
        let start = std::time::Instant::now();
        for _ in 0..args.repeats {
            attend(&q, &k, &v, scale, c.causal)?;
        }
        device.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3 / args.repeats as f64;
        let mut flops = 4.0 * (c.q_len * c.kv_len * c.heads * c.head_dim) as f64;
        if c.causal {
            flops *= 1.0 - c.q_len as f64 / (2.0 * c.kv_len as f64);
        }
        let (err, rounding) = match args.no_reference {
            true => ("—".to_string(), "—".to_string()),
            false => {
                let reference = reference(&q, &k, &v, scale, c.causal)?;
                let rounded = reference.to_dtype(DType::BF16)?;
                let rel = |x: &Tensor| crate::relative_error(x, &reference);
                (format!("{:.2e}", rel(&out)?), format!("{:.2e}", rel(&rounded)?))
            }
        };
        println!(
            "| {} × {} | {} ({}) | {} | {} | {ms:.3} | {:.0} | {err} | {rounding} |",
            c.q_len,
            c.kv_len,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.causal,
            flops / ms / 1e9
        );
    }
    Ok(())
}

/// Unfused attention in f32, one head at a time with its whole score matrix.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let (s, heads, _) = q.dims3()?;
    let (t, kv_heads, _) = k.dims3()?;
    let mask = match causal {
        true => Some(tpinfer_layers::causal_mask(s, t, q.device())?),
        false => None,
    };
    let head = |x: &Tensor, h: usize| -> Result<Tensor> { Ok(x.narrow(1, h, 1)?.squeeze(1)?.to_dtype(DType::F32)?) };
    let mut out = Vec::with_capacity(heads);
    for h in 0..heads {
        let kv = h / (heads / kv_heads);
        let mut scores = ((head(q, h)? * scale)?.matmul(&head(k, kv)?.t()?))?;
        if let Some(mask) = &mask {
            scores = (scores + mask)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        out.push(probs.matmul(&head(v, kv)?)?);
    }
    Ok(Tensor::stack(&out, 1)?)
}
