//! A Wan pipeline directory on the rank group: the prompt's tokens and umT5 states made as Wan
//! and diffusers make them, the encoder and the DiT on the same ranks, TP 3 against TP 1, and
//! the prompt route against the text-states route on the same states, and the VAE's frames
//! split by rows over the ranks.

use candle_core::IndexOp;
use tpinfer_engine::{Engine, Solver, VideoEngine, VideoRequest, VideoShape};
use tpinfer_tests::{tensor_rel_error, TinyWanPipeline, END_OF_TEXT};

const SHAPE: VideoShape = VideoShape {
    frames: 5,
    width: 64,
    height: 32,
};

fn engine(model: &std::path::Path, tp: usize) -> VideoEngine {
    VideoEngine::start(Engine::builder(model).tp(tp), SHAPE).expect("engine")
}

/// "a red fox", guided away from the empty prompt: 2 UniPC steps from seed 3.
fn fox_request(engine: &VideoEngine) -> VideoRequest {
    VideoRequest {
        text: engine.encode_prompt("a red fox").expect("prompt"),
        negative: Some(engine.encode_prompt("").expect("negative")),
        steps: 2,
        shift: 5.0,
        guide_scale: 5.0,
        solver: Solver::UniPc(2),
        seed: 3,
        init_latents: None,
    }
}

#[test]
fn prompts_are_tokenized_encoded_and_padded_as_wan_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pipeline = TinyWanPipeline::default();
    pipeline.write(dir.path());
    let tokenizer = tpinfer_tokenizer::Tokenizer::from_hf_dir(&dir.path().join("tokenizer")).expect("tokenizer");
    let ids = tokenizer.encode("a cat sat", true).expect("ids");
    assert_eq!(ids.last(), Some(&END_OF_TEXT), "umT5's tokenizer appends </s>: {ids:?}");
    let reference = pipeline.encoder.reference(&ids);
    let (one, three) = (engine(dir.path(), 1), engine(dir.path(), 3));
    assert!(one.encodes_prompts());
    // The rank holds the encoder beside the DiT: its plan counts both.
    assert!(one.planned_peak() > one.plan().peak().total());
    // Whitespace is folded before tokenizing, as Wan's prompt_clean does.
    let states = one.encode_prompt("  a  cat\n sat ").expect("encode");
    assert_eq!(states.dims(), [512, pipeline.dit.text_dim]);
    let n = ids.len();
    let rel = tensor_rel_error(&states.i(0..n).expect("rows"), &reference);
    assert!(rel < 1e-5, "the prompt's states against the reference: {rel:e}");
    let padding = states.i(n..).and_then(|p| p.abs()).and_then(|p| p.max_all());
    assert_eq!(
        padding.and_then(|m| m.to_scalar::<f32>()).expect("max"),
        0.0,
        "zero-padded to 512"
    );
    let rel = tensor_rel_error(&three.encode_prompt("a cat sat").expect("encode"), &states);
    assert!(rel < 1e-5, "TP 3 against TP 1: {rel:e}");
    // The empty prompt, diffusers' default negative, is its </s> alone.
    let empty = one.encode_prompt("").expect("encode");
    let rel = tensor_rel_error(
        &empty.i(0..1).expect("row"),
        &pipeline.encoder.reference(&[END_OF_TEXT]),
    );
    assert!(rel < 1e-5, "{rel:e}");
}

