//! The Wan DiT on CPU ranks: every TP width gives TP 1's velocity, in either checkpoint naming.

use candle_core::DType;
use tpinfer_engine::{Engine, VideoEngine, VideoShape};
use tpinfer_tests::{rel_error, run_wan, wan_inputs, TinyWan};

#[test]
fn tp_2_3_4_5_equal_tp_1() {
    // 5 heads (odd) and 100 FFN columns: uneven splits at TP 2, 3 and 4.
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    // 5 latent frames of 8 × 12: 5 × 4 × 6 = 120 video tokens.
    let (latents, text) = wan_inputs(&model, 5, 8, 12, 3);
    let (reference, reduces) = run_wan(&path, 1, DType::F32, &latents, &text, 731.0);
    assert!(reference.iter().all(|v| v.is_finite()));
    // Per block: the self-attention, cross-attention and FFN outputs, and the two QK norms.
    assert_eq!(reduces, 5 * model.layers as u64);
    for tp in [2, 3, 4, 5] {
        let (out, _) = run_wan(&path, tp, DType::F32, &latents, &text, 731.0);
        let err = rel_error(&out, &reference);
        assert!(err < 1e-5, "TP {tp}: relative error {err:e}");
    }
}

/// Sequence parallelism splits the tokens by rows: 75 tokens split unevenly at TP 2 and 4
/// (38 + 37, 19 + 19 + 19 + 18), and a video of fewer tokens than ranks (one token at TP 2)
/// keeps the residual stream whole.
#[test]
fn uneven_and_tiny_row_splits_equal_tp_1() {
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    for ((frames, height, width), widths) in [((5, 6, 10), [2, 4]), ((1, 2, 2), [2, 3])] {
        let (latents, text) = wan_inputs(&model, frames, height, width, 11);
        let (reference, _) = run_wan(&path, 1, DType::F32, &latents, &text, 400.0);
        for tp in widths {
            let (out, _) = run_wan(&path, tp, DType::F32, &latents, &text, 400.0);
            let err = rel_error(&out, &reference);
            assert!(
                err < 1e-5,
                "{frames}×{height}×{width} at TP {tp}: relative error {err:e}"
            );
        }
    }
}

#[test]
fn original_wan_names_load_the_same_model() {
    let diffusers = TinyWan::default();
    let original = TinyWan {
        original_names: true,
        ..TinyWan::default()
    };
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let (pa, pb) = (diffusers.write(a.path()), original.write(b.path()));
    assert!(std::fs::read_to_string(pb.join("config.json"))
        .expect("config")
        .contains("\"num_heads\""));
    let (latents, text) = wan_inputs(&diffusers, 1, 4, 4, 5);
    let (x, _) = run_wan(&pa, 2, DType::F32, &latents, &text, 500.0);
    let (y, _) = run_wan(&pb, 2, DType::F32, &latents, &text, 500.0);
    assert_eq!(x, y, "same weights under either naming give the same velocity");
}

#[test]
fn bf16_tracks_f32() {
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let (latents, text) = wan_inputs(&model, 1, 4, 8, 9);
    let (f32_out, _) = run_wan(&path, 1, DType::F32, &latents, &text, 250.0);
    let (bf16_out, _) = run_wan(&path, 3, DType::BF16, &latents, &text, 250.0);
    let err = rel_error(&bf16_out, &f32_out);
    assert!(err < 3e-2, "bf16 at TP 3 against f32: {err:e}");
}

mod sampling {
    use candle_core::{Device, Tensor};
    use tpinfer_wan::sampler::{Sampler, Schedule, Solver};

    /// Data `N(μ, s²)` per element: the exact flow-matching velocity at `x`, σ, and the exact
    /// ODE endpoint from a start — the flow maps the noise quantile `z` to `μ + s·z`.
    const MU: f64 = 0.7;
    const S: f64 = 0.3;

