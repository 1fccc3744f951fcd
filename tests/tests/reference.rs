//! TP 1 and 3 against an independent implementation: candle-transformers' Llama, Qwen2 and
//! Mistral on the same files.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama as reference;
use tpinfer_tests::{rel_error, run_greedy, Flavor, TinyLlama};

fn reference_logits(dir: &std::path::Path, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let config: reference::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("parse");
    let config = config.into_config(false);
    let device = Device::Cpu;
    // SAFETY: the test's own file, not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &device) }
        .expect("vb");
    let model = reference::Llama::load(vb, &config).expect("load reference");
    let mut cache = reference::Cache::new(true, DType::F32, &config, &device).expect("cache");
    let mut out = Vec::new();
    let input = Tensor::new(prompt, &device)
        .and_then(|t| t.unsqueeze(0))
        .expect("input");
    let mut logits = model.forward(&input, 0, &mut cache).expect("forward");
    let mut pos = prompt.len();
    for step in 0..=steps {
        let values: Vec<f32> = logits.squeeze(0).and_then(|l| l.to_vec1()).expect("logits");
        let token = tpinfer_tests::argmax(&values);
        out.push(values);
        if step < steps {
            let input = Tensor::new(&[token], &device)
                .and_then(|t| t.unsqueeze(0))
                .expect("input");
            logits = model.forward(&input, pos, &mut cache).expect("decode");
            pos += 1;
        }
    }
    out
}

#[test]
fn tp1_matches_candle_transformers_llama() {
    for model in [
        TinyLlama::default(),
        TinyLlama {
            kv_heads: 2,
            tie_embeddings: true,
            llama3_rope_scaling: false,
            seed: 21,
            ..TinyLlama::default()
        },
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = model.write(dir.path());
        // Long enough that llama3 rope scaling (original context 64) matters.
        let prompt: Vec<u32> = (0..80).map(|i| (i * 37 % 250) as u32).collect();
        let want = reference_logits(&path, &prompt, 8);
        for tp in [1, 3] {
            let got = run_greedy(&path, tp, DType::F32, &prompt, 8);
            for (step, (g, w)) in got.logits.iter().zip(&want).enumerate() {
                let err = rel_error(g, w);
                if step == 8 {
                    eprintln!(
                        "TP {tp} step {step}: rel error {err:e}, norm {}",
                        w.iter().map(|x| x * x).sum::<f32>().sqrt()
                    );
                }
                assert!(
                    err < 1e-4,
                    "TP {tp} step {step}: {err:e} against candle-transformers ({model:?})"
                );
            }
        }
    }
}

/// Greedy logits of a model whose `forward(ids, offset)` gives the last position's logits
/// `[1, 1, vocab]`: the prompt's, then `steps` more.
fn greedy_reference(
    mut forward: impl FnMut(&Tensor, usize) -> candle_core::Result<Tensor>,
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<f32>> {
    let device = Device::Cpu;
    let row = |logits: Tensor| -> Vec<f32> { logits.flatten_all().and_then(|l| l.to_vec1()).expect("logits") };
    let input = Tensor::new(prompt, &device)
        .and_then(|t| t.unsqueeze(0))
        .expect("input");
    let mut out = vec![row(forward(&input, 0).expect("prefill"))];
    for step in 0..steps {
        let token = tpinfer_tests::argmax(&out[step]);
        let input = Tensor::new(&[token], &device)
            .and_then(|t| t.unsqueeze(0))
            .expect("input");
        out.push(row(forward(&input, prompt.len() + step).expect("decode")));
    }
    out
}

/// Qwen2 (biases on Q, K and V, tied embeddings), Qwen3 (an RMSNorm over each query and key
/// head) and Mistral (a sliding window longer than the run) run as Llama variants, at TP 1
/// and 3 as candle-transformers' own Qwen2, Qwen3 and Mistral do on the same files.
#[test]
fn qwen2_qwen3_and_mistral_match_candle_transformers() {
    use candle_transformers::models::{mistral, qwen2, qwen3};
    let prompt: Vec<u32> = (0..80).map(|i| (i * 37 % 250) as u32).collect();
    for (flavor, tie_embeddings) in [
        (Flavor::Qwen2, true),
        (Flavor::Qwen3, false),
        (Flavor::Mistral(Some(96)), false),
    ] {
        let model = TinyLlama {
            flavor,
            tie_embeddings,
            llama3_rope_scaling: false,
            seed: 33,
            ..TinyLlama::default()
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let path = model.write(dir.path());
        let config = std::fs::read_to_string(path.join("config.json")).expect("config");
        // SAFETY: the test's own file, not modified while mapped.
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&[path.join("model.safetensors")], DType::F32, &Device::Cpu) }
                .expect("vb");
        let want = match flavor {
            Flavor::Qwen2 => {
                let config: qwen2::Config = serde_json::from_str(&config).expect("qwen2 config");
                let mut reference = qwen2::ModelForCausalLM::new(&config, vb).expect("qwen2");
                greedy_reference(|ids, offset| reference.forward(ids, offset), &prompt, 8)
            }
            Flavor::Qwen3 => {
                let config: qwen3::Config = serde_json::from_str(&config).expect("qwen3 config");
                let mut reference = qwen3::ModelForCausalLM::new(&config, vb).expect("qwen3");
                greedy_reference(|ids, offset| reference.forward(ids, offset), &prompt, 8)
            }
            _ => {
                let config: mistral::Config = serde_json::from_str(&config).expect("mistral config");
                let mut reference = mistral::Model::new(&config, vb).expect("mistral");
                greedy_reference(|ids, offset| reference.forward(ids, offset), &prompt, 8)
            }
        };
        for tp in [1, 3] {
            let got = run_greedy(&path, tp, DType::F32, &prompt, 8);
            for (step, (g, w)) in got.logits.iter().zip(&want).enumerate() {
                let err = rel_error(g, w);
                assert!(
                    err < 1e-4,
                    "{flavor:?} TP {tp} step {step}: {err:e} against candle-transformers"
                );
            }
        }
    }
}
