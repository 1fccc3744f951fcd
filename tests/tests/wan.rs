//! The Wan DiT on CPU ranks: every TP width gives TP 1's velocity, in either checkpoint naming.

use candle_core::DType;
use tpinfer_tests::{rel_error, run_wan, wan_inputs, TinyWan};

#[test]
fn tp_2_3_4_5_equal_tp_1() {
    // 5 heads (odd) and 100 FFN columns: uneven splits at TP 2, 3 and 4.
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    // 5 latent frames of 8 × 12: 5 × 4 × 6 = 120 video tokens.
    let (latents, text) = wan_inputs(&model, 5, 8, 12, 3);
    let (reference, reduces) = run_wan(&path, 1, DType::F32, &latents, &text, 731.0);
    assert!(reference.iter().all(|v| v.is_finite()));
    // Per block: the self-attention, cross-attention and FFN outputs, and the two QK norms.
    assert_eq!(reduces, 5 * model.layers as u64);
    for tp in [2, 3, 4, 5] {
        let (out, _) = run_wan(&path, tp, DType::F32, &latents, &text, 731.0);
        let err = rel_error(&out, &reference);
        assert!(err < 1e-5, "TP {tp}: relative error {err:e}");
    }
}

#[test]
fn original_wan_names_load_the_same_model() {
    let diffusers = TinyWan::default();
    let original = TinyWan {
        original_names: true,
        ..TinyWan::default()
    };
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let (pa, pb) = (diffusers.write(a.path()), original.write(b.path()));
    assert!(std::fs::read_to_string(pb.join("config.json"))
        .expect("config")
        .contains("\"num_heads\""));
    let (latents, text) = wan_inputs(&diffusers, 1, 4, 4, 5);
    let (x, _) = run_wan(&pa, 2, DType::F32, &latents, &text, 500.0);
    let (y, _) = run_wan(&pb, 2, DType::F32, &latents, &text, 500.0);
    assert_eq!(x, y, "same weights under either naming give the same velocity");
}

#[test]
fn bf16_tracks_f32() {
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let (latents, text) = wan_inputs(&model, 1, 4, 8, 9);
    let (f32_out, _) = run_wan(&path, 1, DType::F32, &latents, &text, 250.0);
    let (bf16_out, _) = run_wan(&path, 3, DType::BF16, &latents, &text, 250.0);
    let err = rel_error(&bf16_out, &f32_out);
    assert!(err < 3e-2, "bf16 at TP 3 against f32: {err:e}");
}