#[test]
fn a_prompt_denoises_at_tp_3_as_at_tp_1_and_as_its_states_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyWanPipeline::default().write(dir.path());
    let request = fox_request;
    let one = engine(dir.path(), 1);
    let states = request(&one);
    let latents = one.generate(states.clone(), |_| {}).expect("TP 1");
    let three = engine(dir.path(), 3);
    let latents_three = three.generate(request(&three), |_| {}).expect("TP 3");
    let rel = tensor_rel_error(&latents_three, &latents);
    assert!(rel < 1e-5, "TP 3 against TP 1: {rel:e}");
    // The frames: each rank decodes a band of rows; the video is TP 1's.
    assert!(one.decodes_frames() && three.decodes_frames());
    let frames = one.decode(&latents, |_, _| {}).expect("decode at TP 1");
    assert_eq!(frames.dims(), [SHAPE.frames, 3, SHAPE.height, SHAPE.width]);
    let rel = tensor_rel_error(&three.decode(&latents_three, |_, _| {}).expect("TP 3"), &frames);
    assert!(rel < 1e-5, "the video at TP 3 against TP 1: {rel:e}");
    let reference = tpinfer_tests::reference_vae_decode(&dir.path().join("vae"), &latents);
    let rel = tensor_rel_error(&frames, &reference);
    assert!(rel < 1e-5, "the pipeline's frames against the reference VAE: {rel:e}");
    // The DiT alone, given the same states (the --text-embeds route), denoises the same.
    let dit = engine(&dir.path().join("transformer"), 1);
    assert!(!dit.encodes_prompts() && !dit.decodes_frames());
    assert!(dit.encode_prompt("a red fox").is_err(), "a DiT alone has no encoder");
    let rel = tensor_rel_error(&dit.generate(states, |_| {}).expect("DiT"), &latents);
    assert!(rel < 1e-6, "the states route against the prompt route: {rel:e}");
}

#[test]
fn guidance_without_a_negative_prompt_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyWanPipeline::default().write(dir.path());
    let one = engine(dir.path(), 1);
    let text = one.encode_prompt("a fox").expect("prompt");
    let unguided = |guide_scale| VideoRequest {
        text: text.clone(),
        negative: None,
        steps: 1,
        shift: 5.0,
        guide_scale,
        solver: Solver::Euler,
        seed: 1,
        init_latents: None,
    };
    let err = one.generate(unguided(5.0), |_| {}).expect_err("no negative");
    assert!(
        err.to_string().contains("--guide-scale 5") && err.to_string().contains("negative"),
        "{err}"
    );
    assert!(
        one.generate(unguided(1.0), |_| {}).is_ok(),
        "a scale of 1 needs no negative"
    );
}

/// Given latents start the denoising instead of the seed's noise: the seed's own noise given
/// as latents denoises to the same bits, other noise to other latents, and latents of
/// another shape are refused by name.
#[test]
fn init_latents_start_the_denoising() {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyWanPipeline::default().write(dir.path());
    let one = engine(dir.path(), 2);
    let request = |init_latents| VideoRequest {
        text: one.encode_prompt("a fox").expect("prompt"),
        negative: Some(one.encode_prompt("").expect("negative")),
        steps: 2,
        shift: 5.0,
        guide_scale: 5.0,
        solver: Solver::UniPc(2),
        seed: 9,
        init_latents,
    };
    let seeded = one.generate(request(None), |_| {}).expect("seeded");
    let noise = tpinfer_wan::sampler::seeded_noise(&one.latent_shape(), 9).expect("noise");
    let given = one.generate(request(Some(noise)), |_| {}).expect("given");
    assert_eq!(
        tensor_rel_error(&given, &seeded),
        0.0,
        "the seed's noise, given, is the seeded run"
    );
    let other = tpinfer_wan::sampler::seeded_noise(&one.latent_shape(), 10).expect("noise");
    let moved = one.generate(request(Some(other)), |_| {}).expect("other");
    assert!(tensor_rel_error(&moved, &seeded) > 1e-2, "other noise, other latents");
    let wrong = tpinfer_wan::sampler::seeded_noise(&[4, 2, 4, 9], 9).expect("noise");
    let err = one.generate(request(Some(wrong)), |_| {}).expect_err("wrong shape");
    assert!(err.to_string().contains("--init-latents are [4, 2, 4, 9]"), "{err}");
}

