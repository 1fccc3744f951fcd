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

/// `--quantize fp8 --quantize-lm-head` runs end to end on CPU ranks; a tied head (the
/// embedding) is refused with one clear error before any rank loads.
#[test]
fn quantize_lm_head_generates_and_a_tied_head_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(&dir.path().join("untied"));
    let flags = [
        "--quantize",
        "fp8",
        "--quantize-lm-head",
        "--tp",
        "3",
        "--max-new-tokens",
        "4",
    ];
    let output = generate(&model, &flags);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.contains("decode 4 tokens"),
        "{stderr}"
    );
    let tied = TinyLlama {
        tie_embeddings: true,
        ..TinyLlama::default()
    }
    .write(&dir.path().join("tied"));
    assert_fails_with(
        &generate(&tied, &flags),
        &["--quantize-lm-head", "tie_word_embeddings", "leave the flag out"],
    );
}

/// vLLM users' flags work as they expect: --tensor-parallel-size and --max-model-len are
/// --tp and --max-context, and --gpu-memory-utilization is a share of each GPU's memory,
/// refused by name on CPU ranks and outside (0, 1].
#[test]
fn vllm_flags_are_accepted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let ours = generate(&model, &["--tp", "2", "--max-context", "64", "--max-new-tokens", "6"]);
    // The default width, `auto`, is one CPU rank, and says so in the log.
    let auto = generate(&model, &["-v", "--max-context", "64", "--max-new-tokens", "6"]);
    let one = generate(&model, &["--tp", "1", "--max-context", "64", "--max-new-tokens", "6"]);
    assert!(auto.status.success(), "{}", String::from_utf8_lossy(&auto.stderr));
    assert_eq!(auto.stdout, one.stdout, "--tp auto on CPU ranks is one rank");
    let said = String::from_utf8_lossy(&auto.stderr);
    assert!(said.contains("--tp auto: TP 1"), "{said}");
    assert_fails_with(&generate(&model, &["--tp", "0"]), &["`0` is not a width", "auto"]);
    let theirs = generate(
        &model,
        &[
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "64",
            "--max-new-tokens",
            "6",
        ],
    );
    assert!(theirs.status.success(), "{}", String::from_utf8_lossy(&theirs.stderr));
    assert_eq!(theirs.stdout, ours.stdout, "the same run under vLLM's names");
    assert_fails_with(
        &generate(&model, &["--gpu-memory-utilization", "0.9"]),
        &["--gpu-memory-utilization", "CPU ranks", "--gpu-mem"],
    );
    let output = generate(&model, &["--gpu-memory-utilization", "1.5"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("above 0 and at most 1"));
    let model = model.to_str().expect("utf8");
    let plan = |args: &[&str]| {
        let mut all = vec!["plan", "--model", model, "--gpu-mem", "64GiB", "--json"];
        all.extend_from_slice(args);
        tpinfer(&all, Duration::from_secs(60))
    };
    let theirs = plan(&["--tensor-parallel-size", "2", "--max-model-len", "128"]);
    assert!(theirs.status.success(), "{}", String::from_utf8_lossy(&theirs.stderr));
    assert_eq!(theirs.stdout, plan(&["--tp", "2", "--max-context", "128"]).stdout);
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
    // Sampling options are checked before the model is even looked for.
    assert_fails_with(
        &generate(&dir.path().join("missing"), &["--temperature", "0.7", "--top-k", "0"]),
        &["top_k must be at least 1"],
    );
    assert_fails_with(&generate(&model, &["--device", "cuda"]), &["--features cuda,nccl"]);
    assert_fails_with(
        &generate(&model, &["--lora", "adapter.safetensors"]),
        &["--lora does not apply", "language model"],
    );

    let weights = model.join("model.safetensors");
    let bytes = std::fs::read(&weights).expect("read");
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).expect("truncate");
    assert_fails_with(
        &generate(&model, &["--tp", "2"]),
        &["model.safetensors", "truncated or corrupt"],
    );
}

fn plan(args: &[&str]) -> Output {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    tpinfer(&all, Duration::from_secs(60))
}

fn json(output: &Output) -> serde_json::Value {
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("JSON on stdout")
}

