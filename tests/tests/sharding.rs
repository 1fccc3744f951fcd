//! How the model is split: head, FFN and vocabulary shards, and the bytes each rank reads.

use std::sync::Arc;

use candle_core::{DType, Device};
use tpinfer_comm::ThreadGroup;
use tpinfer_layers::{split_aligned, split_evenly, HeadShard};
use tpinfer_llama::{LlamaCheckpoint, LlamaRank, LlamaShard};
use tpinfer_tests::TinyLlama;

fn lens(ranges: &[std::ops::Range<usize>]) -> Vec<usize> {
    ranges.iter().map(|r| r.len()).collect()
}

#[test]
fn heads_split_as_evenly_as_possible() {
    assert_eq!(lens(&split_evenly(32, 5)), vec![7, 7, 6, 6, 6]);
    assert_eq!(lens(&split_evenly(9, 2)), vec![5, 4]);
    assert_eq!(lens(&split_evenly(40, 8)), vec![5; 8]);
}

#[test]
fn ffn_columns_split_on_64_column_boundaries() {
    let wan = split_aligned(13_824, 5);
    assert_eq!(lens(&wan), vec![2816, 2752, 2752, 2752, 2752]);
    assert!(wan.iter().all(|r| r.start % 64 == 0));
    assert_eq!(lens(&split_aligned(14_336, 3)), vec![4800, 4800, 4736]);
    // Too small for 64: the largest alignment that still gives every rank a part.
    assert_eq!(lens(&split_aligned(100, 3)), vec![36, 32, 32]);
    assert_eq!(
        lens(&split_aligned(128_256, 5)),
        vec![25_664, 25_664, 25_664, 25_664, 25_600]
    );
}

#[test]
fn kv_heads_follow_their_q_heads() {
    // Llama-3-8B: 32 Q heads, 8 KV heads (groups of 4), over 5 ranks.
    let shards: Vec<HeadShard> = (0..5).map(|r| HeadShard::new(32, 8, 5, r).expect("shard")).collect();
    assert_eq!(shards[0].q_heads, 0..7);
    assert_eq!(shards[0].kv_heads, 0..2); // heads 4..7 straddle into KV head 1
    assert_eq!(shards[0].kv_of_q, vec![0, 0, 0, 0, 1, 1, 1]);
    assert_eq!(shards[1].q_heads, 7..14);
    assert_eq!(shards[1].kv_heads, 1..4); // KV head 1 is on ranks 0 and 1
    assert_eq!(shards[4].q_heads, 26..32);
    assert_eq!(shards[4].kv_heads, 6..8);
    // TP wider than the KV heads: every rank holds the one KV head it needs (replication).
    let narrow: Vec<HeadShard> = (0..4).map(|r| HeadShard::new(8, 2, 4, r).expect("shard")).collect();
    assert_eq!(
        narrow.iter().map(|s| s.kv_heads.clone()).collect::<Vec<_>>(),
        vec![0..1, 0..1, 1..2, 1..2]
    );
    assert!(HeadShard::new(9, 3, 10, 0).is_err(), "TP above the head count");
}

/// The paged kernel's arithmetic map from query to KV head agrees with the shard's table at
/// every width, cut groups included (32 heads over 5 ranks start rank 1 inside a group).
#[test]
fn query_groups_name_the_same_kv_heads_as_the_table() {
    for (heads, kv_heads) in [(32, 8), (8, 2), (10, 2), (12, 12), (28, 4)] {
        for world in 1..=heads.min(9) {
            for rank in 0..world {
                let shard = HeadShard::new(heads, kv_heads, world, rank).expect("shard");
                let groups = shard.query_groups();
                assert!(groups.offset < groups.group, "{heads}/{kv_heads} at {rank} of {world}");
                let mapped: Vec<u32> = (0..shard.q_heads.len()).map(|h| groups.kv_head(h) as u32).collect();
                assert_eq!(mapped, shard.kv_of_q, "{heads}/{kv_heads} at {rank} of {world}");
            }
        }
    }
    let rank1 = HeadShard::new(32, 8, 5, 1).expect("shard").query_groups();
    assert_eq!((rank1.group, rank1.offset), (4, 3));
}

/// The bytes a rank reads equal its shard's bytes computed from the headers alone.
#[test]
fn each_rank_reads_exactly_its_shard() {
    let model = TinyLlama {
        heads: 10,
        kv_heads: 2,
        intermediate: 100,
        hidden: 80,
        files: 2,
        ..TinyLlama::default()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model.write(dir.path());
    let checkpoint = Arc::new(LlamaCheckpoint::open(&path).expect("open"));
    let full_bytes: usize = model.tensors().iter().map(|(_, _, v)| v.len() * 4).sum();
    for tp in 1..=5 {
        let comms = ThreadGroup::ranks(tp, std::time::Duration::from_secs(30));
        let mut total = 0;
        for comm in comms {
            let rank = tpinfer_comm::Communicator::rank(&comm);
            let shard = LlamaShard::new(&checkpoint.config, tp, rank).expect("shard");
            let planned = checkpoint.shard_bytes(&shard).expect("plan");
            // Loading needs no collective, so ranks can load one after another here.
            let loaded =
                LlamaRank::load(&checkpoint, shard, Arc::new(comm), DType::F32, &Device::Cpu, 64).expect("load");
            assert_eq!(loaded.bytes_loaded(), planned, "TP {tp} rank {rank}");
            if tp > 1 {
                assert!(planned < full_bytes, "TP {tp} rank {rank} must not read everything");
            }
            total += planned;
        }
        match tp {
            1 => assert_eq!(total, full_bytes),
            // Only norms (and KV heads where TP exceeds their count) are read by several ranks.
            _ => assert!(
                total >= full_bytes && total < full_bytes * 13 / 10,
                "TP {tp}: {total} vs {full_bytes}"
            ),
        }
    }
}

/// diffusers names its index `diffusion_pytorch_model.safetensors.index.json`: the store reads
/// the shards it names, and no other safetensors file in the folder (a stray one would add a
/// tensor the checkpoint does not have).
#[test]
fn a_diffusers_index_names_the_shards() {
    use safetensors::tensor::TensorView;
    use tpinfer_weights::{SafetensorsStore, WeightStore};
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes = [0u8; 16];
    let write = |file: &str, name: &str| {
        let view = TensorView::new(safetensors::Dtype::F32, vec![4], &bytes).expect("view");
        safetensors::serialize_to_file([(name, view)], None, &dir.path().join(file)).expect("write");
    };
    write("diffusion_pytorch_model-00001-of-00002.safetensors", "a");
    write("diffusion_pytorch_model-00002-of-00002.safetensors", "b");
    write("stray.safetensors", "c");
    let index = serde_json::json!({"metadata": {}, "weight_map": {
        "a": "diffusion_pytorch_model-00001-of-00002.safetensors",
        "b": "diffusion_pytorch_model-00002-of-00002.safetensors"
    }});
    std::fs::write(
        dir.path().join("diffusion_pytorch_model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    let store = SafetensorsStore::open(dir.path()).expect("open");
    let mut names = store.names();
    names.sort();
    assert_eq!(names, ["a", "b"]);
}