/// Non-finite input stops a run by name: NaN text states or starting latents before any step,
/// NaN weights after the first step that meets them, not as NaN latents at the end (issue #31).
#[test]
fn non_finite_values_stop_the_run_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyWanPipeline::default().write(dir.path());
    let one = engine(dir.path(), 1);
    let text = one.encode_prompt("a fox").expect("prompt");
    let request = |text: candle_core::Tensor, init_latents| VideoRequest {
        text,
        negative: None,
        steps: 2,
        shift: 5.0,
        guide_scale: 1.0,
        solver: Solver::Euler,
        seed: 1,
        init_latents,
    };
    let nan_text = (text.clone() * f64::NAN).expect("nan");
    let err = one.generate(request(nan_text, None), |_| {}).expect_err("NaN states");
    assert!(err.to_string().contains("the text states hold NaN"), "{err}");
    let nan_latents =
        candle_core::Tensor::full(f32::NAN, one.latent_shape().to_vec(), &candle_core::Device::Cpu).expect("nan");
    let err = one
        .generate(request(text.clone(), Some(nan_latents)), |_| {})
        .expect_err("NaN latents");
    assert!(err.to_string().contains("--init-latents hold NaN"), "{err}");

    // The DiT's output projection overflows (finite weights of 1e38): the first step's
    // latents are not finite.
    let weights = dir.path().join("transformer/diffusion_pytorch_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).expect("load");
    let poisoned = (tensors["proj_out.weight"].ones_like().expect("ones") * 1e38).expect("huge");
    tensors.insert("proj_out.weight".into(), poisoned);
    candle_core::safetensors::save(&tensors, &weights).expect("save");
    let poisoned = engine(dir.path(), 2);
    let err = poisoned
        .generate(request(text, None), |_| {})
        .expect_err("overflowing weights");
    assert!(err.to_string().contains("after denoising step 1 of 2"), "{err}");

    // The text encoder's final norm overflows: its states are not finite.
    let weights = dir.path().join("text_encoder/model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).expect("load");
    let poisoned = (tensors["encoder.final_layer_norm.weight"].ones_like().expect("ones") * 3e38).expect("huge");
    tensors.insert("encoder.final_layer_norm.weight".into(), poisoned);
    candle_core::safetensors::save(&tensors, &weights).expect("save");
    let err = engine(dir.path(), 2)
        .encode_prompt("a fox")
        .expect_err("overflowing states");
    assert!(
        err.to_string().contains("text encoder's states hold NaN") && err.to_string().contains("encoding the prompt"),
        "{err}"
    );
}

/// Where the ranks cannot hold the text encoder beside the DiT and the VAE, the encoder runs
/// first and is freed before they load: the same video, in less memory, and a later prompt
/// is refused by name rather than run on freed weights.
#[test]
fn the_encoder_is_freed_after_encoding_when_the_budget_needs_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyWanPipeline::default().write(dir.path());
    let run = |engine: &VideoEngine| {
        let latents = engine.generate(fox_request(engine), |_| {}).expect("generate");
        engine.decode(&latents, |_, _| {}).expect("decode")
    };
    let together = engine(dir.path(), 2);
    assert!(!together.frees_encoder());
    let held_together = together.planned_peak();
    let budget = |bytes: u64| Engine::builder(dir.path()).tp(2).gpu_mem(bytes);
    let in_turns = VideoEngine::start(budget(held_together - 1), SHAPE).expect("in turns");
    assert!(in_turns.frees_encoder());
    let peak = in_turns.planned_peak();
    assert!(peak < held_together, "{peak} against {held_together}");
    let rel = tensor_rel_error(&run(&in_turns), &run(&together));
    assert!(rel < 1e-6, "the video in turns against the one held together: {rel:e}");
    let err = in_turns.encode_prompt("a blue fox").expect_err("the encoder is freed");
    assert!(err.to_string().contains("text encoder was freed"), "{err}");
    let err = VideoEngine::start(budget(peak - 1), SHAPE)
        .err()
        .expect("under the larger turn");
    assert!(err.to_string().contains("freed before"), "{err}");
}
