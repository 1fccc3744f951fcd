//! Bad input gives one clear error that names the file, tensor or field and the fix.

use std::path::Path;

use tpinfer_engine::{Engine, EngineError, GenerateRequest, Prompt, RuntimeError, SamplingParams};
use tpinfer_tests::{Flavor, TinyLlama};

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyLlama::default().write(dir.path());
    dir
}

fn build_error(path: &Path, tp: usize) -> String {
    match Engine::builder(path).tp(tp).build() {
        Ok(_) => panic!("building from {} at TP {tp} must fail", path.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "error {message:?} must mention {part:?}");
    }
}

#[test]
fn missing_files() {
    let dir = model_dir();
    assert_mentions(&build_error(&dir.path().join("nope"), 1), &["does not exist", "nope"]);

    std::fs::remove_file(dir.path().join("tokenizer.json")).expect("rm");
    assert_mentions(&build_error(dir.path(), 1), &["tokenizer.json", "not found"]);

    std::fs::remove_file(dir.path().join("model.safetensors")).expect("rm");
    assert_mentions(&build_error(dir.path(), 1), &["no weights", "model.safetensors"]);
    // An older checkpoint's pickled shards without their index: both named.
    std::fs::write(dir.path().join("pytorch_model-00001-of-00002.bin"), b"pickles").expect("bin");
    assert_mentions(
        &build_error(dir.path(), 1),
        &[
            "pytorch_model.bin.index.json",
            "is missing",
            "pytorch_model-00001-of-00002.bin",
        ],
    );

    std::fs::remove_file(dir.path().join("config.json")).expect("rm");
    assert_mentions(&build_error(dir.path(), 1), &["config.json"]);
}

#[test]
fn truncated_safetensors() {
    let dir = model_dir();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("truncate");
    assert_mentions(
        &build_error(dir.path(), 2),
        &["model.safetensors", "truncated or corrupt"],
    );
    // A header cut short.
    std::fs::write(&path, &bytes[..20]).expect("truncate");
    assert_mentions(
        &build_error(dir.path(), 2),
        &["model.safetensors", "not a valid safetensors"],
    );
}

#[test]
fn safetensors_header_that_lies() {
    let dir = model_dir();
    let path = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header = String::from_utf8(bytes[8..8 + header_len].to_vec()).expect("utf8");
    // Claim a bigger shape for the embedding than its bytes hold, same header length.
    let lying = header.replacen("[320,64]", "[640,64]", 1);
    assert_ne!(lying, header, "the fixture's header must contain the embedding shape");
    bytes[8..8 + header_len].copy_from_slice(lying.as_bytes());
    std::fs::write(&path, &bytes).expect("write");
    assert_mentions(&build_error(dir.path(), 1), &["model.safetensors", "corrupt"]);
}

#[test]
fn tensor_with_the_wrong_shape() {
    let dir = model_dir();
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).expect("read");
    std::fs::write(
        &config,
        text.replace("\"intermediate_size\":96", "\"intermediate_size\":128"),
    )
    .expect("write");
    assert_mentions(
        &build_error(dir.path(), 2),
        &[
            "model.layers.0.mlp",
            "[96, 64]",
            "[128, 64]",
            "does not match config.json",
        ],
    );
}

#[test]
fn missing_config_field() {
    let dir = model_dir();
    let config = dir.path().join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("read")).expect("json");
    json.as_object_mut().expect("object").remove("num_hidden_layers");
    std::fs::write(&config, json.to_string()).expect("write");
    assert_mentions(
        &build_error(dir.path(), 1),
        &["config.json", "missing field `num_hidden_layers`"],
    );
}

#[test]
fn tp_larger_than_the_head_count() {
    let dir = model_dir();
    let message = build_error(dir.path(), 9);
    assert_mentions(&message, &["9", "8 attention heads", "--tp 8 or less"]);
    assert_eq!(message.matches("cannot shard").count(), 1, "said once: {message}");
}