#[test]
fn plan_reproduces_the_live_avatar_case() {
    let out = json(&plan(&[
        "--model",
        "wan2.2-s2v-14b",
        "--tp",
        "5",
        "--gpu-mem",
        "24GiB",
        "--frames",
        "80",
        "--size",
        "832x480",
        "--json",
    ]));
    let budget = 24u64 << 30;
    assert_eq!(out["budget"], budget);
    assert_eq!(out["fits"], true);
    let totals = out["rank_totals"].as_array().expect("rank totals");
    assert_eq!(totals.len(), 5);
    assert!(totals.iter().all(|t| t.as_u64().expect("bytes") < budget));
    let unshard = out["plan"]["fsdp"]["unshard_buffer"].as_u64().expect("bytes") as f64;
    assert!((unshard / (1u64 << 30) as f64 - 4.17).abs() < 0.005, "{unshard}");
    // The clip's video tokens, the reference frame's and the packed motion frames'.
    assert_eq!(out["plan"]["tokens_per_forward"], 35_074);
    // The table says the same in MiB.
    let table = plan(&["--model", "wan2.2-s2v-14b", "--tp", "5", "--gpu-mem", "24GiB"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("| 4 |") && text.contains("FSDP on 5 GPUs") && text.contains("headroom"),
        "{text}"
    );
}

/// `--attention fp8` plans the E4M3 copies of a DiT's self-attention, by preset, alone and in
/// its pipeline, as the engine does (the 14B DiT at TP 1: its activations grow, nothing else);
/// a language model refuses the flag by name.
#[test]
fn plan_of_fp8_self_attention() {
    let dit = |model: &str, attention: &str| {
        let args = [
            "--model",
            model,
            "--tp",
            "1",
            "--gpu-mem",
            "80GiB",
            "--frames",
            "81",
            "--size",
            "832x480",
            "--attention",
            attention,
            "--json",
        ];
        json(&plan(&args))
    };
    let field = |out: &serde_json::Value, name: &str| out["plan"]["ranks"][0][name].as_u64().expect("bytes");
    let (exact, fp8) = (dit("wan2.1-t2v-14b", "dtype"), dit("wan2.1-t2v-14b", "fp8"));
    assert!(field(&fp8, "activations") > field(&exact, "activations"));
    assert_eq!(field(&fp8, "weights"), field(&exact, "weights"));
    let grown = field(&fp8, "activations") - field(&exact, "activations");
    let (pipe_exact, pipe_fp8) = (
        dit("wan2.1-t2v-14b-pipeline", "dtype"),
        dit("wan2.1-t2v-14b-pipeline", "fp8"),
    );
    let transformer = |out: &serde_json::Value| {
        out["stages"]["transformer"]["ranks"][0]["activations"]
            .as_u64()
            .expect("bytes")
    };
    assert_eq!(transformer(&pipe_fp8) - transformer(&pipe_exact), grown);
    assert_fails_with(
        &plan(&["--model", "llama-3-8b", "--gpu-mem", "24GiB", "--attention", "fp8"]),
        &["--attention is for video DiT models"],
    );
}

#[test]
fn plan_without_tp_suggests_the_smallest_width() {
    let out = json(&plan(&["--model", "llama-3-70b", "--gpu-mem", "24GiB", "--json"]));
    let widths = out["widths"].as_array().expect("widths");
    // Every width up to the 64 heads, not only powers of two.
    assert_eq!(widths.len(), 64);
    let fits: Vec<bool> = widths.iter().map(|w| w["fits"].as_bool().expect("bool")).collect();
    let smallest = out["smallest_fitting_tp"].as_u64().expect("a width fits") as usize;
    assert!(!fits[smallest - 2] && fits[smallest - 1], "{fits:?}");
    // Wider ranks hold less: the peak falls with the width while every rank holds whole GQA
    // groups or whole KV heads (1–8, then 16, 32, 64). In between, some rank's Q heads
    // straddle two groups, so it runs the unfused attention with its score buffers and may
    // peak above a narrower width (TP 9 above TP 8).
    let peaks: Vec<u64> = widths.iter().map(|w| w["peak"].as_u64().expect("bytes")).collect();
    assert!(peaks.windows(2).take(7).all(|p| p[1] < p[0]), "{peaks:?}");
    assert!(
        [8, 16, 32, 64].windows(2).all(|w| peaks[w[1] - 1] < peaks[w[0] - 1]),
        "{peaks:?}"
    );
}

#[test]
fn plan_over_budget_exits_2_with_what_fits() {
    let output = plan(&["--model", "llama-3-8b", "--tp", "1", "--gpu-mem", "16GiB"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("rank 0 needs") && stderr.contains("fits with --tp 2"),
        "{stderr}"
    );
    let bad = plan(&[
        "--model",
        "wan2.1-t2v-14b",
        "--tp",
        "2",
        "--gpu-mem",
        "80GiB",
        "--frames",
        "80",
    ]);
    assert_fails_with(&bad, &["4k + 1"]);
    let unknown = plan(&["--model", "no-such-model", "--gpu-mem", "24GiB"]);
    assert_fails_with(&unknown, &["preset", "llama-3-8b"]);
    let size = plan(&["--model", "llama-3-8b", "--gpu-mem", "lots"]);
    assert!(!size.status.success());
}

#[test]
fn plan_of_a_model_directory_reads_its_headers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let path = model.to_str().expect("utf8");
    let out = json(&plan(&[
        "--model",
        path,
        "--tp",
        "3",
        "--gpu-mem",
        "1GiB",
        "--cpu",
        "--dtype",
        "f32",
        "--max-context",
        "256",
        "--json",
    ]));
    let ranks = out["plan"]["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 3);
    assert!(ranks
        .iter()
        .all(|r| r["context"] == 0 && r["comm"] == 0 && r["libraries"] == 0));
    // TP wider than the heads cannot be planned: the same error as the engine's.
    let wide = plan(&["--model", path, "--tp", "9", "--gpu-mem", "1GiB"]);
    assert_fails_with(&wide, &["9", "attention heads"]);
}

/// Ctrl-C during generation stops every rank at the next token and exits 130, promptly.
#[test]
fn ctrl_c_stops_all_ranks() {
    use std::io::Read;
    let model = tpinfer_tests::assets_dir().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tpinfer"))
        .args(["generate", "--model", model.to_str().expect("utf8"), "--tp", "2"])
        .args(["--prompt", "Once upon a time", "--max-new-tokens", "5000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tpinfer");
    // Wait for the first generated text, so that the ranks are mid-request.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).expect("some output");
    // SAFETY: sends SIGINT to the child we spawned.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("tpinfer did not stop after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by Ctrl-C"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn doctor_on_a_cpu_build_says_how_to_get_gpus() {
    let text = tpinfer(&["doctor"], Duration::from_secs(30));
    assert_eq!(text.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.contains("built for CPU ranks only") && stdout.contains("--features nccl"),
        "{stdout}"
    );
    let json = tpinfer(&["doctor", "--json"], Duration::from_secs(30));
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(report["findings"][0]["severity"], "error");
    assert!(report["inventory"]["built_for_cuda"].is_null());
}

/// A tiny Wan DiT end to end: text embeddings in, latents and previews out, the same latents
/// at TP 1 and TP 3 from the same seed.
#[test]
fn generates_video_latents() {
    use candle_core::{Device, Tensor};
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tpinfer_tests::TinyWan::default();
    let path = model.write(&dir.path().join("wan"));
    let embeds = dir.path().join("embeds.safetensors");
    let text = Tensor::randn(0f32, 1.0, (7, model.text_dim), &Device::Cpu).expect("text");
    let negative = Tensor::randn(0f32, 1.0, (5, model.text_dim), &Device::Cpu).expect("negative");
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("text".to_string(), text), ("negative".to_string(), negative)]),
        &embeds,
    )
    .expect("write embeds");
    let run = |tp: &str| {
        let out = dir.path().join(format!("latents_tp{tp}.safetensors"));
        let output = tpinfer(
            &[
                "generate",
                "--model",
                path.to_str().expect("utf8"),
                "--tp",
                tp,
                "--frames",
                "5",
                "--size",
                "64x32",
                "--steps",
                "4",
                "--text-embeds",
                embeds.to_str().expect("utf8"),
                "--out",
                out.to_str().expect("utf8"),
            ],
            Duration::from_secs(120),
        );
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert!(output.status.success(), "{stderr}");
        assert!(
            stderr.contains("step   4/4") && stderr.contains("s per step"),
            "{stderr}"
        );
        for label in ["first", "last"] {
            let png = out.with_extension(format!("{label}.png"));
            let bytes = std::fs::read(&png).expect("preview written");
            assert_eq!(&bytes[1..4], b"PNG");
        }
        let latents = candle_core::safetensors::load(&out, &Device::Cpu).expect("latents")["latents"].clone();
        latents
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map(|v| (latents.dims().to_vec(), v))
            .expect("values")
    };
    let (shape, one) = run("1");
    assert_eq!(shape, vec![model.channels, 2, 4, 8]);
    assert!(one.iter().all(|v| v.is_finite()));
    let (_, three) = run("3");
    let err = tpinfer_tests::rel_error(&three, &one);
    assert!(err < 1e-5, "TP 3 latents against TP 1: {err:e}");
}

