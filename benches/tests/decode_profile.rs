//! `tpinfer-bench decode-profile` on CPU with a tiny model: at TP 1 every part's row comes out
//! (the argmax and fused-GEMV checks pass); at TP 2 every rank's step and the all-reduces'
//! share come out with sane numbers.

// The helper panics on failure, as the tests themselves do.
#![allow(clippy::expect_used)]

use std::process::Command;

use tpinfer_tests::TinyLlama;

/// The table `decode-profile --tp {tp}` prints for a tiny model.
fn profile(tp: usize) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args([
            "decode-profile",
            "--tp",
            &tp.to_string(),
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
    String::from_utf8_lossy(&run.stdout).into_owned()
}

#[test]
fn decode_profile_at_tp_1_times_every_part() {
    let table = profile(1);
    for part in [
        "decode step, captured graph",
        "the same, the next step queued before the host reads a step",
        "greedy argmax of",
        "embedding lookup",
        "GEMV qkv",
        "GEMV down",
        "gate_up and SiLU product",
        "all weight GEMVs",
        "add_rms_norm",
        "decode attention",
    ] {
        assert!(
            table.lines().any(|l| l.starts_with(&format!("| {part}"))),
            "no row {part:?} in\n{table}"
        );
    }
    // Every tile of the GEMV kernel, and the tile the step uses, for each of the 5 products.
    let gemvs = table.lines().filter(|l| l.contains("tpinfer_kernels::gemv")).count();
    assert_eq!(gemvs, 5 * (tpinfer_kernels::GEMV_TILES.len() + 1) + 1, "{table}");
}

#[test]
fn decode_profile_at_tp_2_times_every_rank_and_the_sums() {
    let table = profile(2);
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