#[test]
fn prompt_longer_than_the_context() {
    let dir = model_dir();
    let engine = Engine::builder(dir.path())
        .tp(2)
        .max_context(16)
        .build()
        .expect("engine");
    let request = GenerateRequest::new(Prompt::text("this prompt is far longer than sixteen tokens"), 4);
    match engine.generate(request) {
        Err(e @ EngineError::PromptTooLong { .. }) => {
            assert_mentions(&e.to_string(), &["46 tokens", "16", "--max-context"])
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("must refuse"),
    }
}

#[test]
fn context_longer_than_the_model_allows() {
    let dir = model_dir();
    for tokens in [0, 513] {
        let result = Engine::builder(dir.path()).tp(2).max_context(tokens).build();
        match result {
            Err(e @ EngineError::Runtime(RuntimeError::Plan(_))) => {
                assert_mentions(&e.to_string(), &[&format!("--max-context {tokens}"), "512 positions"])
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("--max-context {tokens} must be refused"),
        }
    }
    let engine = Engine::builder(dir.path())
        .tp(2)
        .max_context(512)
        .build()
        .expect("the model's own length");
    assert_eq!(engine.max_context(), 512);
}

#[test]
fn cuda_without_the_feature_is_refused_clearly() {
    let dir = model_dir();
    let result = Engine::builder(dir.path())
        .tp(2)
        .device(tpinfer_engine::DeviceKind::Cuda { gpus: None })
        .build();
    match result {
        Err(EngineError::Runtime(RuntimeError::CudaNotBuilt)) => {}
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("must refuse"),
    }
}

#[test]
fn token_ids_outside_the_vocabulary_and_empty_requests() {
    let dir = model_dir();
    let engine = Engine::builder(dir.path()).tp(3).build().expect("engine");
    let refused = |request: GenerateRequest| match engine.generate(request) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("must refuse"),
    };
    assert_mentions(
        &refused(GenerateRequest::new(Prompt::Tokens(vec![1, 320]), 4)),
        &["token id 320", "vocabulary of 320"],
    );
    assert_mentions(&refused(GenerateRequest::new(Prompt::Tokens(vec![]), 4)), &["empty"]);
    assert_mentions(
        &refused(GenerateRequest::new(Prompt::text("a"), 0)),
        &["max_new_tokens"],
    );
    let mut greedy_logprobs = GenerateRequest::new(Prompt::text("a"), 4);
    greedy_logprobs.logprobs = Some(21);
    assert_mentions(&refused(greedy_logprobs), &["logprobs", "21", "at most 20"]);
}

#[test]
fn sampling_parameters_that_cannot_sample() {
    let dir = model_dir();
    let engine = Engine::builder(dir.path()).tp(2).build().expect("engine");
    let sampled = SamplingParams {
        temperature: 0.8,
        ..SamplingParams::default()
    };
    let refused = |sampling: SamplingParams| match engine
        .generate(GenerateRequest::new(Prompt::text("a"), 4).with_sampling(sampling))
    {
        Err(e @ EngineError::InvalidRequest(_)) => e.to_string(),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("must refuse"),
    };
    let with = |change: fn(&mut SamplingParams)| {
        let mut params = sampled.clone();
        change(&mut params);
        refused(params)
    };
    assert_mentions(&with(|p| p.top_k = Some(0)), &["top_k", "at least 1"]);
    assert_mentions(&with(|p| p.top_p = Some(0.0)), &["top_p 0", "(0, 1]"]);
    assert_mentions(&with(|p| p.top_p = Some(1.5)), &["top_p 1.5"]);
    assert_mentions(&with(|p| p.top_p = Some(f64::NAN)), &["top_p NaN"]);
    assert_mentions(&with(|p| p.temperature = f64::NAN), &["temperature NaN"]);
    // Below 0 used to run greedy without a word (issue #31).
    assert_mentions(&with(|p| p.temperature = -1.0), &["temperature -1", "below 0"]);
    assert_mentions(
        &with(|p| p.repetition_penalty = 0.0),
        &["repetition_penalty 0", "above 0"],
    );
    assert_mentions(
        &with(|p| p.repetition_penalty = f32::INFINITY),
        &["repetition_penalty inf"],
    );
    assert_mentions(
        &with(|p| p.frequency_penalty = 2.5),
        &["frequency_penalty 2.5", "-2 to 2"],
    );
    assert_mentions(&with(|p| p.presence_penalty = f32::NAN), &["presence_penalty NaN"]);
    assert_mentions(
        &with(|p| p.logit_bias = vec![(3, 150.0)]),
        &["logit_bias 150", "token 3", "-100 to 100"],
    );
    assert_mentions(
        &with(|p| p.logit_bias = vec![(3, 1.0), (3, -1.0)]),
        &["logit_bias", "token 3 twice"],
    );
    assert_mentions(
        &with(|p| p.logit_bias = vec![(1_000_000, 1.0)]),
        &["logit_bias", "token 1000000", "vocabulary"],
    );
    // Greedy requests are checked too: a bad top_k is a mistake even where it would be ignored.
    let greedy = SamplingParams {
        top_k: Some(0),
        ..SamplingParams::default()
    };
    assert_mentions(&refused(greedy), &["top_k"]);
    // The edges that do sample.
    for ok in [
        SamplingParams {
            top_p: Some(1.0),
            top_k: Some(1),
            ..sampled.clone()
        },
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
    ] {
        let (_, tokens, stats) = engine
            .generate(GenerateRequest::new(Prompt::text("a"), 2).with_sampling(ok))
            .and_then(|stream| stream.collect_text())
            .expect("valid sampling parameters");
        assert_eq!(tokens.len(), stats.generated_tokens);
        assert!(stats.generated_tokens >= 1);
    }
}

/// A config's values the model does not run, and fields of the wrong type, are refused by
/// name: they used to be ignored, taken on trust into a loop over a billion layers, or
/// reported by line and column alone (issue #31).
#[test]
fn config_values_the_model_does_not_run() {
    let dir = model_dir();
    let config = dir.path().join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("read")).expect("json");
    for (field, value, parts) in [
        ("hidden_act", serde_json::json!("gelu"), ["hidden_act", "`gelu`"]),
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000_000u64),
            ["num_hidden_layers", "above the 1024"],
        ),
        ("vocab_size", serde_json::json!(1u64 << 40), ["vocab_size", "above the"]),
        // A field of the wrong type is named (the message said only a line and column).
        ("hidden_size", serde_json::json!("64"), ["`hidden_size`", "wrong type"]),
        // A rope type or value of the wrong type ran as the default rope without a word, or
        // was reported missing.
        (
            "rope_scaling",
            serde_json::json!({"rope_type": 3, "factor": 8.0}),
            ["rope_scaling.rope_type", "is 3"],
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            ["rope_scaling.factor", "a number above 0"],
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": "500000"}),
            ["rope_parameters.rope_theta", "must be a number"],
        ),
        // YaRN without its factor, or with a ramp end of the wrong sign; a type not run.
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "original_max_position_embeddings": 256}),
            ["rope_scaling.factor", "missing"],
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0, "beta_fast": -32}),
            ["rope_scaling.beta_fast", "a number above 0"],
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "longrope", "factor": 4.0}),
            ["`longrope` is not supported", "`yarn`"],
        ),
    ] {
        let mut changed = original.clone();
        changed[field] = value;
        std::fs::write(&config, changed.to_string()).expect("write");
        assert_mentions(&build_error(dir.path(), 1), &parts);
    }
    // Another architecture, and Qwen2's sliding window turned on: refused by name.
    for (changes, parts) in [
        (
            serde_json::json!({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}),
            vec![
                "gemma2",
                "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
            ],
        ),
        (
            serde_json::json!({"model_type": "qwen2", "architectures": ["LlamaForCausalLM"]}),
            vec!["qwen2", "is not one tpinfer runs"],
        ),
        (
            serde_json::json!({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": true}),
            vec!["use_sliding_window", "full attention"],
        ),
        (
            serde_json::json!({"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding_window": -4}),
            vec!["sliding_window", "is -4"],
        ),
    ] {
        let mut changed = original.clone();
        for (field, value) in changes.as_object().expect("object") {
            changed[field] = value.clone();
        }
        std::fs::write(&config, changed.to_string()).expect("write");
        assert_mentions(&build_error(dir.path(), 1), &parts);
    }
}

/// Mistral's sliding window bounds the context: within it attention is the full causal one,
/// and a longer context is refused, naming the window's positions.
#[test]
fn a_mistral_context_stays_within_its_sliding_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama {
        flavor: Flavor::Mistral(Some(96)),
        ..TinyLlama::default()
    }
    .write(dir.path());
    let config = tpinfer_llama::LlamaConfig::from_dir(&path).expect("config");
    assert_eq!(config.max_position_embeddings, 96, "512 positions, a window of 96");
    let err = Engine::builder(&path)
        .max_context(200)
        .build()
        .err()
        .expect("past the window")
        .to_string();
    assert_mentions(&err, &["--max-context 200", "96 positions"]);
    assert!(Engine::builder(&path).max_context(96).build().is_ok());
}

