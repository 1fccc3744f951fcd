//! Property-based fuzzing (proptest, on stable) of what tpinfer reads from files and flags:
//! safetensors headers, GGUF files, `.pth` state dicts, speech-to-video's speech, reference
//! images and pose videos, the config parsers of every family, and the plan's arithmetic. Every case must end in `Ok` or a typed error: no panic, no hang, no wrapped
//! product reported as a fit.
//!
//! CI runs each target for proptest's default case count; a longer run sets `PROPTEST_CASES`
//! (`benches/RESULTS.md` records one of 10 minutes per target).

use std::io::Write;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use proptest::sample::Index;
use tpinfer_plan::{DeviceProfile, Placement, Plan};
use tpinfer_weights::{SafetensorsStore, ShardSpec, WeightStore};

/// A byte-level mutation: overwrite one byte, or eight with all ones (a huge length or count).
#[derive(Debug, Clone)]
enum Mutation {
    Byte(Index, u8),
    Huge(Index),
    Truncate(Index),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        4 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Byte(i, b)),
        2 => any::<Index>().prop_map(Mutation::Huge),
        1 => any::<Index>().prop_map(Mutation::Truncate),
    ];
    prop::collection::vec(one, 1..6)
}

/// `bytes` mutated, within its first `head` bytes (the header, where the lengths are).
fn mutate(mut bytes: Vec<u8>, head: usize, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let head = head.min(bytes.len()).max(1);
        match m {
            Mutation::Byte(i, b) => {
                let at = i.index(head);
                if at < bytes.len() {
                    bytes[at] = *b;
                }
            }
            Mutation::Huge(i) => {
                let at = i.index(head);
                for byte in bytes.iter_mut().skip(at).take(8) {
                    *byte = 0xff;
                }
            }
            Mutation::Truncate(i) => bytes.truncate(i.index(bytes.len().max(1))),
        }
    }
    bytes
}

/// A small safetensors file of three tensors, f32, bf16 and i64.
fn safetensors_bytes() -> Vec<u8> {
    use safetensors::tensor::TensorView;
    let a = [1u8; 24];
    let b = [2u8; 8];
    let c = [3u8; 16];
    let views = [
        (
            "a",
            TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a).expect("a"),
        ),
        ("b", TensorView::new(safetensors::Dtype::BF16, vec![4], &b).expect("b")),
        ("c", TensorView::new(safetensors::Dtype::I64, vec![2], &c).expect("c")),
    ];
    safetensors::serialize(views, None).expect("serialize")
}

/// A llama GGUF of one tiny layer, f32 tensors, and its header's length.
fn gguf_bytes() -> (Vec<u8>, usize) {
    let model = tpinfer_tests::TinyLlama {
        layers: 1,
        ..tpinfer_tests::TinyLlama::default()
    };
    let u = |v: usize| Value::U32(v as u32);
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u(model.layers)),
        ("llama.embedding_length", u(model.hidden)),
        ("llama.feed_forward_length", u(model.intermediate)),
        ("llama.attention.head_count", u(model.heads)),
        ("llama.attention.head_count_kv", u(model.kv_heads)),
        ("llama.context_length", u(256)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.vocab_size", u(model.vocab)),
    ];
    let (h, f, v) = (model.hidden, model.intermediate, model.vocab);
    let kv = model.kv_heads * model.head_dim;
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("token_embd.weight", vec![v, h]),
        ("output_norm.weight", vec![h]),
        ("output.weight", vec![v, h]),
        ("blk.0.attn_norm.weight", vec![h]),
        ("blk.0.attn_q.weight", vec![h, h]),
        ("blk.0.attn_k.weight", vec![kv, h]),
        ("blk.0.attn_v.weight", vec![kv, h]),
        ("blk.0.attn_output.weight", vec![h, h]),
        ("blk.0.ffn_norm.weight", vec![h]),
        ("blk.0.ffn_gate.weight", vec![f, h]),
        ("blk.0.ffn_up.weight", vec![f, h]),
        ("blk.0.ffn_down.weight", vec![h, f]),
    ];
    let tensors: Vec<(&str, QTensor)> = shapes
        .iter()
        .map(|(name, shape)| {
            let t = Tensor::ones(shape.as_slice(), DType::F32, &Device::Cpu).expect("tensor");
            (*name, QTensor::quantize(&t, GgmlDType::F32).expect("quantize"))
        })
        .collect();
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &refs).expect("write gguf");
    let bytes = out.into_inner();
    let content = gguf_file::Content::read(&mut std::io::Cursor::new(&bytes)).expect("read back");
    (bytes, content.tensor_data_offset as usize)
}

