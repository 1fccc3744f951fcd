//! `timeline`: each rank's decode step on its GPU as its chain kernels' CTAs saw it (a build with
//! the `timeline` feature: `scripts/build/build-cuda.sh timeline`). Every chain kernel records, per
//! CTA, the global timer when it started, when its chain wait returned and when it ended, and
//! its SM (cuda/chain.cuh); this prints, per kernel of a layer, how early it started before
//! the kernel ahead of it ended, how long after that end its wait returned, and how much of the
//! step it adds, and writes every launch (and on request every CTA) as TSV. Profilers
//! serialize the kernels of a chain; this sees them overlap.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use tpinfer_llama::LlamaRank;

#[derive(Args)]
pub(crate) struct TimelineArgs {
    /// A Llama directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 8)]
    steps: usize,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Ranks, one per GPU (0..tp), NCCL between them: each traces its own step. The
    /// collectives' kernels are not chain kernels and leave no record: the kernel after a sum
    /// adds the sum's time (the peer all-reduce, where built, is traced by its own name).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Where to write every launch's row (TSV, with the rank).
    #[arg(long)]
    out: PathBuf,
    /// Also every CTA's record of the kernels whose names start with this, into OUT.cta.tsv.
    #[arg(long)]
    ctas_of: Option<String>,
    /// The form the model's linear weights are held in (`fp8`: quantized at load).
    #[arg(long, value_enum, default_value_t = crate::WeightsArg::AsStored)]
    weights: crate::WeightsArg,
}

/// CTAs the trace buffer holds (64 bytes each).
const CAPACITY: u64 = 1 << 20;

struct Row {
    name: String,
    ctas: u64,
    go_min: f64,
    go_max: f64,
    end_min: f64,
    end_max: f64,
    sms: usize,
    /// Every CTA's start, ascending.
    starts: Vec<f64>,
}

// A launch has at least one CTA, so `starts` is never empty.
impl Row {
    fn start_min(&self) -> f64 {
        self.starts[0]
    }

    fn start_max(&self) -> f64 {
        self.starts[self.starts.len() - 1]
    }
}

pub(crate) fn run(args: TimelineArgs) -> Result<()> {
    let context = args.prompt_tokens + 2 * (args.steps + 2) + 8;
    // Every rank on its own GPU and thread, NCCL between them (none at TP 1); each traces
    // into its own buffer (the trace is per thread), and the steps keep in step through the sums.
    let checkpoint = tpinfer_llama::LlamaCheckpoint::open_with(&args.model, args.weights.format())?;
    let c = checkpoint.config.clone();
    let prompt = crate::decode::made_up_prompt(&c, args.prompt_tokens);
    let traces = crate::decode::on_ranks(args.tp, true, |comm, device| {
        let shard = tpinfer_llama::LlamaShard::new(&c, args.tp, comm.rank())?;
        checkpoint.check(&shard)?;
        let mut model = LlamaRank::load(&checkpoint, shard, comm, DType::BF16, &device, context)?;
        trace_rank(&mut model, &device, &prompt, &args)
    })?;
    let mut out = std::fs::File::create(&args.out)?;
    writeln!(
        out,
        "rank\tmode\tindex\tname\tctas\tstart_min\tstart_max\tgo_min\tgo_max\tend_min\tend_max\tsms"
    )?;
    let mut ctas_out = match args.ctas_of {
        Some(_) => {
            let mut f = std::fs::File::create(args.out.with_extension("cta.tsv"))?;
            writeln!(
                f,
                "rank\tmode\tindex\tname\tcta\tsm\tstart\tgo\tend\tmark0\tmark1\tmark2\tmark3"
            )?;
            Some(f)
        }
        None => None,
    };
    for (rank, modes) in traces.iter().enumerate() {
        for t in modes {
            for (i, r) in t.rows.iter().enumerate() {
                writeln!(
                    out,
                    "{rank}\t{}\t{i}\t{}\t{}\t{:.0}\t{:.0}\t{:.0}\t{:.0}\t{:.0}\t{:.0}\t{}",
                    t.mode,
                    r.name,
                    r.ctas,
                    r.start_min(),
                    r.start_max(),
                    r.go_min,
                    r.go_max,
                    r.end_min,
                    r.end_max,
                    r.sms
                )?;
            }
            if let Some(f) = &mut ctas_out {
                for (i, cta, fields) in &t.ctas {
                    let fields: Vec<String> = fields.iter().map(|t| t.to_string()).collect();
                    writeln!(
                        f,
                        "{rank}\t{}\t{i}\t{}\t{cta}\t{}",
                        t.mode,
                        t.rows[*i].name,
                        fields.join("\t")
                    )?;
                }
            }
            let label = match args.tp {
                1 => t.mode.to_string(),
                _ => format!("rank {rank} of {}, {}", args.tp, t.mode),
            };
            summarize(&label, t.step_ms, &t.rows);
        }
    }
    Ok(())
}