/// A video run's bad options fail before the model loads (or, for the text states, before
/// the first step), each by its name.
#[test]
fn bad_video_inputs_exit_non_zero_with_the_cause() {
    use candle_core::{Device, Tensor};
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tpinfer_tests::TinyWan::default();
    let path = model.write(&dir.path().join("wan"));
    let embeds = |name: &str, width: usize| {
        let file = dir.path().join(name);
        let text = Tensor::randn(0f32, 1.0, (7, width), &Device::Cpu).expect("text");
        let mut tensors = std::collections::HashMap::from([("text".to_string(), text.clone())]);
        if name != "unguided.safetensors" {
            tensors.insert("negative".to_string(), text);
        }
        candle_core::safetensors::save(&tensors, &file).expect("write embeds");
        file.to_str().expect("utf8").to_string()
    };
    let (good, wide, unguided) = (
        embeds("good.safetensors", model.text_dim),
        embeds("wide.safetensors", 25),
        embeds("unguided.safetensors", model.text_dim),
    );
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", path.to_str().expect("utf8"), "--size", "64x32"];
        args.extend(["--steps", "1"]);
        args.extend(extra);
        if !extra.contains(&"--frames") {
            args.extend(["--frames", "5"]);
        }
        tpinfer(&args, Duration::from_secs(60))
    };
    // The model's text width is known once it is open: after the plan's line, before a step.
    let output = run(&["--text-embeds", &wide]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && !stderr.contains("panicked") && !stderr.contains("step "));
    for part in ["error: ", "[7, 25]", "[tokens, 24]", "--text-embeds"] {
        assert!(stderr.contains(part), "stderr {stderr:?} must mention {part:?}");
    }
    assert_fails_with(
        &run(&["--text-embeds", &good, "--shift", "0"]),
        &["--shift 0", "above 0"],
    );
    // Guidance (the default scale, 5) never turns itself off for want of a negative.
    assert_fails_with(
        &run(&["--text-embeds", &unguided]),
        &["--guide-scale 5", "negative", "--guide-scale 1"],
    );
    assert_fails_with(
        &run(&["--text-embeds", &good, "--prompt", "a cat"]),
        &["--prompt", "--text-embeds", "not both"],
    );
    assert_fails_with(
        &run(&["--text-embeds", &good, "--frames", "4"]),
        &["--frames 4", "4k + 1"],
    );
    // A LoRA adapter: one that fits runs; one for another model, or none there, is refused.
    let adapter = |name: &str, module: &str| {
        let file = dir.path().join(name);
        let half = |shape: (usize, usize)| Tensor::randn(0f32, 0.1, shape, &Device::Cpu).expect("half");
        let tensors = std::collections::HashMap::from([
            (format!("{module}.lora_A.weight"), half((2, 60))),
            (format!("{module}.lora_B.weight"), half((60, 2))),
        ]);
        candle_core::safetensors::save(&tensors, &file).expect("write adapter");
        file.to_str().expect("utf8").to_string()
    };
    let fits = adapter("fits.safetensors", "blocks.0.attn1.to_q");
    let latents = dir.path().join("latents.safetensors");
    let output = run(&[
        "--text-embeds",
        &good,
        "--lora",
        &fits,
        "--lora-scale",
        "0.5",
        "--out",
        latents.to_str().expect("utf8"),
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(latents.exists());
    let other = adapter("other.safetensors", "blocks.9.attn1.to_q");
    assert_fails_with(
        &run(&["--text-embeds", &good, "--lora", &other, "--lora-scale", "1"]),
        &["other.safetensors", "blocks.9.attn1.to_q.weight", "does not hold"],
    );
    assert_fails_with(
        &run(&["--text-embeds", &good, "--lora", &fits]),
        &["fits.safetensors", "--lora-scale"],
    );
    let out = dir.path().join("missing/latents.safetensors");
    let output = run(&["--text-embeds", &good, "--out", out.to_str().expect("utf8")]);
    assert_fails_with(&output, &["--out", "cannot write into"]);
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains("step "),
        "the output folder must be checked before any step"
    );
}

#[test]
fn a_text_encoder_plans_and_is_not_run_alone() {
    let out = json(&plan(&[
        "--model",
        "umt5-xxl",
        "--tp",
        "2",
        "--gpu-mem",
        "24GiB",
        "--json",
    ]));
    assert_eq!(out["fits"], true);
    assert_eq!(out["plan"]["tokens_per_forward"], 512);
    let dir = tempfile::tempdir().expect("tempdir");
    tpinfer_tests::TinyUmt5::default().write(dir.path());
    let path = dir.path().to_str().expect("utf8");
    let planned = json(&plan(&[
        "--model",
        path,
        "--tp",
        "3",
        "--gpu-mem",
        "1GiB",
        "--cpu",
        "--json",
    ]));
    assert_eq!(planned["rank_totals"].as_array().map(Vec::len), Some(3));
    assert_fails_with(&generate(dir.path(), &[]), &["umT5 text encoder", "--text-embeds"]);
}

/// The wav2vec2 speech encoder S2V ships plans by preset and by directory (a minute of
/// speech unless --max-context gives its encoder frames) and is not run alone.
#[test]
fn a_speech_encoder_plans_and_is_not_run_alone() {
    let out = json(&plan(&[
        "--model",
        "wav2vec2-large-xlsr-53",
        "--tp",
        "4",
        "--gpu-mem",
        "24GiB",
        "--json",
    ]));
    assert_eq!(out["fits"], true);
    assert_eq!(out["plan"]["tokens_per_forward"], 3000);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/wav2vec2-tiny");
    let path = dir.to_str().expect("utf8");
    let planned = json(&plan(&[
        "--model",
        path,
        "--tp",
        "3",
        "--max-context",
        "500",
        "--gpu-mem",
        "1GiB",
        "--cpu",
        "--json",
    ]));
    assert_eq!(planned["rank_totals"].as_array().map(Vec::len), Some(3));
    assert_eq!(planned["plan"]["tokens_per_forward"], 500);
    assert_fails_with(&generate(&dir, &[]), &["wav2vec2 speech encoder", "tpinfer plan"]);
}

/// The S2V pipeline from presets: umT5, S2V's wav2vec2, the S2V DiT (the clip, its reference
/// frame and packed motion frames a forward) and the VAE, which decodes the clip after the
/// 73 motion frames' latents (153 frames), held together on five 24 GiB GPUs.
#[test]
fn the_s2v_pipeline_plans_every_stage() {
    let out = json(&plan(&[
        "--model",
        "wan2.2-s2v-14b-pipeline",
        "--tp",
        "5",
        "--gpu-mem",
        "24GiB",
        "--frames",
        "80",
        "--size",
        "832x480",
        "--json",
    ]));
    let stages = out["stages"].as_object().expect("stages");
    let keys: Vec<&str> = stages.keys().map(String::as_str).collect();
    for key in ["text_encoder", "speech_encoder", "transformer", "vae"] {
        assert!(keys.contains(&key), "{key} in {keys:?}");
    }
    assert_eq!(stages["speech_encoder"]["tokens_per_forward"], 3000);
    // S2V runs wav2vec2 in f32 beside the bf16 DiT.
    assert_eq!(stages["speech_encoder"]["dtype"], "f32");
    assert_eq!(stages["transformer"]["dtype"], "bf16");
    assert_eq!(stages["transformer"]["tokens_per_forward"], 35_074);
    // 153 frames: 39 latent frames of 60 x 104 latents.
    assert_eq!(stages["vae"]["tokens_per_forward"], 39 * 60 * 104);
    // The VAE's encoder: a clip's 73 motion frames at 60 x 104 latents.
    assert_eq!(stages["vae_encode"]["tokens_per_forward"], 73 * 60 * 104);
    assert_eq!(out["fits"], true);
    assert_eq!(out["rank_totals"].as_array().map(Vec::len), Some(5));
    assert!(out["fsdp_total"].as_u64() > out["peak"].as_u64());
    // The official directory's layout: the same stages, from its files.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/s2v-pipeline/model");
    let out = json(&plan(&[
        "--model",
        dir.to_str().expect("utf8"),
        "--tp",
        "2",
        "--size",
        "64x64",
        "--frames",
        "16",
        "--gpu-mem",
        "1GiB",
        "--cpu",
        "--json",
    ]));
    let stages = out["stages"].as_object().expect("stages");
    let keys: Vec<&str> = stages.keys().map(String::as_str).collect();
    for key in ["text_encoder", "speech_encoder", "transformer", "vae", "vae_encode"] {
        assert!(keys.contains(&key), "{key} in {keys:?}");
    }
    // A clip of 16 frames: 4 latent frames of 8 x 8, in patches of 2 x 2, with the reference
    // frame and the packed motion frames.
    assert_eq!(stages["vae"]["tokens_per_forward"], 23 * 8 * 8);
    assert_eq!(out["fits"], true);
}

