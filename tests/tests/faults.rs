//! A rank that fails mid-request: every failure ends the request with the failing rank named,
//! quickly, and later requests are refused with the same cause rather than hanging.

use std::time::{Duration, Instant};

use tpinfer_engine::{Engine, EngineError, Fault, GenerateRequest, Prompt, RuntimeError, StreamEvent};
use tpinfer_tests::TinyLlama;

/// Runs a request on a faulty engine; returns the tokens streamed before the error, the error,
/// and the error of a second request.
fn run_with(fault: Fault, tp: usize) -> (usize, EngineError, EngineError) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let engine = Engine::builder(&path)
        .tp(tp)
        .comm_timeout(Duration::from_secs(5))
        .inject_fault(fault)
        .build()
        .expect("engine");
    let start = Instant::now();
    let mut tokens = 0;
    let mut error = None;
    for event in engine
        .generate(GenerateRequest::new(Prompt::text("hello"), 20))
        .expect("generate")
    {
        match event {
            Ok(StreamEvent::Token { .. }) => tokens += 1,
            Ok(_) => {}
            Err(e) => error = Some(e),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(4), "took {:?}", start.elapsed());
    let error = error.expect("the request must fail");
    let again = engine
        .generate(GenerateRequest::new(Prompt::text("hello"), 2))
        .expect("queued")
        .collect_text()
        .expect_err("the engine is broken");
    (tokens, error, again)
}

#[test]
fn a_rank_returning_an_error_is_the_reported_cause() {
    let (tokens, error, again) = run_with(Fault::Error { rank: 1, step: 3 }, 3);
    assert_eq!(
        tokens, 4,
        "the tokens sampled before the failing decode step are delivered"
    );
    assert!(matches!(error, EngineError::Injected { rank: 1, .. }), "{error}");
    assert!(again.to_string().contains("rank 1: injected fault"), "{again}");
}

#[test]
fn a_panicking_rank_is_the_reported_cause() {
    let (_, error, _) = run_with(Fault::Panic { rank: 2, step: 0 }, 3);
    assert!(
        matches!(error, EngineError::Runtime(RuntimeError::RankPanicked { rank: 2, .. })),
        "{error}"
    );
}

#[test]
fn a_rank_that_dies_silently_is_named() {
    let (_, error, _) = run_with(Fault::Exit { rank: 1, step: 2 }, 2);
    assert!(error.to_string().contains("rank 1"), "{error}");
    assert!(
        matches!(error, EngineError::Runtime(RuntimeError::RankExited { rank: 1 }))
            || error.to_string().contains("rank 1 exited"),
        "{error}"
    );
}

/// Options that would make a failure test pass without a failure, or report a healthy peer
/// as stalled, are refused by name (issue #31).
#[test]
fn impossible_fault_and_timeout_options_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let err = Engine::builder(&path)
        .tp(2)
        .inject_fault(Fault::Error { rank: 2, step: 0 })
        .build()
        .err()
        .expect("no rank 2 at TP 2");
    assert!(err.to_string().contains("rank 2 is not one of the 2 ranks"), "{err}");
    let err = Engine::builder(&path)
        .tp(2)
        .comm_timeout(Duration::ZERO)
        .build()
        .err()
        .expect("a zero timeout");
    assert!(
        err.to_string().contains("--comm-timeout") && err.to_string().contains("is 0"),
        "{err}"
    );
}

/// Logits that turn NaN mid-request (as a NaN in the KV cache makes them) stop it within the
/// steps between two checks, named by its decode step, on every rank alike: before, only the
/// prompt's logits were checked, and decoding ran on to the end on garbage.
#[test]
fn logits_that_turn_nan_stop_the_request_by_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    for (max_new_tokens, stopped_at) in [(80, "decode step 32"), (6, "decode step 5")] {
        let engine = Engine::builder(&path)
            .tp(3)
            .comm_timeout(Duration::from_secs(5))
            .inject_fault(Fault::NonFinite { rank: 0, step: 2 })
            .build()
            .expect("engine");
        let request = GenerateRequest::new(Prompt::text("hello"), max_new_tokens);
        let start = Instant::now();
        let error = engine
            .generate(request)
            .expect("queued")
            .collect_text()
            .expect_err("NaN logits");
        assert!(start.elapsed() < Duration::from_secs(4), "took {:?}", start.elapsed());
        assert!(
            matches!(error, EngineError::NonFinite { what: "logits", .. }),
            "{error}"
        );
        assert!(error.to_string().contains(stopped_at), "{error}");
    }
}