/// Logits that overflow (finite weights of 1e38) stop a request at its prompt's forward,
/// named, on every rank alike: they used to run to garbage tokens without a word (issue #31).
#[test]
fn non_finite_logits_stop_the_request() {
    let dir = model_dir();
    let weights = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).expect("load");
    let poisoned = (tensors["lm_head.weight"].ones_like().expect("ones") * 1e38).expect("huge");
    tensors.insert("lm_head.weight".into(), poisoned);
    candle_core::safetensors::save(&tensors, &weights).expect("save");
    let engine = Engine::builder(dir.path()).tp(2).build().expect("engine");
    let err = engine
        .generate(GenerateRequest::new(Prompt::text("hello"), 4))
        .expect("queued")
        .collect_text()
        .expect_err("infinite logits");
    assert_mentions(&err.to_string(), &["logits hold NaN", "the prompt's forward"]);
}

/// A weight that is not finite is refused at load, naming the tensor and the file: it used to
/// load and run to NaN output (issue #31).
#[test]
fn non_finite_weights_are_refused_at_load() {
    let dir = model_dir();
    let weights = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).expect("load");
    let name = "model.layers.1.mlp.down_proj.weight";
    let t = &tensors[name];
    let poisoned = t.slice_assign(
        &[0..1, 0..1],
        &candle_core::Tensor::full(f32::INFINITY, (1, 1), t.device()).expect("inf"),
    );
    tensors.insert(name.into(), poisoned.expect("poison"));
    candle_core::safetensors::save(&tensors, &weights).expect("save");
    for tp in [1, 2] {
        assert_mentions(
            &build_error(dir.path(), tp),
            &[name, "model.safetensors", "NaN or infinite"],
        );
    }
}

/// A model read from safetensors alone (here a Wan DiT) that ships PyTorch pickles instead
/// names the pickle and the conversion.
#[test]
fn pickles_where_safetensors_are_read_name_the_conversion() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tpinfer_tests::TinyWan::default().write(dir.path());
    std::fs::remove_file(path.join("diffusion_pytorch_model.safetensors")).expect("rm");
    std::fs::write(path.join("diffusion_pytorch_model.bin"), b"pickles").expect("bin");
    let err = tpinfer_wan::WanCheckpoint::open(&path)
        .err()
        .expect("refused")
        .to_string();
    assert_mentions(&err, &["diffusion_pytorch_model.bin", "safe_serialization=True"]);
}

#[test]
fn truncated_gguf() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    TinyLlama::default().write_gguf(&path, |_| candle_core::quantized::GgmlDType::Q8_0);
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("truncate");
    // Refused when the file is opened, before any rank reads a tensor.
    assert_mentions(
        &build_error(&path, 2),
        &[
            "tiny.gguf",
            "truncated",
            &format!("is {} bytes", bytes.len() - 100),
            "download it again",
        ],
    );
}
