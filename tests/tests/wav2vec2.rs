//! The wav2vec2 speech encoder against transformers: `tests/fixtures/wav2vec2-tiny` holds a
//! random `Wav2Vec2ForCTC`, the audio it was run on and every hidden state transformers gave,
//! and the per-video-frame features of the wan22 wheel's S2V resampling
//! (`scripts/reference/reference_wav2vec2.py`). TP 1 is checked against them, every width to
//! 6 (uneven heads at 4 and 5) against TP 1, on the rank group as S2V runs it; then its plan
//! and its bad inputs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{DeviceProfile, Plan, ShardedModel};
use tpinfer_runtime::{DeviceKind, GroupOptions, Launch, RuntimeError, Topology};
use tpinfer_tests::tensor_rel_error;
use tpinfer_wav2vec2::{per_video_frame, Wav2Vec2Model};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/wav2vec2-tiny")
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture().join("reference.safetensors"), &Device::Cpu).expect("reference")
}

fn audio() -> Vec<f32> {
    reference()["audio"].to_vec1().expect("audio")
}

/// Rank 0's hidden states of `samples` with the encoder at `dir` on `tp` CPU ranks, the
/// feature convolutions `chunk` frames at a time (every rank's states are checked equal to
/// rank 0's).
fn encode(dir: &Path, tp: usize, samples: &[f32], chunk: usize) -> Result<Tensor, RuntimeError> {
    let model = Wav2Vec2Model::open(dir).map_err(|e| RuntimeError::Model(e.to_string()))?;
    let mut launch = Launch::new(Topology::new(tp, &DeviceKind::Cpu)?, GroupOptions::default());
    let placement = model.default_placement();
    let handle = launch.add(Arc::new(model), DType::F32, placement)?;
    let group = launch.start()?;
    let samples = samples.to_vec();
    let states = group.run(move |rank| -> Result<Tensor, RuntimeError> {
        let encoder = rank.models.get_mut(&handle)?;
        encoder
            .hidden_states_in_chunks(&samples, chunk)
            .map_err(|e| RuntimeError::of_rank(rank.env.rank, e))
    })?;
    for (rank, s) in states.iter().enumerate() {
        assert_eq!(
            tensor_rel_error(s, &states[0]),
            0.0,
            "rank {rank} holds rank 0's states"
        );
    }
    Ok(states[0].clone())
}

#[test]
fn tp_1_matches_transformers_and_every_width_matches_tp_1() {
    let expected = &reference()["hidden_states"];
    let one = encode(&fixture(), 1, &audio(), 10_000).expect("TP 1");
    assert_eq!(one.dims(), expected.dims());
    // Every state, the first (before any layer) and the last (through the final norm) too.
    for layer in 0..expected.dim(0).expect("layers") {
        let rel = tensor_rel_error(&one.get(layer).expect("state"), &expected.get(layer).expect("state"));
        assert!(rel < 1e-5, "state {layer} against transformers: {rel:e}");
    }
    for tp in 2..=6 {
        let states = encode(&fixture(), tp, &audio(), 10_000).expect("encode");
        let rel = tensor_rel_error(&states, &one);
        assert!(rel < 1e-5, "TP {tp} against TP 1: {rel:e}");
    }
}

/// A transformers directory that ships only `pytorch_model.bin` (a `torch.save`d state dict,
/// read without unpickling code) gives the states its safetensors give.
#[test]
fn a_pytorch_model_bin_gives_the_safetensors_states() {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/original-layout/wav2vec2");
    assert!(bin.join("pytorch_model.bin").is_file() && !bin.join("model.safetensors").exists());
    let from_bin = encode(&bin, 2, &audio(), 10_000).expect("from pytorch_model.bin");
    let from_safetensors = encode(&fixture(), 2, &audio(), 10_000).expect("from model.safetensors");
    assert_eq!(tensor_rel_error(&from_bin, &from_safetensors), 0.0);
}