/// A pipeline directory takes a prompt to a video: an MP4 and PNG frames, with the latents
/// and the prompt's states saved beside them. The states, given to the transformer directory
/// alone (--text-embeds), give the same latents; `tpinfer decode` of the latents gives the same
/// frames.
#[test]
fn a_pipeline_generates_from_a_prompt_and_saves_its_states() {
    use candle_core::Device;
    let dir = tempfile::tempdir().expect("tempdir");
    let pipeline = tpinfer_tests::TinyWanPipeline::default().write(&dir.path().join("pipe"));
    let (embeds, first, second) = (
        dir.path().join("embeds.safetensors"),
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    let (video, frames) = (dir.path().join("fox.mp4"), dir.path().join("frames"));
    let common = ["--frames", "5", "--size", "64x32", "--steps", "2", "--tp", "2"];
    let path = |p: &Path| p.to_str().expect("utf8").to_string();
    let mut args = vec![
        "generate".to_string(),
        "--model".into(),
        path(&pipeline),
        "--prompt".into(),
    ];
    args.extend([
        "a red fox".to_string(),
        "--save-text-embeds".into(),
        path(&embeds),
        "--save-latents".into(),
        path(&first),
        "--out".into(),
        path(&video),
        "--save-frames".into(),
        path(&frames),
    ]);
    args.extend(common.iter().map(|s| s.to_string()));
    let output = tpinfer(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        Duration::from_secs(120),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("step   2/2"), "{stderr}");
    for stage in ["load", "encode", "denoise", "decode", "write"] {
        assert!(stderr.contains(&format!("{stage} ")), "no time for {stage}: {stderr}");
    }
    let saved = candle_core::safetensors::load(&embeds, &Device::Cpu).expect("embeds");
    assert_eq!(saved["text"].dims(), [512, 24]);
    assert_eq!(saved["negative"].dims(), [512, 24]);
    // An MP4 (its first box is `ftyp`) and one 64 × 32 PNG per frame.
    let mp4 = std::fs::read(&video).expect("video");
    assert_eq!(&mp4[4..8], b"ftyp", "not an MP4");
    let pngs = png_frames(&frames);
    assert_eq!(pngs.len(), 5);
    for png in &pngs {
        assert_eq!(&png[1..4], b"PNG");
        // IHDR: width and height, big-endian, at bytes 16..24.
        assert_eq!(&png[16..24], &[0, 0, 0, 64, 0, 0, 0, 32]);
    }

    // The saved latents decode to the same frames.
    let again = dir.path().join("again");
    let output = tpinfer(
        &[
            "decode",
            "--model",
            &path(&pipeline),
            "--latents",
            &path(&first),
            "--save-frames",
            &path(&again),
            "--tp",
            "2",
        ],
        Duration::from_secs(60),
    );
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        png_frames(&again) == pngs,
        "decode of the saved latents made other frames"
    );
    // Outputs that cannot be written are refused before anything runs.
    for (flag, value, expected) in [
        ("--out", path(&dir.path().join("v.avi")), "ending in .mp4"),
        ("--save-frames", path(&frames), "not empty"),
    ] {
        let output = tpinfer(
            &[
                "decode",
                "--model",
                &path(&pipeline),
                "--latents",
                &path(&first),
                flag,
                &value,
            ],
            Duration::from_secs(60),
        );
        assert_fails_with(&output, &[flag, expected]);
    }

    let transformer = pipeline.join("transformer");
    let mut args = vec![
        "generate".to_string(),
        "--model".into(),
        path(&transformer),
        "--text-embeds".into(),
    ];
    args.extend([path(&embeds), "--out".into(), path(&second)]);
    args.extend(common.iter().map(|s| s.to_string()));
    let output = tpinfer(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        Duration::from_secs(120),
    );
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let latents = |p: &Path| candle_core::safetensors::load(p, &Device::Cpu).expect("latents")["latents"].clone();
    let rel = tpinfer_tests::tensor_rel_error(&latents(&second), &latents(&first));
    assert!(rel < 1e-6, "the saved states against the prompt: {rel:e}");

    // A transformer directory alone cannot encode a prompt.
    let output = tpinfer(
        &[
            "generate",
            "--model",
            &path(&transformer),
            "--prompt",
            "a fox",
            "--frames",
            "5",
            "--size",
            "64x32",
        ],
        Duration::from_secs(60),
    );
    assert_fails_with(&output, &["--prompt needs a pipeline directory", "--text-embeds"]);
    // Nor write a video: it has no VAE.
    let output = tpinfer(
        &[
            "generate",
            "--model",
            &path(&transformer),
            "--text-embeds",
            &path(&embeds),
            "--out",
            &path(&dir.path().join("x.mp4")),
            "--frames",
            "5",
            "--size",
            "64x32",
        ],
        Duration::from_secs(60),
    );
    assert_fails_with(&output, &["--out", "no vae/"]);
}

/// The PNG files of a frames folder, in name order.
fn png_frames(dir: &Path) -> Vec<Vec<u8>> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .expect("frames")
        .map(|e| e.expect("entry").path())
        .collect();
    names.sort();
    let expected: Vec<String> = (0..names.len()).map(|i| format!("{i:05}.png")).collect();
    let found: Vec<String> = names
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(found, expected);
    names.iter().map(|p| std::fs::read(p).expect("png")).collect()
}

/// A budget that cannot hold the text encoder beside the DiT and the VAE frees it after
/// encoding, before they load, as the plan says: the same frames as with every stage held.
#[test]
fn a_pipeline_frees_its_encoder_when_the_budget_needs_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pipeline = tpinfer_tests::TinyWanPipeline::default().write(&dir.path().join("pipe"));
    let model = pipeline.to_str().expect("utf8");
    let shape = ["--tp", "2", "--frames", "5", "--size", "64x32"];
    let planned = json(&plan(
        &[
            &["--model", model, "--cpu", "--json", "--gpu-mem", "1GiB"][..],
            &shape[..],
        ]
        .concat(),
    ));
    let held_together = planned["peak"].as_u64().expect("bytes");
    let generate = |budget: Option<u64>, frames: &Path| {
        let budget = budget.map(|b| format!("{b}B"));
        let video = frames.with_extension("mp4");
        let (frames, video) = (frames.to_str().expect("utf8"), video.to_str().expect("utf8"));
        let mut args = vec!["generate", "--model", model, "--prompt", "a red fox", "--steps", "2"];
        args.extend(["--save-frames", frames, "--out", video]);
        args.extend(shape);
        if let Some(budget) = &budget {
            args.extend(["--gpu-mem", budget.as_str()]);
        }
        let output = tpinfer(&args, Duration::from_secs(120));
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stderr).to_string()
    };
    let (held, in_turns) = (dir.path().join("held"), dir.path().join("turns"));
    let stderr = generate(None, &held);
    assert!(!stderr.contains("freed after encoding"), "{stderr}");
    let stderr = generate(Some(held_together - 1), &in_turns);
    assert!(stderr.contains("freed after encoding"), "{stderr}");
    assert!(stderr.contains("load DiT + VAE "), "the second load is timed: {stderr}");
    assert!(png_frames(&in_turns) == png_frames(&held), "the frames differ");
}

