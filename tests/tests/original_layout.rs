//! The text encoder and the VAE as the official Wan checkpoints ship them, `.pth` state dicts in
//! Wan's own names (`tests/fixtures/original-layout`, written by
//! `scripts/reference/reference_original_layout.py` with the wan22 wheel's own `T5Encoder` and
//! `WanVAE_`): read without unpickling code, renamed, and run against the wheel's outputs on
//! the same weights, on CPU ranks at TP 1 to 3. Files that are not such checkpoints are refused
//! by name. (Its `wav2vec2/`, a directory with only `pytorch_model.bin`, is `wav2vec2.rs`'s.)

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_plan::ShardedModel;
use tpinfer_runtime::{DeviceKind, GroupOptions, Launch, RuntimeError, Topology};
use tpinfer_tests::tensor_rel_error;
use tpinfer_umt5::Umt5Model;
use tpinfer_wan_vae::{WanVaeEncoder, WanVaeModel, WanVaeRank, WanVaeShard};
use tpinfer_weights::{PthStore, WeightStore};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/original-layout")
        .join(name)
}

fn reference() -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("reference.safetensors"), &Device::Cpu).expect("reference")
}

/// Rank 0's states of `ids` from Wan's encoder at `pth` on `tp` CPU ranks.
fn encode(pth: &Path, tp: usize, ids: &[u32]) -> Result<Tensor, RuntimeError> {
    let model = Umt5Model::open_original(pth).map_err(|e| RuntimeError::Model(e.to_string()))?;
    let mut launch = Launch::new(Topology::new(tp, &DeviceKind::Cpu)?, GroupOptions::default());
    let placement = model.default_placement();
    let handle = launch.add(Arc::new(model), DType::F32, placement)?;
    let group = launch.start()?;
    let ids = ids.to_vec();
    let states = group.run(move |rank| -> Result<Tensor, RuntimeError> {
        rank.models
            .get_mut(&handle)?
            .encode(&ids)
            .map_err(|e| RuntimeError::of_rank(rank.env.rank, e))
    })?;
    Ok(states[0].clone())
}

/// Wan's T5Encoder, its config read from its shapes (4 heads: TP 3 splits them unevenly), in
/// f32 and as the official bf16 file.
#[test]
fn wans_own_text_encoder_matches_the_wheel() {
    let r = reference();
    let ids: Vec<u32> = r["ids"]
        .to_vec1::<i64>()
        .expect("ids")
        .into_iter()
        .map(|i| i as u32)
        .collect();
    let config = Umt5Model::open_original(&fixture("t5.pth"))
        .expect("open")
        .config()
        .clone();
    assert_eq!(
        (
            config.vocab_size,
            config.d_model,
            config.num_heads,
            config.d_kv,
            config.d_ff
        ),
        (256, 32, 4, 8, 48)
    );
    assert_eq!((config.num_layers, config.relative_attention_num_buckets), (2, 8));
    for tp in 1..=3 {
        let states = encode(&fixture("t5.pth"), tp, &ids).expect("encode");
        let rel = tensor_rel_error(&states, &r["states"]);
        assert!(rel < 1e-5, "TP {tp} against the wheel's T5Encoder: {rel:e}");
    }
    // The bf16 file: the same weights rounded, read as bf16 and run in f32.
    let states = encode(&fixture("t5_bf16.pth"), 2, &ids).expect("encode bf16 file");
    let rel = tensor_rel_error(&states, &r["states"]);
    assert!(rel > 1e-5 && rel < 2e-2, "bf16 weights against the f32 ones: {rel:e}");
}

/// Wan's WanVAE_: its decoder split by rows over ranks, and its encoder, against the wheel's
/// own decode and encode (Wan2_1_VAE's normalisation and clamp).
#[test]
fn wans_own_vae_matches_the_wheel() {
    let r = reference();
    let model = WanVaeModel::open_original(&fixture("vae.pth")).expect("open");
    let (config, store) = (model.config(), model.store().expect("a checkpoint's store"));
    assert_eq!((config.base_dim, config.z_dim), (8, 16));
    let one = decode(config, &**store, &r["latents"], 1);
    let rel = tensor_rel_error(&one, &r["frames"]);
    assert!(rel < 1e-5, "decode against the wheel's: {rel:e}");
    let two = decode(config, &**store, &r["latents"], 2);
    assert!(tensor_rel_error(&two, &one) < 1e-6, "TP 2 against TP 1");
    let encoder = WanVaeEncoder::load(config, &**store, DType::F32, &Device::Cpu).expect("encoder");
    let encoded = encoder.encode(&r["pixels"]).expect("encode");
    let rel = tensor_rel_error(&encoded, &r["encoded"]);
    assert!(rel < 1e-5, "encode against the wheel's: {rel:e}");
}

/// Every rank's band of the decode at TP `tp`, joined: `[3, frames, height, width]`.
fn decode(config: &tpinfer_wan_vae::WanVaeConfig, store: &dyn WeightStore, latents: &Tensor, tp: usize) -> Tensor {
    let bands: Vec<Tensor> = (0..tp)
        .map(|rank| {
            let shard = WanVaeShard::new(tp, rank).expect("shard");
            let vae = WanVaeRank::load(config, store, shard, DType::F32, &Device::Cpu).expect("load");
            vae.decode(latents, None, &mut |_, _| {}).expect("decode").0
        })
        .collect();
    // Bands are `[frames, 3, rows, width]`.
    Tensor::cat(&bands, 2)
        .and_then(|f| f.permute((1, 0, 2, 3)))
        .expect("join")
}

#[test]
fn files_that_are_not_such_checkpoints_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Not a zip archive at all.
    let text = dir.path().join("notes.pth");
    std::fs::write(&text, "not a checkpoint").expect("write");
    let err = PthStore::open(&text).err().expect("text").to_string();
    assert!(
        err.contains("notes.pth") && err.contains("not a PyTorch checkpoint"),
        "{err}"
    );
    // Cut short: the archive's directory, at its end, is gone.
    let cut = dir.path().join("cut.pth");
    let bytes = std::fs::read(fixture("t5.pth")).expect("read");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).expect("write");
    let err = PthStore::open(&cut).err().expect("truncated").to_string();
    assert!(err.contains("cut.pth"), "{err}");
    // Missing.
    let err = PthStore::open(&dir.path().join("absent.pth"))
        .err()
        .expect("missing")
        .to_string();
    assert!(err.contains("absent.pth"), "{err}");
    // A pickle that calls torch's tensor rebuild with no arguments, which candle's reader
    // indexes unchecked (a panic before).
    let short = dir.path().join("short.pth");
    let pickle = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n)Rs.".to_vec();
    let mut archive = zip::ZipWriter::new(std::fs::File::create(&short).expect("create"));
    let stored = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    archive.start_file("archive/data.pkl", stored).expect("entry");
    std::io::Write::write_all(&mut archive, &pickle).expect("pickle");
    archive.finish().expect("finish");
    let err = PthStore::open(&short).err().expect("short rebuild").to_string();
    assert!(err.contains("short.pth") && err.contains("malformed"), "{err}");
    // One model's file given as the other's.
    let err = Umt5Model::open_original(&fixture("vae.pth"))
        .err()
        .expect("a VAE as T5")
        .to_string();
    assert!(err.contains("vae.pth") && err.contains("not Wan's umT5"), "{err}");
    let err = WanVaeModel::open_original(&fixture("t5.pth"))
        .err()
        .expect("T5 as a VAE")
        .to_string();
    assert!(
        err.contains("encoder.conv1.weight") && err.contains("not Wan2.1's VAE"),
        "{err}"
    );
}