/// One rank's last traced decode step, replayed as a graph or run eagerly.
struct Trace {
    mode: &'static str,
    step_ms: f64,
    rows: Vec<Row>,
    ctas: CtaRecords,
}

/// Runs `args.steps` decode steps after `prompt` on this thread's rank, as a captured graph and
/// then eagerly, tracing its chain kernels into a buffer of its own.
fn trace_rank(model: &mut LlamaRank, device: &Device, prompt: &[u32], args: &TimelineArgs) -> Result<Vec<Trace>> {
    let buffer = Tensor::zeros(CAPACITY as usize * 16, DType::U32, device)?;
    tpinfer_kernels::trace_to(tpinfer_kernels::device_address(&buffer)?, CAPACITY);
    let mut traces = Vec::new();
    for graphs in [true, false] {
        model.set_cuda_graphs(graphs)?;
        model.clear_cache();
        model.forward(prompt)?;
        device.synchronize()?;
        let begin = std::time::Instant::now();
        for _ in 0..args.steps {
            tpinfer_kernels::trace_step();
            model.forward(&[1])?;
            device.synchronize()?;
        }
        let step_ms = begin.elapsed().as_secs_f64() * 1e3 / args.steps as f64;
        let (rows, ctas) = read(&buffer, args.ctas_of.as_deref())?;
        let mode = if graphs { "graph" } else { "eager" };
        traces.push(Trace {
            mode,
            step_ms,
            rows,
            ctas,
        });
    }
    Ok(traces)
}

/// Per-CTA records of the kernels named `ctas_of…`: launch, CTA, SM, then start, go, end and
/// the marks in ns from the step's first CTA's start (-1: not recorded).
type CtaRecords = Vec<(usize, u64, [i64; 8])>;

