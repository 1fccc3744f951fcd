//! `tpinfer`: tensor-parallel inference from the command line.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tpinfer_engine::registry::Task;
use tpinfer_engine::{GenerateRequest, Prompt, SamplingParams, StreamEvent};

mod decode;
mod doctor;
mod env;
mod frames;
mod output;
mod plan;
mod plan_pipeline;
mod progress;
mod ranks;
mod serve;
mod speech_video;
mod video;

#[derive(Parser)]
#[command(
    name = "tpinfer",
    version,
    about = "Tensor-parallel inference: one rank per GPU, or per CPU thread"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log: -v the start-up stages and their times, -vv debugging, -vvv everything
    /// (`RUST_LOG` overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Errors only.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// How log lines are written to stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    /// One JSON object per line, with the span (the rank) it came from.
    Json,
}

impl Cli {
    /// Log to stderr at the level the flags ask for, unless `RUST_LOG` says otherwise.
    fn init_logging(&self) {
        let level = match (self.quiet, self.verbose) {
            (true, _) => "error",
            (false, 0) => "warn",
            (false, 1) => "info",
            (false, 2) => "debug",
            (false, _) => "trace",
        };
        // The audio decoder logs the failures tpinfer reports itself, as errors of its own:
        // below -v they would print the one error twice.
        let quiet_crates = match self.verbose {
            0 => ",symphonia=off",
            _ => "",
        };
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{level}{quiet_crates}")));
        // Colours only for a terminal: not in a file or a pipe.
        let logger = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        match self.log_format {
            LogFormat::Text => logger.init(),
            LogFormat::Json => logger.json().init(),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (an LLM), or a video from a prompt (a Wan pipeline directory)
    /// or from text embeddings (a Wan DiT alone, to latents).
    Generate(Box<GenerateArgs>),
    /// Each rank's device memory for a placement against a per-GPU budget, and what fits.
    Plan(plan::PlanArgs),
    /// Decode saved latents (a Wan DiT's) to a video with a pipeline's VAE.
    Decode(decode::DecodeArgs),
    /// Diagnose the GPUs, drivers, libraries, links and NCCL of this machine.
    Doctor(doctor::DoctorArgs),
    /// Serve a language model over an OpenAI-compatible HTTP API, batching requests
    /// continuously.
    Serve(Box<serve::ServeArgs>),
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer.json), a GGUF file,
    /// a Wan pipeline directory in diffusers' layout (or its transformer/ alone), or a Hugging
    /// Face id ORG/NAME[@REVISION], from the cache or downloaded into it (HF_HUB_OFFLINE=1:
    /// the cache alone).
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    ranks: ranks::RankArgs,
    /// The prompt: of an LLM, or of a video with a Wan pipeline directory.
    #[arg(long)]
    prompt: Option<String>,
    /// Most tokens to generate; an end-of-sequence token stops sooner.
    #[arg(long, default_value_t = 128, help_heading = "Language models")]
    max_new_tokens: usize,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long, help_heading = "Language models")]
    chat: bool,
    /// A system message for --chat.
    #[arg(long, requires = "chat", help_heading = "Language models")]
    system: Option<String>,
    /// A chat template for --chat in place of the model's (or for a model that has none): a
    /// Jinja file, or the template itself (vLLM's --chat-template).
    #[arg(long, requires = "chat", help_heading = "Language models")]
    chat_template: Option<String>,
    /// Longest sequence, prompt plus generated tokens (default: the model's, at most 8192;
    /// vLLM's --max-model-len).
    #[arg(long, alias = "max-model-len", help_heading = "Language models")]
    max_context: Option<usize>,
    /// Run each decode step kernel by kernel, not as a replayed CUDA graph (slower; for
    /// debugging).
    #[arg(long, help_heading = "Language models")]
    enforce_eager: bool,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, help_heading = "Language models")]
    temperature: f64,
    /// Sample only from the k likeliest tokens (with --temperature above 0).
    #[arg(long, help_heading = "Language models")]
    top_k: Option<usize>,
    /// Sample only from the likeliest tokens whose probabilities sum to p, in (0, 1] (with
    /// --temperature above 0; after --top-k when both are given).
    #[arg(long, help_heading = "Language models")]
    top_p: Option<f64>,
    /// Above 1 makes the tokens among the last 64 less likely to come again; 1 disables it.
    #[arg(long, default_value_t = 1.0, help_heading = "Language models")]
    repetition_penalty: f32,
    /// Taken off a token's logit for each time it was generated, from -2 to 2 (OpenAI's
    /// frequency_penalty); 0 disables it.
    #[arg(
        long,
        default_value_t = 0.0,
        allow_negative_numbers = true,
        help_heading = "Language models"
    )]
    frequency_penalty: f32,
    /// Taken off the logit of every token generated at all, from -2 to 2 (OpenAI's
    /// presence_penalty); 0 disables it.
    #[arg(
        long,
        default_value_t = 0.0,
        allow_negative_numbers = true,
        help_heading = "Language models"
    )]
    presence_penalty: f32,
    /// The sampler's seed (the video's noise for a Wan DiT).
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Write one JSON object to stdout at the end (the text, its tokens and the run's
    /// statistics) instead of streaming the text.
    #[arg(long, help_heading = "Language models")]
    json: bool,
    /// A LoRA adapter (safetensors: PEFT's names, as Live Avatar ships its adapter, kohya's or
    /// ComfyUI's, in Wan's original names or diffusers') merged into a Wan DiT's weights at
    /// load; each rank merges only its slices.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Every pair's scale, replacing alpha / rank (default: each pair's alpha / rank from the
    /// file, or the adapter_config.json beside it); whole deltas (`.diff`, `.diff_b`) are
    /// added as stored.
    #[arg(long, requires = "lora")]
    lora_scale: Option<f64>,
    #[command(flatten)]
    video: video::VideoArgs,
}