/// A pipeline's plan holds its stages on the same ranks (the text encoder, the DiT, the VAE):
/// each rank's total is every stage's resident bytes and the largest stage's temporaries.
#[test]
fn plan_of_a_pipeline_holds_every_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pipeline = tpinfer_tests::TinyWanPipeline::default().write(&dir.path().join("pipe"));
    let path = pipeline.to_str().expect("utf8");
    let args = [
        "--model", path, "--tp", "2", "--cpu", "--frames", "5", "--size", "64x32", "--json",
    ];
    let out = json(&plan(&[&args[..], &["--gpu-mem", "1GiB"]].concat()));
    let stage =
        |name: &str, rank: usize, field: &str| out["stages"][name]["ranks"][rank][field].as_u64().expect("bytes");
    let stages = ["text_encoder", "transformer", "vae"];
    for rank in 0..2 {
        let resident = |name| stage(name, rank, "weights") + stage(name, rank, "buffers") + stage(name, rank, "cache");
        let temporaries = |name| stage(name, rank, "activations") + stage(name, rank, "allocator_slack");
        let expected = stages.iter().map(|s| resident(s)).sum::<u64>()
            + stages.iter().map(|s| temporaries(s)).max().expect("stages");
        assert_eq!(out["rank_totals"][rank].as_u64(), Some(expected), "rank {rank}");
        assert!(
            stage("vae", rank, "activations") > 0,
            "the VAE's decode peak is planned"
        );
    }
    assert_eq!(out["stages"]["text_encoder"]["tokens_per_forward"], 512);
    assert_eq!(out["encoder_freed_after_encoding"], false);
    // A byte short of holding every stage, the encoder is freed after encoding: each rank
    // then needs the larger of its two turns (the encoder alone; the DiT and the VAE).
    let total = out["rank_totals"][0].as_u64().expect("bytes");
    let short = format!("{}B", total - 1);
    let tight = [&args[..], &["--gpu-mem", &short]].concat();
    let out = json(&plan(&tight));
    assert_eq!(out["encoder_freed_after_encoding"], true, "{out}");
    assert_eq!(out["fits"], true);
    for rank in 0..2 {
        let held = |names: &[&str]| {
            // Each stage keeps its libraries' memory once it has run.
            let resident = |name| {
                ["weights", "buffers", "cache", "libraries"]
                    .iter()
                    .map(|part| stage(name, rank, part))
                    .sum::<u64>()
            };
            let temporaries = |name| stage(name, rank, "activations") + stage(name, rank, "allocator_slack");
            let reserves = stage(names[0], rank, "comm") + stage(names[0], rank, "context");
            names.iter().map(|s| resident(s)).sum::<u64>()
                + names.iter().map(|s| temporaries(s)).max().expect("stages")
                + reserves
        };
        let turns = held(&["text_encoder"]).max(held(&["transformer", "vae"]));
        assert_eq!(out["rank_totals"][rank].as_u64(), Some(turns), "rank {rank}");
    }
    let table: Vec<&str> = tight.iter().copied().filter(|a| *a != "--json").collect();
    let text = String::from_utf8_lossy(&plan(&table).stdout).to_string();
    assert!(text.contains("freed after encoding"), "{text}");
    // Under the larger turn nothing fits.
    let turns = out["peak"].as_u64().expect("bytes");
    let output = plan(&[&args[..], &["--gpu-mem", &format!("{}B", turns - 1)]].concat());
    assert_eq!(
        output.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stderr).contains("even with the encoders freed"));
}

/// Options of the other kind of model are refused by name, before anything loads: sampling
/// for a video, frames for a language model.
#[test]
fn options_that_do_not_apply_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pipeline = tpinfer_tests::TinyWanPipeline::default().write(&dir.path().join("pipe"));
    let llama = tpinfer_tests::TinyLlama::default().write(&dir.path().join("llama"));
    let path = |p: &Path| p.to_str().expect("utf8").to_string();
    for (model, option, value) in [
        (path(&pipeline), "--temperature", "0.7"),
        (path(&pipeline), "--max-new-tokens", "5"),
        (path(&llama), "--frames", "9"),
        (path(&llama), "--out", "x.mp4"),
        (path(&llama), "--attention", "fp8"),
    ] {
        let output = tpinfer(
            &["generate", "--model", &model, "--prompt", "a fox", option, value],
            Duration::from_secs(30),
        );
        assert_fails_with(&output, &[option, "does not apply"]);
    }
    // FP8 self-attention applies to a video model but has no kernel on CPU ranks: refused at
    // load, before any step, with what would run.
    let (model, out) = (path(&pipeline), path(&dir.path().join("fox.mp4")));
    let mut args = vec!["generate", "--model", &model, "--out", &out, "--prompt", "fox"];
    args.extend("--frames 5 --size 64x32 --steps 1 --attention fp8".split(' '));
    let output = tpinfer(&args, Duration::from_secs(60));
    let refusal = [
        "--attention fp8 runs on Hopper and Ada GPUs",
        "leave --attention at its default",
    ];
    assert_fails_with(&output, &refusal);
    assert!(!dir.path().join("fox.mp4").exists(), "no video is written");
}

/// A preset pipeline (`<DiT preset>-pipeline`) plans umT5-XXL, the DiT and Wan2.1's VAE on
/// five 24 GiB cards, beside the same pipeline under FSDP.
#[test]
fn a_preset_pipeline_plans_its_three_stages() {
    let args = [
        "--model",
        "wan2.1-t2v-14b-pipeline",
        "--tp",
        "5",
        "--gpu-mem",
        "24GiB",
        "--frames",
        "81",
        "--size",
        "832x480",
        "--json",
    ];
    let out = json(&plan(&args));
    let stages = out["stages"].as_object().expect("stages");
    assert_eq!(stages.len(), 3, "{stages:?}");
    // umT5-XXL's 5.68 B parameters in bf16, a fifth of them on each rank (and its vocabulary
    // split), within the rounding of uneven shards.
    let encoder = out["stages"]["text_encoder"]["ranks"][0]["weights"]
        .as_u64()
        .expect("bytes");
    assert!(
        (encoder as f64 - 5_680_910_336.0 * 2.0 / 5.0).abs() < 0.02 * encoder as f64,
        "{encoder}"
    );
    // Every rank holds the VAE's whole decoder.
    let vae = |rank: usize| out["stages"]["vae"]["ranks"][rank]["weights"].as_u64().expect("bytes");
    assert!(vae(0) > 0 && (0..5).all(|r| vae(r) == vae(0)));
    assert_eq!(out["fits"], true);
    assert!(
        out["fsdp_total"].as_u64() > out["peak"].as_u64(),
        "FSDP holds more than TP"
    );
}

