//! `tpinfer plan`: each rank's device memory for a placement, against a per-GPU budget.

use std::process::ExitCode;

use anyhow::{bail, Result};
use tpinfer_engine::DType;
use tpinfer_plan::{
    fit_table, kv_sequences_that_fit, mib, over_budget_message, searched_widths, with_kv_sequences, DeviceProfile,
    Placement, Plan, ShardedModel,
};

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A model directory (Llama: config.json + safetensors, or a GGUF file; Wan: a diffusers
    /// pipeline directory, or its transformer/, text_encoder/ or vae/), or a preset:
    /// llama-3-8b, llama-3-70b, llama-3.2-1b, llama-3.2-3b, qwen2.5-7b, qwen2.5-72b, qwen3-8b,
    /// mistral-7b, wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-s2v-14b, umt5-xxl, wan2.1-vae; a Wan
    /// DiT preset with `-pipeline` appended (wan2.1-t2v-14b-pipeline) plans the whole pipeline:
    /// umT5-XXL, the DiT, Wan2.1's VAE.
    #[arg(long)]
    pub model: String,
    /// Tensor-parallel width (vLLM's --tensor-parallel-size). Without it: how every width
    /// fits, and the smallest that does.
    #[arg(long, alias = "tensor-parallel-size")]
    tp: Option<usize>,
    /// Memory per GPU, e.g. 24GiB.
    #[arg(long, value_parser = tpinfer_plan::parse_bytes)]
    gpu_mem: u64,
    /// Compute dtype (default: the checkpoint's, else bf16).
    #[arg(long, value_enum)]
    dtype: Option<crate::ranks::DtypeArg>,
    /// LLM: the longest sequence (default: the model's, at most 8192; vLLM's --max-model-len).
    #[arg(long, alias = "max-model-len")]
    max_context: Option<usize>,
    /// LLM: sequences served at once (`tpinfer serve --max-seqs`), sharing a paged KV cache
    /// of this many full contexts, or of as many as the budget holds where that is fewer, as
    /// `tpinfer serve` sizes it (default 1: one sequence with a cache of its own).
    #[arg(long = "max-seqs", visible_alias = "batch")]
    batch: Option<usize>,
    /// DiT: frames, 4k + 1 (default 81).
    #[arg(long)]
    frames: Option<usize>,
    /// DiT: WIDTHxHEIGHT in pixels (default 832x480).
    #[arg(long, value_parser = parse_size)]
    size: Option<(usize, usize)>,
    /// DiT: plan without classifier-free guidance (no negative prompt, one pass per step).
    #[arg(long)]
    no_cfg: bool,
    /// Plan for CPU ranks (no CUDA context or library workspace).
    #[arg(long)]
    cpu: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    weights: crate::ranks::WeightArgs,
    /// DiT: the precision of the self-attention products (`fp8`: `tpinfer generate
    /// --attention fp8`'s E4M3 copies planned beside them).
    #[arg(long, value_enum, default_value_t = crate::video::AttentionArg::Dtype)]
    attention: crate::video::AttentionArg,
}

pub(crate) fn parse_size(text: &str) -> Result<(usize, usize), String> {
    let (w, h) = text
        .split_once(['x', 'X', '*'])
        .ok_or_else(|| format!("`{text}`: expected WIDTHxHEIGHT, e.g. 832x480"))?;
    let parse = |v: &str| v.trim().parse::<usize>().map_err(|e| format!("`{text}`: {e}"));
    Ok((parse(w)?, parse(h)?))
}

