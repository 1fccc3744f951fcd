//! `tpinfer-bench`: speed and numerics of a model at several TP widths, through the engine as
//! a user runs it.
//!
//! - `speed`: prefill ms and decode tok/s per TP width, as a Markdown table for RESULTS.md.
//! - `attention`: the fused flash-attention kernel's error and speed.
//! - `fp8`: a product with FP8 weights against the dequantized weight's, error and speed.
//! - `sweep`: a grid over TP width and prompt lengths or frame counts, as JSON, CSV and plots.
//! - `logits`: the prefill logits and greedy tokens of one run, as safetensors, for comparison
//!   with a reference implementation (`scripts/reference/reference_llama.py`).
//! - `collectives`: all-reduce, reduce-scatter and all-gather at the models' message sizes.
//! - `decode-profile`: one rank's decode step taken apart (graph, eager, sampling, GEMVs); at
//!   TP > 1, every rank's step and the step's all-reduces.
//! - `timeline` (builds with the `timeline` feature): one rank's decode step as its kernels'
//!   CTAs saw it, overlaps included.

mod attention;
mod collectives;
mod decode;
mod encode;
mod fp8;
mod gguf;
mod linear;
mod load;
mod plots;
mod sample;
mod speech;
mod sweep;
#[cfg(feature = "timeline")]
mod timeline;
mod vae;
mod vae_encode;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tpinfer_engine::{DType, DeviceKind, Engine, Fault, GenerateRequest, Prompt, StreamEvent};

#[derive(Parser)]
#[command(about = "Speed and numerics of tpinfer against TP width")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prefill and decode speed for each TP width.
    Speed(SpeedArgs),
    /// Writes prefill logits and greedy tokens of one run to a safetensors file.
    Logits(LogitsArgs),
    /// A Wan DiT's velocity for given inputs at each TP width: time per forward, device
    /// memory against the plan, and the velocities as safetensors for a reference to compare.
    Dit(DitArgs),
    /// The fused flash-attention kernel: error against an f32 reference, ms and TFLOP/s.
    Attention(attention::AttentionArgs),
    /// A biased linear (and GELU) as one cuBLASLt GEMM against candle's matmul and add.
    Linear(linear::LinearArgs),
    /// A linear with FP8 weights (W8A8 GEMM, or the FP8 GEMV for one row) against the
    /// dequantized weight's product: ms per call and each one's error.
    Fp8(fp8::Fp8Args),
    /// A grid of Llama and DiT runs from a TOML file: JSON, CSV and plots (SVG, PNG).
    Sweep(sweep::SweepArgs),
    /// Where one rank's decode step goes: the step (graph and eager), sampling, the GEMVs.
    DecodeProfile(decode::DecodeProfileArgs),
    /// All-reduce, reduce-scatter and all-gather at the models' message sizes, checked.
    Collectives(collectives::CollectivesArgs),
    /// The umT5 text encoder at each TP width: ms per prompt, memory against the plan, and the
    /// states as safetensors for a reference to compare.
    Encode(encode::EncodeArgs),
    /// The wav2vec2 speech encoder at each TP width: ms per audio, memory against the plan,
    /// and the hidden states as safetensors for a reference to compare.
    Speech(speech::SpeechArgs),
    /// The Wan VAE decoder at each TP width: seconds per decode, memory against the plan,
    /// and the frames for reference_vae.py to compare.
    Vae(vae::VaeArgs),
    /// The Wan VAE encoder on one device: ms per encode, and the latents for
    /// reference_vae_encoder.py's to compare.
    VaeEncode(vae_encode::VaeEncodeArgs),
    /// The device sampler against the host's arithmetic on random logits: ms per call and
    /// tokens equal, per batch of rows and sampling setting.
    Sample(sample::SampleArgs),
    /// An OpenAI-compatible server (`tpinfer serve`) under concurrent streamed requests:
    /// output tok/s, time to first token and inter-token latency per concurrency.
    Load(load::LoadArgs),
    /// A Llama checkpoint written as a GGUF file in a llama.cpp quantization mix.
    Gguf(gguf::GgufArgs),
    /// One rank's decode step as its chain kernels' CTAs saw it (a `timeline` build).
    #[cfg(feature = "timeline")]
    Timeline(timeline::TimelineArgs),
}