fn write_temp(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(bytes))
        .expect("write");
    path
}

/// Any JSON: scalars of every type, and short lists and objects of them.
fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
        any::<f64>().prop_map(|n| serde_json::json!(n)),
        (0u64..70_000).prop_map(|n| serde_json::json!(n)),
        "[a-z_]{0,12}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A config that starts from a valid one and replaces some of its fields with any JSON.
fn config(base: serde_json::Value) -> impl Strategy<Value = String> {
    let keys: Vec<String> = base
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    prop::collection::vec((prop::sample::select(keys), json()), 0..4).prop_map(move |changes| {
        let mut v = base.clone();
        for (key, value) in changes {
            v[key] = value;
        }
        v.to_string()
    })
}

fn llama_config() -> serde_json::Value {
    tpinfer_tests::TinyLlama::default().config_json()
}

fn wan_config() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "WanTransformer3DModel", "num_attention_heads": 5, "attention_head_dim": 12,
        "in_channels": 4, "out_channels": 4, "text_dim": 24, "freq_dim": 16, "ffn_dim": 100,
        "num_layers": 2, "patch_size": [1, 2, 2], "cross_attn_norm": true,
        "qk_norm": "rms_norm_across_heads", "eps": 1e-6
    })
}

fn umt5_config() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 320, "d_model": 24, "d_kv": 4, "d_ff": 40, "num_layers": 2, "num_heads": 6,
        "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
        "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu", "model_type": "umt5"
    })
}

fn vae_config() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2, "temperal_downsample": [false, true, true], "attn_scales": []
    })
}

fn wav2vec2_config() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/wav2vec2-tiny/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture config")).expect("json")
}

fn s2v_config() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "WanModel_S2V", "model_type": "s2v", "dim": 64, "ffn_dim": 96, "num_heads": 4,
        "num_layers": 3, "in_dim": 16, "out_dim": 16, "text_dim": 32, "audio_dim": 32,
        "num_audio_token": 4, "cond_dim": 16, "audio_inject_layers": [0, 2], "enable_adain": true,
        "adain_mode": "attn_norm", "enable_framepack": true, "enable_motioner": false,
        "zero_timestep": true, "motion_frames": 73
    })
}

/// A small LoRA adapter file in PEFT's names, and its header's length.
fn lora_bytes() -> (Vec<u8>, usize) {
    use safetensors::tensor::TensorView;
    let (a, b) = ([1u8; 2 * 3 * 4], [2u8; 4 * 2 * 4]);
    let views = [
        (
            "base_model.model.blocks.0.attn.q.lora_A.default.weight",
            TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a).expect("A"),
        ),
        (
            "base_model.model.blocks.0.attn.q.lora_B.default.weight",
            TensorView::new(safetensors::Dtype::F32, vec![4, 2], &b).expect("B"),
        ),
    ];
    let bytes = safetensors::serialize(views, None).expect("serialize");
    let head = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("length")) as usize;
    (bytes, head)
}

/// A fixture's bytes, from the repository.
fn fixture(path: &str) -> Vec<u8> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    std::fs::read(format!("{root}/{path}")).expect("fixture")
}

/// Speech-to-video's inputs: each fixture, and the name (its extension) it is read under.
const MEDIA: [(&str, &str); 6] = [
    ("tests/fixtures/s2v-pipeline/inputs/speech.wav", "speech.wav"),
    ("crates/media/tests/data/tone-stereo-22050.flac", "speech.flac"),
    ("crates/media/tests/data/tone-mono-44100.mp3", "speech.mp3"),
    ("crates/media/tests/data/s2v-image/face.png", "face.png"),
    ("crates/media/tests/data/s2v-image/face.jpg", "face.jpg"),
    ("tests/fixtures/s2v-pipeline/inputs/pose.mp4", "pose.mp4"),
];

