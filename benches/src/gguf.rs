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
    /// Q4_K, with Q6_K for the LM head and for the attention's V and the FFN's down
    /// projection in the layers llama.cpp gives more bits ([`more_bits`]).
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q8_0")]
    Q8_0,
}

impl Mix {
    /// The block type of GGUF tensor `name` in a model of `layers` layers.
    fn block_type(self, name: &str, layers: usize) -> GgmlDType {
        match self {
            Mix::Q8_0 => GgmlDType::Q8_0,
            Mix::Q4KM if name == "output.weight" => GgmlDType::Q6K,
            Mix::Q4KM => {
                let widened = [".attn_v.", ".ffn_down."].iter().any(|p| name.contains(p));
                match layer_of(name) {
                    Some(layer) if widened && more_bits(layer, layers) => GgmlDType::Q6K,
                    _ => GgmlDType::Q4K,
                }
            }
        }
    }
}

/// The layer `i` of a tensor named `blk.{i}.…`.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The layers whose V and down projections a llama.cpp Q4_K_M file keeps in Q6_K: the first
/// and last eighth, and between them every third layer, starting two past the first eighth
/// (16 of Llama-3-8B's 32; its published Q4_K_M files weigh 4.92 GB).
fn more_bits(layer: usize, layers: usize) -> bool {
    let eighth = layers / 8;
    layer < eighth || layer >= 7 * layers / 8 || (layer - eighth) % 3 == 2
}

pub(crate) fn run(args: GgufArgs) -> Result<()> {
    let checkpoint = LlamaCheckpoint::open(&args.model)?;
    let layers = checkpoint.config.num_hidden_layers;
    let quant = |name: &str| args.mix.block_type(name, layers);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3-8B's Q4_K_M: Q6_K V and down in layers 0–3, 6, 9, …, 24 and 28–31, the LM
    /// head in Q6_K, every other matrix (the output projection `attn_output` included) Q4_K.
    #[test]
    fn q4_k_m_widens_the_v_and_down_of_llama_cpps_layers_and_the_lm_head() {
        let widened: Vec<usize> = (0..32).filter(|&i| more_bits(i, 32)).collect();
        assert_eq!(widened, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
        let mix = Mix::Q4KM;
        assert_eq!(mix.block_type("output.weight", 32), GgmlDType::Q6K);
        assert_eq!(mix.block_type("token_embd.weight", 32), GgmlDType::Q4K);
        assert_eq!(mix.block_type("blk.6.attn_v.weight", 32), GgmlDType::Q6K);
        assert_eq!(mix.block_type("blk.6.ffn_down.weight", 32), GgmlDType::Q6K);
        assert_eq!(mix.block_type("blk.7.attn_v.weight", 32), GgmlDType::Q4K);
        assert_eq!(mix.block_type("blk.7.ffn_down.weight", 32), GgmlDType::Q4K);
        for name in ["attn_output", "attn_q", "attn_k", "ffn_gate", "ffn_up"] {
            assert_eq!(
                mix.block_type(&format!("blk.0.{name}.weight"), 32),
                GgmlDType::Q4K,
                "{name}"
            );
        }
        assert_eq!(Mix::Q8_0.block_type("blk.0.attn_v.weight", 32), GgmlDType::Q8_0);
    }
}
