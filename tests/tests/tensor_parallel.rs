//! The same tiny model at every TP width gives the logits of TP 1.

use candle_core::DType;
use tpinfer_tests::{rel_error, run_device_greedy, run_greedy, run_greedy_set, run_greedy_with, TinyLlama};

const PROMPT: &[u32] = &[
    256, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 5, 300, 17,
];
const DECODE_STEPS: usize = 16;

fn assert_tp_matches_tp1(model: &TinyLlama, widths: &[usize]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let reference = run_greedy(&path, 1, DType::F32, PROMPT, DECODE_STEPS);
    assert_eq!(reference.logits.len(), DECODE_STEPS + 1);
    for &tp in widths {
        let trace = run_greedy(&path, tp, DType::F32, PROMPT, DECODE_STEPS);
        for (step, (got, want)) in trace.logits.iter().zip(&reference.logits).enumerate() {
            let err = rel_error(got, want);
            assert!(
                err < 1e-5,
                "TP {tp} step {step}: relative error {err:e} (model {model:?})"
            );
        }
        assert_eq!(trace.tokens, reference.tokens, "TP {tp}: greedy tokens differ");
        // One all-reduce for the embedding, then exactly two per layer.
        assert_eq!(trace.prefill_all_reduces, 1 + 2 * model.layers as u64, "TP {tp}");
    }
}

#[test]
fn tp_2_3_4_5_equal_tp_1() {
    let model = TinyLlama {
        heads: 10,
        kv_heads: 5,
        ..TinyLlama::default()
    };
    assert_tp_matches_tp1(&model, &[2, 3, 4, 5]);
}

#[test]
fn two_kv_heads_replicated_at_tp_4() {
    let model = TinyLlama {
        heads: 8,
        kv_heads: 2,
        seed: 11,
        ..TinyLlama::default()
    };
    assert_tp_matches_tp1(&model, &[4, 3]);
}

#[test]
fn odd_head_count_and_uneven_ffn_split() {
    // 7 heads over 3 ranks is 3, 2, 2; 100 FFN columns split 4-aligned is 36, 32, 32.
    let model = TinyLlama {
        hidden: 56,
        heads: 7,
        kv_heads: 7,
        intermediate: 100,
        vocab: 301,
        tie_embeddings: true,
        seed: 3,
        ..TinyLlama::default()
    };
    assert_tp_matches_tp1(&model, &[2, 3, 5, 7]);
}

#[test]
fn row_parallel_bias_is_added_once() {
    // With Q/K/V/O biases, a bias added on every rank before the reduce would be counted TP times.
    let model = TinyLlama {
        attention_bias: true,
        seed: 13,
        ..TinyLlama::default()
    };
    assert_tp_matches_tp1(&model, &[2, 3, 4]);
}

#[test]
fn gqa_groups_straddling_ranks() {
    // 12 heads in groups of 4 (3 KV heads) over 5 ranks: 3, 3, 2, 2, 2 Q heads; rank 0 reads
    // KV head 0 for 3 heads, rank 1 reads KV heads 0 and 1.
    let model = TinyLlama {
        hidden: 48,
        heads: 12,
        kv_heads: 3,
        head_dim: 4,
        seed: 5,
        ..TinyLlama::default()
    };
    assert_tp_matches_tp1(&model, &[5, 2]);
}

#[test]
fn sharded_checkpoint_with_index_and_transformers5_config() {
    let base = TinyLlama::default();
    let variant = TinyLlama {
        files: 3,
        transformers5: true,
        ..base.clone()
    };
    let (a, b) = (tempfile::tempdir().expect("tmp"), tempfile::tempdir().expect("tmp"));
    let (pa, pb) = (base.write(a.path()), variant.write(b.path()));
    assert!(pb.join("model.safetensors.index.json").exists());
    let ra = run_greedy(&pa, 1, DType::F32, PROMPT, 4);
    let rb = run_greedy(&pb, 3, DType::F32, PROMPT, 4);
    for (x, y) in rb.logits.iter().zip(&ra.logits) {
        assert!(rel_error(x, y) < 1e-5);
    }
}

#[test]
fn half_precision_tracks_f32() {
    let model = TinyLlama::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let reference = run_greedy(&path, 1, DType::F32, PROMPT, 0);
    for (dtype, tolerance) in [(DType::BF16, 3e-2), (DType::F16, 5e-3)] {
        for tp in [1, 3] {
            let trace = run_greedy(&path, tp, dtype, PROMPT, 0);
            let err = rel_error(&trace.logits[0], &reference.logits[0]);
            assert!(err < tolerance, "{dtype:?} TP {tp}: {err:e}");
            assert!(err > 0.0, "{dtype:?} must really compute in reduced precision");
        }
    }
}

