//! `tpinfer-bench logits` on CPU with a tiny model: through the continuous-batching engine
//! (`--max-seqs`) it writes the tokens and logits of the one-sequence engine, as GPU checks
//! compare both against transformers.

// The helper panics on failure, as the tests themselves do.
#![allow(clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use tpinfer_tests::{rel_error, TinyLlama};

/// The tensors `logits --max-seqs {max_seqs}` writes for `model`.
fn logits(model: &Path, out: &Path, max_seqs: usize) -> std::collections::HashMap<String, candle_core::Tensor> {
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args(["logits", "--tp", "2", "--steps", "6", "--prompt-tokens", "9"])
        .args(["--max-seqs", &max_seqs.to_string(), "--model"])
        .arg(model)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run tpinfer-bench");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    candle_core::safetensors::load(out, &candle_core::Device::Cpu).expect("the written tensors")
}

#[test]
fn batched_logits_equal_the_one_sequence_engines() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(&dir.path().join("model"));
    let alone = logits(&model, &dir.path().join("alone.st"), 1);
    let batched = logits(&model, &dir.path().join("batched.st"), 4);
    let values = |t: &candle_core::Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("f32");
    let tokens = |t: &candle_core::Tensor| t.to_vec1::<i64>().expect("i64");
    assert_eq!(tokens(&batched["tokens"]), tokens(&alone["tokens"]));
    assert_eq!(batched["decode_logits"].dims(), alone["decode_logits"].dims());
    for name in ["prefill_logits", "decode_logits"] {
        let err = rel_error(&values(&batched[name]), &values(&alone[name]));
        assert!(err < 1e-5, "{name}: {err:e}");
    }
}
