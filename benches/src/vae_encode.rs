//! `tpinfer-bench vae-encode`: the Wan VAE encoder on one device, as S2V runs it on its
//! reference image and motion frames: ms per encode of each video of a safetensors file, and
//! the latents for a reference (`scripts/reference/reference_vae_encoder.py`'s) to judge.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use tpinfer_wan_vae::memory::{DecodeDevice, EncodeMemory};
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
        "| video | pixels | dtype | ms per encode (median of {}) | tensors beside the weights, MiB: measured / planned (Δ) |",
        args.repeats
    );
    println!("|---|---|---|---:|---|");
    let mut latents: HashMap<String, Tensor> = HashMap::new();
    for name in names {
        let pixels = &inputs[name];
        let mut times = Vec::with_capacity(args.repeats);
        // The pool's live tensors at the encode's peak, beside the weights (GPUs only).
        tpinfer_runtime::reset_peak(&device);
        let before = tpinfer_runtime::measure(&device).map(|m| m.pool_used);
        let mut encoded = encoder.encode(pixels)?;
        device.synchronize()?;
        let measured = match (before, tpinfer_runtime::measure(&device)) {
            (Some(before), Some(after)) => Some(after.pool_used_peak.saturating_sub(before)),
            _ => None,
        };
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
        let (_, frames, height, width) = pixels.dims4()?;
        let planned =
            EncodeMemory::new(&config, DecodeDevice::new(dtype, args.cuda), frames, height, width).peak as u64;
        let memory = match measured {
            Some(m) => format!(
                "{:.1} / {:.1} ({:+.1}%)",
                tpinfer_plan::mib(m),
                tpinfer_plan::mib(planned),
                100.0 * (m as f64 / planned as f64 - 1.0)
            ),
            None => format!("– / {:.1}", tpinfer_plan::mib(planned)),
        };
        println!("| {name} | {:?} | {dtype:?} | {ms:.1} | {memory} |", pixels.dims());
        let stem = name.trim_end_matches("_pixels");
        latents.insert(format!("{stem}_latents"), encoded.to_device(&Device::Cpu)?);
    }
    if let Some(out) = &args.out {
        candle_core::safetensors::save(&latents, out).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}
