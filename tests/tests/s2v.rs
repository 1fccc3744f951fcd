//! Wan2.2-S2V. Its audio modules against the wan22 wheel's own classes run on the same random
//! weights (`tests/fixtures/s2v-audio`, written by `scripts/reference/reference_s2v_audio.py`):
//! the causal audio encoder of one clip's wav2vec2 features, and two audio injections after a
//! block, at TP 1 against the reference and at every width to 4 (3 splits the heads
//! unevenly) against TP 1. A checkpoint in the official layout (the original config of
//! `WanModel_S2V`, original tensor names): its plan, its refusals. One whole S2V DiT forward
//! against the wheel's `WanModel_S2V` (`tests/fixtures/s2v-dit`, written by
//! `scripts/reference/reference_s2v_dit.py`), with the motion frames and without, at TP 1–4.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::{Communicator, ThreadGroup};
use tpinfer_tests::tensor_rel_error;
use tpinfer_wan::{AudioEmbedding, S2vAudio, S2vCondition, S2vModules, WanCheckpoint, WanConfig, WanRank, WanShard};
use tpinfer_weights::{SafetensorsStore, ShardLoader, WeightFormat};

const MOTION_FRAMES: usize = 73;
const LATENT_MOTION_FRAMES: usize = 19;
const VIDEO_TOKENS: usize = 20 * 6;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/s2v-audio")
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture().join("reference.safetensors"), &Device::Cpu).expect("reference")
}

/// The fixture's shapes: 64 wide in 4 heads, wav2vec2 states 32 wide, 4 audio tokens, two
/// injections.
fn config() -> (WanConfig, S2vModules) {
    let s2v = S2vModules {
        audio_inject_layers: vec![0, 1],
        audio_dim: 32,
        num_audio_token: 4,
        cond_dim: 16,
    };
    let config = WanConfig {
        num_attention_heads: 4,
        attention_head_dim: 16,
        s2v: Some(s2v.clone()),
        ..WanConfig::wan21_t2v_14b()
    };
    (config, s2v)
}

