//! The Wan VAE decoder against an unsplit whole-video reference, and split by rows over
//! ranks and tiles against itself unsplit; its config and checkpoint refused by name. The
//! encoder against diffusers' `AutoencoderKLWan.encode` (`tests/fixtures/vae-encoder`,
//! written by `scripts/reference/reference_vae_encoder.py`).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{Accelerator, Placement, ShardedModel};
use tpinfer_tests::{reference_vae_decode, tensor_rel_error, vae_latents, TinyWanVae};
use tpinfer_wan_vae::memory::Tiling;
use tpinfer_wan_vae::{WanVaeConfig, WanVaeEncoder, WanVaeModel, WanVaeRank, WanVaeShard};
use tpinfer_weights::SafetensorsStore;

/// Latents of 3 frames (9 decoded) of 6 × 5 (48 × 40 pixels).
fn latents(vae: &TinyWanVae) -> Tensor {
    vae_latents(vae.z_dim, 3, 6, 5, 7)
}

/// Every rank's band of `latents` decoded at TP `tp`, split as `tile` says, joined.
fn decode_split(dir: &std::path::Path, latents: &Tensor, tp: usize, tile: Option<Tiling>) -> Tensor {
    let config = WanVaeConfig::from_dir(dir).expect("config");
    let store = SafetensorsStore::open(dir).expect("store");
    let bands: Vec<Tensor> = (0..tp)
        .map(|rank| {
            let shard = WanVaeShard::new(tp, rank).expect("shard");
            let vae = WanVaeRank::load(&config, &store, shard, DType::F32, &Device::Cpu).expect("load");
            let mut chunks = Vec::new();
            let (pixels, first_row) = vae
                .decode(latents, tile, &mut |done, total| chunks.push((done, total)))
                .expect("decode");
            let expected = shard.band(&config, latents.dim(2).expect("h") * 8).expect("band");
            assert_eq!(first_row, expected.start);
            assert_eq!(pixels.dim(2).expect("rows"), expected.len());
            // Every (tile, latent frame) reported, in order, ending at the total.
            let total = chunks.last().expect("progress").1;
            assert_eq!(chunks, (1..=total).map(|d| (d, total)).collect::<Vec<_>>());
            pixels
        })
        .collect();
    Tensor::cat(&bands, 2).expect("join bands")
}

#[test]
fn decoder_matches_the_whole_video_reference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vae = TinyWanVae::default();
    let path = vae.write(dir.path());
    let latents = latents(&vae);
    let reference = reference_vae_decode(&path, &latents);
    assert_eq!(reference.dims(), [9, 3, 48, 40], "1 + 4 × 2 frames of 8× the latents");
    let ours = decode_split(&path, &latents, 1, Some(tiling(48, 4)));
    assert_eq!(ours.dims(), reference.dims());
    let err = tensor_rel_error(&ours, &reference);
    assert!(err < 1e-5, "the VAE decode against the reference: rel {err:.3e}");
    // The pixels are not saturated: the comparison sees the network, not the clamp.
    let inside = reference
        .abs()
        .and_then(|a| a.lt(0.99))
        .and_then(|m| m.to_dtype(DType::F32));
    let inside = inside
        .and_then(|m| m.mean_all())
        .and_then(|m| m.to_scalar::<f32>())
        .expect("mean");
    assert!(inside > 0.5, "only {inside} of the pixels are inside the clamp");
}

#[test]
fn bands_and_tiles_join_into_the_unsplit_decode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vae = TinyWanVae::default();
    let path = vae.write(dir.path());
    let latents = latents(&vae);
    let whole = decode_split(&path, &latents, 1, Some(tiling(48, 4)));
    // Uneven bands (6 latent rows over 4 ranks: 2, 2, 1, 1), tiles of one latent row, tiles
    // that do not divide the band, and the full-rate layers a frame or three at a time (three
    // does not divide a chunk's four).
    for (tp, tile) in [
        (2, None),
        (3, Some(tiling(8, 4))),
        (4, Some(tiling(8, 1))),
        (1, Some(tiling(16, 2))),
        (2, Some(tiling(16, 3))),
        (1, Some(tiling(48, 1))),
        (6, None),
    ] {
        let split = decode_split(&path, &latents, tp, tile);
        let err = tensor_rel_error(&split, &whole);
        assert!(
            err < 1e-6,
            "TP {tp}, split as {tile:?} against the unsplit decode: rel {err:.3e}"
        );
    }
}

