//! A real small model, SmolLM2-135M-Instruct (GGUF, Q4_1), at TP 1, 2 and 3.

use candle_core::DType;
use tpinfer_engine::{Engine, GenerateRequest, Prompt, StopReason};
use tpinfer_tests::{assets_dir, rel_error, run_greedy};
use tpinfer_tokenizer::Tokenizer;
use tpinfer_weights::GgufStore;

fn model() -> std::path::PathBuf {
    assets_dir().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn tp2_and_tp3_give_tp1_greedy_tokens_for_32_steps() {
    let store = GgufStore::open(&model()).expect("open");
    let tokenizer = Tokenizer::from_gguf(store.metadata()).expect("tokenizer");
    let prompt = tokenizer.encode("The three primary colors are", false).expect("encode");
    let reference = run_greedy(&model(), 1, DType::F32, &prompt, 31);
    assert_eq!(reference.tokens.len(), 32);
    for tp in [2, 3] {
        let trace = run_greedy(&model(), tp, DType::F32, &prompt, 31);
        assert_eq!(trace.tokens, reference.tokens, "TP {tp}");
        let err = rel_error(&trace.logits[31], &reference.logits[31]);
        assert!(err < 1e-5, "TP {tp}: last-step logits differ by {err:e}");
    }
    let text = tokenizer.decode(&reference.tokens).expect("decode");
    assert!(
        text.to_lowercase().contains("red"),
        "sensible English expected: {text:?}"
    );
}

#[test]
fn chat_answer_through_the_engine_at_tp3() {
    let engine = Engine::builder(model()).tp(3).build().expect("engine");
    let request = GenerateRequest::new(Prompt::user("What is the capital of France?"), 48);
    let (text, ids, stats) = engine
        .generate(request)
        .expect("generate")
        .collect_text()
        .expect("stream");
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(stats.generated_tokens, ids.len());
    assert_eq!(
        stats.stop_reason,
        StopReason::Eos,
        "the instruct model ends its turn with <|im_end|>"
    );
}

/// A GGUF whose metadata describes fewer layers than its tensor table holds is refused by
/// name: it used to run the fewer layers and answer wrongly (issue #31).
#[test]
fn a_gguf_whose_block_count_disagrees_with_its_tensors_is_refused() {
    use candle_core::quantized::gguf_file::{self, Value};
    let mut file = std::fs::File::open(model()).expect("open");
    let content = gguf_file::Content::read(&mut file).expect("read");
    let blocks = match content.metadata.get("llama.block_count") {
        Some(Value::U32(n)) => *n,
        other => panic!("block_count {other:?}"),
    };
    let fewer = Value::U32(blocks - 1);
    let metadata: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), if k == "llama.block_count" { &fewer } else { v }))
        .collect();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let tensor = content
                .tensor(&mut file, name, &candle_core::Device::Cpu)
                .expect("tensor");
            (name.clone(), tensor)
        })
        .collect();
    let refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("fewer-blocks.gguf");
    let mut out = std::fs::File::create(&path).expect("create");
    gguf_file::write(&mut out, &metadata, &refs).expect("write gguf");
    drop(out);
    let err = Engine::builder(&path).build().err().expect("refused").to_string();
    let last = format!("blk.{}.", blocks - 1);
    assert!(err.contains(&last) && err.contains("block_count"), "{err}");
    // A GGUF file's config is its metadata: no message sends the user to a config.json.
    assert!(err.contains("GGUF metadata") && !err.contains("config.json"), "{err}");
}