    fn velocity(x: &Tensor, sigma: f64) -> Tensor {
        let a = 1.0 - sigma;
        let var = a * a * S * S + sigma * sigma;
        // E[x₀ | x] = μ + a·s²/var · (x − a·μ); v = (x − E[x₀ | x]) / σ.
        let x0 = ((x - a * MU).expect("sub") * (a * S * S / var)).expect("mul") + MU;
        ((x - x0.expect("add")).expect("sub") / sigma).expect("div")
    }

    fn run(solver: Solver, steps: usize, shift: f64, start: &Tensor) -> (Tensor, f64) {
        let schedule = Schedule::new(steps, shift);
        let sigma0 = schedule.sigmas[0];
        let a = 1.0 - sigma0;
        let z = ((start - a * MU).expect("sub") / (a * a * S * S + sigma0 * sigma0).sqrt()).expect("div");
        let exact = ((z * S).expect("mul") + MU).expect("add");
        let mut sampler = Sampler::new(schedule.clone(), solver);
        let mut x = start.clone();
        for i in 0..steps {
            let v = velocity(&x, schedule.sigmas[i]);
            x = sampler.step(&x, &v).expect("step");
        }
        let err = (&x - &exact)
            .expect("sub")
            .sqr()
            .expect("sqr")
            .mean_all()
            .expect("mean");
        let norm = exact.sqr().expect("sqr").mean_all().expect("mean");
        let rel = (err.to_scalar::<f32>().expect("err") / norm.to_scalar::<f32>().expect("norm")).sqrt() as f64;
        (x, rel)
    }

    #[test]
    fn schedule_is_wans_shifted_flow() {
        let s = Schedule::new(4, 5.0);
        assert_eq!(s.sigmas.len(), 5);
        assert_eq!(*s.sigmas.last().expect("last"), 0.0);
        // σ = 0.999 shifted by 5: 5·0.999 / (1 + 4·0.999).
        assert!((s.sigmas[0] - 4.995 / 4.996).abs() < 1e-12);
        assert_eq!(s.timestep(0), 999.0);
        assert!(s.sigmas.windows(2).all(|w| w[1] < w[0]), "decreasing");
    }

    /// Halving the step: Euler's error halves (first order); UniPC with its corrector gains
    /// an order per solver order (2nd for UniPC-1, 3rd for UniPC-2). Unshifted schedule, so
    /// that the last step (to the x₀ prediction, as Wan does) is small.
    #[test]
    fn solvers_converge_at_their_orders() {
        let start = Tensor::randn(0f32, 1.0, 4096, &Device::Cpu).expect("noise");
        let errors = |solver| (run(solver, 10, 1.0, &start).1, run(solver, 20, 1.0, &start).1);
        let (euler_10, euler_20) = errors(Solver::Euler);
        let (uni1_10, uni1_20) = errors(Solver::UniPc(1));
        let (uni2_10, uni2_20) = errors(Solver::UniPc(2));
        let ratio = |a: f64, b: f64| a / b;
        assert!(
            (1.6..2.6).contains(&ratio(euler_10, euler_20)),
            "Euler {euler_10:e} → {euler_20:e}"
        );
        assert!(ratio(uni1_10, uni1_20) > 2.4, "UniPC-1 {uni1_10:e} → {uni1_20:e}");
        assert!(ratio(uni2_10, uni2_20) > 5.0, "UniPC-2 {uni2_10:e} → {uni2_20:e}");
        assert!(uni2_20 < uni1_20 && uni1_20 < euler_20);
        assert!(uni2_20 < 5e-3, "UniPC-2, 20 steps: {uni2_20:e}");
    }
}

/// `model` written to a temporary directory (kept alive by the first value) and loaded on two
/// ranks, planned for `frames` frames of 64 × 64 pixels.
fn tp2_video_engine(model: &TinyWan, frames: usize) -> (tempfile::TempDir, VideoEngine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let shape = VideoShape {
        frames,
        width: 64,
        height: 64,
    };
    let engine = VideoEngine::start(Engine::builder(&path).tp(2), shape).expect("engine");
    (dir, engine)
}

