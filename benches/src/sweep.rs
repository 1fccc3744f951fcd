//! `tpinfer-bench sweep`: a grid of runs from a small TOML file, each point measured after a
//! warm-up, written as JSON and CSV with plots (SVG and PNG).
//!
//! ```toml
//! [llama]                       # TP width × prompt length × new tokens (× batch: 1 only)
//! model = "path/to/llama"
//! tp = [1, 2]
//! prompt = [128, 2048]
//! new = [256]
//! cuda = true
//! dtype = "bf16"
//! repeats = 3
//!
//! [dit]                         # TP width × frames × size × steps
//! model = "path/to/wan/transformer"
//! tp = [1, 2]
//! frames = [21, 41, 81]
//! size = ["832x480"]
//! steps = [4]
//! cuda = true
//! repeats = 2
//! ```
//!
//! `baseline = true` in a grid also runs the reference implementation on the same shapes
//! (`scripts/reference/reference_llama.py speed`: transformers; `scripts/reference/reference_wan.py forward`:
//! diffusers; `python` and `scripts` say where they are) and reports each point's ratio.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use serde::{Deserialize, Serialize};
use tpinfer_engine::{GenerateRequest, Prompt, Solver, StreamEvent, VideoEngine, VideoRequest, VideoShape};

use crate::plots;

#[derive(Args)]
pub struct SweepArgs {
    /// The grid, as TOML: `[llama]` (model, tp, prompt, new, batch, cuda, dtype, repeats)
    /// and/or `[dit]` (model, tp, frames, size, steps, cuda, dtype, repeats); see the README.
    #[arg(long)]
    config: PathBuf,
    /// Folder for sweep.json, sweep.csv and the plots.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepConfig {
    llama: Option<LlamaGrid>,
    dit: Option<DitGrid>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LlamaGrid {
    model: PathBuf,
    tp: Vec<usize>,
    prompt: Vec<usize>,
    new: Vec<usize>,
    #[serde(default = "one")]
    batch: Vec<usize>,
    #[serde(default)]
    cuda: bool,
    dtype: Option<String>,
    #[serde(default = "three")]
    repeats: usize,
    /// Also run the reference implementation on the same shapes.
    #[serde(default)]
    baseline: bool,
    #[serde(default = "python")]
    python: String,
    /// The folder of `reference_llama.py` and `reference_wan.py`.
    #[serde(default = "scripts")]
    scripts: PathBuf,
}

/// Where the reference implementation is.
struct Reference<'a> {
    python: &'a str,
    scripts: &'a Path,
}

fn python() -> String {
    "python3".into()
}

fn scripts() -> PathBuf {
    "scripts/reference".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DitGrid {
    model: PathBuf,
    tp: Vec<usize>,
    frames: Vec<usize>,
    size: Vec<String>,
    #[serde(default = "one")]
    steps: Vec<usize>,
    #[serde(default)]
    cuda: bool,
    dtype: Option<String>,
    #[serde(default = "three")]
    repeats: usize,
    /// Also run the reference implementation on the same shapes.
    #[serde(default)]
    baseline: bool,
    #[serde(default = "python")]
    python: String,
    /// The folder of `reference_llama.py` and `reference_wan.py`.
    #[serde(default = "scripts")]
    scripts: PathBuf,
}

fn one() -> Vec<usize> {
    vec![1]
}

fn three() -> usize {
    3
}

/// Median and spread of a measurement over the repeats.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stat {
    fn of(values: &[f64]) -> Result<Self> {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        match (v.first(), v.last()) {
            (Some(&min), Some(&max)) => Ok(Self {
                median: v[v.len() / 2],
                min,
                max,
            }),
            _ => bail!("no measurements (repeats must be at least 1)"),
        }
    }
}

/// One rank's device memory: the plan, and the measured peak on GPUs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub planned_mib: f64,
    pub measured_mib: Option<f64>,
}

