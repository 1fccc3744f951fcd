//! FP8 E4M3 weights with a scale per output row: compressed-tensors checkpoints loaded as
//! stored, `--quantize fp8` at load, and the plan that counts their bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tpinfer_plan::{DeviceProfile, Placement, Plan};
use tpinfer_tests::{each_rank_holds_its_planned_bytes, rel_error, run_forced, run_greedy, TinyLlama};
use tpinfer_weights::WeightFormat;

/// The tensors a tiny Llama's linear layers (not the embedding nor the LM head) hold, and with
/// `head` its LM head.
fn is_quantized(name: &str, shape: &[usize], head: bool) -> bool {
    shape.len() == 2 && (name.starts_with("model.layers.") || head && name == "lm_head.weight")
}

/// Writes `model` twice: as a compressed-tensors FP8 checkpoint (E4M3 weights, f32
/// `weight_scale` per row, or per tensor for the MLP where `tensor_scales_in_mlp`, as both
/// kinds of checkpoint exist), and as the f32 checkpoint of exactly those weights, values
/// times scales; with `head`, the LM head's too. Returns (FP8 dir, reference dir).
fn write_fp8_and_reference(
    model: &TinyLlama,
    root: &Path,
    tensor_scales_in_mlp: bool,
    head: bool,
) -> (PathBuf, PathBuf) {
    let (fp8, reference) = (root.join("fp8"), root.join("reference"));
    model.write(&fp8);
    model.write(&reference);
    let mut stored = HashMap::new();
    let mut dequantized = HashMap::new();
    for (name, shape, values) in model.tensors() {
        let t = Tensor::from_vec(values, shape.as_slice(), &Device::Cpu).expect("tensor");
        if !is_quantized(&name, &shape, head) {
            stored.insert(name.clone(), t.clone());
            dequantized.insert(name, t);
            continue;
        }
        let amax = t.abs().and_then(|a| a.max_keepdim(1)).expect("amax");
        let scale = match tensor_scales_in_mlp && name.contains(".mlp.") {
            true => amax.max_keepdim(0).and_then(|m| m.reshape(1)).expect("tensor amax"),
            false => amax.squeeze(1).expect("row amax"),
        };
        let scale = (scale / 448.0).expect("scale");
        let column = |s: &Tensor| match s.elem_count() {
            1 => s.reshape((1, 1)),
            _ => s.unsqueeze(1),
        };
        let e4m3 = t
            .broadcast_div(&column(&scale).expect("column"))
            .and_then(|q| q.to_dtype(DType::F8E4M3))
            .expect("e4m3");
        let back = e4m3
            .to_dtype(DType::F32)
            .and_then(|v| v.broadcast_mul(&column(&scale)?))
            .expect("dequantize");
        stored.insert(format!("{name}_scale"), scale);
        stored.insert(name.clone(), e4m3);
        dequantized.insert(name, back);
    }
    candle_core::safetensors::save(&stored, fp8.join("model.safetensors")).expect("save fp8");
    candle_core::safetensors::save(&dequantized, reference.join("model.safetensors")).expect("save reference");
    let mut config = model.config_json();
    config["quantization_config"] = serde_json::json!({
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": if head { vec![] } else { vec!["lm_head"] },
    });
    std::fs::write(fp8.join("config.json"), config.to_string()).expect("config");
    (fp8, reference)
}

const PROMPT: [u32; 6] = [1, 7, 42, 99, 5, 250];

/// 10 heads over 5 KV heads and 100 FFN columns: uneven splits at TP 3 and 4.
fn uneven_tiny_llama() -> TinyLlama {
    TinyLlama {
        heads: 10,
        kv_heads: 5,
        intermediate: 100,
        ..TinyLlama::default()
    }
}

