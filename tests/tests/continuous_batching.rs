//! Continuous batching through the engine: concurrent requests, each with its own sampling
//! parameters and seed, batched into shared steps over a paged KV cache (shared prompt
//! prefixes included), give the tokens of the same request run alone; a dropped stream
//! leaves the others running; a rank failure ends every request in flight with its cause.

use std::sync::Arc;
use std::time::Duration;

use tpinfer_engine::{
    DType, Engine, EngineError, Fault, GenerateRequest, Prompt, SamplingParams, StopReason, StreamEvent,
};
use tpinfer_runtime::host_available;
use tpinfer_tests::TinyLlama;

/// Request `i`: prompts of 1 to 17 tokens; even ones greedy (every other one with frequency
/// and presence penalties, which look at the generated tokens alone, and a logit bias), odd
/// ones sampled with their own seed (every other one with all three penalties); 3 to 18 new
/// tokens.
fn request(i: usize) -> GenerateRequest {
    let prompt: Vec<u32> = (0..1 + (i * 5) % 17).map(|t| ((i * 31 + t * 7) % 250) as u32).collect();
    let sampled = SamplingParams {
        temperature: 0.9,
        top_k: Some(40),
        top_p: Some(0.95),
        repetition_penalty: 1.1,
        seed: 1000 + i as u64,
        ..SamplingParams::default()
    };
    let sampling = match i % 4 {
        0 => SamplingParams::default(),
        1 => sampled,
        2 => SamplingParams {
            frequency_penalty: 0.7,
            presence_penalty: 0.4,
            logit_bias: vec![(5, -100.0), (9, 1.5)],
            ..SamplingParams::default()
        },
        // A repetition window shorter than the tokens generated.
        _ => SamplingParams {
            frequency_penalty: 0.3,
            presence_penalty: -0.2,
            repetition_window: 4,
            ..sampled
        },
    };
    GenerateRequest::new(Prompt::Tokens(prompt), 3 + i % 16).with_sampling(sampling)
}

fn tokens(engine: &Engine, request: GenerateRequest) -> (Vec<u32>, StopReason) {
    let (_, ids, stats) = engine
        .generate(request)
        .expect("generate")
        .collect_text()
        .expect("stream");
    (ids, stats.stop_reason)
}

#[test]
fn concurrent_requests_equal_each_run_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let alone = Engine::builder(&path).max_context(64).build().expect("engine");
    let expected: Vec<_> = (0..24).map(|i| tokens(&alone, request(i))).collect();
    drop(alone);
    for (tp, step_tokens) in [(1, 512), (2, 5), (3, 16)] {
        let engine = Engine::builder(&path)
            .tp(tp)
            .max_context(64)
            .max_seqs(8)
            .step_tokens(step_tokens)
            .build()
            .expect("batching engine");
        let engine = Arc::new(engine);
        let handles: Vec<_> = (0..24)
            .map(|i| {
                let engine = engine.clone();
                std::thread::spawn(move || tokens(&engine, request(i)))
            })
            .collect();
        for (i, (h, want)) in handles.into_iter().zip(&expected).enumerate() {
            let got = h.join().expect("request thread");
            assert_eq!(&got, want, "TP {tp}, step budget {step_tokens}: request {i}");
        }
    }
}

/// A step's new tokens stay within the rows the memory plan counted for one forward (a full
/// context's prompt, or a decode row per sequence): a budget past them runs at them, one
/// within them as asked.
#[test]
fn the_step_budget_stays_within_the_rows_the_plan_counts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = |max_context: usize, max_seqs: usize, step_tokens: usize| {
        Engine::builder(&path)
            .max_context(max_context)
            .max_seqs(max_seqs)
            .step_tokens(step_tokens)
            .build()
            .expect("batching engine")
    };
    let e = engine(64, 8, 4096);
    assert_eq!(
        e.plan().tokens_per_forward.min(64),
        64,
        "the tiny model's prompt chunk holds the context"
    );
    assert_eq!(e.step_tokens(), 64);
    assert_eq!(
        engine(32, 48, 4096).step_tokens(),
        48,
        "a decode row for every sequence"
    );
    assert_eq!(engine(64, 8, 40).step_tokens(), 40);
    // Eight prompts of 17 tokens join the steps together: the budget of 64 splits them.
    let e = Arc::new(e);
    let prompt = |i: u32| GenerateRequest::new(Prompt::Tokens((0..17).map(|t| (i * 17 + t) % 250).collect()), 4);
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let e = e.clone();
            std::thread::spawn(move || tokens(&e, prompt(i)))
        })
        .collect();
    let got: Vec<_> = handles.into_iter().map(|h| h.join().expect("request thread")).collect();
    let alone = engine(64, 1, 1);
    for (i, got) in got.iter().enumerate() {
        assert_eq!(got, &tokens(&alone, prompt(i as u32)), "request {i}");
    }
}