/// The engine's profiled velocity at TP 2: the same velocity as the plain one, and rank 0's
/// stages, the collectives' among them.
#[test]
fn profiled_velocity_names_rank_0s_stages() {
    let model = TinyWan::default();
    let (latents, text) = wan_inputs(&model, 3, 8, 8, 4);
    let (_dir, engine) = tp2_video_engine(&model, 9);
    let plain = engine.velocity(&latents, 500.0, &text).expect("velocity");
    let (profiled, stages) = engine.velocity_profiled(&latents, 500.0, &text).expect("profiled");
    let values = |t: &candle_core::Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
    assert_eq!(values(&plain), values(&profiled));
    let names: Vec<&str> = stages.iter().map(|(name, _)| *name).collect();
    for stage in [
        "embeddings",
        "qk rms-norm + rope",
        "self-attention",
        "all-gather",
        "out projection + sum",
        "ffn down + sum",
        "head",
    ] {
        assert!(names.contains(&stage), "no stage {stage} in {names:?}");
    }
    assert!(stages.iter().map(|(_, t)| t.as_secs_f64()).sum::<f64>() > 0.0);
}

/// A request that would fail mid-run or denoise into NaN (no steps, a bad shift or guidance
/// scale, text states of another width) is refused before any step, by the parameter's name;
/// so are velocity latents of another shape than the engine was planned for.
#[test]
fn requests_that_cannot_denoise() {
    use tpinfer_engine::{EngineError, VideoRequest};
    use tpinfer_wan::sampler::Solver;
    let model = TinyWan::default();
    let (_, text) = wan_inputs(&model, 1, 8, 8, 5);
    let (_dir, engine) = tp2_video_engine(&model, 1);
    let request = VideoRequest {
        text,
        negative: None,
        steps: 2,
        shift: 5.0,
        guide_scale: 1.0,
        solver: Solver::Euler,
        seed: 7,
        init_latents: None,
    };
    let refused = |change: fn(&mut VideoRequest)| {
        let mut bad = request.clone();
        change(&mut bad);
        let mut steps = 0;
        match engine.generate(bad, |_| steps += 1) {
            Err(e @ EngineError::InvalidRequest(_)) => {
                assert_eq!(steps, 0, "refused only after {steps} steps");
                e.to_string()
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("must refuse"),
        }
    };
    for (change, name) in [
        ((|r| r.steps = 0) as fn(&mut VideoRequest), "--steps"),
        (|r| r.shift = 0.0, "--shift 0"),
        (|r| r.shift = f64::NAN, "--shift NaN"),
        (|r| r.guide_scale = f64::INFINITY, "--guide-scale inf"),
        (|r| r.guide_scale = -2.0, "--guide-scale -2 is below 0"),
        (
            |r| r.text = r.text.narrow(1, 0, 20).expect("narrow"),
            "[7, 20], but this model takes [tokens, 24]",
        ),
        (
            |r| r.negative = Some(r.text.narrow(0, 0, 0).expect("narrow")),
            "the negative prompt's states are [0, 24]",
        ),
    ] {
        let message = refused(change);
        assert!(message.contains(name), "{message:?} must name {name}");
    }
    let small = candle_core::Tensor::zeros((4, 1, 4, 4), DType::F32, &candle_core::Device::Cpu).expect("latents");
    match engine.velocity(&small, 500.0, &request.text) {
        Err(e @ EngineError::InvalidRequest(_)) => assert!(e.to_string().contains("[4, 1, 4, 4]"), "{e}"),
        other => panic!(
            "latents of another shape must be refused: {:?}",
            other.map(|t| t.dims().to_vec())
        ),
    }
    let latents = engine.generate(request, |_| {}).expect("a valid request denoises");
    let values = latents.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
    assert!(values.iter().all(|v| v.is_finite()));
}

/// FP8 self-attention runs only where its Hopper kernel does: CPU ranks refuse it at load,
/// naming the option and what would run, and a language model refuses it before loading.
#[test]
fn fp8_self_attention_is_refused_where_no_kernel_runs_it() {
    use tpinfer_engine::SelfAttention;
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let shape = VideoShape {
        frames: 9,
        width: 64,
        height: 64,
    };
    let builder = Engine::builder(&path).tp(2).self_attention(SelfAttention::Fp8);
    let err = VideoEngine::start(builder, shape).err().expect("refused").to_string();
    assert!(
        err.contains("--attention fp8") && err.contains("Hopper") && err.contains("Cpu"),
        "{err}"
    );
    // A chat template is a language model's.
    let builder = Engine::builder(&path).tp(2).chat_template("{{ messages }}");
    let err = VideoEngine::start(builder, shape).err().expect("refused").to_string();
    assert!(err.contains("a chat template is for language models"), "{err}");
    let llama_dir = tempfile::tempdir().expect("tempdir");
    let llama = tpinfer_tests::TinyLlama::default().write(llama_dir.path());
    let err = Engine::builder(&llama)
        .self_attention(SelfAttention::Fp8)
        .build()
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("FP8 self-attention is for Wan video models"), "{err}");
}

