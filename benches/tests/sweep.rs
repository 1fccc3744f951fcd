//! `tpinfer-bench sweep` on CPU ranks with tiny models: the grid's every point is measured and
//! written as JSON, CSV and SVG plots with sane numbers (the CI smoke test of the suite).

use std::process::Command;

use serde_json::Value;
use tpinfer_tests::{TinyLlama, TinyWan};

#[test]
fn sweep_on_cpu_ranks_writes_every_point_and_plot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let llama = TinyLlama {
        heads: 4,
        kv_heads: 2,
        ..TinyLlama::default()
    }
    .write(&dir.path().join("llama"));
    let wan = dir.path().join("wan");
    TinyWan::default().write(&wan);
    let config = dir.path().join("sweep.toml");
    std::fs::write(
        &config,
        format!(
            "[llama]\nmodel = {llama:?}\ntp = [1, 2]\nprompt = [8, 20]\nnew = [4]\nrepeats = 2\n\n\
             [dit]\nmodel = {wan:?}\ntp = [1, 2]\nframes = [5, 9]\nsize = [\"64x32\"]\nsteps = [2]\nrepeats = 2\n"
        ),
    )
    .expect("config");
    let out = dir.path().join("out");
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args(["sweep", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run tpinfer-bench");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    let points: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).expect("json")).expect("parse");
    let of = |kind: &str| points.iter().filter(|p| p["model"] == kind).collect::<Vec<_>>();
    let (llama_points, dit_points) = (of("llama"), of("dit"));
    assert_eq!(llama_points.len(), 2 * 2, "TP × prompt × new");
    assert_eq!(dit_points.len(), 2 * 2, "TP × frames × size × steps");
    let stat_ok = |s: &Value| {
        let (lo, mid, hi) = (s["min"].as_f64(), s["median"].as_f64(), s["max"].as_f64());
        matches!((lo, mid, hi), (Some(lo), Some(mid), Some(hi)) if 0.0 < lo && lo <= mid && mid <= hi)
    };
    for p in &llama_points {
        assert!(stat_ok(&p["prefill_ms"]) && stat_ok(&p["decode_tokens_per_s"]), "{p}");
    }
    for p in &dit_points {
        assert!(stat_ok(&p["step_ms"]) && stat_ok(&p["total_ms"]), "{p}");
        // Two steps, each at least as long as the fastest step.
        assert!(p["total_ms"]["median"].as_f64() >= Some(2.0 * p["step_ms"]["min"].as_f64().unwrap_or(0.0)));
    }
    for p in llama_points.iter().chain(&dit_points) {
        let tp = p["tp"].as_u64().expect("tp") as usize;
        // A share of the time: CPU ranks at TP 2 spend some of it summing and waiting.
        let share = &p["collective_share"];
        let within = |v: Option<f64>| v.is_some_and(|v| (0.0..=1.0).contains(&v));
        assert!(within(share["min"].as_f64()) && within(share["max"].as_f64()), "{p}");
        if tp > 1 {
            assert!(share["max"].as_f64() > Some(0.0), "{p}");
        }
        let memory = p["memory"].as_array().expect("memory");
        assert_eq!(memory.len(), tp, "{p}");
        // CPU ranks: planned bytes, nothing measured on a device.
        assert!(memory
            .iter()
            .all(|m| m["planned_mib"].as_f64() > Some(0.0) && m["measured_mib"].is_null()));
    }
    // More frames plan more memory at the same width.
    let planned = |frames: u64, tp: u64| {
        dit_points
            .iter()
            .find(|p| p["frames"] == frames && p["tp"] == tp)
            .and_then(|p| p["memory"][0]["planned_mib"].as_f64())
            .expect("point")
    };
    assert!(planned(9, 1) > planned(5, 1) && planned(5, 1) > planned(5, 2));

    let csv = std::fs::read_to_string(out.join("sweep.csv")).expect("csv");
    let rows: Vec<&str> = csv.lines().collect();
    assert!(rows[0].starts_with("model,tp,"));
    // One row per point and rank: (1 + 2) ranks × 2 points, for each model.
    assert_eq!(rows.len(), 1 + 6 + 6);
    let columns = rows[0].split(',').count();
    assert!(rows.iter().all(|r| r.split(',').count() == columns));

    for (plot, label) in [
        ("dit_step_time.svg", "9 frames 64x32, 2 steps"),
        ("dit_speedup.svg", "5 frames 64x32, 2 steps"),
        ("dit_memory.svg", "TP 2 planned"),
        ("llama_decode.svg", "prompt 20, 4 new"),
        ("llama_prefill.svg", "prompt 8, 4 new"),
    ] {
        let svg = std::fs::read_to_string(out.join(plot)).unwrap_or_else(|e| panic!("{plot}: {e}"));
        assert!(svg.starts_with("<svg") && svg.contains(label), "{plot} lacks `{label}`");
        let png = std::fs::read(out.join(plot.replace(".svg", ".png"))).expect("png");
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 5_000,
            "{plot} as PNG"
        );
    }
}

