//! LoRA adapters merged into each rank's slices at load, against the same adapter merged into
//! the checkpoint offline (`W + s · B·A` written out here): a tiny Wan DiT at TP 1 to 4, its
//! column-parallel, row-parallel and replicated weights changed; the adapter forms Live
//! Avatar (PEFT), kohya and ComfyUI write (Wan's original names on a diffusers checkpoint and
//! back, each pair's own alpha, whole deltas of biases and norms); adapters that do not fit
//! refused by name.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_tests::{rel_error, run_wan, run_wan_from, wan_inputs, TinyWan};
use tpinfer_wan::WanCheckpoint;
use tpinfer_weights::{LoraAdapter, WeightFormat};

/// The weights the adapter changes, with their `[out, in]` shapes for [`TinyWan::default`]
/// (60 wide, FFN 100): a query and an FFN up projection (split by rows over ranks), an
/// output and an FFN down projection (by columns), the time projection (whole on each rank).
fn targets() -> Vec<(&'static str, [usize; 2])> {
    vec![
        ("blocks.0.attn1.to_q", [60, 60]),
        ("blocks.0.attn1.to_out.0", [60, 60]),
        ("blocks.1.ffn.net.0.proj", [100, 60]),
        ("blocks.1.ffn.net.2", [60, 100]),
        ("condition_embedder.time_proj", [360, 60]),
    ]
}

const RANK: usize = 4;

/// Seeded `A` `[rank, in]` and `B` `[out, rank]` for each target.
fn pairs() -> Vec<(String, Tensor, Tensor)> {
    targets()
        .into_iter()
        .enumerate()
        .map(|(i, (module, [out, inp]))| {
            let seeded = |n: usize, salt: usize| -> Vec<f32> {
                (0..n)
                    .map(|j| (((j * 7919 + i * 104_729 + salt) % 1000) as f32 / 1000.0 - 0.5) * 0.4)
                    .collect()
            };
            let a = Tensor::from_vec(seeded(RANK * inp, 1), (RANK, inp), &Device::Cpu).expect("A");
            let b = Tensor::from_vec(seeded(out * RANK, 2), (out, RANK), &Device::Cpu).expect("B");
            (module.to_string(), a, b)
        })
        .collect()
}

/// The adapter as PEFT saves a model's state dict (Live Avatar's form), with its
/// `adapter_config.json` (alpha 2, rank 4: scale 0.5) beside it.
fn write_peft(dir: &Path) -> std::path::PathBuf {
    let mut tensors = HashMap::new();
    for (module, a, b) in pairs() {
        tensors.insert(format!("base_model.model.{module}.lora_A.default.weight"), a);
        tensors.insert(format!("base_model.model.{module}.lora_B.default.weight"), b);
    }
    let path = dir.join("adapter_model.safetensors");
    candle_core::safetensors::save(&tensors, &path).expect("save adapter");
    std::fs::write(dir.join("adapter_config.json"), r#"{"r": 4, "lora_alpha": 2.0}"#).expect("config");
    path
}

/// The model with `W + 0.5 · B·A` written into its checkpoint.
fn write_merged(model: &TinyWan, dir: &Path) -> std::path::PathBuf {
    let path = model.write(dir);
    let mut tensors = candle_core::safetensors::load(path.join("diffusion_pytorch_model.safetensors"), &Device::Cpu)
        .expect("checkpoint");
    for (module, a, b) in pairs() {
        let name = format!("{module}.weight");
        let merged = (&tensors[&name] + (b.matmul(&a).expect("B·A") * 0.5).expect("scaled")).expect("merged");
        tensors.insert(name, merged);
    }
    candle_core::safetensors::save(&tensors, path.join("diffusion_pytorch_model.safetensors")).expect("save");
    path
}

/// ‖v − reference‖ / ‖reference‖ for the velocity `v` of `base` with `adapter` merged into
/// its slices at load, at TP `tp`.
fn error_at_load(
    base: &Path,
    adapter: &Arc<LoraAdapter>,
    tp: usize,
    (latents, text): (&Tensor, &Tensor),
    reference: &[f32],
) -> f64 {
    let checkpoint = WanCheckpoint::open(base)
        .expect("open")
        .with_lora(adapter.clone())
        .expect("with LoRA");
    let (out, _) = run_wan_from(
        &checkpoint,
        tp,
        DType::F32,
        WeightFormat::AsStored,
        latents,
        text,
        600.0,
    );
    rel_error(&out, reference)
}

#[test]
fn an_adapter_merged_at_load_is_the_merged_checkpoint_at_every_width() {
    let model = TinyWan::default();
    let (base_dir, merged_dir, lora_dir) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let base = model.write(base_dir.path());
    let merged = write_merged(&model, merged_dir.path());
    let adapter = Arc::new(LoraAdapter::open(&write_peft(lora_dir.path()), None).expect("adapter"));
    assert_eq!(adapter.scale_of("blocks.0.attn1.to_q.weight"), Some(0.5));
    assert_eq!(adapter.targets().count(), 5);
    let (latents, text) = wan_inputs(&model, 3, 6, 8, 5);
    let (reference, _) = run_wan(&merged, 1, DType::F32, &latents, &text, 600.0);
    let (without, _) = run_wan(&base, 1, DType::F32, &latents, &text, 600.0);
    assert!(
        rel_error(&without, &reference) > 1e-2,
        "the adapter changes the velocity"
    );
    for tp in 1..=4 {
        let err = error_at_load(&base, &adapter, tp, (&latents, &text), &reference);
        assert!(
            err < 1e-5,
            "TP {tp} with the adapter against the merged checkpoint: {err:e}"
        );
    }
}

/// kohya's names carry alpha in the file: `alpha / rank` is the scale.
#[test]
fn kohya_adapters_carry_their_alpha() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tensors = HashMap::new();
    for (module, a, b) in pairs() {
        tensors.insert(format!("{module}.lora_down.weight"), a);
        tensors.insert(format!("{module}.lora_up.weight"), b);
        tensors.insert(
            format!("{module}.alpha"),
            Tensor::new(&[3f32], &Device::Cpu).expect("alpha"),
        );
    }
    let path = dir.path().join("kohya.safetensors");
    candle_core::safetensors::save(&tensors, &path).expect("save");
    let q = "blocks.0.attn1.to_q.weight";
    assert_eq!(LoraAdapter::open(&path, None).expect("adapter").scale_of(q), Some(0.75));
    assert_eq!(
        LoraAdapter::open(&path, Some(2.0)).expect("adapter").scale_of(q),
        Some(2.0)
    );
}

