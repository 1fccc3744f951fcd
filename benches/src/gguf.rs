//! `gguf`: a Llama checkpoint written as a GGUF file in a llama.cpp quantization mix, for
//! benchmarking the quantized paths on random weights (no GGUF can be downloaded there).

use std::path::PathBuf;

use anyhow::Result;
use candle_core::quantized::GgmlDType;
use clap::{Args, ValueEnum};
use tpinfer_llama::LlamaCheckpoint;

#[derive(Args)]
pub(crate) struct GgufArgs {
    /// A Llama directory (config.json and safetensors).
    #[arg(long)]
    model: PathBuf,
    /// The GGUF file to write; a tokenizer.json beside it serves the engine.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, value_enum, default_value_t = Mix::Q4KM)]
    mix: Mix,
}

/// llama.cpp's quantization mixes.
#[derive(Clone, Copy, ValueEnum)]
enum Mix {
    /// Q4_K, with Q6_K for the attention's V, the FFN's down projection and the LM head.
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q8_0")]
    Q8_0,
}

pub(crate) fn run(args: GgufArgs) -> Result<()> {
    let checkpoint = LlamaCheckpoint::open(&args.model)?;
    let quant = |name: &str| match args.mix {
        Mix::Q8_0 => GgmlDType::Q8_0,
        Mix::Q4KM if ["attn_v", "ffn_down", "output."].iter().any(|p| name.contains(p)) => GgmlDType::Q6K,
        Mix::Q4KM => GgmlDType::Q4K,
    };
    let started = std::time::Instant::now();
    checkpoint.write_gguf(&args.out, &quant)?;
    let bytes = std::fs::metadata(&args.out)?.len();
    println!(
        "wrote {} ({:.2} GB) in {:.1} s",
        args.out.display(),
        bytes as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