fn main() -> ExitCode {
    // Output piped into `head` ends quietly when the reader goes, as a command-line tool's
    // should, rather than panicking on the write (Rust ignores SIGPIPE by default).
    #[cfg(unix)]
    // SAFETY: called first, before any thread exists; restores the signal's default action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    cli.init_logging();
    let given = Given(matches);
    match run(cli, &given) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, leaving out a cause whose text an error before it
/// already says (many errors name their source in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}

/// The options given on the command line (not defaults), to refuse those that do not apply.
struct Given(clap::ArgMatches);

impl Given {
    /// The first of `ids` (clap's ids: the field names) the user gave to `subcommand`, as its
    /// flag.
    fn first(&self, subcommand: &str, ids: &[&str]) -> Option<String> {
        let matches = self.0.subcommand_matches(subcommand)?;
        ids.iter()
            .find(|id| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .map(|id| format!("--{}", id.replace('_', "-")))
    }
}

/// `generate`'s options for language models alone, and for video alone.
const TEXT_ONLY: &[&str] = &[
    "max_new_tokens",
    "json",
    "chat",
    "system",
    "chat_template",
    "max_context",
    "enforce_eager",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
];
const VIDEO_ONLY: &[&str] = &[
    "lora",
    "lora_scale",
    "frames",
    "size",
    "steps",
    "text_embeds",
    "negative_embeds",
    "negative_prompt",
    "save_text_embeds",
    "guide_scale",
    "shift",
    "solver",
    "init_latents",
    "out",
    "save_frames",
    "save_latents",
    "fps",
    "attention",
];

fn run(cli: Cli, given: &Given) -> Result<ExitCode> {
    match cli.command {
        Command::Generate(mut args) => {
            args.model = env::resolve_model(&args.model)?;
            let (task, refused) = match tpinfer_engine::registry::task_of(&args.model) {
                Task::Text => ("a language model", given.first("generate", VIDEO_ONLY)),
                _ => ("a video model", given.first("generate", TEXT_ONLY)),
            };
            if let Some(flag) = refused {
                bail!(
                    "{flag} does not apply to {}: it is {task} (`tpinfer generate --help` lists \
                     each kind's options)",
                    args.model.display()
                );
            }
            generate(*args)
        }
        Command::Plan(mut args) => {
            args.model = env::resolve_model(std::path::Path::new(&args.model))?
                .to_string_lossy()
                .into_owned();
            plan::plan(args)
        }
        Command::Decode(mut args) => {
            args.model = env::resolve_model(&args.model)?;
            decode::decode(args)
        }
        Command::Doctor(args) => doctor::doctor(args),
        Command::Serve(mut args) => {
            let given = args.model.to_string_lossy().into_owned();
            args.model = env::resolve_model(&args.model)?;
            serve::serve(*args, given)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Exit status after Ctrl-C, as shells report a SIGINT.
const INTERRUPTED: u8 = 130;

/// Ctrl-C while loading exits at once; while generating, the first stops the request on every
/// rank at the next token (the ranks agree on it in their per-token broadcast), the second
/// exits at once.
fn interrupt_handler() -> Result<Arc<AtomicBool>> {
    let generating = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let (g, s) = (generating.clone(), stop.clone());
    ctrlc::set_handler(move || {
        if !g.load(Ordering::SeqCst) || s.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted");
            std::process::exit(INTERRUPTED.into());
        }
        eprintln!("\nstopping every rank (Ctrl-C again to exit at once)");
    })?;
    STOP.set(stop).ok();
    Ok(generating)
}

static STOP: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();

fn stop_requested() -> bool {
    STOP.get().is_some_and(|s| s.load(Ordering::SeqCst))
}

fn generate(args: GenerateArgs) -> Result<ExitCode> {
    let generating = interrupt_handler()?;
    let mut ranks = args.ranks.ranks(&args.model)?;
    ranks.builder = ranks.builder.enforce_eager(args.enforce_eager);
    if let Some(template) = &args.chat_template {
        ranks.builder = ranks.builder.chat_template(ranks::chat_template(template)?);
    }
    if let Some(tokens) = args.max_context {
        ranks.builder = ranks.builder.max_context(tokens);
    }
    if let Some(path) = &args.lora {
        let adapter = tpinfer_engine::LoraAdapter::open(path, args.lora_scale)?;
        ranks.builder = ranks.builder.lora(Arc::new(adapter));
    }
    match tpinfer_engine::registry::task_of(&args.model) {
        Task::Video => {
            video::generate_video(ranks, &args.model, args.prompt.as_deref(), &args.video, args.seed)?;
            return Ok(ExitCode::SUCCESS);
        }
        Task::TextEncoder => bail!(
            "{} is a umT5 text encoder, one stage of a video pipeline: `tpinfer plan --model` plans it; to \
             generate, give a Wan transformer directory with --text-embeds",
            args.model.display()
        ),
        Task::VideoDecoder => bail!(
            "{} is a Wan VAE, the decode stage of a video pipeline: `tpinfer decode --model {} --latents FILE` \
             decodes latents with it",
            args.model.display(),
            args.model.display()
        ),
        Task::SpeechEncoder => bail!(
            "{} is a wav2vec2 speech encoder, the audio stage of speech-to-video: `tpinfer plan --model` plans \
             it; to generate, give the Wan2.2-S2V checkpoint directory that holds it, with --audio and --image",
            args.model.display()
        ),
        Task::Text => {}
    }
    let Some(prompt) = args.prompt else {
        bail!("--prompt is required for a language model");
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    sampling.check()?; // before the model loads
    let engine = ranks
        .start(|b| b.build())
        .with_context(|| format!("cannot load {}", args.model.display()))?;
    let prompt = match (args.chat, args.system) {
        (false, _) => Prompt::Text(prompt),
        (true, None) => Prompt::user(prompt),
        (true, Some(system)) => Prompt::Chat(vec![
            tpinfer_engine::ChatMessage::system(system),
            tpinfer_engine::ChatMessage::user(prompt),
        ]),
    };
    let request = GenerateRequest::new(prompt, args.max_new_tokens).with_sampling(sampling);
    let mut stdout = std::io::stdout().lock();
    let mut stream = engine.generate(request)?;
    generating.store(true, Ordering::SeqCst);
    let (mut text, mut tokens) = (String::new(), Vec::new());
    while let Some(event) = stream.next() {
        if stop_requested() {
            // Dropping the stream cancels the request; dropping the engine then joins the
            // ranks, which stop together at the next token.
            drop(stream);
            drop(engine);
            writeln!(stdout)?;
            eprintln!("stopped by Ctrl-C");
            return Ok(ExitCode::from(INTERRUPTED));
        }
        match event? {
            StreamEvent::Token { id, text: piece, .. } if args.json => {
                tokens.push(id);
                text.push_str(&piece);
            }
            StreamEvent::Tail(piece) if args.json => text.push_str(&piece),
            StreamEvent::Token { text, .. } | StreamEvent::Tail(text) => {
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            StreamEvent::Done(stats) if args.json => {
                let report = serde_json::json!({
                    "text": text,
                    "tokens": tokens,
                    "tp": engine.tp(),
                    "prompt_tokens": stats.prompt_tokens,
                    "generated_tokens": stats.generated_tokens,
                    "prefill_seconds": stats.prefill.as_secs_f64(),
                    "decode_seconds": stats.decode.as_secs_f64(),
                    "prompt_tokens_per_second": stats.prompt_tokens_per_second(),
                    "decode_tokens_per_second": stats.decode_tokens_per_second(),
                    "collectives_seconds": stats.collectives.as_secs_f64(),
                    "stop_reason": format!("{:?}", stats.stop_reason),
                });
                writeln!(stdout, "{report}")?;
                stdout.flush()?;
            }
            StreamEvent::Done(stats) => {
                writeln!(stdout)?;
                stdout.flush()?;
                eprintln!(
                    "tp {}: prompt {} tokens, {:.1} tok/s; decode {} tokens, {:.1} tok/s; stopped: {:?}",
                    engine.tp(),
                    stats.prompt_tokens,
                    stats.prompt_tokens_per_second(),
                    stats.generated_tokens,
                    stats.decode_tokens_per_second(),
                    stats.stop_reason,
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
