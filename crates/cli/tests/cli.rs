//! `tpinfer generate` end to end: output, exit codes, and errors that never hang or panic.
#![allow(clippy::expect_used)] // test helpers: a failed expectation is a failed test

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tpinfer_tests::TinyLlama;

/// Runs the binary; a run that outlives `limit` is killed and fails the test (a hang).
fn tpinfer(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tpinfer"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tpinfer");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("tpinfer {args:?} hung for {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    let model = model.to_str().expect("utf8 path");
    let mut args = vec!["generate", "--model", model, "--prompt", "hello tensor parallel world"];
    args.extend_from_slice(extra);
    tpinfer(&args, Duration::from_secs(60))
}

fn assert_fails_with(output: &Output, parts: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "must exit non-zero; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "must not panic: {stderr}");
    assert!(stderr.starts_with("error: "), "one clear error: {stderr}");
    for part in parts {
        assert!(stderr.contains(part), "stderr {stderr:?} must mention {part:?}");
    }
}

#[test]
fn generates_and_reports_speed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let output = generate(&model, &["--tp", "3", "--max-new-tokens", "8"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(!output.stdout.is_empty());
    assert!(
        stderr.contains("tp 3: prompt 28 tokens") && stderr.contains("decode 8 tokens"),
        "{stderr}"
    );
    let chat = generate(&model, &["--tp", "2", "--chat", "--max-new-tokens", "3"]);
    assert!(chat.status.success(), "{}", String::from_utf8_lossy(&chat.stderr));
}

#[test]
fn bad_inputs_exit_non_zero_with_the_cause() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    assert_fails_with(
        &generate(&model, &["--tp", "12"]),
        &["8 attention heads", "--tp 8 or less"],
    );
    assert_fails_with(
        &generate(&model, &["--max-context", "8"]),
        &["28 tokens", "--max-context"],
    );
    assert_fails_with(&generate(&dir.path().join("missing"), &[]), &["does not exist"]);
    assert_fails_with(&generate(&model, &["--device", "cuda"]), &["--features cuda,nccl"]);

    let weights = model.join("model.safetensors");
    let bytes = std::fs::read(&weights).expect("read");
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).expect("truncate");
    assert_fails_with(
        &generate(&model, &["--tp", "2"]),
        &["model.safetensors", "truncated or corrupt"],
    );
}
