use std::process::Command;
use std::time::Duration;

use crate::{
    nccl_debug_lines, parse_topology, run_bounded, verdict, ChildOutcome, Inventory, PlanCheck, Report, SmokeOutcome,
    SmokeRun, SMOKE_JOINED,
};

/// What `tpinfer doctor` is asked to check.
pub struct DoctorOptions {
    /// The deadline of each smoke-test child.
    pub timeout: Duration,
    /// Also run every smoke test with `NCCL_P2P_DISABLE=1`, to measure the difference.
    pub p2p_compare: bool,
    /// A placement whose ranks (rank i on GPU i) must fit the GPUs' free memory.
    pub plan: Option<tpinfer_plan::Plan>,
}

/// The command of a child process that runs the NCCL smoke test over `gpus` and writes its
/// [`SmokeOutcome`] as JSON to `report` (not stdout, where NCCL_DEBUG output interleaves).
pub type SmokeChild<'a> = &'a dyn Fn(&[usize], &std::path::Path) -> Command;

/// Runs every check, the smoke tests through `smoke_child`.
pub fn diagnose(options: &DoctorOptions, smoke_child: SmokeChild) -> Report {
    let inventory = probe_inventory();
    let links = links(&inventory);
    let mut smoke = Vec::new();
    if cfg!(feature = "nccl") && inventory.gpus.len() >= 2 && inventory.driver_error.is_none() {
        let n = inventory.gpus.len();
        let mut groups: Vec<Vec<usize>> = vec![(0..n).collect()];
        if n > 2 {
            groups.extend((0..n).flat_map(|i| (i + 1..n).map(move |j| vec![i, j])));
        }
        for gpus in groups {
            let run = smoke_run(&gpus, false, options.timeout, smoke_child);
            let no_p2p = gpus
                .iter()
                .any(|&i| gpus.iter().any(|&j| !inventory.can_access_peer[i][j]));
            let passed = matches!(run.outcome, SmokeOutcome::Passed { .. });
            smoke.push(run);
            if options.p2p_compare || no_p2p || !passed {
                smoke.push(smoke_run(&gpus, true, options.timeout, smoke_child));
            }
        }
    }
    let plan_check = match &options.plan {
        Some(plan) => plan
            .ranks
            .iter()
            .zip(&inventory.gpus)
            .map(|(rank, gpu)| PlanCheck {
                rank: rank.rank,
                gpu: gpu.ordinal,
                needed: rank.total(),
                available: gpu.free_bytes + plan.device.context_reserve,
            })
            .collect(),
        None => Vec::new(),
    };
    let mut report = Report {
        inventory,
        links,
        smoke,
        plan_check,
        env: crate::relevant_env(),
        findings: Vec::new(),
    };
    report.findings = verdict(&report);
    report
}

#[cfg(feature = "cuda")]
fn probe_inventory() -> Inventory {
    crate::inventory()
}

#[cfg(not(feature = "cuda"))]
fn probe_inventory() -> Inventory {
    Inventory::default()
}

fn smoke_run(gpus: &[usize], p2p_disabled: bool, timeout: Duration, child: SmokeChild) -> SmokeRun {
    let report = std::env::temp_dir().join(format!(
        "tpinfer-smoke-{}-{}-{}.json",
        std::process::id(),
        gpus.iter().map(usize::to_string).collect::<Vec<_>>().join("_"),
        u8::from(p2p_disabled)
    ));
    let _ = std::fs::remove_file(&report);
    let mut command = child(gpus, &report);
    if std::env::var_os("NCCL_DEBUG").is_none() {
        command.env("NCCL_DEBUG", "INFO");
    }
    if p2p_disabled {
        command.env("NCCL_P2P_DISABLE", "1");
    }
    let outcome = match run_bounded(command, timeout) {
        Ok(outcome) => {
            let written = std::fs::read_to_string(&report).ok();
            let _ = std::fs::remove_file(&report);
            smoke_outcome(gpus.len(), outcome, timeout, written)
        }
        Err(e) => SmokeOutcome::Failed {
            error: format!("cannot start the smoke-test child: {e}"),
            nccl_log: Vec::new(),
        },
    };
    SmokeRun {
        gpus: gpus.to_vec(),
        p2p_disabled,
        outcome,
    }
}