/// Every rank's audio embedding and the stream after each injection, on `tp` CPU ranks.
fn run(tp: usize) -> Vec<(AudioEmbedding, Vec<Tensor>)> {
    let (c, s2v) = config();
    let r = reference();
    let comms = ThreadGroup::ranks(tp, Duration::from_secs(30));
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (c, s2v) = (c.clone(), s2v.clone());
            let (features, hidden) = (r["audio_input"].clone(), r["hidden"].clone());
            std::thread::spawn(move || {
                let comm: Arc<dyn Communicator> = Arc::new(comm);
                let store = SafetensorsStore::open(&fixture()).expect("store");
                let shard = WanShard::new(&c, tp, rank).expect("shard");
                let decls = shard.s2v_audio_decls(&c, &s2v);
                let mut w = ShardLoader::new(&store, &decls, DType::F32, &Device::Cpu);
                let audio = S2vAudio::load(&mut w, &s2v, &comm).expect("load");
                let emb = audio
                    .encode(&features, MOTION_FRAMES, LATENT_MOTION_FRAMES, &Device::Cpu)
                    .expect("encode");
                let video = hidden.narrow(0, 0, VIDEO_TOKENS).expect("video");
                let injected = (0..2)
                    .map(|i| {
                        let residual = audio
                            .injection(i, video.clone(), &emb, &c, comm.as_ref())
                            .expect("inject");
                        let rest = hidden.narrow(0, VIDEO_TOKENS, hidden.dim(0).expect("rows") - VIDEO_TOKENS);
                        Tensor::cat(&[(&video + residual).expect("add"), rest.expect("rest")], 0).expect("cat")
                    })
                    .collect();
                (emb, injected)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank")).collect()
}

#[test]
fn tp_1_matches_the_wan22_modules_and_every_width_matches_tp_1() {
    let r = reference();
    let one = run(1).remove(0);
    let (emb, injected) = &one;
    for (name, got) in [("audio_global", &emb.global), ("audio_local", &emb.local)] {
        assert_eq!(got.dims(), r[name].dims(), "{name}");
        let rel = tensor_rel_error(got, &r[name]);
        assert!(rel < 1e-5, "{name} against wan22: {rel:e}");
    }
    for (i, got) in injected.iter().enumerate() {
        let expected = &r[&format!("injected_{i}")];
        let rel = tensor_rel_error(got, expected);
        assert!(rel < 1e-5, "injection {i} against wan22: {rel:e}");
        // The injection changes the video tokens: the test above compares something.
        let video = |t: &Tensor| t.narrow(0, 0, VIDEO_TOKENS).expect("video");
        assert!(tensor_rel_error(&video(got), &video(&r["hidden"])) > 1e-2);
    }
    for tp in 2..=4 {
        for (rank, (emb, injected)) in run(tp).iter().enumerate() {
            let rel = tensor_rel_error(&emb.local, &one.0.local).max(tensor_rel_error(&emb.global, &one.0.global));
            assert!(rel < 1e-6, "TP {tp} rank {rank}: audio embedding against TP 1: {rel:e}");
            for (i, got) in injected.iter().enumerate() {
                let rel = tensor_rel_error(got, &one.1[i]);
                assert!(rel < 1e-5, "TP {tp} rank {rank}: injection {i} against TP 1: {rel:e}");
            }
        }
    }
}

#[test]
fn bad_inputs_are_refused_by_name() {
    let (c, s2v) = config();
    let r = reference();
    let comm: Arc<dyn Communicator> = Arc::new(ThreadGroup::ranks(1, Duration::from_secs(30)).remove(0));
    let store = SafetensorsStore::open(&fixture()).expect("store");
    let decls = WanShard::new(&c, 1, 0).expect("shard").s2v_audio_decls(&c, &s2v);
    let mut w = ShardLoader::new(&store, &decls, DType::F32, &Device::Cpu);
    let audio = S2vAudio::load(&mut w, &s2v, &comm).expect("load");
    let features = &r["audio_input"];
    // Features of 24 states, not the 25 the encoder weighs.
    let err = audio
        .encode(
            &features.narrow(1, 0, 24).expect("narrow"),
            MOTION_FRAMES,
            LATENT_MOTION_FRAMES,
            &Device::Cpu,
        )
        .expect_err("24 states");
    assert!(err.to_string().contains("24 wav2vec2 states"), "{err}");
    // More motion frames dropped than the clip makes.
    let err = audio
        .encode(features, MOTION_FRAMES, 40, &Device::Cpu)
        .expect_err("40 of 39 latent frames");
    assert!(err.to_string().contains("39 latent frames"), "{err}");
    let emb = audio
        .encode(features, MOTION_FRAMES, LATENT_MOTION_FRAMES, &Device::Cpu)
        .expect("encode");
    let video = r["hidden"].narrow(0, 0, VIDEO_TOKENS).expect("video");
    let err = audio
        .injection(0, r["hidden"].narrow(0, 0, 121).expect("121"), &emb, &c, comm.as_ref())
        .expect_err("121 tokens over 20 frames");
    assert!(err.to_string().contains("20 latent frames"), "{err}");
    let err = audio
        .injection(2, video, &emb, &c, comm.as_ref())
        .expect_err("no third injection");
    assert!(err.to_string().contains("injection 2 of 2"), "{err}");
}

fn dit_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/s2v-dit")
}

fn dit_tensors(file: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dit_fixture().join(file), &Device::Cpu).expect(file)
}

/// The fixture DiT's rank of `comm` at TP `tp` in `dtype` on the CPU.
fn dit_rank(checkpoint: &WanCheckpoint, tp: usize, comm: Arc<dyn Communicator>, dtype: DType) -> WanRank {
    let config = &checkpoint.config;
    let shard = WanShard::new(config, tp, comm.rank()).expect("shard");
    WanRank::load(
        config,
        &*checkpoint.store,
        shard,
        WeightFormat::AsStored,
        comm,
        dtype,
        &Device::Cpu,
    )
    .expect("load")
}

/// Every rank's S2V velocity for the fixture's clip with its motion frames and without them
/// (the first clip), on `tp` CPU ranks computing in `dtype`.
fn run_dit(tp: usize, dtype: DType) -> Vec<[Tensor; 2]> {
    let checkpoint = WanCheckpoint::open(&dit_fixture().join("model")).expect("open");
    run_checkpoint(&checkpoint, tp, dtype)
}

