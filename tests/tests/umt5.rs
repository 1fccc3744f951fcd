//! The umT5 text encoder: TP 1 against an unsharded reference written from T5's definition,
//! every width to 6 (uneven heads at 4 and 5) against TP 1, on the rank group as the video
//! pipeline will run it; its plan, and its bad inputs.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{DeviceProfile, Plan, ShardedModel};
use tpinfer_runtime::{DeviceKind, GroupOptions, Launch, RuntimeError, Topology};
use tpinfer_tests::{tensor_rel_error, TinyUmt5};
use tpinfer_umt5::Umt5Model;

/// A 20-token prompt: past the exact buckets (distance 2) and the largest distance (16).
fn prompt() -> Vec<u32> {
    (0..20).map(|i| (i * 37 + 5) % 96).collect()
}

/// Rank 0's states of `ids` with the encoder at `dir` on `tp` CPU ranks (every rank's are
/// checked equal to rank 0's).
fn encode(dir: &std::path::Path, tp: usize, ids: &[u32]) -> Result<Tensor, RuntimeError> {
    let model = Umt5Model::open(dir).map_err(|e| RuntimeError::Model(e.to_string()))?;
    let mut launch = Launch::new(Topology::new(tp, &DeviceKind::Cpu)?, GroupOptions::default());
    let placement = model.default_placement();
    let handle = launch.add(Arc::new(model), DType::F32, placement)?;
    let group = launch.start()?;
    let ids = ids.to_vec();
    let states = group.run(move |rank| -> Result<Tensor, RuntimeError> {
        let encoder = rank.models.get_mut(&handle)?;
        encoder
            .encode(&ids)
            .map_err(|e| RuntimeError::of_rank(rank.env.rank, e))
    })?;
    for (rank, s) in states.iter().enumerate() {
        assert_eq!(
            tensor_rel_error(s, &states[0]),
            0.0,
            "rank {rank} holds rank 0's states"
        );
    }
    Ok(states[0].clone())
}

#[test]
fn tp_1_matches_an_unsharded_reference_and_every_width_matches_tp_1() {
    let tiny = TinyUmt5::default();
    let dir = tempfile::tempdir().expect("tempdir");
    tiny.write(dir.path());
    let ids = prompt();
    let reference = tiny.reference(&ids);
    let one = encode(dir.path(), 1, &ids).expect("TP 1");
    assert_eq!(one.dims(), [20, 32]);
    let rel = tensor_rel_error(&one, &reference);
    assert!(rel < 1e-5, "TP 1 against the reference: {rel:e}");
    for tp in 2..=6 {
        let states = encode(dir.path(), tp, &ids).expect("encode");
        let rel = tensor_rel_error(&states, &one);
        assert!(rel < 1e-5, "TP {tp} against TP 1: {rel:e}");
    }
}

/// The bias must matter, so that the test above compares something that uses it: without
/// positions, attention is order-free and a reversed prompt's last state would be the
/// prompt's first.
#[test]
fn the_relative_position_bias_shapes_the_states() {
    let tiny = TinyUmt5::default();
    let ids = prompt();
    let reversed: Vec<u32> = ids.iter().rev().copied().collect();
    let forward = tiny.reference(&ids);
    let backward = tiny.reference(&reversed);
    let first = forward.get(0).expect("row");
    let last = backward.get(19).expect("row");
    assert!(tensor_rel_error(&last, &first) > 1e-2);
}

#[test]
fn the_preset_is_umt5_xxl_and_it_shards_by_heads() {
    let xxl = Umt5Model::preset("umt5-xxl").expect("preset");
    let placement = xxl.default_placement();
    let one = Plan::new(&xxl, 1, DType::BF16, placement, DeviceProfile::cuda()).expect("plan");
    // 24 layers of 4 × 4096² attention, 3 × 4096 × 10240 FFN, two norms and a 32 × 64 bias
    // table, the 256,384 × 4096 embedding and the final norm.
    assert_eq!(one.ranks[0].weights / 2, 5_680_910_336);
    let five = Plan::new(&xxl, 5, DType::BF16, placement, DeviceProfile::cuda()).expect("plan");
    let sum: u64 = five.ranks.iter().map(|r| r.weights).sum();
    // Only the norms are replicated: 49 vectors of 4096 on four more ranks.
    assert_eq!(sum - one.ranks[0].weights, 4 * 49 * 4096 * 2);
    assert!(Plan::new(&xxl, 65, DType::BF16, placement, DeviceProfile::cuda()).is_err());
}

#[test]
fn bad_input_is_refused_by_name() {
    let tiny = TinyUmt5::default();
    let dir = tempfile::tempdir().expect("tempdir");
    tiny.write(dir.path());
    let err = encode(dir.path(), 7, &prompt()).expect_err("7 ranks for 6 heads");
    assert!(err.to_string().contains("6 attention heads"), "{err}");
    let err = encode(dir.path(), 2, &[3, 96]).expect_err("id 96 of 96");
    assert!(err.to_string().contains("token id 96"), "{err}");
    let err = encode(dir.path(), 1, &[]).expect_err("no tokens");
    assert!(err.to_string().contains("no tokens"), "{err}");

    let mut config = tiny.config_json();
    config.as_object_mut().expect("object").remove("d_model");
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let err = Umt5Model::open(dir.path()).err().expect("no d_model");
    assert!(
        err.to_string().contains("config.json") && err.to_string().contains("`d_model`"),
        "{err}"
    );

    config["d_model"] = 33.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let err = encode(dir.path(), 1, &prompt()).expect_err("33 is not the checkpoint's width");
    assert!(err.to_string().contains("shared.weight"), "{err}");
}

/// A preset plans but has no weights: the rank group says so instead of loading nothing.
#[test]
fn a_preset_does_not_load() {
    let xxl = Umt5Model::preset("umt5-xxl").expect("preset");
    let mut launch = Launch::new(
        Topology::new(1, &DeviceKind::Cpu).expect("topology"),
        GroupOptions::default(),
    );
    let placement = xxl.default_placement();
    launch.add(Arc::new(xxl), DType::BF16, placement).expect("planned");
    let err = launch.start().err().expect("a preset has no weights");
    assert!(err.to_string().contains("umt5-xxl is a preset"), "{err}");
}
