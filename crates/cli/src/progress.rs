//! Progress bars for the stages of a run, and the time each stage took.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// A bar for `stage`, counting `len` `unit`s. It draws on a terminal and stays silent in a log.
pub fn bar(stage: &str, len: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    let template =
        format!("{{prefix:>7}} {{bar:40}} {{pos}}/{{len}} {unit}, {{elapsed}} elapsed, ~{{eta}} left {{msg}}");
    bar.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(stage.to_string());
    bar
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