#[test]
fn chunked_prompt_equals_whole_prompt() {
    // Chunks of 5 split the 17-token prompt 5 + 5 + 5 + 2: each chunk attends to the cached
    // chunks before it through the causal mask's offset.
    let model = TinyLlama {
        heads: 8,
        kv_heads: 2,
        ..TinyLlama::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let whole = run_greedy(&path, 1, DType::F32, PROMPT, DECODE_STEPS);
    for tp in [1, 2, 3] {
        let chunked = run_greedy_with(&path, tp, DType::F32, PROMPT, DECODE_STEPS, Some(5), false);
        for (step, (got, want)) in chunked.logits.iter().zip(&whole.logits).enumerate() {
            let err = rel_error(got, want);
            assert!(err < 1e-5, "TP {tp} step {step}: relative error {err:e}");
        }
        assert_eq!(chunked.tokens, whole.tokens, "TP {tp}");
        // Four chunks, each one embedding all-reduce and two per layer.
        assert_eq!(
            chunked.prefill_all_reduces,
            4 * (1 + 2 * model.layers as u64),
            "TP {tp}"
        );
    }
}

/// The fused attention path (the one CUDA ranks take in bf16, here through the kernel's CPU
/// twin) gives the unfused path's logits: queries and cache read as strided views, the causal
/// offset of later prompt chunks and of decode steps, GQA groups (replicated at TP 4), at TP 1, 2, 4.
#[test]
fn flash_attention_path_equals_unfused_path() {
    let model = TinyLlama {
        heads: 8,
        kv_heads: 2,
        ..TinyLlama::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let unfused = run_greedy(&path, 1, DType::F32, PROMPT, DECODE_STEPS);
    for (tp, chunk) in [(1, None), (2, Some(5)), (4, Some(7))] {
        let fused = run_greedy_with(&path, tp, DType::F32, PROMPT, DECODE_STEPS, chunk, true);
        for (step, (got, want)) in fused.logits.iter().zip(&unfused.logits).enumerate() {
            let err = rel_error(got, want);
            assert!(err < 1e-5, "TP {tp} step {step}: relative error {err:e}");
        }
        assert_eq!(fused.tokens, unfused.tokens, "TP {tp}");
    }
}

/// A decode step whose norms the products around them make (the path of CUDA ranks at TP 1,
/// here through the products' CPU twins: the residual added and u and the sums of squares
/// left by the row-parallel products, the norm's scale applied by the products after them)
/// gives the norm kernels' logits and tokens, every layer's norm and the final one in place;
/// at TP 2 the switch is refused.
#[test]
fn norms_made_in_the_products_equal_the_norm_kernels() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default();
    let path = model.write(dir.path());
    let flash = |rank: &mut tpinfer_llama::LlamaRank| rank.set_flash_attention(true).expect("flash attention");
    let kernels = run_greedy_set(&path, 1, DType::F32, PROMPT, DECODE_STEPS, |rank| {
        flash(rank);
        rank.set_norms_in_products(false).expect("norm kernels");
    });
    let products = run_greedy_set(&path, 1, DType::F32, PROMPT, DECODE_STEPS, |rank| {
        flash(rank);
        rank.set_norms_in_products(true).expect("norms in the products");
    });
    assert!(model.layers > 1, "the norms between layers are made too");
    for (step, (got, want)) in products.logits.iter().zip(&kernels.logits).enumerate() {
        let err = rel_error(got, want);
        assert!(err < 1e-5, "step {step}: relative error {err:e}");
    }
    assert!(
        products.logits.iter().zip(&kernels.logits).any(|(a, b)| a != b),
        "the products' path ran: it rounds where the norm kernels do not"
    );
    assert_eq!(products.tokens, kernels.tokens);

    let refused = run_greedy_set(&path, 2, DType::F32, PROMPT, 0, |rank| {
        assert!(
            rank.set_norms_in_products(true).is_err(),
            "TP 2 has no residual products"
        );
    });
    assert_eq!(refused.tokens.len(), 1);
}

/// Greedy decoding on the device (each step's argmax left there as the next input, the ranks'
/// flags summed within the step) picks the tokens the host picks from the same logits, at
/// every width and with up to three steps queued before the host reads one; every rank reads
/// each step's own flag sum, and a step adds one all-reduce.
#[test]
fn device_greedy_steps_equal_host_greedy_steps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let host = run_greedy(&path, 1, DType::F32, PROMPT, 10);
    for (tp, ahead) in [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (3, 3)] {
        let (device, flags, all_reduces) = run_device_greedy(&path, tp, DType::F32, PROMPT, 10, ahead);
        // Per step: the embedding's, two per layer, and the flags' sum.
        let layers = TinyLlama::default().layers as u64;
        assert_eq!(all_reduces, 10 * (2 + 2 * layers), "TP {tp}, {ahead} ahead");
        assert_eq!(device.tokens, host.tokens, "TP {tp}, {ahead} ahead");
        for (step, (got, want)) in device.logits.iter().zip(&host.logits).enumerate() {
            let err = rel_error(got, want);
            assert!(err < 1e-5, "TP {tp}, {ahead} ahead, step {step}: {err:e}");
        }
        let sum = (1..=tp as u32).sum::<u32>();
        let want: Vec<u32> = (0..10usize)
            .map(|s| if s.is_multiple_of(2) { sum } else { 0 })
            .collect();
        for rank_flags in &flags {
            assert_eq!(rank_flags, &want, "TP {tp}, {ahead} ahead");
        }
    }
}
