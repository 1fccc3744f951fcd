//! A real small model, SmolLM2-135M-Instruct (GGUF, Q4_1), at TP 1, 2 and 3.

use candle_core::DType;
use tpinfer_engine::{Engine, GenerateRequest, Prompt, StopReason, WeightFormat};
use tpinfer_tests::{argmax, assets_dir, rel_error, run_forced, run_greedy};
use tpinfer_tokenizer::Tokenizer;
use tpinfer_weights::GgufStore;

fn model() -> std::path::PathBuf {
    assets_dir().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn prompt() -> Vec<u32> {
    let store = GgufStore::open(&model()).expect("open");
    let tokenizer = Tokenizer::from_gguf(store.metadata()).expect("tokenizer");
    tokenizer.encode("The three primary colors are", false).expect("encode")
}

/// Kept in its Q4_1 blocks (the default) at TP 1 to 3, the model is its dequantized self at
/// TP 1 on CPU ranks, which expand the blocks for each product: fed the same 32 tokens (its
/// own greedy ones), the same logits to f32 rounding.
#[test]
fn kept_blocks_at_tp1_to_3_give_the_dequantized_logits_for_32_steps() {
    let prompt = prompt();
    let kept = run_greedy(&model(), 1, DType::F32, &prompt, 31);
    let forced = &kept.tokens[..31];
    let reference = run_forced(&model(), 1, WeightFormat::Dequantized, &prompt, forced);
    for tp in [1, 2, 3] {
        let logits = run_forced(&model(), tp, WeightFormat::AsStored, &prompt, forced);
        for (step, values) in logits.iter().enumerate() {
            assert_eq!(argmax(values), kept.tokens[step], "TP {tp} step {step}");
            let err = rel_error(values, &reference[step]);
            assert!(err < 1e-5, "TP {tp} step {step}: logits differ by {err:e}");
        }
    }
    let tokenizer = Tokenizer::from_gguf(GgufStore::open(&model()).expect("open").metadata()).expect("tokenizer");
    let text = tokenizer.decode(&kept.tokens).expect("decode");
    assert!(
        text.to_lowercase().contains("red"),
        "sensible English expected: {text:?}"
    );
}

/// Kept quantized, a rank holds the file's blocks and a dense embedding: a fraction of the
/// dequantized model.
#[test]
fn quantized_weights_hold_a_fraction_of_the_dequantized_bytes() {
    use tpinfer_llama::{LlamaCheckpoint, LlamaShard};
    let bytes = |quantized| {
        let checkpoint = LlamaCheckpoint::open_with(&model(), quantized).expect("open");
        let shard = LlamaShard::new(&checkpoint.config, 1, 0).expect("shard");
        tpinfer_weights::ShardLoader::device_bytes(&checkpoint.weight_decls(&shard), DType::F32).expect("bytes")
    };
    let (kept, dequantized) = (bytes(WeightFormat::AsStored), bytes(WeightFormat::Dequantized));
    let file = std::fs::metadata(model()).expect("file").len() as usize;
    // The f32 embedding (49,152 × 576) is the one dense matrix beside the blocks.
    let embedding = 49_152 * 576 * 4;
    assert!(kept < file + embedding, "{kept} bytes kept, file {file}");
    assert!(
        dequantized > 4 * kept / 2,
        "{dequantized} dequantized against {kept} kept"
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
