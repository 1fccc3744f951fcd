//! `tpinfer-bench load`: an OpenAI-compatible server under concurrent streamed requests, as
//! a serving benchmark drives it: at each concurrency, that many clients send requests of a
//! fixed prompt length (token ids) and output length (`ignore_eos`), one after the other.
//! Output tokens per second over the level's wall time, and time to first token and
//! inter-token latency percentiles over every request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use futures_util::StreamExt;
use serde_json::{json, Value};

#[derive(Args)]
pub struct LoadArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The model name the server serves.
    #[arg(long)]
    model: String,
    /// Concurrent clients, one level each.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128")]
    concurrency: Vec<usize>,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    output_tokens: usize,
    /// Requests per level: this many per client (at least one level's worth).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Prompt token ids are drawn below this (the model's vocabulary or less).
    #[arg(long, default_value_t = 32000)]
    vocab: u32,
    /// The first this many prompt tokens are the same in every request (a system prompt,
    /// which the server's prefix cache can share); the rest are each request's own.
    #[arg(long, default_value_t = 0)]
    shared_prefix: usize,
}

/// One request's client-side timings.
struct Timings {
    first_token: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

pub fn run(args: LoadArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        println!(
            "| concurrency | requests | output tok/s | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) | wall s |"
        );
        println!("|---:|---:|---:|---|---|---:|");
        for &clients in &args.concurrency {
            level(&args, clients).await?;
        }
        Ok(())
    })
}

async fn level(args: &LoadArgs, clients: usize) -> Result<()> {
    let client = reqwest::Client::new();
    let total = clients * args.rounds.max(1);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (client, next) = (client.clone(), next.clone());
        let (url, body) = (format!("{}/v1/completions", args.url), BodyArgs::of(args));
        workers.spawn(async move {
            let mut timings = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, anyhow::Error>(timings);
                }
                timings.push(
                    request(&client, &url, body.json(i))
                        .await
                        .with_context(|| format!("request {i}"))?,
                );
            }
        });
    }
    let mut all = Vec::with_capacity(total);
    while let Some(done) = workers.join_next().await {
        all.extend(done??);
    }
    let wall = start.elapsed().as_secs_f64();
    let tokens: usize = all.iter().map(|t| t.tokens).sum();
    let mut ttft: Vec<f64> = all.iter().map(|t| t.first_token.as_secs_f64() * 1e3).collect();
    let mut gaps: Vec<f64> = all
        .iter()
        .flat_map(|t| t.gaps.iter().map(|g| g.as_secs_f64() * 1e3))
        .collect();
    println!(
        "| {clients} | {total} | {:.1} | {:.1} / {:.1} | {:.2} / {:.2} | {wall:.2} |",
        tokens as f64 / wall,
        percentile(&mut ttft, 0.5),
        percentile(&mut ttft, 0.99),
        percentile(&mut gaps, 0.5),
        percentile(&mut gaps, 0.99),
    );
    Ok(())
}

/// What every request of a run shares.
#[derive(Clone)]
struct BodyArgs {
    model: String,
    prompt_tokens: usize,
    output_tokens: usize,
    temperature: f64,
    vocab: u32,
    shared_prefix: usize,
}

impl BodyArgs {
    fn of(args: &LoadArgs) -> Self {
        Self {
            model: args.model.clone(),
            prompt_tokens: args.prompt_tokens,
            output_tokens: args.output_tokens,
            temperature: args.temperature,
            vocab: args.vocab.max(2),
            shared_prefix: args.shared_prefix,
        }
    }

    /// Request `i`: its own prompt of token ids (a hash of its index and position), so that
    /// no two requests share a prefix past the first `shared_prefix` tokens (alike in all).
    fn json(&self, i: usize) -> Value {
        let prompt: Vec<u32> = (0..self.prompt_tokens)
            .map(|p| {
                let owner = match p < self.shared_prefix {
                    true => u64::MAX,
                    false => i as u64,
                };
                let h = owner
                    .wrapping_mul(1_000_003)
                    .wrapping_add(p as u64)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    >> 33;
                1 + (h % (self.vocab as u64 - 1)) as u32
            })
            .collect();
        json!({
            "model": self.model, "prompt": prompt, "max_tokens": self.output_tokens,
            "temperature": self.temperature, "seed": i, "ignore_eos": true,
            "stream": true, "stream_options": {"include_usage": true},
        })
    }
}

async fn request(client: &reqwest::Client, url: &str, body: Value) -> Result<Timings> {
    let sent = Instant::now();
    let response = client.post(url).json(&body).send().await?;
    if !response.status().is_success() {
        let status = response.status();
        bail!("{status}: {}", response.text().await.unwrap_or_default());
    }
    let mut bytes = response.bytes_stream();
    let (mut buffer, mut last, mut first) = (String::new(), None::<Instant>, None);
    let (mut gaps, mut tokens) = (Vec::new(), 0);
    while let Some(chunk) = bytes.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let value: Value = serde_json::from_str(data).with_context(|| format!("chunk {data}"))?;
            if let Some(error) = value.get("error") {
                bail!("the server failed the request: {error}");
            }
            if let Some(usage) = value.get("usage").filter(|u| !u.is_null()) {
                tokens = usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
            }
            let text = value["choices"][0]["text"].as_str().unwrap_or("");
            if !text.is_empty() {
                let now = Instant::now();
                match last {
                    None => first = Some(now - sent),
                    Some(at) => gaps.push(now - at),
                }
                last = Some(now);
            }
        }
    }
    Ok(Timings {
        first_token: first.context("no token came back")?,
        gaps,
        tokens,
    })
}

fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}
