//! S2V's audio modules against the wan22 wheel's own classes run on the same random weights
//! (`tests/fixtures/s2v-audio`, written by `scripts/reference/reference_s2v_audio.py`): the
//! causal audio encoder of one clip's wav2vec2 features, and two audio injections after a
//! block, at TP 1 against the reference and at every width to 4 (3 splits the heads
//! unevenly) against TP 1.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::{Communicator, ThreadGroup};
use tpinfer_tests::tensor_rel_error;
use tpinfer_wan::{AudioEmbedding, S2vAudio, S2vModules, WanConfig, WanShard};
use tpinfer_weights::{SafetensorsStore, ShardLoader};

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
        audio_inject_layers: 2,
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
                let injected = (0..2)
                    .map(|i| {
                        audio
                            .inject(i, &hidden, VIDEO_TOKENS, &emb, &c, comm.as_ref())
                            .expect("inject")
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
        // The reference and motion tokens after the clip's are left alone.
        let rest = got.narrow(0, VIDEO_TOKENS, 10).expect("rest");
        assert_eq!(
            tensor_rel_error(&rest, &r["hidden"].narrow(0, VIDEO_TOKENS, 10).expect("rest")),
            0.0
        );
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
    let err = audio
        .inject(0, &r["hidden"], 121, &emb, &c, comm.as_ref())
        .expect_err("121 tokens over 20 frames");
    assert!(err.to_string().contains("20 latent frames"), "{err}");
    let err = audio
        .inject(2, &r["hidden"], VIDEO_TOKENS, &emb, &c, comm.as_ref())
        .expect_err("no third injection");
    assert!(err.to_string().contains("injection 2 of 2"), "{err}");
}
