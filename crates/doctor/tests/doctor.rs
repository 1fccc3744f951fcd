//! The doctor's judgement on reports it cannot produce on a CPU-only machine: PCIe boxes
//! without P2P, hangs, driver mismatches, too little free memory; and the bounded child runs.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a failed expectation is a failed test

use std::process::Command;
use std::time::{Duration, Instant};

use tpinfer_doctor::{
    parse_topology, run_bounded, smoke_outcome, verdict, AllReduceRow, ChildOutcome, GpuInfo, Inventory, Link,
    PlanCheck, Report, Severity, SmokeOutcome, SmokeRun,
};

const FOUR_4090S: &str = "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPHB\tSYS\tSYS\t0-15\t0\t\tN/A
GPU1\tPHB\t X \tSYS\tSYS\t0-15\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tPIX\t16-31\t1\t\tN/A
GPU3\tSYS\tSYS\tPIX\t X \t16-31\t1\t\tN/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
";

// As the H200 test host prints it: the header underlined with ANSI escapes.
const TWO_H200S: &str = "\t\u{1b}[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\u{1b}[0m
GPU0     X      NV18    0-31    0               N/A
GPU1    NV18     X      0-31    0               N/A
";

fn gpu(ordinal: usize) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: "NVIDIA GeForce RTX 4090".into(),
        compute_capability: (8, 9),
        total_bytes: 24 << 30,
        free_bytes: 23 << 30,
        pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + ordinal),
    }
}

fn inventory(gpus: usize, p2p: bool) -> Inventory {
    Inventory {
        built_for_cuda: Some(13000),
        driver_cuda: Some(13000),
        nccl_version: Some(22809),
        cudnn_version: Some(91900),
        driver_error: None,
        gpus: (0..gpus).map(gpu).collect(),
        can_access_peer: (0..gpus).map(|i| (0..gpus).map(|j| i == j || p2p).collect()).collect(),
        libraries: Vec::new(),
    }
}

fn passed() -> SmokeOutcome {
    SmokeOutcome::Passed {
        init_ms: 900.0,
        sum_correct: true,
        table: vec![AllReduceRow {
            bytes: 8 << 10,
            micros: 30.0,
            algbw_gbs: 0.27,
            busbw_gbs: 0.27,
        }],
    }
}

fn report(inventory: Inventory, smoke: Vec<SmokeRun>) -> Report {
    Report {
        inventory,
        smoke,
        ..Report::default()
    }
}

#[test]
fn topology_of_a_pcie_box_and_an_nvlink_box() {
    let pcie = parse_topology(FOUR_4090S).expect("parses");
    assert_eq!(pcie.len(), 4);
    assert_eq!(pcie[0][1], Link::HostBridge);
    assert_eq!(pcie[0][2], Link::AcrossSockets);
    assert_eq!(pcie[2][3], Link::PcieSwitch);
    assert_eq!(pcie[3][3], Link::Same);
    let nvlink = parse_topology(TWO_H200S).expect("parses");
    assert_eq!(nvlink[0][1], Link::NvLink(18));
    assert!(parse_topology("No devices were found").is_none());
}

#[test]
fn a_healthy_machine_passes() {
    let r = report(
        inventory(2, true),
        vec![SmokeRun {
            gpus: vec![0, 1],
            p2p_disabled: false,
            outcome: passed(),
        }],
    );
    let findings = verdict(&r);
    assert_eq!(findings.len(), 1);
    assert_eq!(findings[0].severity, Severity::Ok);
}

#[test]
fn no_p2p_suggests_disabling_it_and_a_hang_names_the_rank() {
    let hung = SmokeOutcome::Hung {
        seconds: 90.0,
        missing: vec![1],
        stage: "NCCL init".into(),
        nccl_log: vec!["host:1:1 [1] NCCL INFO Channel 00 : 1[1] -> 0[0] via P2P/IPC".into()],
    };
    let r = report(
        inventory(2, false),
        vec![
            SmokeRun {
                gpus: vec![0, 1],
                p2p_disabled: false,
                outcome: hung,
            },
            SmokeRun {
                gpus: vec![0, 1],
                p2p_disabled: true,
                outcome: passed(),
            },
        ],
    );
    let findings = verdict(&r);
    assert_eq!(findings[0].severity, Severity::Error, "{findings:#?}");
    let hang = &findings[0];
    assert!(
        hang.title.contains("hung during NCCL init") && hang.title.contains("[1]"),
        "{}",
        hang.title
    );
    let advice = hang.advice.join("\n");
    assert!(advice.contains("passes with NCCL_P2P_DISABLE=1"), "{advice}");
    assert!(advice.contains("NCCL_IB_DISABLE=1"), "{advice}");
    assert!(advice.contains("via P2P/IPC"), "the NCCL_DEBUG lines: {advice}");
    let p2p = findings
        .iter()
        .find(|f| f.title.contains("cannot access each other's memory"))
        .expect("a P2P warning");
    assert_eq!(p2p.severity, Severity::Warning);
}

#[test]
fn a_missing_cudnn_is_a_warning_that_names_the_fix() {
    let mut inv = inventory(1, true);
    inv.cudnn_version = None;
    let findings = verdict(&report(inv, Vec::new()));
    let missing = findings
        .iter()
        .find(|f| f.title.contains("cuDNN"))
        .expect("a finding about cuDNN");
    assert_eq!(missing.severity, Severity::Warning);
    assert!(
        missing.advice.iter().any(|a| a.contains("LD_LIBRARY_PATH")),
        "{:?}",
        missing.advice
    );
}

