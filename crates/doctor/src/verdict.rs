use crate::{Finding, Report, Severity, SmokeOutcome};

/// The last `NCCL_DEBUG` lines of a child's stderr: what NCCL was doing when it failed.
pub fn nccl_debug_lines(stderr: &str) -> Vec<String> {
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("NCCL INFO") || l.contains("NCCL WARN") || l.contains("NCCL ERROR"))
        .collect();
    lines[lines.len().saturating_sub(20)..]
        .iter()
        .map(|l| l.to_string())
        .collect()
}

fn version(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn finding(severity: Severity, title: impl Into<String>, advice: Vec<String>) -> Finding {
    Finding {
        severity,
        title: title.into(),
        advice,
    }
}

/// What the report means, most severe first, each with specific advice.
pub fn verdict(report: &Report) -> Vec<Finding> {
    let inv = &report.inventory;
    let mut out = Vec::new();
    let Some(built) = inv.built_for_cuda else {
        out.push(finding(
            Severity::Error,
            "this tpinfer was built for CPU ranks only",
            vec![
                "rebuild with `cargo build --release --features nccl` (or scripts/build/build-cuda.sh) to use GPUs"
                    .into(),
            ],
        ));
        return out;
    };
    if let Some(error) = &inv.driver_error {
        out.push(finding(
            Severity::Error,
            format!("the CUDA driver cannot be used: {error}"),
            vec![
                "check that the NVIDIA driver is installed and `nvidia-smi` lists the GPUs".into(),
                "in a container, run with the GPUs exposed (e.g. `--gpus all`)".into(),
            ],
        ));
        return out;
    }
    if let Some(driver) = inv.driver_cuda {
        if (driver as i64) < built as i64 {
            out.push(finding(
                Severity::Error,
                format!(
                    "driver/library mismatch: the driver supports CUDA {} but this binary's kernels need CUDA {}",
                    version(driver as i64),
                    version(built as i64)
                ),
                vec![
                    format!("install a driver that supports CUDA {} or newer", version(built as i64)),
                    format!(
                        "or rebuild against the CUDA {} toolkit the driver supports",
                        version(driver as i64)
                    ),
                ],
            ));
        }
    }
    if inv.gpus.is_empty() {
        out.push(finding(
            Severity::Error,
            "no CUDA GPU is visible",
            vec!["check CUDA_VISIBLE_DEVICES and `nvidia-smi`".into()],
        ));
    }
    for g in inv
        .gpus
        .iter()
        .filter(|g| g.compute_capability < tpinfer_kernels::MIN_COMPUTE_CAPABILITY)
    {
        let ((major, minor), (need_major, need_minor)) =
            (g.compute_capability, tpinfer_kernels::MIN_COMPUTE_CAPABILITY);
        out.push(finding(
            Severity::Error,
            format!(
                "GPU {} ({}) is compute capability {major}.{minor}: tpinfer's CUDA kernels need {need_major}.{need_minor} \
                 or newer",
                g.ordinal, g.name
            ),
            vec![
                "use Ampere or newer GPUs (A100, RTX 30 and 40 series, L4, L40, H100, H200)".into(),
                "or leave this GPU out (CUDA_VISIBLE_DEVICES), or run on CPU ranks (--device cpu)".into(),
            ],
        ));
    }
    if inv.cudnn_version.is_none() {
        out.push(finding(
            Severity::Warning,
            "cuDNN 9 was not found: the Wan VAE's convolutions fall back to one matrix product per tap, slower than cuDNN's",
            vec![
                "install cuDNN 9 (`pip install nvidia-cudnn-cu13`, or NVIDIA's cudnn9-cuda-13 package) and put the \
                 directory holding libcudnn.so.9 on LD_LIBRARY_PATH"
                    .into(),
            ],
        ));
    }
    for (i, row) in inv.can_access_peer.iter().enumerate() {
        for (j, &ok) in row.iter().enumerate() {
            if i < j && !ok {
                let link = report
                    .links
                    .as_ref()
                    .and_then(|l| l.get(i).and_then(|r| r.get(j)).cloned())
                    .unwrap_or_else(|| "unknown link".into());
                out.push(finding(
                    Severity::Warning,
                    format!("GPUs {i} and {j} cannot access each other's memory (no P2P; link: {link})"),
                    vec![
                        "consumer GPUs over PCIe often lack P2P; NCCL then stages through host memory".into(),
                        "if NCCL init hangs or fails with \"unhandled system error\", set NCCL_P2P_DISABLE=1".into(),
                    ],
                ));
            }
        }
    }
    for run in &report.smoke {
        let gpus = format!("{:?}", run.gpus);
        let with = if run.p2p_disabled {
            " with NCCL_P2P_DISABLE=1"
        } else {
            ""
        };
        let retry_passed = |p2p_disabled: bool| {
            report.smoke.iter().any(|r| {
                r.gpus == run.gpus && r.p2p_disabled == p2p_disabled && matches!(r.outcome, SmokeOutcome::Passed { .. })
            })
        };
        match &run.outcome {
            SmokeOutcome::Passed { sum_correct: false, .. } => out.push(finding(
                Severity::Error,
                format!("NCCL all-reduce over GPUs {gpus}{with} returned wrong sums"),
                vec!["a faulty link or driver: run `nvidia-smi -q` for ECC/XID errors, and NCCL's nccl-tests".into()],
            )),
            SmokeOutcome::Passed { .. } => {}
            SmokeOutcome::Failed { error, nccl_log } => {
                let mut advice = p2p_advice(run.p2p_disabled, retry_passed(true));
                advice.extend(log_advice(nccl_log));
                out.push(finding(
                    Severity::Error,
                    format!("NCCL over GPUs {gpus}{with} failed: {error}"),
                    advice,
                ));
            }
            SmokeOutcome::Hung {
                seconds,
                missing,
                stage,
                nccl_log,
            } => {
                let mut advice = p2p_advice(run.p2p_disabled, retry_passed(true));
                advice.push(
                    "without InfiniBand (consumer boxes), set NCCL_IB_DISABLE=1 so NCCL does not probe it".into(),
                );
                advice.extend(log_advice(nccl_log));
                out.push(finding(
                    Severity::Error,
                    format!(
                        "NCCL over GPUs {gpus}{with} hung during {stage}: rank(s) {missing:?} had not finished after \
                         {seconds:.0} s"
                    ),
                    advice,
                ));
            }
        }
    }
    for check in &report.plan_check {
        if check.needed > check.available {
            out.push(finding(
                Severity::Error,
                format!(
                    "rank {} on GPU {} needs {:.2} GiB but {:.2} GiB is free",
                    check.rank,
                    check.gpu,
                    tpinfer_plan::gib(check.needed),
                    tpinfer_plan::gib(check.available)
                ),
                vec![
                    "free the GPU (other processes: `nvidia-smi`), or run `tpinfer plan` for a placement that fits"
                        .into(),
                ],
            ));
        }
    }
    if out.is_empty() {
        out.push(finding(Severity::Ok, "all checks passed", Vec::new()));
    }
    out.sort_by_key(|f| std::cmp::Reverse(f.severity));
    out
}

fn p2p_advice(p2p_disabled: bool, passes_without_p2p: bool) -> Vec<String> {
    match (p2p_disabled, passes_without_p2p) {
        (false, true) => vec!["it passes with NCCL_P2P_DISABLE=1: set it for this machine".into()],
        (false, false) => vec!["try NCCL_P2P_DISABLE=1 (PCIe GPUs without peer-to-peer access)".into()],
        (true, _) => Vec::new(),
    }
}

fn log_advice(log: &[String]) -> Vec<String> {
    match log.is_empty() {
        true => Vec::new(),
        false => vec![format!("NCCL_DEBUG=INFO said, last:\n      {}", log.join("\n      "))],
    }
}
