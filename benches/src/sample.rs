//! `tpinfer-bench sample`: the device sampler (`tpinfer_kernels::sample_rows`) on random
//! logits of a real vocabulary's size: its time per call for a batch of rows, and whether
//! each row picks the token the host's arithmetic (the CPU twin, whose draws the tests check
//! against the softmax) picks from the same logits, seed and draw.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use tpinfer_kernels::{sample_rows, RowSampling};

#[derive(Args)]
pub struct SampleArgs {
    /// Rows per call (a step's sequences), each a comma-separated list entry.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128")]
    rows: Vec<usize>,
    #[arg(long, default_value_t = 128_256)]
    vocab: usize,
    /// Draws compared with the host's per row and setting.
    #[arg(long, default_value_t = 8)]
    draws: u64,
    /// Timed calls per case, after one warm-up.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
}

/// A setting's name and its parameters (seed and draw filled in per row).
fn settings<'a>(recent: &'a [u32], generated: &'a [u32]) -> Vec<(&'static str, RowSampling<'a>)> {
    let t = |temperature| RowSampling {
        temperature,
        ..RowSampling::GREEDY
    };
    vec![
        ("greedy", t(0.0)),
        ("T 0.7", t(0.7)),
        (
            "T 0.7, top-k 50",
            RowSampling {
                top_k: Some(50),
                ..t(0.7)
            },
        ),
        (
            "T 0.7, top-p 0.9",
            RowSampling {
                top_p: Some(0.9),
                ..t(0.7)
            },
        ),
        (
            "T 0.7, top-k 50, top-p 0.95",
            RowSampling {
                top_k: Some(50),
                top_p: Some(0.95),
                ..t(0.7)
            },
        ),
        (
            "T 1, repetition penalty 1.1 over 64 tokens",
            RowSampling {
                repetition_penalty: 1.1,
                penalized: recent,
                ..t(1.0)
            },
        ),
        (
            "T 1, repetition 1.1 over 64 tokens, frequency 0.5 and presence 0.3 over 64 generated (16 distinct), 2 tokens biased",
            RowSampling {
                repetition_penalty: 1.1,
                penalized: recent,
                frequency_penalty: 0.5,
                presence_penalty: 0.3,
                generated,
                logit_bias: &[(0, -100.0), (2003, 4.0)],
                ..t(1.0)
            },
        ),
    ]
}

pub fn run(args: SampleArgs) -> Result<()> {
    let device = crate::gpu()?;
    let recent: Vec<u32> = (0..64u32).map(|i| i * 1999 % args.vocab as u32).collect();
    let generated: Vec<u32> = (0..64u32).map(|i| (i % 16) * 2003 % args.vocab as u32).collect();
    println!("| rows | sampling | ms per call | tokens equal to the host's |");
    println!("|---:|---|---:|---:|");
    for &n in &args.rows {
        // Logits spread as a model's: a few tokens stand out of a broad tail.
        let logits = (Tensor::randn(0f32, 1.0, (n, args.vocab), &device)? * 3.0)?;
        let host = logits.to_device(&Device::Cpu)?;
        let single = settings(&recent, &generated);
        // Each row its own setting, so that every threshold stage has rows that skip it.
        let mixed: Vec<RowSampling<'_>> = single[..5].iter().map(|&(_, s)| s).collect();
        let cases = single
            .iter()
            .map(|&(name, s)| (name, vec![s]))
            .chain([("rows in turn: each of the first five", mixed)]);
        for (name, pattern) in cases {
            let rows = |draw: u64| -> Vec<RowSampling<'_>> {
                (0..n as u64)
                    .map(|r| RowSampling {
                        seed: 1000 + r,
                        draw,
                        ..pattern[r as usize % pattern.len()]
                    })
                    .collect()
            };
            let (mut equal, mut total) = (0, 0);
            for draw in 0..args.draws {
                let got: Vec<u32> = sample_rows(&logits, &rows(draw))?.to_vec1()?;
                let want: Vec<u32> = sample_rows(&host, &rows(draw))?.to_vec1()?;
                equal += got.iter().zip(&want).filter(|(a, b)| a == b).count();
                total += n;
            }
            let params = rows(0);
            sample_rows(&logits, &params)?;
            device.synchronize()?;
            let start = std::time::Instant::now();
            for _ in 0..args.repeats {
                sample_rows(&logits, &params)?;
            }
            device.synchronize()?;
            let ms = start.elapsed().as_secs_f64() * 1e3 / args.repeats as f64;
            println!("| {n} | {name} | {ms:.3} | {equal} / {total} |");
            // A flip needs a Gumbel score tie within the f32 rounding of exp and log: rare.
            if equal * 100 < total * 99 {
                bail!("{name} at {n} rows: {equal} of {total} tokens equal to the host's");
            }
        }
    }
    Ok(())
}