/// Checks that `path` held in each of `formats` gives, at every width from 1 to 5, the logits
/// of the f32 `reference` (TP 1) along its greedy tokens from `prompt`. Returns the
/// reference's tokens and logits.
fn every_width_gives_the_reference(
    path: &Path,
    formats: &[WeightFormat],
    reference: &Path,
    prompt: &[u32],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let expected = run_greedy(reference, 1, DType::F32, prompt, 6);
    let forced = &expected.tokens[..6];
    for &format in formats {
        for tp in 1..=5 {
            let logits = run_forced(path, tp, format, prompt, forced);
            for (step, values) in logits.iter().enumerate() {
                let err = rel_error(values, &expected.logits[step]);
                assert!(err < 1e-5, "{format:?} TP {tp} step {step}: {err:e}");
            }
        }
    }
    (forced.to_vec(), expected.logits)
}

#[test]
fn a_compressed_tensors_fp8_checkpoint_at_tp_1_to_5_runs_its_weights() {
    let model = uneven_tiny_llama();
    let dir = tempfile::tempdir().expect("tempdir");
    let (fp8, reference) = write_fp8_and_reference(&model, dir.path(), true, false);
    let formats = [WeightFormat::AsStored, WeightFormat::Dequantized];
    every_width_gives_the_reference(&fp8, &formats, &reference, &PROMPT);
}

#[test]
fn quantize_fp8_at_load_runs_per_row_fp8_weights_at_tp_1_to_5() {
    let model = uneven_tiny_llama();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(&dir.path().join("f32"));
    // The weights an FP8 quantization with one scale per row makes, written out in f32.
    let (_, reference) = write_fp8_and_reference(&model, dir.path(), false, false);
    // Row scales come from whole rows, so every width quantizes every weight alike.
    let (forced, expected) = every_width_gives_the_reference(&path, &[WeightFormat::Fp8], &reference, &PROMPT);
    // E4M3 keeps 3 mantissa bits: this random model's logits move by 1.1e-1.
    let original = run_forced(&path, 1, WeightFormat::AsStored, &PROMPT, &forced);
    let err = rel_error(&expected[6], &original[6]);
    assert!(err > 1e-3, "FP8 against f32: {err:e}");
}

/// `--quantize-lm-head`: the LM head quantized per row as the layers are, its vocabulary rows
/// split over the ranks (uneven at TP 3 and 4), at every width the logits of those weights.
#[test]
fn quantize_lm_head_runs_a_per_row_fp8_head_at_tp_1_to_5() {
    let model = TinyLlama {
        vocab: 250,
        ..uneven_tiny_llama()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(&dir.path().join("f32"));
    let (_, reference) = write_fp8_and_reference(&model, dir.path(), false, true);
    let prompt = PROMPT.map(|t| t % 250);
    let (forced, expected) =
        every_width_gives_the_reference(&path, &[WeightFormat::Fp8WithLmHead], &reference, &prompt);
    // The head was quantized: the layers alone in FP8 give other logits.
    let layers_only = run_forced(&path, 1, WeightFormat::Fp8, &prompt, &forced);
    let err = rel_error(&expected[6], &layers_only[6]);
    assert!(err > 1e-3, "an FP8 head against an f32 one: {err:e}");
}

/// A model whose LM head is its embedding (tied) has no head of its own to quantize, and a
/// video model none at all: `--quantize-lm-head` is refused by name, at open and in a plan.
#[test]
fn quantize_lm_head_is_refused_for_a_tied_head_or_a_video_model() {
    let model = TinyLlama {
        tie_embeddings: true,
        ..TinyLlama::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let err = tpinfer_llama::LlamaCheckpoint::open_with(&path, WeightFormat::Fp8WithLmHead)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("--quantize-lm-head") && err.contains("tie_word_embeddings"),
        "{err}"
    );
    for (name, says) in [
        ("llama-3.2-1b", "tie_word_embeddings"),
        ("wan2.1-t2v-1.3b", "no LM head"),
    ] {
        let err = tpinfer_engine::registry::open_as(name, WeightFormat::Fp8WithLmHead)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("--quantize-lm-head") && err.contains(says),
            "{name}: {err}"
        );
    }
    assert!(tpinfer_engine::registry::open_as("llama-3-8b", WeightFormat::Fp8WithLmHead).is_ok());
}

