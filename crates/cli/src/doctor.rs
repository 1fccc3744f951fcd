//! `tpinfer doctor`: GPUs, drivers, libraries, links, bounded NCCL smoke tests and advice.

use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::Result;
use tpinfer_doctor::{diagnose, DoctorOptions, Report, Severity, SmokeOutcome, SMOKE_SIZES};
use tpinfer_plan::{mib, DeviceProfile, Placement, Plan};

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Seconds each NCCL smoke test may take before it is killed and reported as a hang.
    #[arg(long, default_value_t = 90)]
    timeout: u64,
    /// Also run every smoke test with NCCL_P2P_DISABLE=1 and show the difference.
    #[arg(long)]
    p2p_compare: bool,
    /// Check that this model (a directory or a `tpinfer plan` preset) fits the GPUs' free
    /// memory at --tp, rank i on GPU i.
    #[arg(long, requires = "tp")]
    model: Option<String>,
    #[arg(long)]
    tp: Option<usize>,
    /// With --model: the context to plan for (default: the model's, at most 8192).
    #[arg(long)]
    max_context: Option<usize>,
    /// Internal: run one smoke test over these GPUs and write its outcome as JSON to
    /// --smoke-report.
    #[arg(long, hide = true, value_delimiter = ',', requires = "smoke_report")]
    smoke_child: Option<Vec<usize>>,
    #[arg(long, hide = true)]
    smoke_report: Option<std::path::PathBuf>,
}