/// Prints the plan; exits 2 when the placement does not fit.
pub fn plan(args: PlanArgs) -> Result<ExitCode> {
    let dir = std::path::Path::new(&args.model);
    let preset_pipeline = !dir.exists() && args.model.ends_with(crate::plan_pipeline::PIPELINE_SUFFIX);
    if tpinfer_engine::WanPipelineDir::detect(dir) || tpinfer_engine::S2vPipelineDir::detect(dir) || preset_pipeline {
        return pipeline(&args);
    }
    let (_, model) = match args.attention.precision() {
        tpinfer_engine::SelfAttention::ComputeDtype => {
            tpinfer_engine::registry::open_as(&args.model, args.weights.format())?
        }
        precision => match tpinfer_engine::registry::open_dit_as(&args.model, args.weights.format(), precision) {
            Some(dit) => (tpinfer_engine::registry::Task::Video, dit?),
            None => bail!("--attention is for video DiT models; {} is not one", args.model),
        },
    };
    let model = &*model;
    // As the engine does: f32 on CPU ranks, the checkpoint's dtype on GPUs.
    let dtype = match (args.dtype, args.cpu) {
        (Some(dtype), _) => dtype.dtype(),
        (None, true) => DType::F32,
        (None, false) => model.default_dtype(),
    };
    let device = match args.cpu {
        true => DeviceProfile::cpu(),
        false => DeviceProfile::cuda(),
    };
    if args.no_cfg && matches!(model.default_placement(), Placement::Llm { .. }) {
        bail!("--no-cfg is for video DiT models");
    }
    let placement = match (model.default_placement(), args.max_context, args.frames, args.size) {
        (Placement::Llm { max_context, batch, .. }, context, None, None) => {
            Placement::llm(context.unwrap_or(max_context), args.batch.unwrap_or(batch))
        }
        (Placement::Dit { .. }, ..) if args.batch.is_some() => {
            bail!("--max-seqs is for LLMs; a DiT runs one video, its CFG passes in turn")
        }
        (
            Placement::Dit {
                frames, width, height, ..
            },
            None,
            f,
            size,
        ) => {
            let (width, height) = size.unwrap_or((width, height));
            Placement::Dit {
                frames: f.unwrap_or(frames),
                width,
                height,
                cfg: !args.no_cfg,
            }
        }
        (Placement::Llm { .. }, ..) => bail!("--frames and --size are for video DiT models; give an LLM --max-context"),
        (Placement::Dit { .. }, ..) => bail!("--max-context is for LLMs; give a video DiT --frames and --size"),
    };
    if !args.json {
        let dtype = format!("{dtype:?}").to_lowercase();
        match args.weights.format() {
            tpinfer_engine::WeightFormat::Fp8 => println!(
                "Linear weights in FP8 E4M3 with a scale per output row; the embedding and LM head in {dtype}.\n"
            ),
            tpinfer_engine::WeightFormat::Fp8WithLmHead => println!(
                "Linear weights and the LM head in FP8 E4M3 with a scale per output row; the embedding in {dtype}.\n"
            ),
            tpinfer_engine::WeightFormat::Dequantized => println!("Quantized weights expanded to {dtype} at load.\n"),
            tpinfer_engine::WeightFormat::AsStored => {}
        }
        if args.attention.precision() == tpinfer_engine::SelfAttention::Fp8 {
            println!("Self-attention on E4M3 operands (Hopper and Ada GPUs in bf16), its copies planned.\n");
        }
    }
    match args.tp {
        Some(0) => bail!("--tp must be at least 1"),
        Some(tp) => one_width(model, tp, dtype, placement, device, args.gpu_mem, args.json),
        None => all_widths(model, dtype, placement, device, args.gpu_mem, args.json),
    }
}

/// A pipeline's plan: the video placement from --frames, --size and --no-cfg.
fn pipeline(args: &PlanArgs) -> Result<ExitCode> {
    if args.max_context.is_some() || args.batch.is_some() {
        bail!("--max-context and --max-seqs are for LLMs; a pipeline is placed with --frames and --size");
    }
    let models = crate::plan_pipeline::Models::open(&args.model, args.weights.format(), args.attention.precision())?;
    let (width, height) = args.size.unwrap_or((832, 480));
    // Text-to-video's 81 frames; speech-to-video's clips of 80.
    let video = Placement::Dit {
        frames: args.frames.unwrap_or(if models.is_s2v() { 80 } else { 81 }),
        width,
        height,
        cfg: !args.no_cfg,
    };
    let dtype = match (args.dtype, args.cpu) {
        (Some(dtype), _) => dtype.dtype(),
        (None, true) => DType::F32,
        (None, false) => DType::BF16,
    };
    let device = match args.cpu {
        true => DeviceProfile::cpu(),
        false => DeviceProfile::cuda(),
    };
    crate::plan_pipeline::plan(models, args.tp, dtype, video, device, args.gpu_mem, args.json)
}