#[test]
fn fp8_ranks_hold_the_planned_bytes_and_70b_fits_four_24_gib_gpus_only_in_fp8() {
    use tpinfer_llama::LlamaCheckpoint;
    let model = TinyLlama::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    for format in [WeightFormat::Fp8, WeightFormat::Fp8WithLmHead] {
        let checkpoint = LlamaCheckpoint::open_with(&path, format).expect("open");
        each_rank_holds_its_planned_bytes(&checkpoint, &[1, 3], DType::BF16, |_| {});
    }
    let plan = |format| {
        let (_, model) = tpinfer_engine::registry::open_as("llama-3-70b", format).expect("preset");
        Plan::new(&*model, 4, DType::BF16, Placement::llm(8192, 1), DeviceProfile::cuda()).expect("plan")
    };
    let budget = 24u64 << 30;
    let (fp8, bf16) = (plan(WeightFormat::Fp8), plan(WeightFormat::AsStored));
    assert!(fp8.fits(budget), "FP8 at TP 4: {:?}", fp8.peak());
    assert!(!bf16.fits(budget), "bf16 at TP 4: {:?}", bf16.peak());
    // 70.6 B parameters, 2.1 B of them the embedding and LM head kept in bf16.
    let weights = fp8.ranks.iter().map(|r| r.weights).sum::<u64>() as f64 / 1e9;
    assert!(
        (72.0..73.5).contains(&weights),
        "{weights:.2} GB of weights over the ranks"
    );
}

#[test]
fn an_fp8_checkpoint_without_a_scale_or_of_another_method_is_refused_by_name() {
    let model = TinyLlama::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let (fp8, _) = write_fp8_and_reference(&model, dir.path(), false, false);
    let start = |dir: &Path| {
        tpinfer_engine::Engine::builder(dir)
            .build()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let mut tensors = candle_core::safetensors::load(fp8.join("model.safetensors"), &Device::Cpu).expect("load");
    tensors.remove("model.layers.1.mlp.down_proj.weight_scale");
    candle_core::safetensors::save(&tensors, fp8.join("model.safetensors")).expect("save");
    let err = start(&fp8);
    assert!(err.contains("model.layers.1.mlp.down_proj.weight_scale"), "{err}");

    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fp8.join("config.json")).expect("read")).expect("json");
    config["quantization_config"]["quant_method"] = serde_json::json!("awq");
    std::fs::write(fp8.join("config.json"), config.to_string()).expect("write");
    let err = start(&fp8);
    assert!(
        err.contains("quant_method `awq`") && err.contains("--quantize fp8"),
        "{err}"
    );
}

/// The Wan DiT's blocks in FP8: every width gives TP 1's velocity (row scales come from
/// whole rows), and FP8 really changed the weights.
#[test]
fn a_wan_dit_in_fp8_at_tp_2_to_5_gives_tp_1s_velocity() {
    use tpinfer_tests::{run_wan_as, wan_inputs, TinyWan};
    let model = TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let (latents, text) = wan_inputs(&model, 5, 8, 12, 3);
    let run = |tp, format| run_wan_as(&path, tp, DType::F32, format, &latents, &text, 731.0).0;
    let reference = run(1, WeightFormat::Fp8);
    for tp in 2..=5 {
        let err = rel_error(&run(tp, WeightFormat::Fp8), &reference);
        assert!(err < 1e-5, "TP {tp}: {err:e}");
    }
    let err = rel_error(&reference, &run(1, WeightFormat::AsStored));
    assert!(err > 1e-4, "FP8 against f32: {err:e}");
}