/// The plan of FP8 self-attention: the path takes it only where flash attention runs, and a
/// forward's peak grows by at most the kernel's E4M3 copies and scales, counted to the byte:
/// at TP 1 the attention is the 14B DiT's peak and grows, at TP 2 and 5 the FFN stays it.
#[test]
fn fp8_self_attention_plans_its_copies() {
    use tpinfer_wan::memory::{AttentionPath, DitMemory, ForwardPath, Video};
    use tpinfer_wan::{SelfAttention, WanConfig, WanShard};
    let fp8 = |path: ForwardPath| path.with_self_attention(SelfAttention::Fp8).attention;
    assert_eq!(fp8(ForwardPath::for_device(true, DType::BF16, 128)), AttentionPath::Fp8);
    assert_eq!(
        fp8(ForwardPath::for_device(true, DType::F32, 128)),
        AttentionPath::Blockwise
    );
    // Q 1000 × 12 heads and K and V 1000 × 4, V's keys padded to 1024, all of 128 values a
    // byte; f32 scales: Q's 16 blocks of 64 rows × 12, K's 8 of 128 × 4, and V's maximum and
    // scale per channel of each KV head.
    let bytes = (12_000 + 4_000 + 4 * 1024) * 128 + 4 * (16 * 12 + 8 * 4 + 2 * 4 * 128);
    assert_eq!(tpinfer_kernels::flash_attention_fp8_bytes(1000, 12, 1000, 4), bytes);
    let c = WanConfig::wan21_t2v_14b();
    let video = Video {
        frames: 81,
        width: 832,
        height: 480,
        cfg: true,
    };
    let s = c.sequence_tokens(81, 832, 480);
    for tp in [1, 2, 5] {
        let shard = WanShard::new(&c, tp, 0).expect("shard");
        let path = ForwardPath::for_device(true, DType::BF16, 128);
        let plain = DitMemory::new(&c, &shard, DType::BF16, video, path);
        let quantized = DitMemory::new(
            &c,
            &shard,
            DType::BF16,
            video,
            path.with_self_attention(SelfAttention::Fp8),
        );
        let heads = shard.heads.len();
        let copies = tpinfer_kernels::flash_attention_fp8_bytes(s, heads, s, heads);
        let grown = quantized.activations - plain.activations;
        assert!(
            grown <= copies && (grown > 0) == (tp == 1),
            "TP {tp}: {grown} of {copies}"
        );
        assert_eq!((quantized.buffers, quantized.latents), (plain.buffers, plain.latents));
    }
}
