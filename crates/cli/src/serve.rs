//! `tpinfer serve`: the OpenAI-compatible server (tpinfer-server) over an engine that batches
//! requests continuously.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::ranks::RankArgs;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A language model: a Hugging Face directory, a GGUF file, or a Hugging Face id.
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub ranks: RankArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Sequences decoding at once; the paged KV cache holds this many full contexts, or as
    /// many as the memory budget affords where that is fewer (CPU ranks without --gpu-mem: half
    /// of the host's available memory; then the newest sequence is preempted and recomputed
    /// when its blocks run out).
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    max_seqs: usize,
    /// New tokens per step: decode tokens, and prompts prefilled in chunks beside them; at
    /// most the rows the memory plan counts for one forward (the context, or one per sequence).
    #[arg(long, default_value_t = tpinfer_engine::DEFAULT_STEP_TOKENS, value_parser = at_least_one)]
    step_tokens: usize,
    /// Requests running or queued beyond which new ones get 429 (default: 4 × --max-seqs).
    #[arg(long)]
    max_queue: Option<usize>,
    /// The longest sequence (prompt and generated tokens) a request may reach.
    #[arg(long)]
    max_context: Option<usize>,
    /// A chat template in place of the model's (or for a model that has none): a Jinja file,
    /// or the template itself (vLLM's --chat-template).
    #[arg(long)]
    chat_template: Option<String>,
    /// The model name clients give (default: the --model argument as given).
    #[arg(long)]
    served_model_name: Option<String>,
    /// After SIGTERM or Ctrl-C, how long requests in flight may take to finish before they
    /// are cancelled.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout_secs: u64,
}

/// Connections the kernel queues before the server accepts them (std's listeners take 128).
const LISTEN_BACKLOG: u32 = 1024;

pub fn serve(args: ServeArgs, given_model: String) -> Result<()> {
    if tpinfer_engine::registry::task_of(&args.model) != tpinfer_engine::registry::Task::Text {
        bail!(
            "{} is not a language model: `tpinfer serve` serves LLMs (`tpinfer generate` makes videos)",
            args.model.display()
        );
    }
    let address: SocketAddr = format!("{}:{}", args.host, args.port).parse().with_context(|| {
        format!(
            "--host {} --port {} is not an address to listen on",
            args.host, args.port
        )
    })?;
    // The address is claimed before the model loads: a port in use fails now, not after the
    // load. Bound but not yet listening, it refuses connections until the engine is up.
    let socket = match address {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .and_then(|socket| {
        socket.set_reuseaddr(true)?;
        socket.bind(address)?;
        Ok(socket)
    })
    .with_context(|| format!("cannot listen on {address}"))?;
    let mut ranks = args.ranks.ranks(&args.model)?;
    ranks.builder = ranks.builder.max_seqs(args.max_seqs).step_tokens(args.step_tokens);
    if let Some(template) = &args.chat_template {
        ranks.builder = ranks.builder.chat_template(crate::ranks::chat_template(template)?);
    }
    if let Some(tokens) = args.max_context {
        ranks.builder = ranks.builder.max_context(tokens);
    }
    let engine = ranks
        .start(|b| b.build())
        .with_context(|| format!("cannot load {}", args.model.display()))?;
    let options = tpinfer_server::ServerOptions {
        model: args.served_model_name.unwrap_or(given_model),
        max_queue: args.max_queue.unwrap_or(4 * args.max_seqs),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the server's runtime")?;
    let grace = Duration::from_secs(args.shutdown_timeout_secs);
    runtime.block_on(async move {
        // Listened for before the address is announced: a SIGTERM that follows it stops the
        // server, where the default action would kill it (axum polls its shutdown future
        // only once a task of its own runs).
        let shutdown = shutdown_signal()?;
        let listener = socket
            .listen(LISTEN_BACKLOG)
            .with_context(|| format!("cannot listen on {address}"))?;
        if args.max_seqs > 1 {
            let positions = engine.kv_cache_positions();
            eprintln!(
                "KV cache: {positions} positions, {} full contexts of {} for up to {} sequences (shorter ones share it finer); \
                 {} new tokens a step",
                positions / engine.max_context(),
                engine.max_context(),
                args.max_seqs,
                engine.step_tokens()
            );
        }
        eprintln!(
            "serving {} on http://{} (OpenAI API: /v1/chat/completions, /v1/completions, /v1/models; /health, /metrics)",
            options.model,
            listener.local_addr().unwrap_or(address)
        );
        let app = tpinfer_server::router(Arc::new(engine), options);
        let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
        let server = axum::serve(tpinfer_server::without_nagle(listener), app).with_graceful_shutdown(async move {
            shutdown.await;
            eprintln!("stopping: no new connections; requests in flight have {grace:?} to finish");
            let _ = stopping_tx.send(true);
        });
        let mut stopping = stopping;
        tokio::select! {
            served = server => served.context("the server failed"),
            () = async {
                let _ = stopping.wait_for(|&s| s).await;
                tokio::time::sleep(grace).await;
            } => {
                eprintln!("requests still in flight after {grace:?}: cancelled");
                Ok(())
            }
        }
    })
}

/// SIGTERM or Ctrl-C, listened for from this call on (inside the runtime).
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// A count that zero would leave the server unable to run anything.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{text}` is not a count of at least 1")),
    }
}