#[test]
fn sweep_refuses_a_batch_the_engine_cannot_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let llama = TinyLlama::default().write(&dir.path().join("llama"));
    let config = dir.path().join("sweep.toml");
    std::fs::write(
        &config,
        format!("[llama]\nmodel = {llama:?}\ntp = [1]\nprompt = [8]\nnew = [2]\nbatch = [1, 4]\n"),
    )
    .expect("config");
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args(["sweep", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(dir.path().join("out"))
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success() && stderr.contains("tpinfer plan --batch 4"),
        "{stderr}"
    );
}

/// With `baseline = true` the sweep runs the reference scripts on the same shapes and
/// reports tpinfer over them; here a stand-in interpreter plays transformers and diffusers
/// (the real scripts need torch and a GPU) and checks the arguments it is given.
#[test]
fn sweep_reports_its_ratio_to_the_baseline() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let llama = TinyLlama::default().write(&dir.path().join("llama"));
    let wan = dir.path().join("wan");
    TinyWan::default().write(&wan);
    let fake = dir.path().join("fake-python");
    std::fs::write(
        &fake,
        r#"#!/bin/sh
script=$(basename "$1"); cmd=$2; shift 2; all="$*"; out=""; json=""
while [ $# -gt 0 ]; do case "$1" in --out) out=$2; shift;; --out-json) json=$2; shift;; esac; shift; done
case "$script $cmd" in
  "reference_llama.py speed")
    case "$all" in *"--prompt-tokens 8 --prefill-tokens 8 --new-tokens 3"*) ;; *) echo "bad: $all" >&2; exit 4;; esac
    echo '{"decode_tok_s": 50.0, "prefill_ms": 4.0}' > "$json";;
  "reference_wan.py inputs") : > "$out";;
  "reference_wan.py forward") echo '{"ms_per_forward": 2.5}' > "$json";;
  *) echo "unexpected $script $cmd" >&2; exit 3;;
esac
"#,
    )
    .expect("fake");
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let config = dir.path().join("sweep.toml");
    let write = |python: &str| {
        std::fs::write(
            &config,
            format!(
                "[llama]\nmodel = {llama:?}\ntp = [1]\nprompt = [8]\nnew = [3]\nrepeats = 1\nbaseline = true\n\
                 python = {python:?}\n\n[dit]\nmodel = {wan:?}\ntp = [1]\nframes = [5]\nsize = [\"64x32\"]\n\
                 steps = [1]\nrepeats = 1\nbaseline = true\npython = {python:?}\n"
            ),
        )
        .expect("config")
    };
    let sweep = || {
        Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
            .args(["sweep", "--config"])
            .arg(&config)
            .arg("--out")
            .arg(dir.path().join("out"))
            .output()
            .expect("run")
    };
    write(&fake.display().to_string());
    let run = sweep();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let points: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out/sweep.json")).expect("json"))
            .expect("parse");
    let close = |a: Option<f64>, b: Option<f64>| matches!((a, b), (Some(a), Some(b)) if (a - b).abs() < 1e-9 * b.abs().max(1.0));
    for p in &points {
        let b = &p["baseline"];
        match p["model"].as_str() {
            Some("llama") => {
                let decode = p["decode_tokens_per_s"]["median"].as_f64().map(|v| v / 50.0);
                let prefill = p["prefill_ms"]["median"].as_f64().map(|v| v / 4.0);
                assert!(
                    close(b["decode_ratio"].as_f64(), decode) && close(b["prefill_ratio"].as_f64(), prefill),
                    "{p}"
                );
            }
            _ => {
                // Two forwards per guided step.
                assert_eq!(b["step_ms"].as_f64(), Some(5.0), "{p}");
                let ratio = p["step_ms"]["median"].as_f64().map(|v| v / 5.0);
                assert!(close(b["step_ratio"].as_f64(), ratio), "{p}");
            }
        }
    }
    // A baseline that fails stops the sweep with its command and status.
    write("false");
    let run = sweep();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success() && stderr.contains("the baseline `false"),
        "{stderr}"
    );
}