/// `--quantize fp8` plans the linear weights in E4M3 with row scales: Llama-3-70B fits four
/// 24 GiB cards only so, and the Wan-14B pipeline's DiT and umT5 two of them with room.
#[test]
fn fp8_plans_fit_where_bf16_does_not() {
    let planned = |args: &[&str], quantize: &[&str]| {
        let all: Vec<&str> = args.iter().chain(quantize).chain(&["--json"]).copied().collect();
        plan(&all)
    };
    let llama = [
        "--model",
        "llama-3-70b",
        "--tp",
        "4",
        "--gpu-mem",
        "24GiB",
        "--max-context",
        "8192",
    ];
    let fp8 = json(&planned(&llama, &["--quantize", "fp8"]));
    assert_eq!(fp8["fits"], true);
    // --quantize-lm-head: a rank's 32,064 rows of 8,192 take a byte a value and a scale a row
    // where they took two bytes a value.
    let head = json(&planned(&llama, &["--quantize", "fp8", "--quantize-lm-head"]));
    let weights = |out: &serde_json::Value| out["plan"]["ranks"][0]["weights"].as_u64().expect("bytes");
    assert_eq!(weights(&fp8) - weights(&head), 32_064 * 8_192 - 32_064 * 4);
    let alone = planned(&llama, &["--quantize-lm-head"]);
    assert_eq!(alone.status.code(), Some(2), "--quantize-lm-head needs --quantize");
    let video = planned(
        &[
            "--model",
            "wan2.1-t2v-1.3b",
            "--gpu-mem",
            "24GiB",
            "--frames",
            "21",
            "--size",
            "832x480",
        ],
        &["--quantize", "fp8", "--quantize-lm-head"],
    );
    let stderr = String::from_utf8_lossy(&video.stderr);
    assert!(
        video.status.code() == Some(1) && stderr.contains("no LM head"),
        "{stderr}"
    );
    let bf16 = planned(&llama, &[]);
    assert_eq!(bf16.status.code(), Some(2), "bf16 70B does not fit four 24 GiB GPUs");
    let wan = [
        "--model",
        "wan2.1-t2v-14b-pipeline",
        "--tp",
        "2",
        "--gpu-mem",
        "24GiB",
        "--frames",
        "81",
        "--size",
        "832x480",
    ];
    let (fp8, bf16) = (json(&planned(&wan, &["--quantize", "fp8"])), json(&planned(&wan, &[])));
    assert_eq!(fp8["fits"], true);
    let dit = |out: &serde_json::Value| {
        out["stages"]["transformer"]["ranks"][0]["weights"]
            .as_u64()
            .expect("bytes")
    };
    // The blocks' weights halve; the embedders and output projection stay in bf16.
    let ratio = dit(&fp8) as f64 / dit(&bf16) as f64;
    assert!((0.5..0.53).contains(&ratio), "DiT weights FP8 / bf16: {ratio:.3}");
    assert!(fp8["peak"].as_u64() < bf16["peak"].as_u64());
}

/// Outputs: a directory (or device) as --out is refused by name before any step; a written
/// file has the mode a plain create gives; a link is followed, not replaced.
#[cfg(unix)]
#[test]
fn video_outputs_are_written_safely() {
    use std::os::unix::fs::PermissionsExt;

    use candle_core::{Device, Tensor};
    let dir = tempfile::tempdir().expect("tempdir");
    let model = tpinfer_tests::TinyWan::default();
    let path = model.write(&dir.path().join("wan"));
    let embeds = dir.path().join("embeds.safetensors");
    let text = Tensor::randn(0f32, 1.0, (7, model.text_dim), &Device::Cpu).expect("text");
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("text".to_string(), text.clone()), ("negative".to_string(), text)]),
        &embeds,
    )
    .expect("write embeds");
    let run = |out: &Path| {
        let args = [
            "generate",
            "--model",
            path.to_str().expect("utf8"),
            "--frames",
            "5",
            "--size",
            "64x32",
            "--steps",
            "1",
            "--text-embeds",
            embeds.to_str().expect("utf8"),
            "--out",
            out.to_str().expect("utf8"),
        ];
        tpinfer(&args, Duration::from_secs(60))
    };
    let folder = dir.path().join("a-folder");
    std::fs::create_dir(&folder).expect("mkdir");
    let output = run(&folder);
    assert_fails_with(&output, &["--out", "a-folder", "a directory"]);
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains("step "),
        "refused before any step"
    );

    let plain = dir.path().join("plain");
    std::fs::File::create(&plain).expect("create");
    let umask_mode = std::fs::metadata(&plain).expect("meta").permissions().mode() & 0o777;
    let out = dir.path().join("latents.safetensors");
    let output = run(&out);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let mode = std::fs::metadata(&out).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode, umask_mode, "the mode a plain create gives");

    let target = dir.path().join("target.safetensors");
    std::fs::write(&target, b"old").expect("target");
    let link = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    let output = run(&link);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        std::fs::symlink_metadata(&link).expect("meta").file_type().is_symlink(),
        "still a link"
    );
    let latents = candle_core::safetensors::load(&target, &Device::Cpu).expect("the target holds the latents");
    assert!(latents.contains_key("latents"));
}