/// The last step's rows, times in ns from its first CTA's start, and the CTA records asked for.
fn read(buffer: &Tensor, ctas_of: Option<&str>) -> Result<(Vec<Row>, CtaRecords)> {
    let words = buffer.to_vec1::<u32>()?;
    let at = |cta: u64, field: u64| {
        let i = (8 * cta + field) as usize * 2;
        words[i] as u64 | (words[i + 1] as u64) << 32
    };
    let launches = tpinfer_kernels::trace_launches();
    if launches.is_empty() {
        bail!("no chain kernel was traced");
    }
    let mut rows = Vec::with_capacity(launches.len());
    for l in &launches {
        let (mut starts, mut go, mut end) = (Vec::new(), Vec::new(), Vec::new());
        let mut sms = std::collections::BTreeSet::new();
        for cta in l.first..l.first + l.ctas {
            starts.push(at(cta, 0) as f64);
            // A kernel that never waits (none in a chain) counts from its start.
            go.push(if at(cta, 1) < at(cta, 0) {
                at(cta, 0)
            } else {
                at(cta, 1)
            });
            end.push(at(cta, 2));
            sms.insert(at(cta, 3));
        }
        starts.sort_by(f64::total_cmp);
        // A launch has at least one CTA.
        let min = |v: &[u64]| v.iter().copied().fold(u64::MAX, u64::min) as f64;
        let max = |v: &[u64]| v.iter().copied().fold(0, u64::max) as f64;
        rows.push(Row {
            name: l.name.clone(),
            ctas: l.ctas,
            go_min: min(&go),
            go_max: max(&go),
            end_min: min(&end),
            end_max: max(&end),
            sms: sms.len(),
            starts,
        });
    }
    let t0 = rows.iter().map(Row::start_min).fold(f64::MAX, f64::min);
    for r in &mut rows {
        for t in [&mut r.go_min, &mut r.go_max, &mut r.end_min, &mut r.end_max] {
            *t -= t0;
        }
        for t in &mut r.starts {
            *t -= t0;
        }
    }
    let mut ctas = Vec::new();
    for (i, l) in launches.iter().enumerate() {
        if !ctas_of.is_some_and(|p| l.name.starts_with(p)) {
            continue;
        }
        for cta in l.first..l.first + l.ctas {
            // A mark older than the CTA's start is an earlier step's (a CTA that did not pass it).
            let time = |f| {
                if at(cta, f) < at(cta, 0) {
                    -1
                } else {
                    at(cta, f) as i64 - t0 as i64
                }
            };
            let record = [
                at(cta, 3) as i64,
                time(0),
                time(1),
                time(2),
                time(4),
                time(5),
                time(6),
                time(7),
            ];
            ctas.push((i, cta - l.first, record));
        }
    }
    Ok((rows, ctas))
}

/// Per kernel, named with the kernel before it (the same GEMV after attention and after the
/// MLP are different rows), the mean over its launches (µs): `adds` = its end minus the end of the
/// kernel before it (the step's time it accounts for), `early` = how long before that end its
/// first CTA started, `hop` = from that end to its first wait's return, `run` = from its first
/// wait's return to its end, and the CTAs that started before the kernel ahead ended.
fn summarize(mode: &str, step_ms: f64, rows: &[Row]) {
    let span = rows.last().map_or(0.0, |r| r.end_max) / 1e3;
    println!(
        "\n## {mode}: step {step_ms:.3} ms by the host, {span:.1} µs from the first traced CTA's start to the last one's end, {} launches\n",
        rows.len()
    );
    println!("| kernel | launches | CTAs | SMs | adds µs | early µs | hop µs | run µs | CTAs started early |");
    println!("|---|---|---|---|---|---|---|---|---|");
    #[derive(Default)]
    struct Sum {
        n: usize,
        ctas: u64,
        sms: usize,
        adds: f64,
        early: f64,
        hop: f64,
        run: f64,
        started_early: f64,
    }
    // In order of first appearance.
    let mut sums: Vec<(String, Sum)> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let before = if i == 0 { 0.0 } else { rows[i - 1].end_max };
        let after = if i == 0 { "the step's start" } else { &rows[i - 1].name };
        let key = format!("{} after {after}", r.name);
        let at = match sums.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                sums.push((key, Sum::default()));
                sums.len() - 1
            }
        };
        let s = &mut sums[at].1;
        s.n += 1;
        s.ctas = r.ctas;
        s.sms = r.sms;
        s.adds += r.end_max - before;
        s.early += before - r.start_min();
        s.hop += r.go_min - before;
        s.run += r.end_max - r.go_min;
        s.started_early += r.starts.partition_point(|&t| t < before) as f64;
    }
    for (name, s) in sums {
        let n = s.n as f64;
        println!(
            "| {name} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} |",
            s.n,
            s.ctas,
            s.sms,
            s.adds / n / 1e3,
            s.early / n / 1e3,
            s.hop / n / 1e3,
            s.run / n / 1e3,
            s.started_early / n
        );
    }
}