#[test]
fn adapters_that_do_not_fit_are_refused_by_name() {
    let model = TinyWan::default();
    let (base_dir, lora_dir) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let base = model.write(base_dir.path());
    let checkpoint = WanCheckpoint::open(&base).expect("open");
    let write = |tensors: &HashMap<String, Tensor>| {
        let path = lora_dir.path().join("adapter.safetensors");
        candle_core::safetensors::save(tensors, &path).expect("save");
        path
    };
    let pair = |module: &str, out: usize, inp: usize| {
        HashMap::from([
            (
                format!("{module}.lora_A.weight"),
                Tensor::zeros((RANK, inp), DType::F32, &Device::Cpu).expect("A"),
            ),
            (
                format!("{module}.lora_B.weight"),
                Tensor::zeros((out, RANK), DType::F32, &Device::Cpu).expect("B"),
            ),
        ])
    };
    // A weight this model does not have, and one of another shape.
    for (module, out, inp, named) in [
        ("blocks.7.attn1.to_q", 60, 60, "does not hold"),
        ("blocks.0.attn1.to_q", 64, 60, "makes [64, 60]"),
    ] {
        let adapter = Arc::new(LoraAdapter::open(&write(&pair(module, out, inp)), Some(1.0)).expect("adapter"));
        let err = checkpoint.with_lora(adapter).err().expect("refused").to_string();
        assert!(err.contains(module) && err.contains(named), "{err}");
    }
    // Half a pair; a model's weight, not an adapter; no scale anywhere.
    let mut half = pair("blocks.0.attn1.to_q", 60, 60);
    half.remove("blocks.0.attn1.to_q.lora_B.weight");
    let err = LoraAdapter::open(&write(&half), Some(1.0))
        .expect_err("half")
        .to_string();
    assert!(err.contains("only one half"), "{err}");
    let mut weight = pair("blocks.0.attn1.to_q", 60, 60);
    weight.insert(
        "blocks.0.attn1.to_q.weight".into(),
        Tensor::zeros((60, 60), DType::F32, &Device::Cpu).expect("W"),
    );
    let err = LoraAdapter::open(&write(&weight), Some(1.0))
        .expect_err("weight")
        .to_string();
    assert!(
        err.contains("`blocks.0.attn1.to_q.weight`") && err.contains("no LoRA pair's half"),
        "{err}"
    );
    let err = LoraAdapter::open(&write(&pair("blocks.0.attn1.to_q", 60, 60)), None)
        .expect_err("no scale")
        .to_string();
    assert!(
        err.contains("--lora-scale") && err.contains("blocks.0.attn1.to_q"),
        "{err}"
    );
    // A value that is not a number: a corrupt file, refused before anything merges it.
    let mut poisoned = pair("blocks.0.attn1.to_q", 60, 60);
    let nan = Tensor::full(f32::NAN, (60, RANK), &Device::Cpu).expect("NaN");
    poisoned.insert("blocks.0.attn1.to_q.lora_B.weight".into(), nan);
    let err = LoraAdapter::open(&write(&poisoned), Some(1.0))
        .expect_err("NaN")
        .to_string();
    assert!(err.contains("lora_B") && err.contains("not finite"), "{err}");
}