/// CPU ranks given no budget size the paged cache to their part of half the host's available
/// memory ([`tpinfer_runtime::CPU_POOL_SHARE`]): a server of more full contexts than that holds
/// starts with fewer, where the plan of all of them had been refused for the host's memory,
/// and serves. The pool is allocated zeroed and untouched, so it takes no memory until used.
#[test]
fn cpu_ranks_size_the_kv_cache_to_their_share_of_the_host() {
    let Some(available) = host_available() else {
        return; // no /proc/meminfo: the share is not taken
    };
    let dir = tempfile::tempdir().expect("tempdir");
    // 64 KiB of keys and values a position in f32: 4,096 full contexts of 512 are 128 GiB.
    let path = TinyLlama {
        layers: 8,
        hidden: 1024,
        heads: 8,
        kv_heads: 8,
        head_dim: 128,
        ..TinyLlama::default()
    }
    .write(dir.path());
    let engine = Engine::builder(&path)
        .max_context(512)
        .max_seqs(4096)
        .build()
        .expect("a batching engine on CPU ranks");
    let block = 16 * 64 * 1024;
    let share = (available as f64 * tpinfer_runtime::CPU_POOL_SHARE) as usize;
    let blocks = engine.load().kv_blocks;
    assert!(
        blocks < 4096 * 512 / 16,
        "{blocks} blocks: the pool was not sized to the host"
    );
    // MemAvailable moves between the two readings; a tenth of the share either way.
    assert!(
        blocks * block <= share + share / 10,
        "{blocks} blocks of {block} bytes against a share of {share}"
    );
    assert!(
        blocks * block >= share / 2,
        "{blocks} blocks of {block} bytes against a share of {share}"
    );
    let (ids, _) = tokens(&engine, request(3));
    assert!(!ids.is_empty());
}

/// Requests that begin with the same 40 tokens (a system prompt) share its computed KV blocks
/// (16 positions each): every later one finds 32 positions cached, and each still gives the
/// tokens of the same request run alone, sampled or greedy, at TP 1 and 2.
#[test]
fn requests_that_share_a_prompt_prefix_share_its_blocks_and_their_tokens_are_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    fn ask(i: usize) -> GenerateRequest {
        let system = (0..40).map(|t| (t * 13 % 250) as u32);
        let prompt = system.chain([200 + i as u32, 7, 9]).collect();
        GenerateRequest {
            prompt: Prompt::Tokens(prompt),
            ..request(i)
        }
    }
    let alone = Engine::builder(&path).max_context(96).build().expect("engine");
    let expected: Vec<_> = (0..6).map(|i| tokens(&alone, ask(i))).collect();
    drop(alone);
    for tp in [1, 2] {
        let engine = Engine::builder(&path)
            .tp(tp)
            .max_context(96)
            .max_seqs(4)
            .build()
            .expect("batching engine");
        // The first computes the prefix; then the others, one after another and at once.
        assert_eq!(tokens(&engine, ask(0)), expected[0], "TP {tp}: the first request");
        assert_eq!(engine.load().prefix_hit_tokens, 0);
        assert_eq!(tokens(&engine, ask(1)), expected[1], "TP {tp}: the second request");
        assert_eq!(engine.load().prefix_hit_tokens, 32);
        let engine = Arc::new(engine);
        let handles: Vec<_> = (2..6)
            .map(|i| {
                let engine = engine.clone();
                std::thread::spawn(move || tokens(&engine, ask(i)))
            })
            .collect();
        for (i, h) in (2..6).zip(handles) {
            assert_eq!(h.join().expect("request thread"), expected[i], "TP {tp}: request {i}");
        }
        assert_eq!(engine.load().prefix_hit_tokens, 6 * 32 - 32);
        // A request's end is seen after its blocks are free.
        assert_eq!(engine.load().kv_blocks_used, 0);
    }
}

#[test]
fn a_dropped_stream_ends_its_request_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = Engine::builder(&path).tp(2).max_seqs(4).build().expect("engine");
    let mut dropped = engine
        .generate(GenerateRequest::new(Prompt::Tokens(vec![1, 2, 3]), 400))
        .expect("generate");
    let kept = engine
        .generate(GenerateRequest::new(Prompt::Tokens(vec![4, 5]), 30))
        .expect("generate");
    assert!(matches!(dropped.next(), Some(Ok(StreamEvent::Token { .. }))));
    drop(dropped);
    let (_, ids, stats) = kept.collect_text().expect("the other request finishes");
    assert_eq!((ids.len(), stats.stop_reason), (30, StopReason::MaxTokens));
    // The dropped request's blocks came back: the engine still serves.
    let (ids, _) = tokens(&engine, GenerateRequest::new(Prompt::Tokens(vec![7]), 5));
    assert_eq!(ids.len(), 5);
}

