//! Continuous batching's forward: sequences that join at different steps, prefilled in chunks
//! beside the others' decode steps, over a paged KV cache whose blocks are scattered, give the
//! logits of each sequence run alone at TP 1.

use candle_core::DType;
use tpinfer_tests::{rel_error, run_batched_greedy, run_greedy, Batching, Flavor, TinyLlama};

const DECODE_STEPS: usize = 12;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        (1..12).collect(),
        vec![5],
        (40..47).collect(),
        (100..123).collect(),
        vec![256, 72, 101],
    ]
}

fn assert_batch_matches_alone(model: &TinyLlama, widths: &[usize], how: Batching) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let prompts = prompts();
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| run_greedy(&path, 1, DType::F32, p, DECODE_STEPS))
        .collect();
    for &tp in widths {
        let batched = run_batched_greedy(&path, tp, DType::F32, &prompts, DECODE_STEPS, how);
        assert_eq!(batched.len(), prompts.len());
        for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
            assert_eq!(got.logits.len(), DECODE_STEPS + 1, "TP {tp} sequence {i}");
            for (step, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
                let err = rel_error(g, w);
                assert!(err < 1e-5, "TP {tp} sequence {i} step {step}: relative error {err:e}");
            }
            assert_eq!(got.tokens, want.tokens, "TP {tp} sequence {i}: greedy tokens differ");
        }
    }
}

#[test]
fn a_batch_over_paged_blocks_equals_each_sequence_alone() {
    let how = Batching {
        chunk: 5,
        block_size: 4,
        flash: false,
    };
    assert_batch_matches_alone(&TinyLlama::default(), &[1, 2, 3], how);
}

#[test]
fn prompt_chunks_through_the_flash_kernel_equal_each_sequence_alone() {
    // As CUDA ranks run bf16: each prompt chunk's causal attention in the fused kernel.
    let how = Batching {
        chunk: 5,
        block_size: 4,
        flash: true,
    };
    assert_batch_matches_alone(&TinyLlama::default(), &[1, 2], how);
}

#[test]
fn whole_prompts_in_one_block_size_of_one() {
    // Every position its own block; every prompt prefilled in one step.
    let how = Batching {
        chunk: 64,
        block_size: 1,
        flash: false,
    };
    assert_batch_matches_alone(&TinyLlama::default(), &[1], how);
}

#[test]
fn tied_embeddings_and_biases_with_uneven_heads() {
    let model = TinyLlama {
        heads: 10,
        kv_heads: 5,
        tie_embeddings: true,
        attention_bias: true,
        ..TinyLlama::default()
    };
    let how = Batching {
        chunk: 3,
        block_size: 8,
        flash: false,
    };
    assert_batch_matches_alone(&model, &[1, 4], how);
}

/// Qwen2's Q/K/V biases without an output bias, and Qwen3's per-head query and key norms,
/// through the batched path at TP 1 and 3.
#[test]
fn qwen_variants_through_the_batched_path() {
    for (flavor, tie_embeddings) in [(Flavor::Qwen2, true), (Flavor::Qwen3, false)] {
        let model = TinyLlama {
            flavor,
            tie_embeddings,
            llama3_rope_scaling: false,
            ..TinyLlama::default()
        };
        let how = Batching {
            chunk: 5,
            block_size: 4,
            flash: false,
        };
        assert_batch_matches_alone(&model, &[1, 3], how);
    }
}
