//! The server's counters and latency histograms, in Prometheus' text format.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use tpinfer_engine::Load;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (count, bound) in self.counts.iter_mut().zip(BUCKETS) {
            if seconds <= bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (count, bound) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug, Default)]
struct Counters {
    requests: u64,
    /// Requests refused for a full queue.
    rejected: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
}

/// Shared by every request handler.
#[derive(Debug, Default)]
pub struct Metrics {
    counters: Mutex<Counters>,
    started: std::sync::OnceLock<std::time::Instant>,
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Counters) -> T) -> T {
        f(&mut self.counters.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn started(&self) {
        self.started.get_or_init(std::time::Instant::now);
    }

    pub fn rejected(&self) {
        self.with(|c| c.rejected += 1);
    }

    /// A request that ended: its token counts and, where it produced tokens, its latencies.
    pub fn finished(&self, prompt_tokens: usize, generated: usize, first_token: Option<Duration>, gaps: &[Duration]) {
        self.with(|c| {
            c.requests += 1;
            c.prompt_tokens += prompt_tokens as u64;
            c.generated_tokens += generated as u64;
            if let Some(ttft) = first_token {
                c.time_to_first_token.observe(ttft.as_secs_f64());
            }
            for gap in gaps {
                c.inter_token_latency.observe(gap.as_secs_f64());
            }
        });
    }

    pub fn render(&self, load: Load) -> String {
        let c = self.with(|c| {
            (
                c.requests,
                c.rejected,
                c.prompt_tokens,
                c.generated_tokens,
                c.time_to_first_token.clone(),
                c.inter_token_latency.clone(),
            )
        });
        let (requests, rejected, prompt, generated, ttft, itl) = c;
        let uptime = self.started.get().map_or(0.0, |t| t.elapsed().as_secs_f64());
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, kind: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        gauge(
            "tpinfer_requests_running",
            "Requests generating now.",
            "gauge",
            load.running as f64,
        );
        gauge(
            "tpinfer_requests_queued",
            "Requests waiting to run.",
            "gauge",
            load.queued as f64,
        );
        gauge(
            "tpinfer_kv_blocks_used",
            "KV cache blocks held by sequences.",
            "gauge",
            load.kv_blocks_used as f64,
        );
        gauge(
            "tpinfer_kv_blocks",
            "KV cache blocks in all.",
            "gauge",
            load.kv_blocks as f64,
        );
        gauge(
            "tpinfer_preemptions_total",
            "Sequences preempted for KV blocks (recomputed when they resume).",
            "counter",
            load.preemptions as f64,
        );
        gauge(
            "tpinfer_prefix_cache_hit_tokens_total",
            "Prompt tokens found in the KV cache (a prefix another request computed) instead of computed.",
            "counter",
            load.prefix_hit_tokens as f64,
        );
        gauge(
            "tpinfer_requests_total",
            "Requests that ended.",
            "counter",
            requests as f64,
        );
        gauge(
            "tpinfer_requests_rejected_total",
            "Requests refused for a full queue.",
            "counter",
            rejected as f64,
        );
        gauge(
            "tpinfer_prompt_tokens_total",
            "Prompt tokens of ended requests.",
            "counter",
            prompt as f64,
        );
        gauge(
            "tpinfer_generation_tokens_total",
            "Tokens generated.",
            "counter",
            generated as f64,
        );
        let rate = if uptime > 0.0 { generated as f64 / uptime } else { 0.0 };
        gauge(
            "tpinfer_generation_tokens_per_second",
            "Tokens generated per second since the start.",
            "gauge",
            rate,
        );
        ttft.render(
            "tpinfer_time_to_first_token_seconds",
            "From the request to its first token.",
            &mut out,
        );
        itl.render(
            "tpinfer_inter_token_latency_seconds",
            "Between a request's tokens.",
            &mut out,
        );
        out
    }
}