fn one_width(
    model: &dyn ShardedModel,
    tp: usize,
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
    budget: u64,
    json: bool,
) -> Result<ExitCode> {
    let kv_sequences = kv_sequences_that_fit(model, tp, dtype, placement, device, budget);
    let placement = with_kv_sequences(placement, kv_sequences);
    let plan = Plan::new(model, tp, dtype, placement, device)?;
    let peak = plan.peak().total();
    let fits = peak <= budget;
    if json {
        let report = serde_json::json!({
            "plan": plan,
            "kv_sequences_that_fit": kv_sequences,
            "budget": budget,
            "fits": fits,
            "peak_rank": plan.peak().rank,
            "peak": peak,
            "headroom": budget as i128 - peak as i128,
            "rank_totals": plan.ranks.iter().map(|r| r.total()).collect::<Vec<_>>(),
            "fsdp_total": plan.fsdp.total(),
            "fsdp_fits": plan.fsdp.total() <= budget,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_plan(&plan, budget);
        if let (
            Placement::Llm {
                max_context,
                batch,
                kv_sequences: pool,
            },
            Some(fit),
        ) = (placement, kv_sequences)
        {
            let held = pool.unwrap_or(batch);
            println!(
                "KV cache: the budget holds {fit} sequences of {max_context} positions at full length; the paged \
                 cache is sized for {held} of the {batch} served at once{}",
                match held < batch {
                    true => " (shorter ones share it; when its blocks run out, the newest is preempted and recomputed)",
                    false => "",
                }
            );
        }
    }
    if !fits {
        eprintln!("does not fit: {}", over_budget_message(model, &plan, dtype, budget));
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}

fn describe(placement: Placement, tokens: usize) -> String {
    match placement {
        Placement::Llm {
            max_context, batch: 1, ..
        } => {
            format!("max context {max_context} (prompts in chunks of {tokens})")
        }
        Placement::Llm {
            max_context,
            batch,
            kv_sequences: Some(held),
        } => {
            format!(
                "batch {batch} × max context {max_context}, a KV cache of {held} full contexts (prompts in chunks of \
                 {tokens})"
            )
        }
        Placement::Llm { max_context, batch, .. } => {
            format!("batch {batch} × max context {max_context} (prompts in chunks of {tokens})")
        }
        Placement::Dit {
            frames,
            width,
            height,
            cfg,
        } => {
            let guidance = if cfg { "" } else { ", without CFG" };
            format!("{frames} frames at {width}x{height} ({tokens} video tokens{guidance})")
        }
    }
}

fn print_plan(plan: &Plan, budget: u64) {
    let cache = match plan.placement {
        Placement::Llm { .. } => "KV cache",
        Placement::Dit { .. } => "latents",
    };
    println!(
        "{}, {}, TP {}, {}; budget {:.0} MiB {} ({} profile)\n",
        plan.model,
        plan.dtype,
        plan.tp,
        describe(plan.placement, plan.tokens_per_forward),
        mib(budget),
        if plan.device.is_cuda() {
            "per GPU"
        } else {
            "per CPU rank"
        },
        plan.device.name
    );
    println!(
        "| rank | weights | buffers | {cache} | activations | allocator slack | libraries | NCCL | CUDA context | total | headroom |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &plan.ranks {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.rank,
            mib(r.weights),
            mib(r.buffers),
            mib(r.cache),
            mib(r.activations),
            mib(r.allocator_slack),
            mib(r.libraries),
            mib(r.comm),
            mib(r.context),
            mib(r.total()),
            mib(budget) - mib(r.total()),
        );
    }
    println!("\n(MiB per rank)\n");
    let (f, g) = (&plan.fsdp, &plan.fsdp.gpu);
    println!(
        "FSDP on {} GPU{}, for comparison (MiB per GPU): shard {:.1} + unshard buffer {:.1} ({}) + buffers {:.1} + \
         {cache} {:.1} + activations {:.1} + allocator slack {:.1} + libraries {:.1} + NCCL {:.1} + context {:.1} = \
         {:.1}: {}",
        f.world,
        if f.world == 1 { "" } else { "s" },
        mib(g.weights),
        mib(f.unshard_buffer),
        f.largest_unit,
        mib(g.buffers),
        mib(g.cache),
        mib(g.activations),
        mib(g.allocator_slack),
        mib(g.libraries),
        mib(g.comm),
        mib(g.context),
        mib(f.total()),
        verdict(f.total(), budget),
    );
    let peak = plan.peak();
    println!(
        "TP {}: the fullest rank (rank {}) needs {:.1} MiB: {}",
        plan.tp,
        peak.rank,
        mib(peak.total()),
        verdict(peak.total(), budget)
    );
}

fn verdict(needed: u64, budget: u64) -> String {
    match needed <= budget {
        true => format!("fits, {:.1} MiB headroom", mib(budget - needed)),
        false => format!("over by {:.1} MiB", mib(needed - budget)),
    }
}

fn all_widths(
    model: &dyn ShardedModel,
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
    budget: u64,
    json: bool,
) -> Result<ExitCode> {
    // Every width the model shards to: any width, not only powers of two (up to
    // WIDEST_SEARCHED).
    let table = fit_table(model, dtype, placement, device, budget, searched_widths(model, 1));
    if table.is_empty() {
        // Report why width 1 cannot even be planned.
        Plan::new(model, 1, dtype, placement, device)?;
    }
    let smallest = table.iter().find(|w| w.fits).map(|w| w.tp);
    if json {
        let report = serde_json::json!({
            "model": model.name(),
            "dtype": format!("{dtype:?}").to_lowercase(),
            "placement": placement,
            "budget": budget,
            "widths": table,
            "smallest_fitting_tp": smallest,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let limit = match placement {
            Placement::Llm { .. } => "longest context that fits",
            Placement::Dit { .. } => "most frames that fit",
        };
        println!(
            "{}, {}, {}; budget {:.0} MiB per GPU\n",
            model.name(),
            format!("{dtype:?}").to_lowercase(),
            describe(placement, 0).split(" (").next().unwrap_or_default(),
            mib(budget)
        );
        // Serving several sequences, also how many full contexts the budget's KV cache holds.
        let pooled = matches!(placement, Placement::Llm { batch, .. } if batch > 1);
        let pool = match pooled {
            true => " full contexts the budget's KV cache holds |",
            false => "",
        };
        println!("| TP | fullest rank, MiB | fits | {limit} |{pool}");
        println!("|---:|---:|:---:|---:|{}", if pooled { "---:|" } else { "" });
        // Past the smallest fitting width, show a few more: wider only ever fits better.
        let shown = smallest.map_or(table.len(), |tp| table.iter().position(|w| w.tp == tp).unwrap_or(0) + 4);
        for w in table.iter().take(shown) {
            let limit = w
                .max_context
                .or(w.max_frames)
                .map_or("none".to_string(), |v| v.to_string());
            let pool = match pooled {
                true => format!(" {} |", w.kv_sequences.map_or("none".to_string(), |n| n.to_string())),
                false => String::new(),
            };
            println!(
                "| {} | {:.1} | {} | {limit} |{pool}",
                w.tp,
                mib(w.peak),
                if w.fits { "yes" } else { "no" }
            );
        }
        match smallest {
            Some(tp) => println!("\nThe smallest width that fits: --tp {tp}"),
            None => println!("\nNo width fits: add GPUs, shorten the context or the video, or use a smaller dtype"),
        }
    }
    Ok(match smallest {
        Some(_) => ExitCode::SUCCESS,
        None => ExitCode::from(2),
    })
}