fn tiling(rows: usize, frames: usize) -> Tiling {
    Tiling { rows, frames }
}

#[test]
/// Half precision on CPU ranks is f16 (candle's CPU GEMM has no bf16); the GPU host checks
/// bf16 against diffusers.
fn f16_decode_stays_near_f32() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vae = TinyWanVae::default();
    let path = vae.write(dir.path());
    let latents = latents(&vae);
    let reference = reference_vae_decode(&path, &latents);
    let config = WanVaeConfig::from_dir(&path).expect("config");
    let store = SafetensorsStore::open(&path).expect("store");
    let shard = WanVaeShard::new(2, 1).expect("shard");
    let vae = WanVaeRank::load(&config, &store, shard, DType::F16, &Device::Cpu).expect("load");
    let (pixels, first) = vae
        .decode(&latents, Some(tiling(8, 2)), &mut |_, _| {})
        .expect("decode");
    let reference = reference.narrow(2, first, pixels.dim(2).expect("rows")).expect("band");
    let err = tensor_rel_error(&pixels, &reference);
    assert!(err > 0.0 && err < 2e-2, "f16 against the f32 reference: rel {err:.3e}");
}

#[test]
fn vae_configs_are_refused_by_field() {
    let base = r#""_class_name": "AutoencoderKLWan", "z_dim": 16"#;
    for (extra, named) in [
        (r#", "is_residual": true"#, "is_residual"),
        (r#", "patch_size": 2"#, "patch_size"),
        (r#", "base_dim": "96""#, "base_dim"),
        (r#", "base_dim": 0"#, "base_dim"),
        (r#", "dim_mult": [1, 2, "4", 4]"#, "dim_mult"),
        (r#", "dim_mult": []"#, "dim_mult"),
        (r#", "temperal_downsample": [false, true]"#, "temperal_downsample"),
        (r#", "temperal_downsample": [false, 1, true]"#, "temperal_downsample"),
        (r#", "latents_std": [1.0, 2.0]"#, "latents_std"),
        (r#", "num_res_blocks": 1000000000"#, "num_res_blocks"),
        (
            r#", "base_dim": 3, "dim_mult": [1], "temperal_downsample": []"#,
            "base_dim",
        ),
    ] {
        let text = format!("{{{base}{extra}}}");
        let err = WanVaeConfig::from_json(&text, "vae/config.json").expect_err(extra);
        let message = err.to_string();
        assert!(
            message.contains(named) && message.contains("vae/config.json"),
            "{extra}: {message}"
        );
    }
    let mut std = vec!["1.0"; 16];
    std[3] = "0.0";
    let text = format!("{{{base}, \"latents_std\": [{}]}}", std.join(", "));
    let err = WanVaeConfig::from_json(&text, "c").expect_err("zero std");
    assert!(err.to_string().contains("above 0"), "{err}");
    let wan21 = WanVaeConfig::from_json(&format!("{{{base}}}"), "c").expect("defaults");
    assert_eq!(wan21, WanVaeConfig::wan21());
}

#[test]
fn the_checkpoint_is_checked_and_the_plan_refuses_what_cannot_split() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vae = TinyWanVae::default();
    let path = vae.write(dir.path());
    let model = Arc::new(WanVaeModel::open(&path).expect("open"));
    // The encoder's tensors are present and left alone.
    for shard in model.shards(2).expect("shards") {
        model
            .check(tpinfer_plan::RankShard::weight_decls(&shard))
            .expect("check");
    }
    // An absurd width is refused before a shard is made (it allocated one per rank, and
    // aborted the process; found by tests/tests/fuzz.rs).
    let err = model.shards(usize::MAX).err().expect("refused");
    assert!(err.to_string().contains("--tp 2048 or less"), "{err}");
    // Latent rows are the unit of the split: 6 of them (48 pixels) take at most 6 ranks.
    let placement = |height| Placement::Dit {
        frames: 9,
        width: 40,
        height,
        cfg: false,
    };
    let shards = model.shards(7).expect("shards");
    let err = tpinfer_plan::RankShard::footprint(&shards[0], DType::F32, placement(48), Accelerator::Cpu)
        .expect_err("7 ranks over 6 latent rows");
    assert!(err.to_string().contains("at most 6"), "{err}");
    let err = tpinfer_plan::RankShard::footprint(&shards[0], DType::F32, placement(44), Accelerator::Cpu)
        .expect_err("44 rows");
    assert!(err.to_string().contains("multiples of 8"), "{err}");
    // A decoder tensor missing from the checkpoint is named.
    let other = tempfile::tempdir().expect("tempdir");
    let smaller = TinyWanVae {
        num_res_blocks: 2,
        ..vae.clone()
    };
    std::fs::copy(
        path.join("diffusion_pytorch_model.safetensors"),
        other.path().join("model.safetensors"),
    )
    .expect("copy");
    let config = serde_json::to_string(&serde_json::json!({
        "_class_name": "AutoencoderKLWan", "base_dim": smaller.base_dim, "z_dim": smaller.z_dim,
        "num_res_blocks": 2, "latents_mean": smaller.config().latents_mean, "latents_std": smaller.config().latents_std
    }))
    .expect("json");
    std::fs::write(other.path().join("config.json"), config).expect("config");
    let wrong = WanVaeModel::open(other.path()).expect("open");
    let shards = wrong.shards(1).expect("shards");
    let err = wrong
        .check(tpinfer_plan::RankShard::weight_decls(&shards[0]))
        .expect_err("a res block too many");
    assert!(err.to_string().contains("decoder.up_blocks.0.resnets.2"), "{err}");
}

/// Frames that come out of the VAE not finite stop the decode by name: the clamp kept NaN,
/// which the 8-bit conversion turned into black pixels without a word (issue #31). Finite
/// weights of 1e38 overflow a convolution, and the norm after it makes NaN of the infinities.
#[test]
fn frames_that_are_not_finite_stop_the_decode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vae = TinyWanVae::default();
    let path = vae.write(dir.path());
    let weights = path.join("diffusion_pytorch_model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).expect("load");
    let name = "decoder.up_blocks.0.resnets.0.conv1.weight";
    let huge = (tensors[name].ones_like().expect("ones") * 1e38).expect("huge");
    tensors.insert(name.into(), huge);
    candle_core::safetensors::save(&tensors, &weights).expect("save");
    let latents = latents(&vae);
    let shape = tpinfer_engine::VaeEngine::video_shape(&path, 3, 6, 5).expect("shape");
    let engine =
        tpinfer_engine::VaeEngine::start(tpinfer_engine::EngineBuilder::new(&path).tp(2), shape).expect("start");
    let err = engine.decode(&latents, |_, _| {}).expect_err("NaN frames");
    assert!(
        err.to_string()
            .contains("frames hold NaN or infinite values after the VAE's decode"),
        "{err}"
    );
}

/// The encoder on the same tiny random VAE as diffusers' `AutoencoderKLWan.encode`, the
/// posterior's mode normalised as S2V hands it to the DiT: a 9-frame video (the first frame
/// alone, then two chunks of four through the causal caches and both time halvings) and a
/// single image (S2V's reference), in f32. Inputs it cannot encode are refused by name.
#[test]
fn the_encoder_matches_diffusers() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vae-encoder");
    let config = WanVaeConfig::from_dir(&fixture.join("model")).expect("config");
    let store = SafetensorsStore::open(&fixture.join("model")).expect("store");
    let encoder = WanVaeEncoder::load(&config, &store, DType::F32, &Device::Cpu).expect("load");
    let cases = candle_core::safetensors::load(fixture.join("cases.safetensors"), &Device::Cpu).expect("cases");
    for name in ["video", "image"] {
        let got = encoder.encode(&cases[&format!("{name}_pixels")]).expect("encode");
        let want = &cases[&format!("{name}_latents")];
        assert_eq!(got.dims(), want.dims(), "{name}");
        let rel = tensor_rel_error(&got, want);
        assert!(rel < 1e-5, "{name} against diffusers: {rel:e}");
    }
    let video = &cases["video_pixels"];
    for (pixels, named) in [
        (video.narrow(1, 0, 8).expect("8 frames"), "1 + 4k frames"),
        (video.narrow(2, 0, 20).expect("20 rows"), "multiples of 8"),
        (video.narrow(0, 0, 2).expect("2 channels"), "[3, 1 + 4k frames"),
    ] {
        let err = encoder.encode(&pixels).expect_err(named).to_string();
        assert!(err.contains(named), "{:?}: {err}", pixels.dims());
    }
}