/// The feature convolutions run on overlapping windows of the audio: 7 frames at a time
/// (the audio's 64 frames in 10 windows, the last short) give the frames of one pass.
#[test]
fn the_feature_convolutions_cut_into_windows_give_the_same_states() {
    let whole = encode(&fixture(), 1, &audio(), 10_000).expect("whole");
    let cut = encode(&fixture(), 2, &audio(), 7).expect("in windows");
    let rel = tensor_rel_error(&cut, &whole);
    assert!(rel < 1e-6, "windows against one pass: {rel:e}");
}

/// S2V's resampling of the states to video frames at 16 fps, in clips of 80 frames (one
/// clip, mostly past the audio's end) and of 16 (two clips, the second partly silent).
#[test]
fn per_video_frame_features_match_s2v() {
    let r = reference();
    for (clip, clips) in [(80, 1), (16, 2)] {
        let got = per_video_frame(&r["hidden_states"], 16, clip).expect("resample");
        let expected = &r[&format!("bucket_{clip}")];
        assert_eq!(got.clips, clips);
        assert_eq!(got.features.dims(), expected.dims());
        let rel = tensor_rel_error(&got.features, expected);
        assert!(rel < 1e-6, "clips of {clip}: {rel:e}");
    }
    // From the encoder's own states, the whole path: audio to the features of each frame.
    let states = encode(&fixture(), 3, &audio(), 10_000).expect("encode");
    let got = per_video_frame(&states, 16, 80).expect("resample");
    let rel = tensor_rel_error(&got.features, &r["bucket_80"]);
    assert!(rel < 1e-5, "TP 3 audio to frames: {rel:e}");
}

/// A copy of the fixture's checkpoint with its tensors renamed by `rename` (`None` drops one).
fn renamed_copy(dir: &Path, rename: impl Fn(&str) -> Option<String>) {
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).expect("config");
    let tensors =
        candle_core::safetensors::load(fixture().join("model.safetensors"), &Device::Cpu).expect("checkpoint");
    let renamed: HashMap<String, Tensor> = tensors
        .into_iter()
        .filter_map(|(k, v)| Some((rename(&k)?, v)))
        .collect();
    candle_core::safetensors::save(&renamed, dir.join("model.safetensors")).expect("save");
}

/// transformers' bare `Wav2Vec2Model` (no `wav2vec2.` prefix, no CTC head) and the older
/// `weight_norm`'s `weight_g`/`weight_v` names hold the same encoder.
#[test]
fn a_bare_model_with_the_older_weight_norm_names_is_the_same_encoder() {
    let dir = tempfile::tempdir().expect("tempdir");
    renamed_copy(dir.path(), |name| {
        let name = name.strip_prefix("wav2vec2.")?;
        Some(
            name.replace("parametrizations.weight.original0", "weight_g")
                .replace("parametrizations.weight.original1", "weight_v"),
        )
    });
    let expected = encode(&fixture(), 1, &audio(), 10_000).expect("fixture");
    let got = encode(dir.path(), 1, &audio(), 10_000).expect("renamed");
    assert_eq!(tensor_rel_error(&got, &expected), 0.0);
}

#[test]
fn the_preset_is_xlsr_53_and_it_shards_by_heads() {
    let xlsr = Wav2Vec2Model::preset("wav2vec2-large-xlsr-53").expect("preset");
    let placement = xlsr.default_placement();
    let one = Plan::new(&xlsr, 1, DType::F32, placement, DeviceProfile::cuda()).expect("plan");
    // transformers' Wav2Vec2Model in this shape holds 315,437,696 parameters besides its
    // training-time mask embedding (counted on the meta device).
    assert_eq!(one.ranks[0].weights / 4, 315_437_696);
    let five = Plan::new(&xlsr, 5, DType::F32, placement, DeviceProfile::cuda()).expect("plan");
    let sum: u64 = five.ranks.iter().map(|r| r.weights).sum();
    // Four more copies of what is whole on every rank: the convolutions, the projection,
    // the norms and the row-parallel biases, 13,275,776 parameters.
    assert_eq!(sum - one.ranks[0].weights, 4 * 13_275_776 * 4);
    assert!(Plan::new(&xlsr, 17, DType::F32, placement, DeviceProfile::cuda()).is_err());
}