/// What a smoke-test child's end means: its own `report`, a failure with NCCL's last words, or
/// a hang naming the ranks that never joined.
pub fn smoke_outcome(world: usize, child: ChildOutcome, timeout: Duration, report: Option<String>) -> SmokeOutcome {
    match child {
        ChildOutcome::Exited {
            code: Some(0),
            stdout,
            stderr,
        } => {
            let log = nccl_debug_lines(&format!("{stdout}\n{stderr}"));
            let Some(report) = report else {
                return SmokeOutcome::Failed {
                    error: "the smoke-test child exited without writing its report".into(),
                    nccl_log: log,
                };
            };
            match serde_json::from_str::<SmokeOutcome>(&report) {
                Ok(SmokeOutcome::Failed { error, .. }) => SmokeOutcome::Failed { error, nccl_log: log },
                Ok(outcome) => outcome,
                Err(e) => SmokeOutcome::Failed {
                    error: format!("unreadable smoke-test report ({e})"),
                    nccl_log: log,
                },
            }
        }
        ChildOutcome::Exited { code, stdout, stderr } => {
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty() && !l.contains("NCCL INFO"))
                .unwrap_or("no message");
            SmokeOutcome::Failed {
                error: format!("the smoke-test child exited with {code:?}: {last}"),
                nccl_log: nccl_debug_lines(&format!("{stdout}\n{stderr}")),
            }
        }
        ChildOutcome::TimedOut { stdout, stderr } => {
            let joined: Vec<usize> = stderr
                .lines()
                .filter_map(|l| l.split(SMOKE_JOINED).nth(1))
                .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
                .collect();
            let missing: Vec<usize> = (0..world).filter(|r| !joined.contains(r)).collect();
            SmokeOutcome::Hung {
                seconds: timeout.as_secs_f64(),
                stage: match missing.is_empty() {
                    true => "the all-reduces".into(),
                    false => "NCCL init".into(),
                },
                missing,
                nccl_log: nccl_debug_lines(&format!("{stdout}\n{stderr}")),
            }
        }
    }
}

/// `nvidia-smi topo -m`'s links, re-indexed by CUDA ordinal through the PCI bus ids (nvidia-smi
/// numbers GPUs in PCI order, CUDA by its own order and CUDA_VISIBLE_DEVICES).
fn links(inventory: &Inventory) -> Option<Vec<Vec<String>>> {
    let output = |args: &[&str]| match run_bounded(
        {
            let mut c = Command::new("nvidia-smi");
            c.args(args);
            c
        },
        Duration::from_secs(20),
    ) {
        Ok(ChildOutcome::Exited {
            code: Some(0), stdout, ..
        }) => Some(stdout),
        _ => None,
    };
    let matrix = parse_topology(&output(&["topo", "-m"])?)?;
    let buses = output(&["--query-gpu=index,pci.bus_id", "--format=csv,noheader"])?;
    // "00000000:18:00.0" (nvidia-smi) and "0000:18:00.0" (CUDA) end alike.
    let tail = |id: &str| {
        id.trim()
            .to_ascii_lowercase()
            .rsplit(':')
            .take(2)
            .collect::<Vec<_>>()
            .join(":")
    };
    let smi_index = |bus: &str| {
        buses.lines().find_map(|l| {
            let (index, id) = l.split_once(',')?;
            (tail(id) == tail(bus)).then(|| index.trim().parse::<usize>().ok())?
        })
    };
    let order: Vec<usize> = inventory
        .gpus
        .iter()
        .map(|g| smi_index(&g.pci_bus_id))
        .collect::<Option<_>>()?;
    order
        .iter()
        .map(|&i| {
            order
                .iter()
                .map(|&j| matrix.get(i)?.get(j).map(|l| l.describe()))
                .collect::<Option<_>>()
        })
        .collect()
}
