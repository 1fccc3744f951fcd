//! `tpinfer-bench decode-profile --tp 2` on CPU rank threads with a tiny model: every rank's
//! step and the all-reduces' share come out with sane numbers.

use std::process::Command;

use tpinfer_tests::TinyLlama;

#[test]
fn decode_profile_at_tp_2_times_every_rank_and_the_sums() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args([
            "decode-profile",
            "--tp",
            "2",
            "--steps",
            "4",
            "--prompt-tokens",
            "6",
            "--model",
        ])
        .arg(&model)
        .output()
        .expect("run tpinfer-bench");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let table = String::from_utf8_lossy(&run.stdout);
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("| {name}")))
            .unwrap_or_else(|| panic!("no row {name:?} in\n{table}"))
            .split('|')
            .map(str::trim)
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let step = row("decode step");
    let per_rank: Vec<f64> = step[2].split(" / ").map(|ms| ms.parse().expect("ms")).collect();
    assert_eq!(per_rank.len(), 2, "one time per rank: {step:?}");
    assert!(per_rank.iter().all(|&ms| ms > 0.0 && ms < 10_000.0), "{step:?}");
    let layers = TinyLlama::default().layers;
    let sums = row("all-reduce");
    assert!(sums[3].starts_with(&format!("x{} = ", 2 * layers + 2)), "{sums:?}");
}