#[test]
fn bad_input_is_refused_by_name() {
    let err = encode(&fixture(), 7, &audio(), 10_000).expect_err("7 ranks for 6 heads");
    assert!(err.to_string().contains("6 attention heads"), "{err}");
    let err = encode(&fixture(), 2, &[0.1; 300], 10_000).expect_err("shorter than a frame");
    assert!(
        err.to_string().contains("300 samples are shorter than one frame"),
        "{err}"
    );
    let mut nan = audio();
    nan[100] = f32::NAN;
    let err = encode(&fixture(), 1, &nan, 10_000).expect_err("NaN");
    assert!(err.to_string().contains("NaN"), "{err}");

    let dir = tempfile::tempdir().expect("tempdir");
    renamed_copy(dir.path(), |name| Some(name.to_string()));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).expect("read")).expect("json");
    let write =
        |config: &serde_json::Value| std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let open_err = |config: &serde_json::Value| {
        write(config);
        Wav2Vec2Model::open(dir.path()).err().expect("refused").to_string()
    };
    let mut c = config.clone();
    c.as_object_mut().expect("object").remove("hidden_size");
    let err = open_err(&c);
    assert!(err.contains("config.json") && err.contains("`hidden_size`"), "{err}");
    let mut c = config.clone();
    c["do_stable_layer_norm"] = false.into();
    assert!(open_err(&c).contains("`do_stable_layer_norm`"));
    let mut c = config.clone();
    c["conv_kernel"] = serde_json::json!([10, 4, 4]);
    assert!(open_err(&c).contains("`conv_kernel`"));
    let mut c = config.clone();
    c["num_attention_heads"] = 5.into();
    assert!(open_err(&c).contains("not a multiple of `num_attention_heads`"));
    // Strides whose product wraps a usize (it panicked in the frame count before it was
    // bounded), and kernels small beside them: frames far apart that each span little.
    let mut c = config.clone();
    c["conv_stride"] = serde_json::json!([16_000, 16_000, 16_000, 16_000]);
    c["conv_kernel"] = serde_json::json!([1, 1, 1, 1]);
    assert!(open_err(&c).contains("lie apart by more than"));

    // A config that disagrees with the checkpoint: the tensor is named.
    let mut c = config.clone();
    c["intermediate_size"] = 44.into();
    write(&c);
    let err = encode(dir.path(), 1, &audio(), 10_000).expect_err("44 is not the checkpoint's width");
    assert!(err.to_string().contains("intermediate_dense"), "{err}");

    // A checkpoint missing a tensor.
    write(&config);
    renamed_copy(dir.path(), |name| {
        (!name.ends_with("encoder.layer_norm.bias")).then(|| name.to_string())
    });
    let err = encode(dir.path(), 1, &audio(), 10_000).expect_err("no final norm bias");
    assert!(err.to_string().contains("encoder.layer_norm.bias"), "{err}");
}

/// A preset plans but has no weights: the rank group says so instead of loading nothing.
#[test]
fn the_preset_cannot_load() {
    let xlsr = Wav2Vec2Model::preset("wav2vec2-large-xlsr-53").expect("preset");
    let mut launch = Launch::new(
        Topology::new(1, &DeviceKind::Cpu).expect("topology"),
        GroupOptions::default(),
    );
    let placement = xlsr.default_placement();
    launch.add(Arc::new(xlsr), DType::F32, placement).expect("add");
    let err = launch.start().err().expect("a preset has no weights");
    assert!(err.to_string().contains("is a preset"), "{err}");
}
