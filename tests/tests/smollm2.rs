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
