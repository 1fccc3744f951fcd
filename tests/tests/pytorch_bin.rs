//! A Llama directory that ships PyTorch pickles instead of safetensors (`pytorch_model.bin`,
//! or shards and their index, as older transformers checkpoints do) loads through the pickle
//! reader that runs no code, and gives the safetensors' logits bit for bit at TP 1 and 3; an
//! index that puts a tensor in the wrong shard is refused by name.

use candle_core::DType;
use tpinfer_engine::Engine;
use tpinfer_tests::{run_greedy, Flavor, TinyLlama};

#[test]
fn a_pytorch_model_bin_gives_the_safetensors_logits() {
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 % 250) as u32).collect();
    for model in [
        TinyLlama::default(),
        TinyLlama {
            flavor: Flavor::Qwen2,
            tie_embeddings: true,
            llama3_rope_scaling: false,
            ..TinyLlama::default()
        },
    ] {
        let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().expect("tempdir")).collect();
        let safetensors = model.write(dirs[0].path());
        for (dir, files) in [(&dirs[1], 1), (&dirs[2], 3)] {
            let bin = model.write_torch(dir.path(), files);
            assert!(!bin.join("model.safetensors").exists());
            for tp in [1, 3] {
                let want = run_greedy(&safetensors, tp, DType::F32, &prompt, 4);
                let got = run_greedy(&bin, tp, DType::F32, &prompt, 4);
                assert_eq!(got.logits, want.logits, "{:?}, {files} file(s), TP {tp}", model.flavor);
            }
        }
    }
}

#[test]
fn an_index_that_misplaces_a_tensor_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = TinyLlama::default().write_torch(dir.path(), 2);
    let index = path.join("pytorch_model.bin.index.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).expect("read")).expect("json");
    json["weight_map"]["model.norm.weight"] = "pytorch_model-00001-of-00002.bin".into();
    std::fs::write(&index, json.to_string()).expect("write");
    let err = Engine::builder(&path).build().err().expect("refused").to_string();
    assert!(
        err.contains("pytorch_model.bin.index.json") && err.contains("`model.norm.weight`"),
        "{err}"
    );
}
