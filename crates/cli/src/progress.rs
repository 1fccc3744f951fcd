//! Progress bars for the stages of a run, and the time each stage took.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tpinfer_engine::LoadProgress;

/// A bar for `stage`, counting `len` `unit`s. It draws on a terminal and stays silent in a log.
pub fn bar(stage: &str, len: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    let template =
        format!("{{prefix:>7}} {{bar:40}} {{pos}}/{{len}} {unit}, {{elapsed}} elapsed, ~{{eta}} left {{msg}}");
    bar.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(stage.to_string());
    bar
}

/// One denoising step's line, above `bar` on a terminal and a plain line in a log; the bar
/// moves on.
pub fn report_step(bar: &ProgressBar, step: &tpinfer_engine::StepReport) {
    bar.suspend(|| {
        eprintln!(
            "step {:>3}/{}: t = {:>4}, {:.3} s",
            step.index + 1,
            step.steps,
            step.timestep,
            step.elapsed.as_secs_f64()
        )
    });
    bar.inc(1);
}

/// A bar of the weight bytes loaded over all ranks, drawn from `progress` until dropped.
pub struct LoadBar {
    done: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
}

impl LoadBar {
    pub fn new(progress: LoadProgress) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let watching = done.clone();
        let watcher = std::thread::spawn(move || {
            let bar = ProgressBar::new(0);
            let template = "{prefix:>7} {bar:40} {bytes}/{total_bytes}, {elapsed} elapsed, ~{eta} left";
            bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
            bar.set_prefix("weights");
            while !watching.load(Ordering::Relaxed) {
                // The total is known once the plan fits, before the first weight is read.
                let total = progress.total();
                if total > 0 {
                    bar.set_length(total);
                    bar.set_position(progress.placed().min(total));
                }
                // Woken at once when the bar is dropped.
                std::thread::park_timeout(Duration::from_millis(100));
            }
            bar.finish_and_clear();
        });
        Self {
            done,
            watcher: Some(watcher),
        }
    }
}

impl Drop for LoadBar {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(watcher) = self.watcher.take() {
            watcher.thread().unpark();
            let _ = watcher.join();
        }
    }
}

/// The wall time of each stage of a run, in order.
#[derive(Default)]
pub struct Stages(Vec<(&'static str, Duration)>);

impl Stages {
    /// Runs `f` as stage `name`, timing it.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.0.push((name, start.elapsed()));
        out
    }

    /// One line: each stage's seconds and the total.
    pub fn summary(&self) -> String {
        let total: Duration = self.0.iter().map(|(_, d)| *d).sum();
        let stages: Vec<String> = self
            .0
            .iter()
            .map(|(name, d)| format!("{name} {:.2} s", d.as_secs_f64()))
            .collect();
        format!("time: {} (total {:.2} s)", stages.join(", "), total.as_secs_f64())
    }
}