/// A CUDA rank's FP8 product quantizes its input (a byte a value and an f32 scale a row) and
/// multiplies on FP8 tensor cores; a CPU rank expands the weight to the compute dtype. The
/// plan counts each beside the bf16 model's activations: Llama-3-8B at TP 1, a 2,048-token
/// chunk, the widest input the FFN's 14,336; the largest weight the merged gate/up.
#[test]
fn fp8_products_plan_a_quantized_input_on_cuda_and_an_expanded_weight_on_cpu() {
    let plan = |format, device| {
        let (_, model) = tpinfer_engine::registry::open_as("llama-3-8b", format).expect("preset");
        Plan::new(&*model, 1, DType::BF16, Placement::llm(2048, 1), device).expect("plan")
    };
    let extra = |device: fn() -> DeviceProfile| {
        let (fp8, bf16) = (
            plan(WeightFormat::Fp8, device()),
            plan(WeightFormat::AsStored, device()),
        );
        (
            fp8.tokens_per_forward,
            fp8.ranks[0].activations - bf16.ranks[0].activations,
        )
    };
    let (chunk, cuda) = extra(DeviceProfile::cuda);
    assert_eq!(cuda, chunk as u64 * (14_336 + 4), "CUDA: {chunk} rows");
    let (_, cpu) = extra(DeviceProfile::cpu);
    assert_eq!(
        cpu,
        (2 * 14_336 * 4096 * 2 * 2) as u64,
        "CPU: the gate/up expanded, E4M3 to bf16 and the product"
    );
}

/// The same for the video models: the Wan-14B DiT at TP 2 (81 frames at 480p: 32,760 tokens;
/// its block's peak is the FFN's down projection, whose input, the FFN's hidden, is the widest,
/// 6,912 columns a rank; the largest weight its up or down projection) and umT5-XXL (a
/// 512-token prompt, the widest input its FFN's 10,240; gate and up expanded together on CPU).
/// The DiT counts each product's bytes in the phase it runs in: at TP 1 with FP8
/// self-attention, whose copies make the attention the block's peak, FP8 weights add nothing
/// (on the H200 the live tensors measured 16,012 MiB against 16,064 planned, benches/RESULTS.md).
#[test]
fn video_fp8_products_plan_a_quantized_input_on_cuda_and_an_expanded_weight_on_cpu() {
    let extra = |name: &str, tp, placement: Placement, device: fn() -> DeviceProfile| {
        let plan = |format| {
            let (_, model) = tpinfer_engine::registry::open_as(name, format).expect("preset");
            Plan::new(&*model, tp, DType::BF16, placement, device()).expect("plan")
        };
        let (fp8, bf16) = (plan(WeightFormat::Fp8), plan(WeightFormat::AsStored));
        (
            fp8.tokens_per_forward as u64,
            fp8.ranks[0].activations - bf16.ranks[0].activations,
        )
    };
    let video = Placement::Dit {
        frames: 81,
        width: 832,
        height: 480,
        cfg: true,
    };
    let (tokens, cuda) = extra("wan2.1-t2v-14b", 2, video, DeviceProfile::cuda);
    assert_eq!((tokens, cuda), (32_760, 32_760 * (6_912 + 4)), "DiT on CUDA");
    let fp8_attention_at_tp1 = |format| {
        let model = tpinfer_engine::registry::open_dit_as("wan2.1-t2v-14b", format, tpinfer_engine::SelfAttention::Fp8)
            .expect("a DiT")
            .expect("preset");
        Plan::new(&*model, 1, DType::BF16, video, DeviceProfile::cuda())
            .expect("plan")
            .ranks[0]
            .activations
    };
    assert_eq!(
        fp8_attention_at_tp1(WeightFormat::Fp8),
        fp8_attention_at_tp1(WeightFormat::AsStored),
        "TP 1, FP8 attention"
    );
    let (_, cpu) = extra("wan2.1-t2v-14b", 2, video, DeviceProfile::cpu);
    assert_eq!(
        cpu,
        2 * 2 * 6_912 * 5_120,
        "DiT on CPU: the FFN's projection expanded and scaled"
    );
    let prompt = Placement::llm(512, 1);
    let (_, cuda) = extra("umt5-xxl", 1, prompt, DeviceProfile::cuda);
    assert_eq!(cuda, 512 * (10_240 + 4), "umT5 on CUDA");
    let (_, cpu) = extra("umt5-xxl", 1, prompt, DeviceProfile::cpu);
    assert_eq!(
        cpu,
        2 * 2 * 2 * 10_240 * 4_096,
        "umT5 on CPU: gate and up expanded and scaled"
    );
}

