//! The memory plan is the truth: exact weight bytes per rank, published model sizes, and an
//! engine that refuses an over-budget placement before it loads anything.

use std::sync::Arc;

use candle_core::{DType, Device};
use tpinfer_comm::ThreadGroup;
use tpinfer_engine::{Engine, EngineError, RuntimeError};
use tpinfer_llama::{LlamaCheckpoint, LlamaRank, LlamaShard};
use tpinfer_plan::{DeviceProfile, Placement, Plan, ShardedModel};
use tpinfer_tests::TinyLlama;

/// A preset or a model directory, as `tpinfer plan` opens it.
fn open(name: &str) -> Result<Arc<dyn ShardedModel>, tpinfer_plan::PlanError> {
    tpinfer_engine::registry::open(name).map(|(_, model)| model)
}

/// At every width and in both dtypes, each rank's planned weight bytes are what loading that
/// rank places on its device, and (same dtype) what it reads from the checkpoint.
#[test]
fn planned_weight_bytes_equal_loaded_bytes_at_tp_1_to_5() {
    let model = TinyLlama {
        heads: 10,
        kv_heads: 5,
        intermediate: 100,
        ..TinyLlama::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let checkpoint = Arc::new(LlamaCheckpoint::open(&path).expect("open"));
    let spec = open(path.to_str().expect("utf8")).expect("plan model");
    for dtype in [DType::F32, DType::BF16] {
        for tp in 1..=5 {
            let placement = Placement::llm(64, 1);
            let plan = Plan::new(&*spec, tp, dtype, placement, DeviceProfile::cpu()).expect("plan");
            let comms = ThreadGroup::ranks(tp, std::time::Duration::from_secs(30));
            for (rank, comm) in comms.into_iter().enumerate() {
                let shard = LlamaShard::new(&checkpoint.config, tp, rank).expect("shard");
                // Each rank loads on its own thread in the engine; here one at a time suffices,
                // since loading needs no collective.
                let loaded =
                    LlamaRank::load(&checkpoint, shard, Arc::new(comm), dtype, &Device::Cpu, 64).expect("load");
                let planned = plan.ranks[rank].weights as usize;
                assert_eq!(
                    planned,
                    loaded.weight_bytes_on_device(),
                    "TP {tp} rank {rank} {dtype:?}"
                );
                if dtype == DType::F32 {
                    assert_eq!(planned, loaded.bytes_loaded(), "TP {tp} rank {rank}: bytes read");
                }
            }
        }
    }
}

/// The presets' weights are the published parameter counts (bf16, two bytes each).
#[test]
fn presets_match_published_parameter_counts() {
    let params = |name: &str| {
        let model = open(name).expect("preset");
        let placement = model.default_placement();
        let plan = Plan::new(&*model, 1, DType::BF16, placement, DeviceProfile::cuda()).expect("plan");
        plan.ranks[0].weights / 2
    };
    assert_eq!(params("llama-3-8b"), 8_030_261_248);
    assert_eq!(params("llama-3-70b"), 70_553_706_496);
    assert_eq!(params("llama-3.2-1b"), 1_235_814_400);
    assert_eq!(params("llama-3.2-3b"), 3_212_749_824);
    // Qwen2's Q, K and V biases counted.
    assert_eq!(params("qwen2.5-7b"), 7_615_616_512);
    assert_eq!(params("qwen2.5-72b"), 72_706_203_648);
    assert_eq!(params("mistral-7b"), 7_248_023_552);
    // Qwen3's per-head Q and K norms counted.
    assert_eq!(params("qwen3-8b"), 8_190_735_360);
    // Wan2.2-S2V-14B's diffusion model is 32.6 GB of bf16 in its four safetensors shards.
    let s2v = params("wan2.2-s2v-14b") * 2;
    assert!((32.4e9..32.8e9).contains(&(s2v as f64)), "{s2v}");
}

/// Sharding splits, never duplicates, except what is replicated by design: the sum over ranks
/// is the whole model plus (TP - 1) copies of the replicated tensors.
#[test]
fn wan_shards_sum_to_the_model() {
    let model = open("wan2.1-t2v-14b").expect("preset");
    let placement = model.default_placement();
    let whole = Plan::new(&*model, 1, DType::BF16, placement, DeviceProfile::cuda()).expect("plan");
    let five = Plan::new(&*model, 5, DType::BF16, placement, DeviceProfile::cuda()).expect("plan");
    let sum: u64 = five.ranks.iter().map(|r| r.weights).sum();
    let replicated = sum - whole.ranks[0].weights;
    assert_eq!(replicated % 4, 0, "four extra copies of the replicated tensors");
    // Replicated: embeddings, time projection, head, norms, modulation, row-parallel biases.
    let per_copy = replicated / 4;
    assert!(
        per_copy < whole.ranks[0].weights / 20,
        "replicated {per_copy} of {}",
        whole.ranks[0].weights
    );
    // 13,824 FFN columns over 5 ranks: 2,816 + 4 × 2,752, so rank 0 holds the most.
    assert!(five.ranks[0].weights > five.ranks[1].weights);
    assert_eq!(five.ranks[1].weights, five.ranks[4].weights);
}

/// The Live Avatar case: Wan2.2-S2V-14B on five 24 GiB GPUs. Under FSDP every GPU gathers the
/// root module (everything outside the 40 blocks: the S2V audio modules, embeddings, head):
/// the 4.17 GiB unshard buffer reported for it. Under TP no rank gathers anything. An
/// 80-frame clip's sequence is its 31,200 video tokens, the reference frame's 1,560 and the
/// packed motion frames' 2,314; S2V's clips are 4k frames, not T2V's 4k + 1.
#[test]
fn s2v_on_five_24_gib_gpus() {
    let model = open("wan2.2-s2v-14b").expect("preset");
    let placement = |frames| Placement::Dit {
        frames,
        width: 832,
        height: 480,
        cfg: true,
    };
    assert_eq!(model.default_placement(), placement(80));
    let plan = Plan::new(&*model, 5, DType::BF16, placement(80), DeviceProfile::cuda()).expect("plan");
    assert_eq!(plan.tokens_per_forward, 31_200 + 1_560 + 2_314);
    let err = Plan::new(&*model, 5, DType::BF16, placement(81), DeviceProfile::cuda()).expect_err("81 frames");
    assert!(err.to_string().contains("4k (e.g. 48, 80)"), "{err}");
    let unshard_gib = plan.fsdp.unshard_buffer as f64 / (1u64 << 30) as f64;
    assert!(
        (unshard_gib - 4.17).abs() < 0.005,
        "unshard buffer {unshard_gib:.3} GiB"
    );
    let budget = 24u64 << 30;
    assert!(plan.fits(budget), "TP 5 must fit 24 GiB: {:?}", plan.peak());
    assert!(
        plan.peak().total() < plan.fsdp.total(),
        "TP needs less than FSDP per GPU"
    );
}

#[test]
fn engine_refuses_an_over_budget_placement_naming_what_fits() {
    let model = TinyLlama {
        heads: 8,
        kv_heads: 4,
        ..TinyLlama::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let spec = open(path.to_str().expect("utf8")).expect("plan model");
    let plan = |tp| Plan::new(&*spec, tp, DType::F32, Placement::llm(512, 1), DeviceProfile::cpu()).expect("plan");
    // A budget between what TP 2 and TP 1 need.
    let (one, two) = (plan(1).peak().total(), plan(2).peak().total());
    assert!(two < one);
    let budget = (one + two) / 2;
    let err = Engine::builder(&path)
        .tp(1)
        .max_context(512)
        .gpu_mem(budget)
        .build()
        .err()
        .expect("over budget");
    let EngineError::Runtime(RuntimeError::OverBudget(message)) = &err else {
        panic!("expected OverBudget, got {err}");
    };
    assert!(message.contains("rank 0 needs"), "{message}");
    assert!(message.contains("fits with --tp 2"), "{message}");
    assert!(message.contains("--max-context"), "{message}");
    // The suggestion is right: TP 2 starts and runs under the same budget.
    let engine = Engine::builder(&path)
        .tp(2)
        .max_context(512)
        .gpu_mem(budget)
        .build()
        .expect("fits at TP 2");
    assert_eq!(engine.plan().tp, 2);
}

/// `batch` sequences hold one KV cache each, exactly; a decode step of the batch never plans
/// less than one sequence's. A budget too small for them all sizes the paged cache to the full
/// contexts it holds; one too small for even one names the context that fits.
#[test]
fn batch_multiplies_the_kv_cache_and_a_budget_sizes_the_pool() {
    let model = open("llama-3-8b").expect("preset");
    let planned = |placement: Placement| Plan::new(&*model, 2, DType::BF16, placement, DeviceProfile::cuda());
    let plan = |batch: usize| planned(Placement::llm(8192, batch)).expect("plan");
    let (one, eight) = (plan(1), plan(8));
    for (a, b) in one.ranks.iter().zip(&eight.ranks) {
        assert_eq!(b.cache, 8 * a.cache);
        assert_eq!(b.weights, a.weights);
        assert!(b.activations >= a.activations);
    }
    let pooled = |max_context: usize, held: usize| {
        planned(Placement::Llm {
            max_context,
            batch: 32,
            kv_sequences: Some(held),
        })
        .expect("plan")
    };
    // 8B at TP 2 with 8k contexts: 0.5 GiB of KV cache per sequence and rank; 12 GiB of
    // budget leaves room for a few sequences, not 32.
    let budget = 12u64 << 30;
    assert!(!plan(32).fits(budget));
    let serving = Placement::llm(8192, 32);
    let fit = tpinfer_plan::kv_sequences_that_fit(&*model, 2, DType::BF16, serving, DeviceProfile::cuda(), budget);
    let sized = tpinfer_plan::with_kv_sequences(serving, fit);
    let Placement::Llm {
        kv_sequences: Some(held),
        ..
    } = sized
    else {
        panic!("no pool sized: {sized:?}");
    };
    assert!((1..32).contains(&held), "{held}");
    assert!(pooled(8192, held).fits(budget) && !pooled(8192, held + 1).fits(budget));
    assert_eq!(pooled(8192, held).ranks[0].cache, held as u64 * one.ranks[0].cache);
    // Too small for one 8k context beside the weights: the longest that fits is named.
    let tight = one.peak().total() - (one.ranks[0].cache / 2);
    let full = plan(32);
    assert!(!pooled(8192, 1).fits(tight));
    let message = tpinfer_plan::over_budget_message(&*model, &full, DType::BF16, tight);
    let context: usize = message
        .split("--max-context ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --max-context suggestion in: {message}"));
    assert!(
        pooled(context, 1).fits(tight) && !pooled(context + 1, 1).fits(tight),
        "{message}"
    );
    let zero = planned(Placement::llm(8192, 0));
    assert!(zero.is_err());
}

/// Guidance runs its unconditional pass after the conditional one: it adds the negative
/// prompt's states and two latent buffers, never activations.
#[test]
fn cfg_adds_prompt_states_and_latents_only() {
    let model = open("wan2.1-t2v-14b").expect("preset");
    let plan = |cfg: bool| {
        let placement = Placement::Dit {
            frames: 81,
            width: 832,
            height: 480,
            cfg,
        };
        Plan::new(&*model, 2, DType::BF16, placement, DeviceProfile::cuda()).expect("plan")
    };
    let (with, without) = (plan(true), plan(false));
    for (a, b) in with.ranks.iter().zip(&without.ranks) {
        assert_eq!(
            (a.weights, a.activations, a.buffers),
            (b.weights, b.activations, b.buffers)
        );
        // 512 × 4096 f32 text states and their 512 × 5120 bf16 embedding, two f32 latents
        // of 16 × 21 × 60 × 104.
        let latents = 2 * 16 * 21 * 60 * 104 * 4;
        assert_eq!(a.cache - b.cache, (512 * 4096 * 4 + 512 * 5120 * 2 + latents) as u64);
    }
}

/// A batched CUDA rank's captured steps are in its plan: one logits buffer and one step's
/// temporaries for the largest bucket of rows, which holds `max_seqs` (1, 2, 4, 8, then
/// multiples of 16).
#[test]
fn the_plan_counts_the_batched_steps_graphs_for_the_largest_bucket() {
    use tpinfer_llama::memory::{step_rows, Batch, RankMemory};
    let buckets: Vec<usize> = [1, 2, 3, 5, 8, 9, 16, 17, 40, 128].into_iter().map(step_rows).collect();
    assert_eq!(buckets, [1, 2, 4, 8, 8, 16, 16, 32, 48, 128]);
    let json = r#"{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false}"#;
    let config = tpinfer_llama::LlamaConfig::from_json(json, "llama-3-8b").expect("config");
    let shard = LlamaShard::new(&config, 1, 0).expect("shard");
    let batch = Batch {
        sequences: 40,
        kv_sequences: None,
    };
    let plan = |flash| RankMemory::batched(&config, &shard, DType::BF16, 1024, 512, batch, flash);
    let graphs = plan(true).buffers - plan(false).buffers;
    let logits = 48 * config.vocab_size * 4;
    assert!(
        graphs > logits,
        "{graphs} bytes for 48 rows of {} logits",
        config.vocab_size
    );
    // Besides, the temporaries of one 48-row step (its bf16 logits among them), not one per
    // bucket.
    assert!(graphs < 2 * logits, "{graphs}");
}