#[test]
fn a_rank_failure_ends_every_request_in_flight_with_its_cause() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = Engine::builder(&path)
        .tp(3)
        .max_seqs(4)
        .comm_timeout(Duration::from_secs(5))
        .inject_fault(Fault::Error { rank: 1, step: 3 })
        .build()
        .expect("engine");
    let streams: Vec<_> = (0..3)
        .map(|i| {
            engine
                .generate(GenerateRequest::new(Prompt::Tokens(vec![1 + i]), 20))
                .expect("generate")
        })
        .collect();
    let errors: Vec<EngineError> = streams
        .into_iter()
        .map(|s| s.collect_text().expect_err("the step failed"))
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, EngineError::Injected { rank: 1, .. })),
        "{errors:?}"
    );
    for e in &errors {
        assert!(e.to_string().contains("rank 1: injected fault"), "{e}");
    }
    let again = engine
        .generate(GenerateRequest::new(Prompt::Tokens(vec![9]), 2))
        .expect("queued")
        .collect_text()
        .expect_err("the engine is broken");
    assert!(again.to_string().contains("rank 1: injected fault"), "{again}");
}

#[test]
fn zero_sequences_or_step_tokens_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    for builder in [
        Engine::builder(&path).max_seqs(0),
        Engine::builder(&path).max_seqs(2).step_tokens(0),
    ] {
        let error = builder.build().err().expect("refused");
        assert!(error.to_string().contains("max_seqs"), "{error}");
    }
}

#[test]
fn non_finite_logits_end_greedy_and_sampled_requests_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = Engine::builder(&path)
        .max_seqs(4)
        .inject_fault(Fault::NonFinite { rank: 0, step: 2 })
        .build()
        .expect("engine");
    let streams: Vec<_> = [request(0), request(1)]
        .into_iter()
        .map(|r| engine.generate(r).expect("generate"))
        .collect();
    for stream in streams {
        let error = stream.collect_text().expect_err("NaN logits");
        assert!(matches!(error, EngineError::NonFinite { .. }), "{error}");
    }
}

#[test]
fn a_budget_that_holds_two_full_contexts_serves_eight_sequences_by_preempting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let (tp, context, sequences) = (2, 64, 8);
    // The budget of a KV cache of two full contexts: not enough for a third.
    let model = tpinfer_llama::LlamaModel::open_checkpoint(&path).expect("model");
    let plan = |held: usize| {
        let placement = tpinfer_plan::Placement::Llm {
            max_context: context,
            batch: sequences,
            kv_sequences: Some(held),
        };
        tpinfer_plan::Plan::new(&model, tp, DType::F32, placement, tpinfer_plan::DeviceProfile::cpu())
            .expect("plan")
            .peak()
            .total()
    };
    let budget = plan(2);
    assert!(plan(3) > budget);
    let full = tpinfer_plan::Placement::llm(context, sequences);
    let fit =
        tpinfer_plan::kv_sequences_that_fit(&model, tp, DType::F32, full, tpinfer_plan::DeviceProfile::cpu(), budget);
    assert_eq!(fit, Some(2));

    // 16 requests whose prompts and outputs fill 48 of the 64 positions.
    let long = |i: usize| {
        let prompt: Vec<u32> = (0..8 + i % 5).map(|t| ((i * 17 + t * 11) % 250) as u32).collect();
        let mut request = GenerateRequest::new(Prompt::Tokens(prompt), 36);
        request.ignore_eos = true;
        if i % 2 == 1 {
            request.sampling = SamplingParams {
                temperature: 0.8,
                seed: 77 + i as u64,
                ..SamplingParams::default()
            };
        }
        request
    };
    let alone = Engine::builder(&path).max_context(context).build().expect("engine");
    let expected: Vec<_> = (0..16).map(|i| tokens(&alone, long(i))).collect();
    drop(alone);
    let engine = Engine::builder(&path)
        .tp(tp)
        .max_context(context)
        .max_seqs(sequences)
        .gpu_mem(budget)
        .build()
        .expect("an engine whose KV cache holds two full contexts");
    assert_eq!(engine.load().kv_blocks, 2 * context / 16);
    let engine = Arc::new(engine);
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let engine = engine.clone();
            std::thread::spawn(move || tokens(&engine, long(i)))
        })
        .collect();
    for (i, (h, want)) in handles.into_iter().zip(&expected).enumerate() {
        let got = h.join().expect("request thread");
        assert_eq!(got.0.len(), 36, "request {i} is complete");
        assert_eq!(&got, want, "request {i}");
    }
    let load = engine.load();
    assert!(load.preemptions > 0, "{load:?}");
    // The scheduler reports its blocks after the step that ended the last request, which a
    // client may see end first.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while engine.load().kv_blocks_used > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(engine.load().kv_blocks_used, 0, "every block is back");
}
