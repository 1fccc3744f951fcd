//! `tpinfer-bench`: prefill and decode speed of a model at several TP widths, through the
//! engine as a user runs it. Prints a Markdown table for `benches/RESULTS.md`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use tpinfer_engine::{Engine, GenerateRequest, Prompt, StreamEvent};

#[derive(Parser)]
#[command(about = "Prefill and decode speed against TP width")]
struct Args {
    /// A Hugging Face model directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// TP widths to measure, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    tp: Vec<usize>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Measured runs per width, after one warm-up run.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

struct Sample {
    prefill_ms: f64,
    decode_tok_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!("| TP | prompt tokens | new tokens | prefill ms (median) | decode tok/s (median) | decode tok/s (min–max) |");
    println!("|---|---|---|---|---|---|");
    for &tp in &args.tp {
        let engine = Engine::builder(&args.model)
            .tp(tp)
            .build()
            .with_context(|| format!("loading at TP {tp}"))?;
        let vocab = engine.config().vocab_size as u32;
        // A fixed pseudo-random prompt, so every width sees the same tokens.
        let prompt: Vec<u32> = (0..args.prompt_tokens as u32)
            .map(|i| (i * 7919 + 13) % vocab.min(30_000))
            .collect();
        let mut samples = Vec::new();
        for run in 0..=args.repeats {
            let request = GenerateRequest::new(Prompt::Tokens(prompt.clone()), args.new_tokens);
            let mut stats = None;
            for event in engine.generate(request)? {
                if let StreamEvent::Done(s) = event? {
                    stats = Some(s);
                }
            }
            let stats = stats.context("generation ended without stats")?;
            if run > 0 {
                samples.push(Sample {
                    prefill_ms: stats.prefill.as_secs_f64() * 1e3,
                    decode_tok_s: stats.decode_tokens_per_second(),
                });
            }
        }
        let decode: Vec<f64> = samples.iter().map(|s| s.decode_tok_s).collect();
        let (lo, hi) = decode
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        println!(
            "| {tp} | {} | {} | {:.1} | {:.1} | {lo:.1}–{hi:.1} |",
            args.prompt_tokens,
            args.new_tokens,
            median(samples.iter().map(|s| s.prefill_ms).collect()),
            median(decode),
        );
    }
    Ok(())
}