/// [`run_dit`] of `checkpoint`.
fn run_checkpoint(checkpoint: &WanCheckpoint, tp: usize, dtype: DType) -> Vec<[Tensor; 2]> {
    let inputs = dit_tensors("inputs.safetensors");
    let timestep = inputs["timestep"].to_vec1::<f32>().expect("timestep")[0] as f64;
    let comms = ThreadGroup::ranks(tp, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (checkpoint, inputs) = (checkpoint, &inputs);
                s.spawn(move || {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let rank = dit_rank(checkpoint, tp, comm, dtype);
                    let context = rank.embed_text(&inputs["text"]).expect("text");
                    let audio = rank.encode_s2v_audio(&inputs["audio"]).expect("audio");
                    let noisy = &inputs["noisy"];
                    [Some(inputs["motion"].clone()), None].map(|motion| {
                        let condition = S2vCondition {
                            reference: inputs["reference"].clone(),
                            motion,
                            pose: inputs["pose"].clone(),
                            audio: audio.clone(),
                        };
                        let clip = rank.prepare_s2v(noisy.dims(), &condition).expect("prepare");
                        rank.forward_s2v(noisy, timestep, &context, &clip, None)
                            .expect("forward")
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

/// The whole S2V forward (pose, reference and frame-packed motion tokens at timestep 0, their
/// RoPE positions, the audio injections) against the wan22 wheel's model in f32; then every
/// width, with sequence parallelism splitting the video and the condition tokens across
/// ranks, against TP 1.
#[test]
fn an_s2v_dit_forward_matches_the_wan22_model_at_every_width() {
    let reference = dit_tensors("reference.safetensors");
    let one = run_dit(1, DType::F32).remove(0);
    for (got, case) in one.iter().zip(["with_motion", "first_clip"]) {
        assert_eq!(got.dims(), reference[case].dims(), "{case}");
        let rel = tensor_rel_error(got, &reference[case]);
        assert!(rel < 1e-5, "{case} against wan22: {rel:e}");
    }
    // The motion frames move the velocity: the comparison above reaches the frame packer.
    assert!(tensor_rel_error(&reference["with_motion"], &reference["first_clip"]) > 1e-2);
    for tp in 2..=4 {
        for (rank, outs) in run_dit(tp, DType::F32).iter().enumerate() {
            for (case, (got, want)) in ["with_motion", "first_clip"].iter().zip(outs.iter().zip(&one)) {
                let rel = tensor_rel_error(got, want);
                assert!(rel < 1e-5, "TP {tp} rank {rank} {case} against TP 1: {rel:e}");
            }
        }
    }
}

/// In bf16 the forward errs against the wheel's f32 output no more than the wheel's own bf16
/// run does (4.39e-3 on the H200, under its autocast, benches/RESULTS.md) times 1.25: S2V's
/// residual stream, time embedding, head and audio encoder run in f32 as the wheel runs them
/// (with a bf16 stream and bf16 time embedding the error was 6.8e-3).
#[test]
fn a_bf16_s2v_forward_errs_like_the_wheels_own_bf16() {
    const WHEEL_BF16: f64 = 4.39e-3;
    let reference = dit_tensors("reference.safetensors");
    for tp in [1, 2] {
        for (rank, outs) in run_dit(tp, DType::BF16).iter().enumerate() {
            for (got, case) in outs.iter().zip(["with_motion", "first_clip"]) {
                let rel = tensor_rel_error(&got.to_dtype(DType::F32).expect("f32"), &reference[case]);
                assert!(
                    rel <= 1.25 * WHEEL_BF16,
                    "TP {tp} rank {rank} {case} in bf16 against wan22 f32: {rel:e}"
                );
            }
        }
    }
}

/// A LoRA adapter in PEFT's form (Live Avatar's) on an S2V checkpoint in the original names,
/// merged into each rank's slices at load, against the same adapter merged offline: a block's
/// query (split by rows over ranks), an audio injection's output (by columns) and the causal
/// audio encoder's projection (whole on each rank, held in f32).
#[test]
fn a_lora_adapter_merges_into_an_s2v_checkpoint() {
    const RANK: usize = 2;
    let targets = [
        ("blocks.1.self_attn.q", [64, 64]),
        ("audio_injector.injector.0.o", [64, 64]),
        ("casual_audio_encoder.encoder.final_linear", [64, 64]),
    ];
    let pairs: Vec<(&str, Tensor, Tensor)> = targets
        .iter()
        .enumerate()
        .map(|(i, &(module, [out, inp]))| {
            let seeded = |n: usize, salt: usize| -> Vec<f32> {
                (0..n)
                    .map(|j| (((j * 7919 + i * 104_729 + salt) % 1000) as f32 / 1000.0 - 0.5) * 0.6)
                    .collect()
            };
            let a = Tensor::from_vec(seeded(RANK * inp, 1), (RANK, inp), &Device::Cpu).expect("A");
            let b = Tensor::from_vec(seeded(out * RANK, 2), (out, RANK), &Device::Cpu).expect("B");
            (module, a, b)
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut adapter = HashMap::new();
    for (module, a, b) in &pairs {
        adapter.insert(format!("base_model.model.{module}.lora_A.weight"), a.clone());
        adapter.insert(format!("base_model.model.{module}.lora_B.weight"), b.clone());
    }
    let adapter_path = dir.path().join("adapter.safetensors");
    candle_core::safetensors::save(&adapter, &adapter_path).expect("save adapter");
    let merged_dir = dir.path().join("merged");
    std::fs::create_dir_all(&merged_dir).expect("merged dir");
    let model = dit_fixture().join("model");
    std::fs::copy(model.join("config.json"), merged_dir.join("config.json")).expect("config");
    let weights = "diffusion_pytorch_model.safetensors";
    let mut tensors = candle_core::safetensors::load(model.join(weights), &Device::Cpu).expect("checkpoint");
    for (module, a, b) in &pairs {
        let name = format!("{module}.weight");
        let merged = (&tensors[&name] + b.matmul(a).expect("B·A")).expect("merged");
        tensors.insert(name, merged);
    }
    candle_core::safetensors::save(&tensors, merged_dir.join(weights)).expect("save merged");
    let lora = Arc::new(tpinfer_weights::LoraAdapter::open(&adapter_path, Some(1.0)).expect("adapter"));
    let with_adapter = WanCheckpoint::open(&model)
        .expect("open")
        .with_lora(lora)
        .expect("merge");
    let merged = WanCheckpoint::open(&merged_dir).expect("open merged");
    let plain = run_dit(1, DType::F32).remove(0);
    let offline = run_checkpoint(&merged, 1, DType::F32).remove(0);
    assert!(
        tensor_rel_error(&offline[0], &plain[0]) > 1e-3,
        "the adapter moves the velocity"
    );
    for tp in [1, 2] {
        for (rank, outs) in run_checkpoint(&with_adapter, tp, DType::F32).iter().enumerate() {
            for (got, want) in outs.iter().zip(&offline) {
                let rel = tensor_rel_error(got, want);
                assert!(
                    rel < 1e-5,
                    "TP {tp} rank {rank}: merged at load against offline: {rel:e}"
                );
            }
        }
    }
}

/// Conditioning that does not fit the clip is refused by name, before any forward: a
/// reference of two frames, motion latents of 18 frames, pose latents of another size,
/// latents too small for the frame packer, and latents of another size than the clip's.
#[test]
fn s2v_clips_that_do_not_fit_are_refused_by_name() {
    let checkpoint = WanCheckpoint::open(&dit_fixture().join("model")).expect("open");
    let inputs = dit_tensors("inputs.safetensors");
    let comm: Arc<dyn Communicator> = Arc::new(ThreadGroup::ranks(1, Duration::from_secs(30)).remove(0));
    let rank = dit_rank(&checkpoint, 1, comm, DType::F32);
    let noisy = &inputs["noisy"];
    let good = S2vCondition {
        reference: inputs["reference"].clone(),
        motion: Some(inputs["motion"].clone()),
        pose: inputs["pose"].clone(),
        audio: rank.encode_s2v_audio(&inputs["audio"]).expect("audio"),
    };
    let frames = |t: &Tensor, n: usize| Tensor::cat(&[t, t], 1).expect("cat").narrow(1, 0, n).expect("narrow");
    for (condition, named) in [
        (
            S2vCondition {
                reference: frames(&good.reference, 2),
                ..good.clone()
            },
            "the reference latent are [16, 2, 8, 16]",
        ),
        (
            S2vCondition {
                motion: Some(frames(&inputs["motion"], 18)),
                ..good.clone()
            },
            "the motion latents are [16, 18, 8, 16]",
        ),
        (
            S2vCondition {
                pose: frames(&good.pose, 3),
                ..good.clone()
            },
            "the pose latents are [16, 3, 8, 16]",
        ),
    ] {
        let err = rank
            .prepare_s2v(noisy.dims(), &condition)
            .err()
            .expect(named)
            .to_string();
        assert!(err.contains(named), "{err}");
    }
    let err = rank
        .prepare_s2v(&[16, 4, 6, 16], &good)
        .err()
        .expect("6 latent rows")
        .to_string();
    assert!(err.contains("at least 8 × 8 latents"), "{err}");
    let clip = rank.prepare_s2v(noisy.dims(), &good).expect("prepare");
    let context = rank.embed_text(&inputs["text"]).expect("text");
    let wider = Tensor::cat(&[noisy, noisy], 3).expect("wider");
    let err = rank
        .forward_s2v(&wider, 500.0, &context, &clip, None)
        .expect_err("wider")
        .to_string();
    assert!(err.contains("prepared for (4, 4, 8) patches"), "{err}");
    let err = rank.forward(noisy, 500.0, &context).expect_err("no clip").to_string();
    assert!(err.contains("needs its clip"), "{err}");
}

/// A tiny S2V checkpoint as the official one is laid out: `config.json` in the original
/// form of `WanModel_S2V` and every tensor the plan declares, in the original names, random.
fn write_s2v_checkpoint(dir: &Path, config: &serde_json::Value) {
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let wan = WanConfig::from_dir(dir).expect("parse");
    let renames: HashMap<String, String> = tpinfer_wan::original_names(&wan).into_iter().collect();
    let tensors: HashMap<String, Tensor> = WanShard::new(&wan, 1, 0)
        .expect("shard")
        .weight_decls(&wan)
        .iter()
        .map(|d| {
            let name = renames.get(&d.name).cloned().unwrap_or_else(|| d.name.clone());
            let t = Tensor::randn(0f32, 0.02, d.shape.as_slice(), &Device::Cpu).expect("randn");
            (name, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("diffusion_pytorch_model.safetensors")).expect("save");
}

fn official_config() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "WanModel_S2V",
        "model_type": "s2v",
        "dim": 64, "ffn_dim": 96, "freq_dim": 32, "num_heads": 4, "num_layers": 3,
        "in_dim": 16, "out_dim": 16, "text_dim": 32, "patch_size": [1, 2, 2],
        "audio_dim": 32, "num_audio_token": 4, "cond_dim": 16,
        "audio_inject_layers": [0, 2],
        "enable_adain": true, "adain_mode": "attn_norm", "enable_framepack": true,
        "framepack_drop_mode": "padd", "enable_motioner": false, "zero_timestep": true,
        "zero_init": true, "add_last_motion": true, "trainable_token": false,
        "enable_tsm": false, "motion_frames": 73, "window_size": [-1, -1],
        "qk_norm": true, "cross_attn_norm": true, "eps": 1e-6
    })
}

/// The official layout plans at every width (its tensors checked against the declarations,
/// the S2V modules' among them).
#[test]
fn an_s2v_checkpoint_plans_at_every_width() {
    use tpinfer_family::Family;
    use tpinfer_plan::{DeviceProfile, Placement, Plan, ShardedModel};

    let dir = tempfile::tempdir().expect("tempdir");
    write_s2v_checkpoint(dir.path(), &official_config());
    let model = tpinfer_wan::WanModel::open(dir.path()).expect("open");
    let s2v = model.config().s2v.clone().expect("S2V modules");
    assert_eq!(s2v.audio_inject_layers, [0, 2]);
    let placement = Placement::Dit {
        frames: 80,
        width: 64,
        height: 32,
        cfg: true,
    };
    for tp in 1..=4 {
        let plan = Plan::new(&model, tp, DType::F32, placement, DeviceProfile::cpu()).expect("plan");
        // 20 latent frames of 2 x 4 patches, the reference's 8, the motion frames' 8 + 2 + 0.
        assert_eq!(plan.tokens_per_forward, 20 * 8 + 8 + 8 + 2);
        for shard in model.rank_shards(tp).expect("shards") {
            model
                .check(shard.weight_decls())
                .expect("the checkpoint holds every declared slice");
        }
    }
}

/// Through the engine at TP 2: an S2V velocity (the clip's audio encoded and its reference,
/// motion and pose embedded on every rank) is the wan22 model's, and a clip denoised with
/// guidance (three UniPC steps, the unconditional pass with the negative prompt and silent
/// audio) is the wheel's `generate` loop's; a forward without the clip, and `generate`, which
/// runs text-to-video, are refused by name.
#[test]
fn the_engine_runs_an_s2v_velocity_and_refuses_what_it_cannot_run() {
    use tpinfer_engine::{Engine, S2vInputs, VideoEngine, VideoRequest, VideoShape};

    let inputs = dit_tensors("inputs.safetensors");
    let (_, frames, h, w) = inputs["noisy"].dims4().expect("latents");
    let shape = VideoShape {
        frames: frames * 4,
        width: w * 8,
        height: h * 8,
    };
    let engine = VideoEngine::start(Engine::builder(dit_fixture().join("model")).tp(2), shape).expect("engine");
    let timestep = inputs["timestep"].to_vec1::<f32>().expect("timestep")[0] as f64;
    let clip = S2vInputs {
        reference: inputs["reference"].clone(),
        motion: Some(inputs["motion"].clone()),
        pose: inputs["pose"].clone(),
        audio: inputs["audio"].clone(),
    };
    let (v, _) = engine
        .s2v_velocity(&inputs["noisy"], timestep, &inputs["text"], &clip, false)
        .expect("velocity");
    let rel = tensor_rel_error(&v, &dit_tensors("reference.safetensors")["with_motion"]);
    assert!(rel < 1e-5, "engine TP 2 against wan22: {rel:e}");
    let err = engine
        .velocity(&inputs["noisy"], timestep, &inputs["text"])
        .expect_err("no clip")
        .to_string();
    assert!(err.contains("needs a clip"), "{err}");
    // The clip denoised as the wheel's `generate` denoises it, from the same latents.
    let request = VideoRequest {
        text: inputs["text"].clone(),
        negative: Some(inputs["negative"].clone()),
        steps: 3,
        shift: 3.0,
        guide_scale: 4.5,
        solver: tpinfer_wan::sampler::Solver::UniPc(2),
        seed: 7,
        init_latents: Some(inputs["noisy"].clone()),
    };
    let mut steps = Vec::new();
    let denoised = engine
        .generate_s2v_clip(request.clone(), clip, |s| steps.push(s.index))
        .expect("denoise");
    assert_eq!(steps, [0, 1, 2]);
    let rel = tensor_rel_error(&denoised, &dit_tensors("reference.safetensors")["denoised"]);
    assert!(rel < 1e-5, "a clip denoised at TP 2 against the wheel's loop: {rel:e}");
    let err = engine
        .generate(request, |_| {})
        .expect_err("no S2V generate")
        .to_string();
    assert!(err.contains("speech-to-video") && err.contains("clip by clip"), "{err}");
}

#[test]
fn s2v_configs_tpinfer_does_not_run_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (key, value, named) in [
        (
            "audio_inject_layers",
            serde_json::json!([2, 0]),
            "`audio_inject_layers`",
        ),
        ("audio_inject_layers", serde_json::json!([0, 3]), "below `num_layers` 3"),
        (
            "adain_mode",
            serde_json::json!("attn_out"),
            "`adain_mode` is `attn_out`",
        ),
        (
            "enable_framepack",
            serde_json::json!(false),
            "`enable_framepack` is false",
        ),
        ("motion_frames", serde_json::json!(72), "`motion_frames` is 72"),
        ("model_type", serde_json::json!("i2v"), "model_type `i2v`"),
    ] {
        let mut config = official_config();
        config[key] = value;
        std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
        let err = WanConfig::from_dir(dir.path()).expect_err(key).to_string();
        assert!(err.contains(named) && err.contains("config.json"), "{key}: {err}");
    }
}