#[derive(Args)]
struct DitArgs {
    /// A Wan DiT directory (diffusers or original names).
    #[arg(long)]
    model: PathBuf,
    /// safetensors with `latents` [C, F, H, W], `text` [tokens, text_dim] and `timestep` [1]
    /// (for an S2V model also `reference`, `pose`, `audio` and, after a first clip, `motion`);
    /// several (comma-separated) run on one loaded engine per width.
    #[arg(long, value_delimiter = ',', required = true)]
    inputs: Vec<PathBuf>,
    #[arg(long)]
    cuda: bool,
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    tp: Vec<usize>,
    /// Timed forwards per width, after one warm-up.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Writes `{out}_tp{N}.safetensors` (tensor `velocity`) for each width.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also time each stage of rank 0's forward of the last inputs at every width (CUDA events
    /// on a GPU, read after the forward).
    #[arg(long)]
    profile: bool,
    /// Also denoise from the last inputs' latents for this many guided steps (UniPC, the
    /// inputs' `negative` states or else their `text` as the negative prompt; an S2V model's
    /// clip with silent audio for the unconditional pass) and report each step's time: a
    /// guided step as `generate` runs it, the conditioning prepared once.
    #[arg(long, default_value_t = 0)]
    guided_steps: usize,
    /// The form the blocks' linear weights are held in (`fp8`: quantized at load).
    #[arg(long, value_enum, default_value_t = WeightsArg::AsStored)]
    weights: WeightsArg,
    /// Self-attention's products on E4M3 operands (Hopper, bf16).
    #[arg(long)]
    attention_fp8: bool,
    /// Before the forwards, takes the device memory past the plan plus this many MiB (as
    /// `tpinfer-bench vae --limit-to-plan`; negative below the plan): the least card a forward
    /// runs on.
    #[arg(long, allow_negative_numbers = true)]
    limit_to_plan: Option<f64>,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum WeightsArg {
    AsStored,
    Dequantized,
    Fp8,
    /// `fp8`, and the LM head too (`--quantize-lm-head`).
    Fp8LmHead,
}

impl WeightsArg {
    pub(crate) fn format(self) -> tpinfer_engine::WeightFormat {
        match self {
            Self::AsStored => tpinfer_engine::WeightFormat::AsStored,
            Self::Dequantized => tpinfer_engine::WeightFormat::Dequantized,
            Self::Fp8 => tpinfer_engine::WeightFormat::Fp8,
            Self::Fp8LmHead => tpinfer_engine::WeightFormat::Fp8WithLmHead,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum DtypeArg {
    F32,
    F16,
    Bf16,
}

#[derive(Args)]
struct Common {
    /// A Hugging Face model directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    cuda: bool,
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// Prompt length in tokens; the prompt is the same fixed pseudo-random ids in every run
    /// (and in the reference script): id_i = (7919 i + 13) mod min(vocab, 30000).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long)]
    max_context: Option<usize>,
    /// Decode kernel by kernel instead of replaying a captured CUDA graph.
    #[arg(long)]
    enforce_eager: bool,
    /// The form the linear weights are held in: as stored (GGUF blocks, FP8 checkpoints),
    /// dequantized, or quantized to FP8 at load.
    #[arg(long, value_enum, default_value_t = WeightsArg::AsStored)]
    weights: WeightsArg,
    /// Test switch: inject a fault, KIND:RANK:STEP with KIND one of error, panic, oom, exit, nan.
    #[arg(long, value_parser = parse_fault)]
    fault: Option<Fault>,
    /// Seconds a rank waits for its peers before naming them.
    #[arg(long, default_value_t = 120)]
    comm_timeout: u64,
}

fn parse_fault(text: &str) -> Result<Fault, String> {
    let parts: Vec<&str> = text.split(':').collect();
    let [kind, rank, step] = parts.as_slice() else {
        return Err("expected KIND:RANK:STEP".into());
    };
    let rank = rank.parse().map_err(|e| format!("rank: {e}"))?;
    let step = step.parse().map_err(|e| format!("step: {e}"))?;
    Ok(match *kind {
        "error" => Fault::Error { rank, step },
        "panic" => Fault::Panic { rank, step },
        "oom" => Fault::Oom { rank, step },
        "exit" => Fault::Exit { rank, step },
        "nan" => Fault::NonFinite { rank, step },
        other => return Err(format!("unknown fault `{other}`")),
    })
}

#[derive(Args)]
struct SpeedArgs {
    #[command(flatten)]
    common: Common,
    /// TP widths to measure, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    tp: Vec<usize>,
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Measured runs per width, after one warm-up run.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Above 1, run through the continuous-batching engine (the paged KV cache, one request
    /// in its batched steps), as `tpinfer serve` does; the memory column then holds the
    /// engine's whole plan.
    #[arg(long, default_value_t = 1)]
    max_seqs: usize,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Greedy tokens to generate.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Above 1, run through the continuous-batching engine (the paged KV cache and its
    /// kernels), as `tpinfer serve` does.
    #[arg(long, default_value_t = 1)]
    max_seqs: usize,
    #[arg(long)]
    out: PathBuf,
}

/// The peer paths the environment allows, read as `tpinfer` reads them (`NCCL_P2P_DISABLE=1`,
/// `TPINFER_PEER_ALL_REDUCE=0`, `TPINFER_PEER_ROWS=0`), so that a bench runs what the CLI runs.
fn comm_options() -> tpinfer_engine::CommOptions {
    let is = |var: &str, value: &str| std::env::var(var).is_ok_and(|v| v.trim() == value);
    tpinfer_engine::CommOptions {
        peer_access: !is("NCCL_P2P_DISABLE", "1"),
        peer_all_reduce: !is("TPINFER_PEER_ALL_REDUCE", "0"),
        peer_rows: !is("TPINFER_PEER_ROWS", "0"),
    }
}

/// A builder for `model` at `tp` on GPUs 0..tp (`cuda`) or CPU ranks, in `dtype`.
fn builder(model: &std::path::Path, tp: usize, cuda: bool, dtype: Option<DtypeArg>) -> tpinfer_engine::EngineBuilder {
    let mut builder = Engine::builder(model).tp(tp).comm_options(comm_options());
    if cuda {
        builder = builder.device(DeviceKind::Cuda { gpus: None });
    }
    if let Some(dtype) = dtype {
        builder = builder.dtype(dtype_of(dtype));
    }
    builder
}

/// The dtype a stage bench runs in: the one given, else bf16 on GPUs and f32 on CPU ranks.
fn stage_dtype(dtype: Option<DtypeArg>, cuda: bool) -> DType {
    match (dtype, cuda) {
        (Some(d), _) => dtype_of(d),
        (None, true) => DType::BF16,
        (None, false) => DType::F32,
    }
}

/// GPUs 0.. or CPU ranks.
fn device_kind(cuda: bool) -> tpinfer_runtime::DeviceKind {
    match cuda {
        true => tpinfer_runtime::DeviceKind::Cuda { gpus: None },
        false => tpinfer_runtime::DeviceKind::Cpu,
    }
}

/// The fullest rank's peak device memory against its plan, "measured / planned" in MiB (a
/// dash for CPU ranks, which report none).
fn memory_cell(memory: &[Option<tpinfer_runtime::DeviceMemory>], plan: &tpinfer_plan::Plan) -> String {
    match memory.iter().zip(&plan.ranks).max_by_key(|(_, p)| p.total()) {
        Some((Some(m), p)) => format!(
            "{:.0} / {:.0}",
            tpinfer_plan::mib(m.peak()),
            tpinfer_plan::mib(p.total())
        ),
        Some((None, p)) => format!("– / {:.0}", tpinfer_plan::mib(p.total())),
        None => "–".into(),
    }
}

pub(crate) fn dtype_of(dtype: DtypeArg) -> DType {
    match dtype {
        DtypeArg::F32 => DType::F32,
        DtypeArg::F16 => DType::F16,
        DtypeArg::Bf16 => DType::BF16,
    }
}

/// Fails where `--fault` names a decode step that `new_tokens` never reaches (step `s` runs
/// for the (s + 2)-th token): a failure test would pass without its failure.
fn check_fault(common: &Common, new_tokens: usize) -> Result<()> {
    let step = match common.fault {
        Some(
            Fault::Error { step, .. }
            | Fault::Panic { step, .. }
            | Fault::Oom { step, .. }
            | Fault::Exit { step, .. }
            | Fault::NonFinite { step, .. },
        ) => step,
        None => return Ok(()),
    };
    if step + 2 > new_tokens {
        bail!(
            "--fault at decode step {step} is never reached with {new_tokens} new tokens: give at least {}",
            step + 2
        );
    }
    Ok(())
}

fn engine(common: &Common, tp: usize, max_seqs: usize) -> Result<Engine> {
    let mut builder = builder(&common.model, tp, common.cuda, common.dtype)
        .max_seqs(max_seqs)
        .comm_timeout(std::time::Duration::from_secs(common.comm_timeout))
        .enforce_eager(common.enforce_eager);
    builder = builder.weight_format(common.weights.format());
    if let Some(fault) = common.fault {
        builder = builder.inject_fault(fault);
    }
    if let Some(context) = common.max_context {
        builder = builder.max_context(context);
    }
    builder
        .build()
        .with_context(|| format!("loading {} at TP {tp}", common.model.display()))
}

fn prompt(engine: &Engine, tokens: usize) -> Vec<u32> {
    let modulus = (engine.config().vocab_size as u32).min(30_000);
    (0..tokens as u32).map(|i| (i * 7919 + 13) % modulus).collect()
}

/// `run` once to warm up and `repeats` times more on a rank, each timed in ms between syncs of
/// `device`: its last output as f32 on the host, the first time (which also loads kernels and
/// makes cuBLAS's handles) and the median of the others.
fn timed_runs(
    device: &candle_core::Device,
    rank: usize,
    repeats: usize,
    mut run: impl FnMut() -> Result<candle_core::Tensor, tpinfer_runtime::RuntimeError>,
) -> Result<(candle_core::Tensor, f64, f64), tpinfer_runtime::RuntimeError> {
    let of_rank = |e: candle_core::Error| tpinfer_runtime::RuntimeError::of_rank(rank, e.into());
    let mut times = Vec::with_capacity(repeats + 1);
    let mut last = None;
    for _ in 0..=repeats {
        // The run before's output is let go first: the device's peak is then one run's.
        drop(last.take());
        device.synchronize().map_err(of_rank)?;
        let start = std::time::Instant::now();
        let out = run()?;
        device.synchronize().map_err(of_rank)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        last = Some(out);
    }
    let last = last.ok_or_else(|| tpinfer_runtime::RuntimeError::Stopped("no run".into()))?;
    // Widened on the host: an f32 copy on the device beside the output would be the peak.
    let host = last
        .to_device(&candle_core::Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .map_err(of_rank)?;
    let first = times.remove(0);
    let median = match times.is_empty() {
        true => f64::NAN,
        false => median(times),
    };
    Ok((host, first, median))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn speed(args: SpeedArgs) -> Result<()> {
    check_fault(&args.common, args.new_tokens)?;
    println!(
        "| TP | prompt tokens | new tokens | prefill ms (median) | decode tok/s (median) | decode tok/s (min–max) \
         | peak device memory per rank, MiB: measured / planned for this run (Δ) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut details = Vec::new();
    for &tp in &args.tp {
        let engine = engine(&args.common, tp, args.max_seqs)?;
        let ids = prompt(&engine, args.common.prompt_tokens);
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        for run in 0..=args.repeats {
            let request = GenerateRequest::new(Prompt::Tokens(ids.clone()), args.new_tokens);
            let mut stats = None;
            for event in engine.generate(request)? {
                if let StreamEvent::Done(s) = event? {
                    stats = Some(s);
                }
            }
            let stats = stats.context("generation ended without stats")?;
            if stats.generated_tokens != args.new_tokens {
                bail!(
                    "stopped after {} tokens ({:?})",
                    stats.generated_tokens,
                    stats.stop_reason
                );
            }
            if run > 0 {
                prefill.push(stats.prefill.as_secs_f64() * 1e3);
                decode.push(stats.decode_tokens_per_second());
            }
        }
        let (lo, hi) = decode
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let plan = engine.plan();
        let this_run = planned_for_run(&engine, &args.common, args.common.prompt_tokens, args.new_tokens)?;
        let memory: Vec<String> = engine
            .device_memory()
            .iter()
            .zip(plan.ranks.iter().zip(&this_run))
            .map(|(m, (planned, &(run_activations, run_slack)))| {
                let slack = if planned.allocator_slack > 0 { run_slack } else { 0 };
                let run_total = match args.max_seqs {
                    1 => planned.total_with(run_activations, slack),
                    _ => planned.total(),
                };
                let run_mib = tpinfer_plan::mib(run_total);
                match m {
                    None => format!("– / {run_mib:.0}"),
                    Some(m) => {
                        details.push(format!(
                            "| {tp} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} \
                             | {run_mib:.0} |",
                            planned.rank,
                            tpinfer_plan::mib(planned.weights + planned.buffers + planned.cache),
                            tpinfer_plan::mib(planned.activations),
                            tpinfer_plan::mib(run_activations),
                            tpinfer_plan::mib(slack),
                            tpinfer_plan::mib(planned.libraries + planned.comm + planned.context),
                            tpinfer_plan::mib(m.used - m.pool_reserved),
                            tpinfer_plan::mib(m.pool_used_peak),
                            tpinfer_plan::mib(m.pool_peak),
                            tpinfer_plan::mib(planned.total()),
                            tpinfer_plan::mib(m.peak()),
                        ));
                        let off = 100.0 * (m.peak() as f64 / run_total as f64 - 1.0);
                        format!("{:.0} / {run_mib:.0} ({off:+.1}%)", tpinfer_plan::mib(m.peak()))
                    }
                }
            })
            .collect();
        println!(
            "| {tp} | {} | {} | {:.1} | {:.1} | {lo:.1}–{hi:.1} | {} |",
            args.common.prompt_tokens,
            args.new_tokens,
            median(prefill),
            median(decode),
            memory.join(", "),
        );
    }
    if !details.is_empty() {
        println!(
            "\n| TP | rank | planned weights + buffers + KV, MiB | planned activations (max context) \
             | planned activations (this run) | planned pool slack (this run) | planned libraries + NCCL + context | measured outside the pool \
             (context, cuBLAS, NCCL) | measured pool peak (tensors) | measured pool peak (reserved) \
             | planned total (max context) | measured peak | planned peak (this run) |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        details.iter().for_each(|d| println!("{d}"));
    }
    Ok(())
}

/// Each rank's planned activation peak and pool slack for a run of `prompt` tokens and `new`
/// generated ones, by the same model the engine checks itself against, with what the prompt's
/// products of quantized weights take beyond dense ones (as the plan counts them).
fn planned_for_run(engine: &Engine, common: &Common, prompt: usize, new: usize) -> Result<Vec<(u64, u64)>> {
    use tpinfer_family::Family;
    use tpinfer_llama::memory::{flash_attention, prefill_chunk, request_memory};
    let model = tpinfer_llama::LlamaModel::open_checkpoint_with(&common.model, common.weights.format())?;
    let accelerator = match common.cuda {
        true => tpinfer_plan::Accelerator::Cuda,
        false => tpinfer_plan::Accelerator::Cpu,
    };
    model
        .shards(engine.tp())?
        .iter()
        .map(|rank| {
            let shard = &rank.shard;
            let flash = flash_attention(common.cuda, engine.dtype(), engine.config().head_dim, shard);
            let chunk = prefill_chunk(shard.heads.q_heads.len(), engine.max_context(), flash);
            // The last generated token is sampled but never run through the model.
            let total = prompt + new - 1;
            let m = request_memory(engine.config(), shard, engine.dtype(), chunk, prompt, total, flash);
            let quantized = rank.quantized_product_bytes(engine.dtype(), accelerator, prompt.min(chunk));
            Ok(((m.peak + quantized) as u64, m.pool_slack() as u64))
        })
        .collect()
}

fn logits(args: LogitsArgs) -> Result<()> {
    check_fault(&args.common, args.steps)?;
    let engine = engine(&args.common, args.tp, args.max_seqs)?;
    let ids = prompt(&engine, args.common.prompt_tokens);
    let (stream, trace) = engine.generate_traced(GenerateRequest::new(Prompt::Tokens(ids), args.steps))?;
    let (_, tokens, stats) = stream.collect_text()?;
    let prefill: Vec<f32> = trace.recv().context("no logits traced")?;
    let prefill_bytes: Vec<u8> = prefill.iter().flat_map(|v| v.to_le_bytes()).collect();
    // The logits of every decode step after the prompt's: where a captured graph runs.
    let steps: Vec<Vec<f32>> = trace.try_iter().collect();
    let step_bytes: Vec<u8> = steps.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|&t| i64::from(t).to_le_bytes()).collect();
    use safetensors::tensor::TensorView as view;
    let tensors = vec![
        (
            "prefill_logits",
            view::new(safetensors::Dtype::F32, vec![prefill.len()], &prefill_bytes)?,
        ),
        (
            "tokens",
            view::new(safetensors::Dtype::I64, vec![tokens.len()], &token_bytes)?,
        ),
        (
            "decode_logits",
            view::new(safetensors::Dtype::F32, vec![steps.len(), prefill.len()], &step_bytes)?,
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &args.out)?;
    eprintln!(
        "TP {}: {} tokens, prefill {:.1} ms, decode {:.1} tok/s",
        args.tp,
        tokens.len(),
        stats.prefill.as_secs_f64() * 1e3,
        stats.decode_tokens_per_second()
    );
    Ok(())
}

/// One velocity's inputs.
struct DitInputs {
    latents: candle_core::Tensor,
    text: candle_core::Tensor,
    /// The negative prompt's states, for guided steps.
    negative: Option<candle_core::Tensor>,
    timestep: f64,
    /// An S2V model's clip conditioning.
    s2v: Option<tpinfer_engine::S2vInputs>,
    shape: tpinfer_engine::VideoShape,
}

impl DitInputs {
    fn velocity(
        &self,
        engine: &tpinfer_engine::VideoEngine,
        profile: bool,
    ) -> Result<(candle_core::Tensor, tpinfer_engine::StageProfile)> {
        Ok(match (&self.s2v, profile) {
            (Some(clip), _) => engine.s2v_velocity(&self.latents, self.timestep, &self.text, clip, profile)?,
            (None, true) => engine.velocity_profiled(&self.latents, self.timestep, &self.text)?,
            (None, false) => (engine.velocity(&self.latents, self.timestep, &self.text)?, Vec::new()),
        })
    }
}

fn dit_inputs(path: &std::path::Path) -> Result<DitInputs> {
    let inputs = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .with_context(|| format!("reading {}", path.display()))?;
    let get = |name: &str| {
        inputs
            .get(name)
            .cloned()
            .with_context(|| format!("{} lacks `{name}`", path.display()))
    };
    let (latents, text) = (get("latents")?, get("text")?);
    let timestep = get("timestep")?.flatten_all()?.to_vec1::<f32>()?[0] as f64;
    // S2V inputs (`reference`, `pose`, `audio`, and `motion` after the first clip) make an
    // S2V velocity of a clip of 4k frames.
    let s2v = match inputs.contains_key("reference") {
        true => Some(tpinfer_engine::S2vInputs {
            reference: get("reference")?,
            motion: inputs.get("motion").cloned(),
            pose: get("pose")?,
            audio: get("audio")?,
        }),
        false => None,
    };
    let (_, f, h, w) = latents.dims4()?;
    let shape = tpinfer_engine::VideoShape {
        frames: match s2v {
            Some(_) => f * 4,
            None => (f - 1) * 4 + 1,
        },
        width: w * 8,
        height: h * 8,
    };
    Ok(DitInputs {
        latents,
        text,
        negative: inputs.get("negative").cloned(),
        timestep,
        s2v,
        shape,
    })
}

fn dit(args: DitArgs) -> Result<()> {
    use tpinfer_engine::VideoEngine;
    let inputs = args.inputs.iter().map(|p| dit_inputs(p)).collect::<Result<Vec<_>>>()?;
    // One engine per width, planned for the largest video; memory is compared for that one.
    let largest = inputs
        .iter()
        .map(|i| i.shape)
        .max_by_key(|s| s.frames * s.width * s.height)
        .context("no inputs")?;
    println!(
        "| TP | frames | video tokens | ms per forward (median) | min–max | peak device memory per rank, MiB: measured / planned (Δ) |"
    );
    println!("|---|---|---|---|---|---|");
    for &tp in &args.tp {
        let precision = match args.attention_fp8 {
            true => tpinfer_engine::SelfAttention::Fp8,
            false => tpinfer_engine::SelfAttention::ComputeDtype,
        };
        let builder = builder(&args.model, tp, args.cuda, args.dtype)
            .weight_format(args.weights.format())
            .self_attention(precision);
        let engine = VideoEngine::start(builder, largest).with_context(|| format!("loading at TP {tp}"))?;
        let taken = take_past_plan(&engine.device_memory(), engine.plan(), args.limit_to_plan)?;
        for (index, input) in inputs.iter().enumerate() {
            let run = || -> Result<candle_core::Tensor> { Ok(input.velocity(&engine, false)?.0) };
            let mut velocity = run()?;
            let mut times = Vec::new();
            for _ in 0..args.repeats {
                // The run before's output is let go first: the device's peak is then one run's.
                drop(velocity);
                let start = std::time::Instant::now();
                velocity = run()?;
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
            let (lo, hi) = times
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            let memory: Vec<String> = match input.shape == largest {
                false => vec!["–".into()],
                true => engine
                    .device_memory()
                    .iter()
                    .zip(&engine.plan().ranks)
                    .map(|(m, p)| match m {
                        Some(m) => format!(
                            "{:.0} / {:.0} ({:+.1}%)",
                            tpinfer_plan::mib(m.peak()),
                            tpinfer_plan::mib(p.total()),
                            100.0 * (m.peak() as f64 / p.total() as f64 - 1.0)
                        ),
                        None => format!("– / {:.0}", tpinfer_plan::mib(p.total())),
                    })
                    .collect(),
            };
            let (_, f, h, w) = input.latents.dims4()?;
            println!(
                "| {tp} | {} | {} | {:.1} | {lo:.1}–{hi:.1} | {} |",
                input.shape.frames,
                f * (h / 2) * (w / 2),
                median(times.clone()),
                memory.join(", ")
            );
            if let Some(out) = &args.out {
                let suffix = if inputs.len() > 1 {
                    format!("_{index}")
                } else {
                    String::new()
                };
                let path = PathBuf::from(format!("{}_tp{tp}{suffix}.safetensors", out.display()));
                velocity.save_safetensors("velocity", &path)?;
            }
        }
        // A denoising run holds the sampler's state and both prompts, as the plan counts them,
        // beside a forward: the parts below are of the whole run so far.
        if args.guided_steps > 0 {
            dit_guided_steps(&engine, tp, inputs.last().context("no inputs")?, args.guided_steps)?;
        }
        print_memory_parts(&engine.device_memory(), engine.plan());
        print_limited(taken.as_ref(), &engine.device_memory());
        if args.profile {
            dit_profile(&engine, tp, inputs.last().context("no inputs")?)?;
        }
    }
    Ok(())
}

/// Device memory held away from a run (`--limit-to-plan`): `bytes` of the pool, taken after
/// the launch's budget check, as a card of the plan's size plus `extra_mib` would hold them.
pub(crate) struct Taken {
    #[cfg(feature = "cuda")]
    _held: candle_core::cuda_backend::cudarc::driver::CudaSlice<u8>,
    bytes: u64,
    extra_mib: f64,
}

/// With `extra_mib`, takes rank 0's device memory past its plan plus that many MiB (the
/// process alone on the device), from the device's pool on the primary context: a candle
/// device of its own would add a cuBLAS handle's 64 MiB outside the pool.
pub(crate) fn take_past_plan(
    memory: &[Option<tpinfer_runtime::DeviceMemory>],
    plan: &tpinfer_plan::Plan,
    extra_mib: Option<f64>,
) -> Result<Option<Taken>> {
    let Some(extra_mib) = extra_mib else {
        return Ok(None);
    };
    let (Some(Some(memory)), Some(rank)) = (memory.first(), plan.ranks.first()) else {
        anyhow::bail!("--limit-to-plan needs CUDA ranks");
    };
    // A negative EXTRA limits a run the plan over-counts below its plan.
    let limit = (rank.total() as f64 + extra_mib * 1048576.0).max(0.0) as u64;
    let bytes = memory.total.saturating_sub(limit);
    #[cfg(feature = "cuda")]
    {
        let stream = candle_core::cuda_backend::cudarc::driver::CudaContext::new(0)?.default_stream();
        let held = stream.alloc_zeros::<u8>(bytes as usize)?;
        stream.synchronize()?;
        Ok(Some(Taken {
            _held: held,
            bytes,
            extra_mib,
        }))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = bytes;
        anyhow::bail!("--limit-to-plan needs a CUDA build")
    }
}

/// Rank 0's peak without the memory `taken` held away from it, where some was.
pub(crate) fn print_limited(taken: Option<&Taken>, memory: &[Option<tpinfer_runtime::DeviceMemory>]) {
    if let (Some(taken), Some(Some(m))) = (taken, memory.first()) {
        println!(
            "limited to the plan + {:.0} MiB ({:.0} MiB taken): peak {:.0} MiB without them",
            taken.extra_mib,
            tpinfer_plan::mib(taken.bytes),
            tpinfer_plan::mib(m.peak().saturating_sub(taken.bytes))
        );
    }
}

/// Rank 0's measured peak in its parts beside the plan's (MiB): the pool's live tensors, the
/// pool's reserve beyond them, and what the device holds outside the pool (the CUDA context,
/// cuBLAS, cuDNN's handle and loaded kernels), to say which term a miss is in.
pub(crate) fn print_memory_parts(memory: &[Option<tpinfer_runtime::DeviceMemory>], plan: &tpinfer_plan::Plan) {
    let (Some(Some(m)), Some(p)) = (memory.first(), plan.ranks.first()) else {
        return;
    };
    let mib = tpinfer_plan::mib;
    let tensors = p.weights + p.buffers + p.cache + p.activations;
    println!(
        "rank 0, MiB measured / planned: pool tensors {:.0} / {:.0}; pool reserve beyond them {:.0} / {:.0}; \
         outside the pool {:.0} / {:.0}",
        mib(m.pool_used_peak),
        mib(tensors),
        mib(m.pool_peak.saturating_sub(m.pool_used_peak)),
        mib(p.allocator_slack),
        mib(m.used.saturating_sub(m.pool_reserved)),
        mib(p.libraries + p.comm + p.context)
    );
}

/// Each guided step's time of a short denoising run from the input's latents.
fn dit_guided_steps(engine: &tpinfer_engine::VideoEngine, tp: usize, input: &DitInputs, steps: usize) -> Result<()> {
    let request = tpinfer_engine::VideoRequest {
        text: input.text.clone(),
        negative: Some(input.negative.clone().unwrap_or_else(|| input.text.clone())),
        steps,
        shift: 3.0,
        guide_scale: 4.5,
        solver: tpinfer_engine::Solver::UniPc(2),
        seed: 0,
        init_latents: Some(input.latents.clone()),
    };
    let mut times = Vec::new();
    let on_step = |r: tpinfer_engine::StepReport| times.push(r.elapsed.as_secs_f64() * 1e3);
    let start = std::time::Instant::now();
    match &input.s2v {
        Some(clip) => engine.generate_s2v_clip(request, clip.clone(), on_step)?,
        None => engine.generate(request, on_step)?,
    };
    let wall = start.elapsed().as_secs_f64() * 1e3;
    let first = times.first().copied().unwrap_or(0.0);
    println!(
        "\n| TP | guided steps | ms per step (median) | first step ms | run wall ms |\n|---|---|---|---|---|\n\
         | {tp} | {steps} | {:.1} | {first:.1} | {wall:.1} |",
        median(times)
    );
    Ok(())
}

/// Where rank 0's forward spends its time at this TP width, stage by stage (the last input,
/// after that input's timed runs).
fn dit_profile(engine: &tpinfer_engine::VideoEngine, tp: usize, input: &DitInputs) -> Result<()> {
    let start = std::time::Instant::now();
    let (_, stages) = input.velocity(engine, true)?;
    let total = start.elapsed().as_secs_f64() * 1e3;
    println!("\n| stage (TP {tp}, rank 0, device time) | ms | share |\n|---|---|---|");
    for (stage, spent) in stages {
        let ms = spent.as_secs_f64() * 1e3;
        println!("| {stage} | {ms:.1} | {:.0}% |", 100.0 * ms / total);
    }
    println!("| total (wall) | {total:.1} | |");
    Ok(())
}

/// GPU 0.
/// ‖a − reference‖ / ‖reference‖, `a` taken to f32 (sums on the tensors' device).
pub(crate) fn relative_error(a: &candle_core::Tensor, reference: &candle_core::Tensor) -> Result<f64> {
    let diff = (a.to_dtype(DType::F32)? - reference)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f32>()?;
    let norm = reference.sqr()?.sum_all()?.to_scalar::<f32>()?;
    Ok((diff as f64 / norm as f64).sqrt())
}

pub(crate) fn gpu() -> Result<candle_core::Device> {
    Ok(candle_core::Device::new_cuda(0)?)
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Speed(args) => speed(args),
        Command::Logits(args) => logits(args),
        Command::Dit(args) => dit(args),
        Command::Attention(args) => attention::run(args),
        Command::Sample(args) => sample::run(args),
        Command::Linear(args) => linear::run(args),
        Command::Fp8(args) => fp8::run(args),
        Command::Sweep(args) => sweep::run(args),
        Command::DecodeProfile(args) => decode::run(args),
        Command::Collectives(args) => collectives::run(args),
        Command::Encode(args) => encode::encode(args),
        Command::Speech(args) => speech::speech(args),
        Command::Vae(args) => vae::vae(args),
        Command::VaeEncode(args) => vae_encode::vae_encode(args),
        Command::Load(args) => load::run(args),
        Command::Gguf(args) => gguf::run(args),
        #[cfg(feature = "timeline")]
        Command::Timeline(args) => timeline::run(args),
    }
}
