//! The embedding API: a `Send + Sync` engine, token streams, sampling and stopping.

use std::sync::Arc;

use candle_core::DType;
use tpinfer_engine::{Engine, GenerateRequest, LoadProgress, Prompt, SamplingParams, StopReason, StreamEvent};
use tpinfer_tests::{run_greedy, TinyLlama};

fn tiny_engine(tp: usize) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = Engine::builder(&path).tp(tp).build().expect("engine");
    (dir, engine)
}

fn greedy(engine: &Engine, prompt: &str, n: usize) -> Vec<u32> {
    let (_, ids, _) = engine
        .generate(GenerateRequest::new(Prompt::text(prompt), n))
        .expect("generate")
        .collect_text()
        .expect("stream");
    ids
}

#[test]
fn engine_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Engine>();
}

#[test]
fn requests_from_many_threads_get_the_same_tokens_as_tp1() {
    let (_d1, tp1) = tiny_engine(1);
    let expected = greedy(&tp1, "hello world", 12);
    assert_eq!(expected.len(), 12);
    let (_d3, engine) = tiny_engine(3);
    let engine = Arc::new(engine);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let engine = engine.clone();
            std::thread::spawn(move || greedy(&engine, "hello world", 12))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("thread"), expected);
    }
}

/// The engine's greedy requests (steps queued ahead of the host on the device path) give the
/// tokens of a plain host loop that waits for every step and takes the argmax itself, at every
/// width, up to the last token and through a stop in mid-pipeline.
#[test]
fn engine_greedy_tokens_equal_a_host_argmax_loop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let prompt = vec![256, 72, 101, 108, 108, 111];
    let expected = run_greedy(&path, 1, DType::F32, &prompt, 15).tokens;
    for tp in [1, 2, 3] {
        let engine = Engine::builder(&path).tp(tp).build().expect("engine");
        for n in [1, 2, 7, 16] {
            let (_, ids, stats) = engine
                .generate(GenerateRequest::new(Prompt::Tokens(prompt.clone()), n))
                .expect("generate")
                .collect_text()
                .expect("stream");
            assert_eq!(ids, expected[..n], "TP {tp}, {n} tokens");
            assert_eq!(stats.stop_reason, StopReason::MaxTokens, "TP {tp}, {n} tokens");
        }
    }
}

#[test]
fn the_stream_yields_tokens_then_stats() {
    let (_d, engine) = tiny_engine(2);
    let stream = engine
        .generate(GenerateRequest::new(Prompt::text("abc"), 6))
        .expect("generate");
    let events: Vec<StreamEvent> = stream.map(|e| e.expect("event")).collect();
    assert!(
        events.len() == 7 || events.len() == 8,
        "6 tokens, maybe a tail, then Done"
    );
    let ids: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Token { text, .. } | StreamEvent::Tail(text) => Some(text.as_str()),
            StreamEvent::Done(_) => None,
        })
        .collect();
    assert_eq!(text, engine.tokenizer().decode(&ids).expect("decode"));
    let StreamEvent::Done(stats) = &events[events.len() - 1] else {
        panic!("last event must be Done")
    };
    assert_eq!(stats.generated_tokens, 6);
    assert_eq!(stats.prompt_tokens, 4, "BOS + 3 bytes");
    assert_eq!(stats.stop_reason, StopReason::MaxTokens);
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let (_d, engine) = tiny_engine(2);
    let run = |seed: u64, params: SamplingParams| {
        let request = GenerateRequest::new(Prompt::text("xyz"), 24).with_sampling(SamplingParams { seed, ..params });
        engine
            .generate(request)
            .expect("generate")
            .collect_text()
            .expect("stream")
            .1
    };
    let hot = SamplingParams {
        temperature: 1.5,
        top_p: Some(0.95),
        top_k: Some(100),
        ..SamplingParams::default()
    };
    assert_eq!(run(1, hot.clone()), run(1, hot.clone()));
    assert_ne!(run(1, hot.clone()), run(2, hot.clone()));
    let top1 = SamplingParams {
        temperature: 0.7,
        top_k: Some(1),
        ..SamplingParams::default()
    };
    assert_eq!(run(9, top1), greedy(&engine, "xyz", 24), "top-k 1 is greedy");
    let penalized = run(
        0,
        SamplingParams {
            repetition_penalty: 5.0,
            ..SamplingParams::default()
        },
    );
    let distinct = |ids: &[u32]| ids.iter().collect::<std::collections::HashSet<_>>().len();
    let plain = greedy(&engine, "xyz", 24);
    assert!(distinct(&penalized) > distinct(&plain), "penalty must diversify");
    // OpenAI's penalties on the generated tokens: greedy still, but off the beaten track.
    for (frequency_penalty, presence_penalty) in [(2.0, 0.0), (0.0, 2.0)] {
        let penalized = run(
            0,
            SamplingParams {
                frequency_penalty,
                presence_penalty,
                ..SamplingParams::default()
            },
        );
        assert!(
            distinct(&penalized) > distinct(&plain),
            "frequency {frequency_penalty}, presence {presence_penalty}: {penalized:?} against {plain:?}"
        );
    }
    // A bias of −100 bans the token greedy decoding picks first.
    let banned = run(
        0,
        SamplingParams {
            logit_bias: vec![(plain[0], -100.0)],
            ..SamplingParams::default()
        },
    );
    assert!(!banned.contains(&plain[0]), "{banned:?} holds the banned {}", plain[0]);
}