/// Absurd counts from flags or files are refused by name and at once: they used to wrap into
/// a reported fit, or to loop for hours over a billion layers or batch sizes (issue #31).
#[test]
fn plan_refuses_absurd_sizes_quickly() {
    let start = Instant::now();
    let refused = |args: &[&str], named: &[&str]| {
        let output = plan(&[args, &["--gpu-mem", "24GiB"]].concat());
        assert_fails_with(&output, named);
    };
    refused(
        &["--model", "llama-3-8b", "--batch", "1000000000000"],
        &["--max-seqs 1000000000000", "65536"],
    );
    refused(
        &[
            "--model",
            "wan2.1-t2v-14b",
            "--tp",
            "1",
            "--size",
            "4294967296x4294967296",
        ],
        &["--size 4294967296x4294967296", "16384 pixels"],
    );
    refused(
        &["--model", "wan2.1-t2v-14b", "--frames", "18446744073709551613"],
        &["--frames 18446744073709551613", "16385 frames"],
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let config = model.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("read")).expect("json");
    json["num_hidden_layers"] = 1_000_000_000u64.into();
    std::fs::write(&config, json.to_string()).expect("write");
    refused(
        &["--model", model.to_str().expect("utf8")],
        &["num_hidden_layers", "1000000000", "above the 1024"],
    );
    // A batch over budget: the largest that fits is found by bisection, not a count down.
    let output = plan(&[
        "--model",
        "llama-3-8b",
        "--tp",
        "1",
        "--gpu-mem",
        "24GiB",
        "--max-seqs",
        "60000",
    ]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--max-seqs "),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
}

/// A VAE over budget is refused at once, by `plan` and by `decode`, with nothing written: the
/// refusal's search for a width that fits planned every one of the VAE's 2,048 bands and
/// checked the checkpoint once a rank, minutes of a seeming hang.
#[test]
fn a_vae_over_budget_is_refused_at_once() {
    use candle_core::{DType, Device, Tensor};
    let dir = tempfile::tempdir().expect("tempdir");
    let pipeline = tpinfer_tests::TinyWanPipeline::default();
    let z = pipeline.dit.channels;
    let pipeline = pipeline.write(&dir.path().join("pipe"));
    let vae = pipeline.join("vae");
    let vae = vae.to_str().expect("utf8");
    let video = ["--frames", "81", "--size", "832x480", "--gpu-mem", "1MiB"];
    let start = Instant::now();
    for tp in [None, Some("1")] {
        let mut args = vec!["--model", vae];
        args.extend(tp.map(|tp| ["--tp", tp]).into_iter().flatten());
        args.extend(video);
        let output = plan(&args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let latents = dir.path().join("latents.safetensors");
    Tensor::zeros((z, 21, 60, 104), DType::F32, &Device::Cpu)
        .and_then(|t| t.save_safetensors("latents", &latents))
        .expect("latents");
    let frames = dir.path().join("frames");
    let output = tpinfer(
        &[
            "decode",
            "--model",
            vae,
            "--latents",
            latents.to_str().expect("utf8"),
            "--save-frames",
            frames.to_str().expect("utf8"),
            "--gpu-mem",
            "1MiB",
        ],
        Duration::from_secs(60),
    );
    assert_fails_with(&output, &["does not fit", "at any TP width up to 64"]);
    assert!(!frames.exists(), "a refused decode wrote {}", frames.display());
    assert!(start.elapsed() < Duration::from_secs(30), "{:?}", start.elapsed());
}

/// Serving 64 sequences of 8,192 positions of Llama-3-8B on one 24 GiB GPU: their KV caches
/// at full length (64 GiB) do not fit, so the paged cache holds as many full contexts as the
/// budget affords, as `tpinfer serve` sizes it: one more would not fit.
#[test]
fn plan_sizes_a_serving_kv_cache_to_the_budget() {
    let args = [
        "--model",
        "llama-3-8b",
        "--tp",
        "1",
        "--gpu-mem",
        "24GiB",
        "--max-context",
        "8192",
        "--max-seqs",
        "64",
    ];
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let out = json(&plan(&with_json));
    assert_eq!(out["fits"], true, "{out}");
    let held = out["kv_sequences_that_fit"].as_u64().expect("kv_sequences_that_fit") as u128;
    assert!((1..64).contains(&held), "{held}");
    assert_eq!(out["plan"]["placement"]["kv_sequences"], held as u64);
    let rank = &out["plan"]["ranks"][0];
    // Llama-3-8B's keys and values: 32 layers × 8 KV heads × 128 × 2 × 2 bytes a position.
    let per_sequence = 8192u128 * 32 * 8 * 128 * 2 * 2;
    assert_eq!(rank["cache"].as_u64().expect("cache") as u128, held * per_sequence);
    let (peak, budget) = (out["peak"].as_u64().expect("peak") as u128, 24u128 << 30);
    assert!(peak <= budget && peak + per_sequence > budget, "{peak} {budget}");
    // In words, and for every width.
    let text = plan(&args);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.contains(&format!("the budget holds {held} sequences of 8192 positions")),
        "{stdout}"
    );
    let widths = [&args[..2], &args[4..]].concat();
    let table = plan(&widths);
    let stdout = String::from_utf8_lossy(&table.stdout);
    assert!(stdout.contains("full contexts the budget's KV cache holds"), "{stdout}");
    let tp1 = stdout.lines().find(|l| l.starts_with("| 1 |")).expect("the TP 1 row");
    assert!(tp1.ends_with(&format!(" {held} |")), "{tp1}");
}

/// An error says its cause once: a missing config.json used to print the OS error twice.
#[test]
fn an_error_names_its_cause_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let output = generate(dir.path(), &[]);
    assert_fails_with(&output, &["config.json"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

/// A Wan directory without text says what it needs, not that an LLM's --prompt is missing.
#[test]
fn a_wan_run_without_text_says_what_it_needs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tpinfer_tests::TinyWan::default().write(&dir.path().join("wan"));
    let output = tpinfer(
        &["generate", "--model", path.to_str().expect("utf8")],
        Duration::from_secs(30),
    );
    assert_fails_with(&output, &["--prompt (with a pipeline directory) or --text-embeds"]);
}

/// `tpinfer generate --model ORG/NAME` runs the cached snapshot as its directory would run,
/// and finds it through HF_HOME too; a model the cache lacks is downloaded from HF_ENDPOINT
/// (here a hub on a local port), or refused at once with HF_HUB_OFFLINE=1.
#[test]
fn the_cli_takes_a_hub_id() {
    use std::process::Command;
    let dir = tempfile::tempdir().expect("tempdir");
    let snapshot = tpinfer_tests::hub_snapshot(&dir.path().join("hub"), "org/tiny", tpinfer_tests::HUB_COMMIT);
    TinyLlama::default().write(&snapshot);
    let remote = TinyLlama::default().write(&dir.path().join("remote"));
    let server = tpinfer_tests::FakeHub::serve_dir("org/fetched", tpinfer_tests::HUB_COMMIT, &remote);
    let run = |model: &str, vars: &[(&str, std::path::PathBuf)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tpinfer"));
        command
            .args([
                "generate",
                "--model",
                model,
                "--prompt",
                "hello",
                "--max-new-tokens",
                "4",
                "--tp",
                "2",
            ])
            .env("HF_ENDPOINT", &server.endpoint);
        for var in ["HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN"] {
            command.env_remove(var);
        }
        command
            .envs(vars.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("tpinfer")
    };
    let cache = [("HF_HUB_CACHE", dir.path().join("hub"))];
    let by_id = run("org/tiny", &cache);
    assert!(by_id.status.success(), "{}", String::from_utf8_lossy(&by_id.stderr));
    let by_path = run(snapshot.to_str().expect("utf8"), &cache);
    assert_eq!(by_id.stdout, by_path.stdout);
    let by_home = run("org/tiny", &[("HF_HOME", dir.path().to_path_buf())]);
    assert_eq!(by_home.stdout, by_path.stdout);
    assert!(
        server.requested().is_empty(),
        "a cached model asked the hub: {:?}",
        server.requested()
    );

    let offline = [cache[0].clone(), ("HF_HUB_OFFLINE", "1".into())];
    let missing = run("org/fetched", &offline);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("org/fetched is not in the Hugging Face cache"));
    assert!(
        server.requested().is_empty(),
        "offline, the hub was asked: {:?}",
        server.requested()
    );

    let fetched = run("org/fetched", &cache);
    assert!(fetched.status.success(), "{}", String::from_utf8_lossy(&fetched.stderr));
    assert_eq!(
        fetched.stdout, by_path.stdout,
        "the downloaded model runs as the cached one"
    );
    assert!(server.requested().iter().any(|f| f.ends_with(".safetensors")));
    let again = run("org/fetched", &offline);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
}

/// `--json` writes the text, its tokens and the statistics as one JSON object; `-v` logs the
/// start-up stages with their times, as JSON lines that name their rank with
/// `--log-format json`; `-q` logs nothing but errors.
#[test]
fn json_output_and_log_levels() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let output = generate(&model, &["--tp", "2", "--max-new-tokens", "5", "--json", "-v"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let tokens = report["tokens"].as_array().expect("tokens").len();
    assert!(tokens > 0 && report["generated_tokens"] == tokens, "{report}");
    assert!(report["text"].is_string() && report["decode_tokens_per_second"].as_f64().is_some());
    // The default device is `auto`: CPU threads in a build without NCCL.
    for stage in [
        "the ranks' devices device=Cpu",
        "planned",
        "joined the communicator",
        "loaded",
        "started",
    ] {
        assert!(stderr.contains(stage), "no {stage} at -v: {stderr}");
    }
    let output = generate(&model, &["--max-new-tokens", "2", "-v", "--log-format", "json"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON log line"))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["span"]["rank"] == 0 && l["fields"]["message"] == "loaded"),
        "{stderr}"
    );
    let quiet = generate(&model, &["--max-new-tokens", "2", "-q", "--gpu-mem", "1TiB"]);
    assert!(quiet.status.success());
    assert!(String::from_utf8_lossy(&quiet.stderr)
        .lines()
        .all(|l| !l.contains("WARN") && !l.contains("INFO")));
}

/// Speech-to-video from the official layout: an MP4 whose video and AAC audio both last the
/// speech's 1.5 s (24 frames at 16 fps, two clips made and cut at the speech's end), and the
/// frames as PNGs; flags that do not apply refused by name.
#[test]
fn speech_to_video_writes_a_talking_video() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/s2v-pipeline");
    let (model, inputs) = (fixture.join("model"), fixture.join("inputs"));
    let dir = tempfile::tempdir().expect("tempdir");
    let (video, frames) = (dir.path().join("talk.mp4"), dir.path().join("frames"));
    let path = |p: &Path| p.to_str().expect("utf8").to_string();
    let (audio, image) = (path(&inputs.join("speech.wav")), path(&inputs.join("face.png")));
    let common = [
        "--audio", &audio, "--image", &image, "--size", "64x64", "--frames", "16", "--steps", "1", "--tp", "2",
    ];
    // A run with `common` and `more`, which must succeed: its stderr.
    let succeed = |more: &[&str]| {
        let output = tpinfer(
            &[&["generate", "--model", &path(&model)][..], &common, more].concat(),
            Duration::from_secs(120),
        );
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "{stderr}");
        stderr
    };
    let (out, saved) = (path(&video), path(&frames));
    let stderr = succeed(&["--out", &out, "--save-frames", &saved]);
    assert!(stderr.contains("2 clips, 24 frames"), "{stderr}");
    assert_eq!(std::fs::read_dir(&frames).expect("frames").count(), 24);
    let file = std::fs::File::open(&video).expect("mp4");
    let size = file.metadata().expect("size").len();
    let mp4 = mp4::Mp4Reader::read_header(std::io::BufReader::new(file), size).expect("an MP4");
    let kinds: Vec<String> = mp4
        .tracks()
        .values()
        .map(|t| format!("{:?}", t.track_type().expect("type")))
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert!(
        kinds.iter().any(|k| k == "Video") && kinds.iter().any(|k| k == "Audio"),
        "{kinds:?}"
    );
    for track in mp4.tracks().values() {
        let seconds = track.duration().as_secs_f64();
        assert!((seconds - 1.5).abs() < 0.05, "a track lasts {seconds} s");
    }
    // With a pose video, one clip: its frames read as far as the clip takes them.
    let (pose, posed) = (path(&inputs.join("pose.mp4")), path(&dir.path().join("posed.mp4")));
    let stderr = succeed(&["--pose-video", &pose, "--max-clips", "1", "--out", &posed]);
    assert!(stderr.contains("1 clip"), "{stderr}");
    // Refused by name, before anything loads.
    let model = path(&model);
    let without_image = ["generate", "--model", &model, "--audio", &audio];
    assert_fails_with(&tpinfer(&without_image, Duration::from_secs(30)), &["--image"]);
    let mut at_24 = common.to_vec();
    at_24.extend(["--fps", "24"]);
    assert_fails_with(
        &tpinfer(
            &[&["generate", "--model", &model][..], &at_24].concat(),
            Duration::from_secs(30),
        ),
        &["--fps 24", "16 frames a second"],
    );
    let embeds = [
        "generate",
        "--model",
        &model,
        "--audio",
        &audio,
        "--image",
        &image,
        "--text-embeds",
        "x.st",
    ];
    assert_fails_with(
        &tpinfer(&embeds, Duration::from_secs(30)),
        &["--text-embeds", "speech-to-video"],
    );
    let bad_frames = [&["generate", "--model", &model][..], &common[..6], &["--frames", "18"]].concat();
    assert_fails_with(
        &tpinfer(&bad_frames, Duration::from_secs(30)),
        &["--frames 18", "4k frames"],
    );
    let t2v = tpinfer_tests::TinyWanPipeline::default();
    let t2v_dir = tempfile::tempdir().expect("tempdir");
    let pipeline = t2v.write(t2v_dir.path());
    assert_fails_with(
        &generate(&pipeline, &["--audio", &audio]),
        &["--audio", "not a Wan2.2-S2V checkpoint"],
    );
}

/// `--chat-template` replaces the model's chat template, from a file or given inline: a
/// template that renders the message alone makes the prompt the text without its BOS (27
/// tokens where the plain prompt is 28). A missing file, a value that is no template and a
/// template that does not render are each refused before any weight loads.
#[test]
fn a_chat_template_replaces_the_models() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(&dir.path().join("model"));
    let bare = "{{ messages[0]['content'] }}";
    let file = dir.path().join("bare.jinja");
    std::fs::write(&file, bare).expect("write template");
    for template in [file.to_str().expect("utf8"), bare] {
        let output = generate(
            &model,
            &["--chat", "--chat-template", template, "--max-new-tokens", "2"],
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        assert!(stderr.contains("prompt 27 tokens"), "{stderr}");
    }
    let missing = dir.path().join("missing.jinja");
    assert_fails_with(
        &generate(&model, &["--chat", "--chat-template", missing.to_str().expect("utf8")]),
        &["--chat-template", "missing.jinja", "no such file"],
    );
    assert_fails_with(
        &generate(&model, &["--chat", "--chat-template", "{% for m in messages %}"]),
        &["the chat template given for", "chat template: "],
    );
    // A model without a template: --chat says how to give one, and --chat-template does.
    let config = model.join("tokenizer_config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("read")).expect("json");
    json.as_object_mut().expect("object").remove("chat_template");
    std::fs::write(&config, json.to_string()).expect("write");
    assert_fails_with(&generate(&model, &["--chat"]), &["no chat template", "--chat-template"]);
    let output = generate(&model, &["--chat", "--chat-template", bare, "--max-new-tokens", "2"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}