pub fn doctor(args: DoctorArgs) -> Result<ExitCode> {
    let timeout = Duration::from_secs(args.timeout);
    if let (Some(gpus), Some(report)) = (&args.smoke_child, &args.smoke_report) {
        std::fs::write(report, serde_json::to_string(&smoke_child(gpus, timeout))?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let plan = match (&args.model, args.tp) {
        (Some(model), Some(tp)) => {
            let (_, model) = tpinfer_engine::registry::open(model)?;
            let model = &*model;
            let placement = match (model.default_placement(), args.max_context) {
                (Placement::Llm { batch, .. }, Some(max_context)) => Placement::llm(max_context, batch),
                (placement, _) => placement,
            };
            Some(Plan::new(
                model,
                tp,
                model.default_dtype(),
                placement,
                DeviceProfile::cuda(),
            )?)
        }
        _ => None,
    };
    let exe = std::env::current_exe()?;
    let child = |gpus: &[usize], report: &std::path::Path| {
        let mut command = Command::new(&exe);
        let list: Vec<String> = gpus.iter().map(usize::to_string).collect();
        command
            .args([
                "doctor",
                "--smoke-child",
                &list.join(","),
                "--timeout",
                &args.timeout.to_string(),
            ])
            .arg("--smoke-report")
            .arg(report);
        command
    };
    let options = DoctorOptions {
        timeout,
        p2p_compare: args.p2p_compare,
        plan,
    };
    let report = diagnose(&options, &child);
    match args.json {
        true => println!("{}", serde_json::to_string_pretty(&report)?),
        false => print_report(&report, args.timeout),
    }
    Ok(match report.severity() {
        Severity::Error => ExitCode::FAILURE,
        _ => ExitCode::SUCCESS,
    })
}

#[cfg(feature = "nccl")]
fn smoke_child(gpus: &[usize], timeout: Duration) -> SmokeOutcome {
    // The parent sets NCCL_P2P_DISABLE for the comparison run: the peer paths follow it.
    tpinfer_doctor::run_smoke(gpus, SMOKE_SIZES, timeout, crate::env::comm_options())
}

#[cfg(not(feature = "nccl"))]
fn smoke_child(_gpus: &[usize], _timeout: Duration) -> SmokeOutcome {
    SmokeOutcome::Failed {
        error: format!(
            "this tpinfer was built without NCCL; smoke sizes {SMOKE_SIZES:?} not run: rebuild with --features nccl"
        ),
        nccl_log: Vec::new(),
    }
}

fn version(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn print_report(report: &Report, timeout: u64) {
    let inv = &report.inventory;
    println!("tpinfer doctor\n");
    let built = inv
        .built_for_cuda
        .map_or("CPU ranks only".into(), |v| format!("CUDA {}", version(v as i64)));
    let driver = inv
        .driver_cuda
        .map_or("–".into(), |v| format!("CUDA {}", version(v as i64)));
    let nccl = inv.nccl_version.map_or("–".into(), |v| {
        // NCCL ≥ 2.9 encodes major·10000 + minor·100 + patch.
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    });
    let cudnn = inv.cudnn_version.map_or("not found".into(), |v| {
        // cuDNN ≥ 9 encodes major·10000 + minor·100 + patch.
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    });
    println!("this binary: {built}; driver supports: {driver}; NCCL: {nccl}; cuDNN: {cudnn}");
    if let Some(e) = &inv.driver_error {
        println!("driver error: {e}");
    }
    if !inv.gpus.is_empty() {
        println!("\n| GPU | name | compute capability | free / total memory, MiB | PCI bus | what runs |");
        println!("|---|---|---|---|---|---|");
        for g in &inv.gpus {
            println!(
                "| {} | {} | {}.{} | {:.0} / {:.0} | {} | {} |",
                g.ordinal,
                g.name,
                g.compute_capability.0,
                g.compute_capability.1,
                mib(g.free_bytes),
                mib(g.total_bytes),
                g.pci_bus_id,
                g.runs()
            );
        }
    }
    if !inv.libraries.is_empty() {
        println!("\nlibraries loaded:");
        for (lib, path) in &inv.libraries {
            println!("  {lib:<12} {path}");
        }
    }
    if inv.gpus.len() > 1 {
        println!("\npeer access (cuDeviceCanAccessPeer) and link (nvidia-smi topo -m):\n");
        let header: Vec<String> = inv.gpus.iter().map(|g| format!("GPU{}", g.ordinal)).collect();
        println!("| | {} |", header.join(" | "));
        println!("|---|{}", "---|".repeat(header.len()));
        for (i, row) in inv.can_access_peer.iter().enumerate() {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(j, &p2p)| {
                    if i == j {
                        return "–".into();
                    }
                    let link = report
                        .links
                        .as_ref()
                        .and_then(|l| l.get(i)?.get(j).cloned())
                        .unwrap_or_else(|| "link unknown".into());
                    format!("{}, {link}", if p2p { "P2P" } else { "no P2P" })
                })
                .collect();
            println!("| GPU{i} | {} |", cells.join(" | "));
        }
    }
    if !report.smoke.is_empty() {
        println!("\nNCCL smoke tests (init, all-reduce sums, timings; child processes killed after {timeout} s):");
        for run in &report.smoke {
            let with = if run.p2p_disabled {
                " with NCCL_P2P_DISABLE=1"
            } else {
                ""
            };
            match &run.outcome {
                SmokeOutcome::Passed {
                    init_ms,
                    sum_correct,
                    table,
                } => {
                    println!(
                        "\nGPUs {:?}{with}: init {init_ms:.0} ms, sums {}",
                        run.gpus,
                        if *sum_correct { "correct" } else { "WRONG" }
                    );
                    println!("| message | µs per all-reduce | algorithm GB/s | bus GB/s |");
                    println!("|---:|---:|---:|---:|");
                    for row in table {
                        println!(
                            "| {} KiB | {:.1} | {:.2} | {:.2} |",
                            row.bytes >> 10,
                            row.micros,
                            row.algbw_gbs,
                            row.busbw_gbs
                        );
                    }
                }
                SmokeOutcome::Failed { error, .. } => println!("\nGPUs {:?}{with}: FAILED: {error}", run.gpus),
                SmokeOutcome::Hung {
                    seconds,
                    missing,
                    stage,
                    ..
                } => println!(
                    "\nGPUs {:?}{with}: HUNG in {stage} (killed after {seconds:.0} s); ranks not joined: {missing:?}",
                    run.gpus
                ),
            }
        }
    }
    for check in &report.plan_check {
        println!(
            "\nplan: rank {} on GPU {} needs {:.0} MiB, {:.0} MiB available",
            check.rank,
            check.gpu,
            mib(check.needed),
            mib(check.available)
        );
    }
    if !report.env.is_empty() {
        println!("\nenvironment:");
        for (k, v) in &report.env {
            println!("  {k}={v}");
        }
    }
    println!("\nverdict:");
    for f in &report.findings {
        let tag = match f.severity {
            Severity::Ok => "ok",
            Severity::Warning => "warning",
            Severity::Error => "error",
        };
        println!("  [{tag}] {}", f.title);
        for advice in &f.advice {
            println!("      → {advice}");
        }
    }
}