#[test]
fn generation_stops_when_the_context_is_full() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = Engine::builder(&path).tp(2).max_context(10).build().expect("engine");
    let (_, ids, stats) = engine
        .generate(GenerateRequest::new(Prompt::text("abcdef"), 100))
        .expect("generate")
        .collect_text()
        .expect("stream");
    assert_eq!(stats.stop_reason, StopReason::ContextFull);
    assert_eq!(
        7 + ids.len(),
        11,
        "prompt 7 tokens; tokens up to the 10-position context, plus the last sampled"
    );
}

/// The start-up warm-up (a two-token prompt and two decode steps) needs four positions; a
/// shorter context starts without it, and its requests give a host loop's tokens.
#[test]
fn an_engine_too_short_to_warm_up_still_serves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let prompt = vec![256, 72];
    let expected = run_greedy(&path, 1, DType::F32, &prompt, 1).tokens;
    let engine = Engine::builder(&path).tp(2).max_context(3).build().expect("engine");
    let (_, ids, _) = engine
        .generate(GenerateRequest::new(Prompt::Tokens(prompt), 1))
        .expect("generate")
        .collect_text()
        .expect("stream");
    assert_eq!(ids, expected[..1]);
}

#[test]
fn a_dropped_stream_cancels_and_the_engine_serves_the_next_request() {
    let (_d, engine) = tiny_engine(3);
    let mut stream = engine
        .generate(GenerateRequest::new(Prompt::text("a"), 400))
        .expect("generate");
    assert!(matches!(stream.next(), Some(Ok(StreamEvent::Token { .. }))));
    drop(stream);
    assert_eq!(greedy(&engine, "hello", 5).len(), 5);
}

#[test]
fn chat_prompts_use_the_model_template() {
    let (_d, engine) = tiny_engine(1);
    let (_, _, stats) = engine
        .generate(GenerateRequest::new(Prompt::user("hi"), 2))
        .expect("generate")
        .collect_text()
        .expect("stream");
    // BOS + "<|user|>" (8 bytes) + "hi" + <|eot_id|> + "<|assistant|>" (13 bytes)
    assert_eq!(stats.prompt_tokens, 1 + 8 + 2 + 1 + 13);
}

/// The load progress reaches the bytes it expected, which are the plan's weights over all
/// ranks: what the CLI's bar shows while a model loads.
#[test]
fn load_progress_counts_every_rank_up_to_the_planned_weights() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let progress = LoadProgress::new();
    let engine = Engine::builder(&model)
        .tp(3)
        .load_progress(progress.clone())
        .build()
        .expect("engine");
    let planned: u64 = engine.plan().ranks.iter().map(|r| r.weights).sum();
    assert!(planned > 0);
    assert_eq!(progress.total(), planned);
    assert_eq!(progress.placed(), planned, "every rank's weights counted once");
}