/// A `weight_scale` of the wrong shape, or one that is not finite or not above 0, is refused by
/// the scale's name when the ranks load it.
#[test]
fn an_fp8_scale_of_the_wrong_shape_or_not_finite_is_refused_by_name() {
    let model = TinyLlama::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let (fp8, _) = write_fp8_and_reference(&model, dir.path(), false, false);
    let original = candle_core::safetensors::load(fp8.join("model.safetensors"), &Device::Cpu).expect("load");
    let name = "model.layers.0.self_attn.o_proj.weight_scale";
    let scale = original.get(name).expect("a row scale").clone();
    let rows = scale.dim(0).expect("rows");
    let with_first = |value: f32| {
        let first = Tensor::new(&[value], &Device::Cpu).and_then(|v| v.to_dtype(scale.dtype()));
        scale.slice_assign(&[..1], &first.expect("value")).expect("assign")
    };
    let bad_scales = [
        (
            "of the wrong shape",
            Tensor::ones(rows + 1, DType::F32, &Device::Cpu).expect("ones"),
            "scales for",
        ),
        ("not finite", with_first(f32::NAN), "NaN or infinite"),
        ("of 0", with_first(0.0), "row 0's scale is 0"),
    ];
    for (what, bad, said) in bad_scales {
        let mut tensors = original.clone();
        tensors.insert(name.to_string(), bad.to_dtype(scale.dtype()).expect("dtype"));
        candle_core::safetensors::save(&tensors, fp8.join("model.safetensors")).expect("save");
        for tp in [1, 2] {
            let err = tpinfer_engine::Engine::builder(&fp8)
                .tp(tp)
                .build()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                err.contains(name) && err.contains(said),
                "a scale {what} at TP {tp}: {err:?}"
            );
        }
    }
}

/// `--quantize fp8` of a weight holding NaN or an infinity is refused by the weight's name, at
/// every width (a row-parallel split quantizes whole rows on each rank).
#[test]
fn quantizing_a_weight_that_is_not_finite_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write(dir.path());
    let file = path.join("model.safetensors");
    let original = candle_core::safetensors::load(&file, &Device::Cpu).expect("load");
    for (name, value) in [
        ("model.layers.0.mlp.down_proj.weight", f32::NAN),
        ("model.layers.1.self_attn.q_proj.weight", f32::INFINITY),
    ] {
        let weight = original.get(name).expect("a weight");
        let bad = Tensor::new(&[[value]], &Device::Cpu)
            .and_then(|v| v.to_dtype(weight.dtype()))
            .and_then(|v| weight.slice_assign(&[3..4, 1..2], &v))
            .expect("assign");
        let mut tensors = original.clone();
        tensors.insert(name.to_string(), bad);
        candle_core::safetensors::save(&tensors, &file).expect("save");
        for tp in [1, 2] {
            let err = tpinfer_engine::Engine::builder(&path)
                .tp(tp)
                .weight_format(WeightFormat::Fp8)
                .build()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                err.contains(name) && err.contains("NaN or infinite"),
                "{value} in {name} at TP {tp}: {err:?}"
            );
        }
    }
}
