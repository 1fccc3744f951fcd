//! `tpinfer-bench vae-encode`: the Wan VAE encoder on one device, as S2V runs it on its
//! reference image and motion frames: ms per encode of each video of a safetensors file, and
//! the latents for a reference (`scripts/reference/reference_vae_encoder.py`'s) to judge.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use tpinfer_wan_vae::{WanVaeConfig, WanVaeEncoder};
use tpinfer_weights::SafetensorsStore;

#[derive(Args)]
pub struct VaeEncodeArgs {
    /// A Wan VAE directory (diffusers' `AutoencoderKLWan`).
    #[arg(long)]
    model: PathBuf,
    /// safetensors whose `{name}_pixels` tensors, `[3, frames, height, width]` in [−1, 1], are
    /// encoded.
    #[arg(long)]
    pixels: PathBuf,
    #[arg(long)]
    cuda: bool,
    #[arg(long, value_enum)]
    dtype: Option<crate::DtypeArg>,
    /// Timed encodes per video, after one warm-up.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Writes `{name}_latents` (f32) for each video to this safetensors file.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn vae_encode(args: VaeEncodeArgs) -> Result<()> {
    let device = match args.cuda {
        true => crate::gpu()?,
        false => Device::Cpu,
    };
    let dtype = crate::stage_dtype(args.dtype, args.cuda);
    let config = WanVaeConfig::from_dir(&args.model)?;
    let store = SafetensorsStore::open(&args.model)?;
    let encoder = WanVaeEncoder::load(&config, &store, dtype, &device)?;
    let inputs = candle_core::safetensors::load(&args.pixels, &Device::Cpu)
        .with_context(|| format!("reading {}", args.pixels.display()))?;
    let mut names: Vec<&String> = inputs.keys().filter(|k| k.ends_with("_pixels")).collect();
    names.sort();
    anyhow::ensure!(!names.is_empty(), "{} has no `*_pixels` tensor", args.pixels.display());
    println!(
        "| video | pixels | dtype | ms per encode (median of {}) |",
        args.repeats
    );
    println!("|---|---|---|---:|");
    let mut latents: HashMap<String, Tensor> = HashMap::new();
    for name in names {
        let pixels = &inputs[name];
        let mut times = Vec::with_capacity(args.repeats);
        let mut encoded = encoder.encode(pixels)?;
        device.synchronize()?;
        for _ in 0..args.repeats {
            let start = Instant::now();
            encoded = encoder.encode(pixels)?;
            device.synchronize()?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let ms = match times.is_empty() {
            true => f64::NAN,
            false => crate::median(times),
        };
        println!("| {name} | {:?} | {dtype:?} | {ms:.1} |", pixels.dims());
        let stem = name.trim_end_matches("_pixels");
        latents.insert(format!("{stem}_latents"), encoded.to_device(&Device::Cpu)?);
    }
    if let Some(out) = &args.out {
        candle_core::safetensors::save(&latents, out).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}