/// One point of the grid.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "model")]
pub enum Point {
    #[serde(rename = "llama")]
    Llama {
        tp: usize,
        prompt: usize,
        new: usize,
        batch: usize,
        prefill_ms: Stat,
        decode_tokens_per_s: Stat,
        /// Rank 0's host time in collectives over the request's time.
        collective_share: Stat,
        memory: Vec<RankMemory>,
        /// transformers on one GPU, same shapes, and tpinfer's median over it.
        baseline: Option<LlamaBaseline>,
    },
    #[serde(rename = "dit")]
    Dit {
        tp: usize,
        frames: usize,
        width: usize,
        height: usize,
        steps: usize,
        video_tokens: usize,
        /// One denoising step (two forwards: CFG).
        step_ms: Stat,
        total_ms: Stat,
        /// Rank 0's host time in collectives over the step's time.
        collective_share: Stat,
        memory: Vec<RankMemory>,
        /// diffusers on one GPU, same latents, and tpinfer's median step over its step.
        baseline: Option<DitBaseline>,
    },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LlamaBaseline {
    pub prefill_ms: f64,
    #[serde(alias = "decode_tok_s")]
    pub decode_tokens_per_s: f64,
    /// tpinfer's prefill ms over the baseline's (below 1: faster).
    #[serde(default)]
    pub prefill_ratio: f64,
    /// tpinfer's decode tok/s over the baseline's (above 1: faster).
    #[serde(default)]
    pub decode_ratio: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct DitBaseline {
    /// Two forwards (CFG), the scheduler's step not included.
    pub step_ms: f64,
    /// tpinfer's step ms over the baseline's (below 1: faster).
    pub step_ratio: f64,
}

pub fn run(args: SweepArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.config).with_context(|| format!("reading {}", args.config.display()))?;
    let config: SweepConfig = toml::from_str(&text).with_context(|| format!("parsing {}", args.config.display()))?;
    if config.llama.is_none() && config.dit.is_none() {
        bail!("{}: give a [llama] and/or a [dit] grid", args.config.display());
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut points = Vec::new();
    if let Some(grid) = &config.llama {
        llama(grid, &mut points)?;
    }
    if let Some(grid) = &config.dit {
        dit(grid, &mut points)?;
    }
    let json = serde_json::to_string_pretty(&points)?;
    std::fs::write(args.out.join("sweep.json"), json)?;
    std::fs::write(args.out.join("sweep.csv"), csv(&points))?;
    plots::draw(&points, &args.out)?;
    eprintln!("wrote {} points to {}", points.len(), args.out.display());
    Ok(())
}

fn dtype(name: &Option<String>) -> Result<Option<crate::DtypeArg>> {
    Ok(match name.as_deref() {
        None => None,
        Some("f32") => Some(crate::DtypeArg::F32),
        Some("f16") => Some(crate::DtypeArg::F16),
        Some("bf16") => Some(crate::DtypeArg::Bf16),
        Some(other) => bail!("dtype `{other}`: f32, f16 or bf16"),
    })
}

fn memory(measured: Vec<Option<tpinfer_engine::DeviceMemory>>, planned: &tpinfer_engine::Plan) -> Vec<RankMemory> {
    planned
        .ranks
        .iter()
        .zip(measured)
        .map(|(p, m)| RankMemory {
            rank: p.rank,
            planned_mib: tpinfer_plan::mib(p.total()),
            measured_mib: m.map(|m| tpinfer_plan::mib(m.peak())),
        })
        .collect()
}

fn llama(grid: &LlamaGrid, points: &mut Vec<Point>) -> Result<()> {
    if let Some(&batch) = grid.batch.iter().find(|&&b| b != 1) {
        bail!(
            "[llama] batch {batch}: the engine serves one sequence at a time; plan larger batches with \
             `tpinfer plan --batch {batch}`"
        );
    }
    let longest = grid.prompt.iter().max().copied().unwrap_or(0) + grid.new.iter().max().copied().unwrap_or(0);
    let mut baselines = std::collections::HashMap::new();
    if grid.baseline {
        for &prompt in &grid.prompt {
            for &new in &grid.new {
                baselines.insert((prompt, new), llama_baseline(grid, prompt, new)?);
            }
        }
    }
    for &tp in &grid.tp {
        let engine = crate::builder(&grid.model, tp, grid.cuda, dtype(&grid.dtype)?)
            .max_context(longest)
            .build()
            .with_context(|| format!("loading {} at TP {tp}", grid.model.display()))?;
        for &prompt in &grid.prompt {
            for &new in &grid.new {
                let ids = crate::prompt(&engine, prompt);
                let (mut prefill, mut decode, mut share) = (Vec::new(), Vec::new(), Vec::new());
                for run in 0..=grid.repeats {
                    let request = GenerateRequest::new(Prompt::Tokens(ids.clone()), new);
                    let mut stats = None;
                    for event in engine.generate(request)? {
                        if let StreamEvent::Done(s) = event? {
                            stats = Some(s);
                        }
                    }
                    let stats = stats.context("generation ended without stats")?;
                    if run > 0 {
                        prefill.push(stats.prefill.as_secs_f64() * 1e3);
                        decode.push(stats.decode_tokens_per_second());
                        let total = (stats.prefill + stats.decode).as_secs_f64();
                        share.push(stats.collectives.as_secs_f64() / total.max(1e-9));
                    }
                }
                let (prefill_ms, decode_tokens_per_s) = (Stat::of(&prefill)?, Stat::of(&decode)?);
                let baseline = baselines.get(&(prompt, new)).map(|b: &LlamaBaseline| LlamaBaseline {
                    prefill_ratio: prefill_ms.median / b.prefill_ms,
                    decode_ratio: decode_tokens_per_s.median / b.decode_tokens_per_s,
                    ..*b
                });
                let point = Point::Llama {
                    tp,
                    prompt,
                    new,
                    batch: 1,
                    prefill_ms,
                    decode_tokens_per_s,
                    collective_share: Stat::of(&share)?,
                    memory: memory(engine.device_memory(), engine.plan()),
                    baseline,
                };
                eprintln!(
                    "llama TP {tp}, prompt {prompt}, {new} new: prefill {:.1} ms, decode {:.1} tok/s",
                    prefill_ms.median, decode_tokens_per_s.median
                );
                points.push(point);
            }
        }
    }
    Ok(())
}

fn parse_size(size: &str) -> Result<(usize, usize)> {
    let (w, h) = size
        .split_once(['x', 'X'])
        .with_context(|| format!("size `{size}`: WIDTHxHEIGHT"))?;
    Ok((w.trim().parse()?, h.trim().parse()?))
}

/// Seeded text states `[512, text_dim]` standing in for umT5's (speed does not depend on them).
fn text_states(model: &Path, seed: u64) -> Result<Tensor> {
    let config = tpinfer_wan::WanConfig::from_dir(model).map_err(|e| anyhow::anyhow!("{e}"))?;
    let noise = tpinfer_wan::sampler::seeded_noise(&[512, config.text_dim], seed)?;
    Ok((noise * 0.5)?.to_device(&Device::Cpu)?)
}

fn dit(grid: &DitGrid, points: &mut Vec<Point>) -> Result<()> {
    let (text, negative) = (text_states(&grid.model, 1)?, text_states(&grid.model, 2)?);
    let mut baselines = std::collections::HashMap::new();
    for &tp in &grid.tp {
        for size in &grid.size {
            let (width, height) = parse_size(size)?;
            for &frames in &grid.frames {
                if grid.baseline && !baselines.contains_key(&(frames, width, height)) {
                    baselines.insert((frames, width, height), dit_baseline(grid, frames, size)?);
                }
                let shape = VideoShape { frames, width, height };
                let builder = crate::builder(&grid.model, tp, grid.cuda, dtype(&grid.dtype)?);
                let engine = VideoEngine::start(builder, shape)
                    .with_context(|| format!("loading {} at TP {tp} for {frames} frames", grid.model.display()))?;
                for &steps in &grid.steps {
                    let (mut step, mut total, mut share) = (Vec::new(), Vec::new(), Vec::new());
                    for run in 0..=grid.repeats {
                        let request = VideoRequest {
                            text: text.clone(),
                            negative: Some(negative.clone()),
                            steps,
                            shift: 5.0,
                            guide_scale: 5.0,
                            solver: Solver::UniPc(2),
                            seed: 7,
                            init_latents: None,
                        };
                        let mut reports = Vec::new();
                        let start = std::time::Instant::now();
                        let latents = engine.generate(request, |r| reports.push(r))?;
                        let elapsed = start.elapsed().as_secs_f64() * 1e3;
                        if latents.dtype() != DType::F32 || latents.dims() != engine.latent_shape() {
                            bail!("latents {:?} {:?} at TP {tp}", latents.dtype(), latents.dims());
                        }
                        if run > 0 {
                            for r in &reports {
                                step.push(r.elapsed.as_secs_f64() * 1e3);
                                share.push(r.collectives.as_secs_f64() / r.elapsed.as_secs_f64().max(1e-9));
                            }
                            total.push(elapsed);
                        }
                    }
                    let [_, f, h, w] = engine.latent_shape();
                    let step_ms = Stat::of(&step)?;
                    let baseline = baselines.get(&(frames, width, height)).map(|&base: &f64| DitBaseline {
                        step_ms: base,
                        step_ratio: step_ms.median / base,
                    });
                    let point = Point::Dit {
                        tp,
                        frames,
                        width,
                        height,
                        steps,
                        video_tokens: f * (h / 2) * (w / 2),
                        step_ms,
                        total_ms: Stat::of(&total)?,
                        collective_share: Stat::of(&share)?,
                        memory: memory(engine.device_memory(), engine.plan()),
                        baseline,
                    };
                    eprintln!(
                        "dit TP {tp}, {frames} frames at {width}x{height}, {steps} steps: {:.1} ms a step",
                        step_ms.median
                    );
                    points.push(point);
                }
            }
        }
    }
    Ok(())
}

/// Runs the reference script `script` with `args`; its failure is an error carrying the end
/// of what it printed.
fn run_script(reference: &Reference, script: &str, args: &[String]) -> Result<()> {
    let path = reference.scripts.join(script);
    let output = std::process::Command::new(reference.python)
        .arg(&path)
        .args(args)
        .output()
        .with_context(|| format!("running {} {}", reference.python, path.display()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        bail!(
            "the baseline `{} {} {}` failed ({}): {}",
            reference.python,
            path.display(),
            args.join(" "),
            output.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        );
    }
    Ok(())
}

/// [`run_script`], then what it wrote to `json` (its `--out-json`).
fn reference_report(reference: &Reference, script: &str, args: &[String], json: &Path) -> Result<serde_json::Value> {
    run_script(reference, script, args)?;
    let text = std::fs::read_to_string(json).with_context(|| format!("the baseline wrote no {}", json.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn llama_baseline(grid: &LlamaGrid, prompt: usize, new: usize) -> Result<LlamaBaseline> {
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("baseline.json");
    let args = [
        "speed".to_string(),
        "--model".into(),
        grid.model.display().to_string(),
        "--prompt-tokens".into(),
        prompt.to_string(),
        "--prefill-tokens".into(),
        prompt.to_string(),
        "--new-tokens".into(),
        new.to_string(),
        "--out-json".into(),
        json.display().to_string(),
    ];
    let refs = Reference {
        python: &grid.python,
        scripts: &grid.scripts,
    };
    let value = reference_report(&refs, "reference_llama.py", &args, &json)?;
    Ok(serde_json::from_value(value)?)
}

/// diffusers' step for `frames` at `size`: two forwards (CFG) of the same latents.
fn dit_baseline(grid: &DitGrid, frames: usize, size: &str) -> Result<f64> {
    let dir = tempfile::tempdir()?;
    let path = |name: &str| dir.path().join(name).display().to_string();
    let (inputs, json) = (path("inputs.st"), dir.path().join("baseline.json"));
    let make = [
        "inputs".to_string(),
        "--frames".into(),
        frames.to_string(),
        "--size".into(),
        size.to_string(),
        "--out".into(),
        inputs.clone(),
    ];
    let refs = Reference {
        python: &grid.python,
        scripts: &grid.scripts,
    };
    run_script(&refs, "reference_wan.py", &make)?;
    if !Path::new(&inputs).exists() {
        bail!("the baseline's `reference_wan.py inputs` wrote no {inputs}");
    }
    let forward = [
        "forward".to_string(),
        "--model".into(),
        grid.model.display().to_string(),
        "--inputs".into(),
        inputs,
        "--dtype".into(),
        grid.dtype.clone().unwrap_or_else(|| "bf16".into()),
        "--repeats".into(),
        grid.repeats.max(1).to_string(),
        "--out".into(),
        path("velocity.st"),
        "--out-json".into(),
        json.display().to_string(),
    ];
    let value = reference_report(&refs, "reference_wan.py", &forward, &json)?;
    let ms = value["ms_per_forward"]
        .as_f64()
        .context("the baseline's report lacks ms_per_forward")?;
    Ok(2.0 * ms)
}

/// One row per point and rank.
fn csv(points: &[Point]) -> String {
    let mut out = String::from(
        "model,tp,prompt,new,frames,width,height,steps,rank,prefill_ms,decode_tok_s,step_ms,step_ms_min,step_ms_max,\
         total_ms,collective_share,planned_mib,measured_mib,prefill_ratio,decode_ratio,step_ratio\n",
    );
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
    for point in points {
        match point {
            Point::Llama {
                tp,
                prompt,
                new,
                prefill_ms,
                decode_tokens_per_s,
                collective_share,
                memory,
                baseline,
                ..
            } => {
                let ratios = baseline.map_or(",,".into(), |b| {
                    format!("{:.4},{:.4},", b.prefill_ratio, b.decode_ratio)
                });
                for m in memory {
                    out.push_str(&format!(
                        "llama,{tp},{prompt},{new},,,,,{},{:.3},{:.3},,,,,{:.4},{:.1},{},{ratios}\n",
                        m.rank,
                        prefill_ms.median,
                        decode_tokens_per_s.median,
                        collective_share.median,
                        m.planned_mib,
                        opt(m.measured_mib)
                    ));
                }
            }
            Point::Dit {
                tp,
                frames,
                width,
                height,
                steps,
                step_ms,
                total_ms,
                collective_share,
                memory,
                baseline,
                ..
            } => {
                let ratio = baseline.map_or(String::new(), |b| format!("{:.4}", b.step_ratio));
                for m in memory {
                    out.push_str(&format!(
                        "dit,{tp},,,{frames},{width},{height},{steps},{},,,{:.3},{:.3},{:.3},{:.3},{:.4},{:.1},{},,,{ratio}\n",
                        m.rank,
                        step_ms.median,
                        step_ms.min,
                        step_ms.max,
                        total_ms.median,
                        collective_share.median,
                        m.planned_mib,
                        opt(m.measured_mib)
                    ));
                }
            }
        }
    }
    out
}