/// The original Wan code's name of each of [`targets`]' modules, as ComfyUI and kohya name a
/// Wan adapter's changes.
fn original(module: &str) -> &'static str {
    match module {
        "blocks.0.attn1.to_q" => "blocks.0.self_attn.q",
        "blocks.0.attn1.to_out.0" => "blocks.0.self_attn.o",
        "blocks.1.ffn.net.0.proj" => "blocks.1.ffn.0",
        "blocks.1.ffn.net.2" => "blocks.1.ffn.2",
        "condition_embedder.time_proj" => "time_projection.1",
        other => panic!("no original name for {other}"),
    }
}

/// A seeded whole delta of `n` values.
fn delta(n: usize, salt: usize) -> Tensor {
    let values: Vec<f32> = (0..n).map(|j| (((j * 31 + salt) % 17) as f32 - 8.0) * 0.01).collect();
    Tensor::from_vec(values, n, &Device::Cpu).expect("delta")
}

/// Each pair's alpha (rank 4): every pair its own scale, alpha / 4.
fn alpha(i: usize) -> f32 {
    1.0 + i as f32
}

/// The ComfyUI form (`diffusion_model.` before Wan's original names, `lora_down`/`lora_up`,
/// an alpha per pair, whole deltas of the first query's bias and norm), or kohya's
/// (`lora_unet_`, dots as underscores).
fn write_comfy(dir: &Path, kohya: bool) -> std::path::PathBuf {
    let name = |module: &str| match kohya {
        true => format!("lora_unet_{}", module.replace('.', "_")),
        false => format!("diffusion_model.{module}"),
    };
    let mut tensors = HashMap::new();
    for (i, (module, a, b)) in pairs().into_iter().enumerate() {
        let module = name(original(&module));
        tensors.insert(format!("{module}.lora_down.weight"), a);
        tensors.insert(format!("{module}.lora_up.weight"), b);
        tensors.insert(
            format!("{module}.alpha"),
            Tensor::new(&[alpha(i)], &Device::Cpu).expect("alpha"),
        );
    }
    tensors.insert(format!("{}.diff_b", name("blocks.0.self_attn.q")), delta(60, 1));
    tensors.insert(format!("{}.diff", name("blocks.0.self_attn.norm_q")), delta(60, 2));
    let path = dir.join(if kohya {
        "kohya.safetensors"
    } else {
        "comfy.safetensors"
    });
    candle_core::safetensors::save(&tensors, &path).expect("save adapter");
    path
}

/// The model with [`write_comfy`]'s changes written into its checkpoint (diffusers' names).
fn write_comfy_merged(model: &TinyWan, dir: &Path) -> std::path::PathBuf {
    let path = model.write(dir);
    let file = path.join("diffusion_pytorch_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu).expect("checkpoint");
    let mut add = |name: &str, change: Tensor| {
        let merged = (&tensors[name] + change).expect("merged");
        tensors.insert(name.to_string(), merged);
    };
    for (i, (module, a, b)) in pairs().into_iter().enumerate() {
        let scale = alpha(i) as f64 / RANK as f64;
        add(
            &format!("{module}.weight"),
            (b.matmul(&a).expect("B·A") * scale).expect("scaled"),
        );
    }
    add("blocks.0.attn1.to_q.bias", delta(60, 1));
    add("blocks.0.attn1.norm_q.weight", delta(60, 2));
    candle_core::safetensors::save(&tensors, &file).expect("save");
    path
}

/// A Wan adapter as ComfyUI and kohya's tools save it names the weights as the original Wan
/// code does, with a scale per pair and whole deltas beside the pairs; it merges into a
/// checkpoint in diffusers' names as into one in the original names, at every width, as the
/// offline merge of the same changes.
#[test]
fn comfyui_and_kohya_adapters_merge_into_either_naming() {
    let model = TinyWan::default();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().expect("tempdir")).collect();
    let diffusers = model.write(dirs[0].path());
    let original = TinyWan {
        original_names: true,
        ..TinyWan::default()
    }
    .write(dirs[1].path());
    let merged = write_comfy_merged(&model, dirs[2].path());
    let (latents, text) = wan_inputs(&model, 3, 6, 8, 5);
    let (reference, _) = run_wan(&merged, 1, DType::F32, &latents, &text, 600.0);
    let (without, _) = run_wan(&diffusers, 1, DType::F32, &latents, &text, 600.0);
    assert!(
        rel_error(&without, &reference) > 1e-2,
        "the adapter changes the velocity"
    );
    for kohya in [false, true] {
        let adapter = Arc::new(LoraAdapter::open(&write_comfy(dirs[3].path(), kohya), None).expect("adapter"));
        assert_eq!(adapter.targets().count(), 7, "five pairs and two whole deltas");
        for (base, widths) in [(&diffusers, 1..=3), (&original, 2..=2)] {
            for tp in widths {
                let err = error_at_load(base, &adapter, tp, (&latents, &text), &reference);
                assert!(err < 1e-5, "kohya {kohya}, {}, TP {tp}: {err:e}", base.display());
            }
        }
    }
}
