//! `tpinfer-bench vae`: the Wan VAE decoder on the rank group at each TP width: seconds per
//! decode, device memory against the plan, and the frames as safetensors for the reference
//! (`scripts/reference/reference_vae.py compare`) to judge.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::Args;
use tpinfer_engine::{EngineBuilder, VaeEngine};

#[derive(Args)]
pub struct VaeArgs {
    /// A Wan VAE directory (diffusers' `AutoencoderKLWan`), or a pipeline directory with `vae/`.
    #[arg(long)]
    model: PathBuf,
    /// safetensors with `latents` [z, latent frames, h, w], as `reference_vae.py latents` writes.
    #[arg(long)]
    latents: PathBuf,
    #[arg(long)]
    cuda: bool,
    #[arg(long, value_enum)]
    dtype: Option<crate::DtypeArg>,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    tp: Vec<usize>,
    /// Timed decodes per width, after one warm-up.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Before the decodes, takes the device memory past the plan plus this many MiB (rank 0's
    /// device, the process alone on it), as a card of that size would be: the decode must run
    /// in what the plan counts, its pool unable to keep more. The peak is then given without
    /// what was taken. Negative: below the plan.
    #[arg(long, allow_negative_numbers = true)]
    limit_to_plan: Option<f64>,
    /// Writes `{out}_tp{N}.safetensors` (tensor `frames` [T, 3, H, W], f32) for each width.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn vae(args: VaeArgs) -> Result<()> {
    let latents = candle_core::safetensors::load(&args.latents, &Device::Cpu)
        .with_context(|| format!("reading {}", args.latents.display()))?
        .remove("latents")
        .with_context(|| format!("{} has no tensor `latents`", args.latents.display()))?
        .to_dtype(DType::F32)?;
    let [_, frames, h, w] =
        <[usize; 4]>::try_from(latents.dims()).map_err(|_| anyhow::anyhow!("latents are not 4-D"))?;
    let shape = VaeEngine::video_shape(&args.model, frames, h, w)?;
    let dtype = crate::stage_dtype(args.dtype, args.cuda);
    println!(
        "| TP | video | dtype | s per decode (median of {}) | peak MiB measured / planned, fullest rank |",
        args.repeats
    );
    println!("|---:|---|---|---:|---|");
    for &tp in &args.tp {
        let builder = EngineBuilder::new(&args.model)
            .tp(tp)
            .device(crate::device_kind(args.cuda))
            .dtype(dtype);
        let engine = VaeEngine::start(builder, shape)?;
        let taken = crate::take_past_plan(&engine.device_memory(), engine.plan(), args.limit_to_plan)?;
        let mut times = Vec::with_capacity(args.repeats + 1);
        let mut decoded = None;
        for _ in 0..=args.repeats {
            let start = Instant::now();
            decoded = Some(engine.decode(&latents, |_, _| {})?);
            times.push(start.elapsed().as_secs_f64());
        }
        // The first decode warms up, unless it is the only one.
        if times.len() > 1 {
            times.remove(0);
        }
        times.sort_by(f64::total_cmp);
        let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        let device_memory = engine.device_memory();
        let memory = crate::memory_cell(&device_memory, engine.plan());
        println!(
            "| {tp} | {} × {}x{} | {dtype:?} | {median:.3} | {memory} |",
            shape.frames, shape.width, shape.height
        );
        crate::print_memory_parts(&device_memory, engine.plan());
        crate::print_limited(taken.as_ref(), &device_memory);
        if let (Some(out), Some(frames)) = (&args.out, decoded) {
            let path = PathBuf::from(format!("{}_tp{tp}.safetensors", out.display()));
            frames
                .save_safetensors("frames", &path)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}