#[test]
fn a_gpu_older_than_ampere_is_an_error_that_names_it() {
    let mut inv = inventory(2, true);
    inv.gpus[1].name = "Tesla T4".into();
    inv.gpus[1].compute_capability = (7, 5);
    let findings = verdict(&report(inv.clone(), Vec::new()));
    let old = &findings[0];
    assert_eq!(old.severity, Severity::Error, "{findings:#?}");
    assert!(
        old.title.contains("GPU 1 (Tesla T4) is compute capability 7.5") && old.title.contains("need 8.0"),
        "{}",
        old.title
    );
    assert!(
        old.advice.iter().any(|a| a.contains("--device cpu")),
        "{:?}",
        old.advice
    );
    assert_eq!(
        findings.iter().filter(|f| f.severity == Severity::Error).count(),
        1,
        "GPU 0 (8.9) is fine"
    );
    assert!(inv.gpus[1].runs().starts_with("nothing"), "{}", inv.gpus[1].runs());
}

#[test]
fn what_runs_follows_the_compute_capability() {
    let on = |major, minor| {
        let mut g = gpu(0);
        g.compute_capability = (major, minor);
        g.runs()
    };
    // Ampere has no FP8 tensor cores: FP8 checkpoints run, expanded.
    assert!(on(8, 6).contains("FP8 weights expanded to bf16"), "{}", on(8, 6));
    assert!(on(8, 0).ends_with("no FP8 attention"), "{}", on(8, 0));
    // Ada and Hopper run FP8 weights on their tensor cores, and FP8 attention where this
    // build has the kernel's machine code (a CUDA build; none in a CPU one).
    for (capability, kernel) in [((8, 9), "mma.sync"), ((9, 0), "wgmma")] {
        let runs = on(capability.0, capability.1);
        assert!(runs.contains("FP8 weights on FP8 tensor cores"), "{runs}");
        let attention = tpinfer_kernels::fp8_attention_kernel(capability).is_some();
        assert_eq!(runs.contains(&format!("FP8 attention ({kernel})")), attention, "{runs}");
    }
}

#[test]
fn an_old_driver_is_a_mismatch_with_both_versions() {
    let mut inv = inventory(2, true);
    inv.driver_cuda = Some(12040);
    let findings = verdict(&report(inv, Vec::new()));
    let mismatch = &findings[0];
    assert_eq!(mismatch.severity, Severity::Error);
    assert!(
        mismatch.title.contains("CUDA 12.4") && mismatch.title.contains("CUDA 13.0"),
        "{}",
        mismatch.title
    );
}

#[test]
fn too_little_free_memory_for_the_plan() {
    let mut r = report(inventory(2, true), Vec::new());
    r.plan_check = vec![PlanCheck {
        rank: 1,
        gpu: 1,
        needed: 20 << 30,
        available: 12 << 30,
    }];
    let findings = verdict(&r);
    assert!(
        findings[0]
            .title
            .contains("rank 1 on GPU 1 needs 20.00 GiB but 12.00 GiB is free"),
        "{findings:#?}"
    );
}

#[test]
fn a_hung_child_is_killed_at_its_deadline() {
    let start = Instant::now();
    let mut sleeper = Command::new("sh");
    sleeper.args(["-c", "echo 'tpinfer-smoke: joined rank 0 after 5 ms' >&2; sleep 30"]);
    // The deadline leaves a loaded machine time to start the shell and read its first line:
    // at 500 ms, a run of the whole suite on two busy cores killed it before the line was read.
    let outcome = run_bounded(sleeper, Duration::from_secs(2)).expect("spawn");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "killed at the deadline, not after the 30 s sleep"
    );
    assert!(matches!(outcome, ChildOutcome::TimedOut { .. }));
    // Rank 0 joined, rank 1 did not: the report names rank 1 and the stage.
    match smoke_outcome(2, outcome, Duration::from_secs(2), None) {
        SmokeOutcome::Hung { missing, stage, .. } => {
            assert_eq!(missing, vec![1]);
            assert_eq!(stage, "NCCL init");
        }
        other => panic!("expected a hang, got {other:?}"),
    }
    let mut failing = Command::new("sh");
    failing.args([
        "-c",
        "echo 'host:9:9 [0] NCCL WARN Cuda failure out of memory' >&2; echo 'cannot init' >&2; exit 3",
    ]);
    let outcome = run_bounded(failing, Duration::from_secs(10)).expect("spawn");
    match smoke_outcome(2, outcome, Duration::from_secs(10), None) {
        SmokeOutcome::Failed { error, nccl_log } => {
            assert!(error.contains("Some(3)") && error.contains("cannot init"), "{error}");
            assert_eq!(nccl_log.len(), 1);
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// The child's report comes in its own file: NCCL_DEBUG=INFO output on stdout is only its log.
#[test]
fn a_smoke_report_beside_nccl_debug_output() {
    let report = serde_json::to_string(&passed()).expect("json");
    let log = "host:1:1 [0] NCCL INFO Bootstrap: Using eth0\nhost:1:1 [0] NCCL INFO comm 0x1 rank 0\n";
    let exited = || ChildOutcome::Exited {
        code: Some(0),
        stdout: log.to_string(),
        stderr: String::new(),
    };
    let read = smoke_outcome(2, exited(), Duration::from_secs(1), Some(report.clone()));
    assert_eq!(serde_json::to_string(&read).expect("json"), report);
    match smoke_outcome(2, exited(), Duration::from_secs(1), None) {
        SmokeOutcome::Failed { error, nccl_log } => {
            assert!(error.contains("without writing its report"), "{error}");
            assert_eq!(nccl_log.len(), 2);
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}