/// The fields of a tokenizer.json, and of its Unigram model, that the tokenizer fuzz replaces.
const TOKENIZER_FIELDS: [&str; 8] = [
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "model",
    "truncation",
    "padding",
];
const UNIGRAM_FIELDS: [&str; 4] = ["type", "unk_id", "vocab", "byte_fallback"];

proptest! {
    /// Every tensor of a mutated safetensors file opens and reads to a value or an error.
    #[test]
    fn safetensors_headers(mutations in mutations()) {
        let clean = safetensors_bytes();
        let head = 8 + u64::from_le_bytes(clean[..8].try_into().expect("length")) as usize;
        let bytes = mutate(clean, head, &mutations);
        let dir = tempfile::tempdir().expect("tempdir");
        write_temp(&dir, "model.safetensors", &bytes);
        if let Ok(store) = SafetensorsStore::open(dir.path()) {
            for name in store.names() {
                let _ = store.read(&name, &ShardSpec::Replicated);
                let _ = store.read(&name, &ShardSpec::Range { dim: 0, start: 1, len: 1 });
            }
        }
    }

    /// A mutated GGUF header opens as a Llama checkpoint, or is refused.
    #[test]
    fn gguf_files(mutations in mutations()) {
        let (clean, head) = gguf_bytes();
        let bytes = mutate(clean, head, &mutations);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_temp(&dir, "model.gguf", &bytes);
        let _ = tpinfer_llama::LlamaCheckpoint::open(&path);
    }

    /// Each family's config parser takes any value in any field.
    #[test]
    fn llama_configs(text in config(llama_config())) {
        let _ = tpinfer_llama::LlamaConfig::from_json(&text, "config.json");
    }

    #[test]
    fn wan_configs(text in config(wan_config())) {
        let _ = tpinfer_wan::WanConfig::from_json(&text, "config.json");
    }

    #[test]
    fn umt5_configs(text in config(umt5_config())) {
        let _ = tpinfer_umt5::Umt5Config::from_json(&text, "config.json");
    }

    #[test]
    fn vae_configs(text in config(vae_config())) {
        let _ = tpinfer_wan_vae::WanVaeConfig::from_json(&text, "config.json");
    }

    /// A config that parses also sizes its frames without a wrapped product.
    #[test]
    fn wav2vec2_configs(text in config(wav2vec2_config())) {
        if let Ok(c) = tpinfer_wav2vec2::Wav2Vec2Config::from_json(&text, "config.json") {
            let _ = (c.receptive_field(), c.frames(16_000 * 60), c.head_dim());
        }
    }

    #[test]
    fn s2v_configs(text in config(s2v_config())) {
        if let Ok(c) = tpinfer_wan::WanConfig::from_json(&text, "config.json") {
            let _ = c.sequence_tokens(80, 832, 480);
        }
    }

    /// A mutated adapter file opens to an adapter or an error.
    #[test]
    fn lora_files(mutations in mutations()) {
        let (clean, head) = lora_bytes();
        let bytes = mutate(clean, head, &mutations);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_temp(&dir, "adapter.safetensors", &bytes);
        let _ = tpinfer_weights::LoraAdapter::open(&path, Some(1.0));
    }

    /// Mutated speech, reference images and pose videos, in their headers (the first 512
    /// bytes) or anywhere, read to a value or a typed error.
    #[test]
    fn s2v_media(which in 0..MEDIA.len(), whole in any::<bool>(), mutations in mutations()) {
        let (source, name) = MEDIA[which];
        let clean = fixture(source);
        let head = if whole { clean.len() } else { 512 };
        let bytes = mutate(clean, head, &mutations);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_temp(&dir, name, &bytes);
        match name.rsplit('.').next() {
            Some("wav" | "flac" | "mp3") => {
                let _ = tpinfer_media::read_speech(&path, 16_000);
            }
            Some("png" | "jpg") => {
                if let Ok((h, w)) = tpinfer_media::image_size(&path) {
                    let (fh, fw) = tpinfer_media::s2v_frame_size(h, w, 832 * 480);
                    let _ = tpinfer_media::read_reference_image(&path, fh, fw);
                }
            }
            _ => {
                if let Ok(video) = tpinfer_media::read_video_frames(&path, 16, 8) {
                    let _ = tpinfer_media::pose_pixels(&video, 64, 64, 8);
                }
            }
        }
    }

    /// A mutated `.pth` state dict (the pickle is in its first 4 KiB) opens and reads to
    /// tensors or a typed error.
    #[test]
    fn pth_files(mutations in mutations(), whole in any::<bool>()) {
        let clean = fixture("tests/fixtures/original-layout/t5_bf16.pth");
        let head = if whole { clean.len() } else { 4096 };
        let bytes = mutate(clean, head, &mutations);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_temp(&dir, "t5.pth", &bytes);
        if let Ok(store) = tpinfer_weights::PthStore::open(&path) {
            for name in store.names() {
                let _ = store.read(&name, &ShardSpec::Replicated);
                let _ = store.read(&name, &ShardSpec::Range { dim: 0, start: 1, len: 1 });
            }
        }
    }

    /// A tokenizer.json (the tiny umT5 Unigram one) with fields of its own, of its model and
    /// one vocabulary entry replaced by any JSON loads, encodes and decodes, or is refused.
    #[test]
    fn tokenizer_files(
        top in prop::collection::vec((prop::sample::select(TOKENIZER_FIELDS.to_vec()), json()), 0..2),
        model in prop::collection::vec((prop::sample::select(UNIGRAM_FIELDS.to_vec()), json()), 0..3),
        entry in (any::<Index>(), json()),
    ) {
        let path = "tests/fixtures/s2v-pipeline/model/google/umt5-xxl/tokenizer.json";
        let mut v: serde_json::Value = serde_json::from_slice(&fixture(path)).expect("json");
        for (key, value) in top {
            v[key] = value;
        }
        if let Some(fields) = v.get_mut("model").and_then(|m| m.as_object_mut()) {
            for (key, value) in model {
                fields.insert(key.into(), value);
            }
        }
        let vocab = v.pointer_mut("/model/vocab").and_then(|m| m.as_array_mut());
        if let Some(vocab) = vocab.filter(|v| !v.is_empty()) {
            let at = entry.0.index(vocab.len());
            vocab[at] = entry.1;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        write_temp(&dir, "tokenizer.json", v.to_string().as_bytes());
        if let Ok(t) = tpinfer_tokenizer::Tokenizer::from_hf_dir(dir.path()) {
            if let Ok(ids) = t.encode("a cab  zz \u{2581}q", true) {
                let _ = t.decode(&ids);
            }
            let _ = t.decode(&[0, 1, 2, 3, 57, 58, 1_000_000]);
        }
    }

    /// Any width, batch, context, frames and size on any preset plans, or is refused; a plan
    /// that is made adds up (no product wrapped into a small total).
    #[test]
    fn plan_arithmetic(
        preset in prop::sample::select(tpinfer_engine::registry::presets()),
        tp in prop_oneof![1usize..9, any::<usize>()],
        big in prop_oneof![1usize..100_000, any::<usize>()],
        other in prop_oneof![1usize..100_000, any::<usize>()],
        frames in prop_oneof![Just(81usize), 1usize..400, any::<usize>()],
        cuda in any::<bool>(),
    ) {
        let (_, model) = tpinfer_engine::registry::open(preset).expect("preset");
        let placement = match model.default_placement() {
            Placement::Llm { .. } => Placement::llm(big, other),
            Placement::Dit { .. } => Placement::Dit { frames, width: big, height: other, cfg: true },
        };
        let device = if cuda { DeviceProfile::cuda() } else { DeviceProfile::cpu() };
        if let Ok(plan) = Plan::new(&*model, tp, DType::BF16, placement, device) {
            for rank in &plan.ranks {
                let total = rank.total();
                prop_assert!(total >= rank.weights && total >= rank.activations && total >= rank.cache);
            }
        }
    }
}
