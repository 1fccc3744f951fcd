//! GGUF weights kept in their quant blocks: each rank's slice of the blocks, the splits that
//! respect them, and the model they run against its dequantized self and its TP 1 self.

use std::collections::HashMap;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use tpinfer_layers::{split_blocks, split_evenly, HeadShard};
use tpinfer_tests::{argmax, each_rank_holds_its_planned_bytes, rel_error, run_forced, run_greedy, Flavor, TinyLlama};
use tpinfer_weights::{GgufStore, ShardSpec, WeightFormat, WeightStore};

const TYPES: [GgmlDType; 6] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// A GGUF file of one random `[rows, cols]` matrix `w` in `dtype`, opened as a store that
/// names it `w`, and `q` for the same matrix with llama.cpp's rotary rows over `heads`.
fn one_matrix(dir: &tempfile::TempDir, dtype: GgmlDType, rows: usize, cols: usize, heads: usize) -> GgufStore {
    let t = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).expect("randn");
    let q = QTensor::quantize(&t, dtype).expect("quantize");
    let path = dir.path().join(format!("{dtype:?}.gguf"));
    let mut file = std::fs::File::create(&path).expect("create");
    gguf_file::write(&mut file, &[], &[("w", &q)]).expect("write");
    let names = HashMap::from([
        ("w".to_string(), ("w".to_string(), None)),
        ("q".to_string(), ("w".to_string(), Some(heads))),
    ]);
    GgufStore::open(&path).expect("open").with_names(names)
}

/// A quantized slice, expanded to f32 on the CPU.
fn dequantized(store: &GgufStore, name: &str, spec: &ShardSpec) -> Tensor {
    let (slice, _) = store.read_quantized(name, spec).expect("read quantized");
    candle_core::quantized::ggml_file::qtensor_from_ggml(slice.dtype, &slice.bytes, slice.shape, &Device::Cpu)
        .and_then(|q| q.dequantize(&Device::Cpu))
        .expect("dequantize")
}

#[test]
fn every_rank_slice_of_the_blocks_is_the_same_slice_of_the_dequantized_matrix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (rows, cols, heads) = (40, 1280, 4);
    for dtype in TYPES {
        let store = one_matrix(&dir, dtype, rows, cols, heads);
        for tp in 1..=5 {
            let row_parts = split_evenly(rows, tp);
            let col_parts = split_blocks(cols, tp, dtype.block_size()).expect("split");
            for (dim, parts) in [(0, &row_parts), (1, &col_parts)] {
                for part in parts {
                    let spec = ShardSpec::range(dim, part.clone());
                    for name in ["w", "q"] {
                        let (dense, _) = store.read(name, &spec).expect("read");
                        let diff = (dequantized(&store, name, &spec) - dense)
                            .and_then(|d| d.abs()?.flatten_all()?.max(0))
                            .and_then(|m| m.to_scalar::<f32>())
                            .expect("diff");
                        assert_eq!(diff, 0.0, "{dtype:?} {name} TP {tp} {spec:?}");
                    }
                }
            }
        }
        let block = dtype.block_size();
        let err = store
            .read_quantized("w", &ShardSpec::range(1, block / 2..cols))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("do not fall on its blocks"), "{dtype:?}: {err}");
    }
}

#[test]
fn splits_keep_whole_blocks_and_refuse_with_the_widths_that_work() {
    // 14,336 FFN columns in blocks of 256 over 5 ranks: 12, 11, 11, 11, 11 blocks.
    let lens: Vec<usize> = split_blocks(14_336, 5, 256)
        .expect("split")
        .iter()
        .map(|r| r.len())
        .collect();
    assert_eq!(lens, vec![3072, 2816, 2816, 2816, 2816]);
    let err = split_blocks(1536, 7, 256)
        .expect_err("6 blocks over 7 ranks")
        .to_string();
    assert!(err.contains("--tp 6 or less") && err.contains("--dequantize"), "{err}");
    // Blocks of 256 over heads of 128: heads in pairs, so rank 1 of 5 starts at head 8.
    let shard = HeadShard::in_units(32, 8, 5, 1, 2).expect("shard");
    assert_eq!(shard.q_heads, 8..14);
    let err = HeadShard::in_units(32, 8, 17, 0, 2)
        .expect_err("16 pairs over 17 ranks")
        .to_string();
    assert!(err.contains("--tp 16 or less"), "{err}");
}

/// A tiny Llama wide enough for K-quant blocks at TP 5: 20 heads of 64 over 4 KV heads (the
/// attention output's blocks of 256 span 4 heads, five runs of them) and 1,280 FFN columns
/// (five blocks).
fn wide_tiny_llama() -> TinyLlama {
    TinyLlama {
        hidden: 1280,
        intermediate: 1280,
        heads: 20,
        kv_heads: 4,
        head_dim: 64,
        layers: 2,
        ..TinyLlama::default()
    }
}

/// Q4_K_M's mix: Q6_K for V and FFN down, Q4_K for the rest, so V is not joined to Q and K.
/// [`wide_tiny_llama`] written as a Q4_K_M GGUF, opened with its blocks kept, and its one
/// rank's shard at TP 1.
fn wide_q4_k_m_shard() -> (TinyLlama, Vec<tpinfer_llama::LlamaRankShard>) {
    use tpinfer_family::Family;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q4_k_m.gguf");
    let model = wide_tiny_llama();
    model.write_gguf(&path, q4_k_m);
    let family = tpinfer_llama::LlamaModel::open_checkpoint_with(&path, WeightFormat::AsStored).expect("open");
    (model, family.shards(1).expect("shards"))
}

fn q4_k_m(name: &str) -> GgmlDType {
    match name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight") {
        true => GgmlDType::Q6K,
        false => GgmlDType::Q4K,
    }
}

/// A quantized file at TP 1 to 5, its blocks kept, fed TP 1's greedy tokens: every width's
/// logits against the same file dequantized at TP 1. CPU ranks expand the blocks for each
/// product, so the kept path is the dequantized model, sliced by blocks, to f32 rounding.
fn kept_against_dequantized(path: &std::path::Path) {
    let prompt = [1u32, 7, 42, 99, 5, 250];
    let tp1 = run_greedy(path, 1, DType::F32, &prompt, 8);
    let forced = &tp1.tokens[..8];
    let reference = run_forced(path, 1, WeightFormat::Dequantized, &prompt, forced);
    for tp in 1..=5 {
        let logits = run_forced(path, tp, WeightFormat::AsStored, &prompt, forced);
        for (step, values) in logits.iter().enumerate() {
            let err = rel_error(values, &reference[step]);
            assert!(err < 1e-5, "TP {tp} step {step}: {err:e}");
            assert_eq!(argmax(values), tp1.tokens[step], "TP {tp} step {step}");
        }
    }
}

#[test]
fn a_q4_k_m_tiny_llama_at_tp_1_to_5_is_its_dequantized_self() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q4_k_m.gguf");
    wide_tiny_llama().write_gguf(&path, q4_k_m);
    kept_against_dequantized(&path);
}

#[test]
fn a_q8_0_tiny_llama_at_tp_1_to_5_is_its_dequantized_self() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q8_0.gguf");
    wide_tiny_llama().write_gguf(&path, |_| GgmlDType::Q8_0);
    kept_against_dequantized(&path);
}

#[test]
fn a_kept_rank_holds_the_planned_blocks() {
    use tpinfer_llama::LlamaCheckpoint;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q4_k_m.gguf");
    wide_tiny_llama().write_gguf(&path, q4_k_m);
    for quantized in [WeightFormat::AsStored, WeightFormat::Dequantized] {
        let checkpoint = LlamaCheckpoint::open_with(&path, quantized).expect("open");
        each_rank_holds_its_planned_bytes(&checkpoint, &[1, 3, 5], DType::F32, |decls| {
            let kept = decls.iter().filter(|d| d.quant.is_some()).count();
            // As stored: every linear and the LM head.
            let expected = if quantized == WeightFormat::AsStored {
                2 * 7 + 1
            } else {
                0
            };
            assert_eq!(kept, expected, "{quantized:?}");
        });
    }
}

#[test]
fn a_gguf_with_rope_freqs_runs_as_its_llama3_scaled_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default();
    assert!(model.llama3_rope_scaling);
    let hf = model.write(&dir.path().join("hf"));
    let gguf = dir.path().join("model.gguf");
    model.write_gguf(&gguf, |_| GgmlDType::F32);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    for tp in [1, 3] {
        let reference = run_greedy(&hf, tp, DType::F32, &prompt, 4);
        let trace = run_greedy(&gguf, tp, DType::F32, &prompt, 4);
        assert_eq!(trace.tokens, reference.tokens, "TP {tp}");
        for (step, logits) in trace.logits.iter().enumerate() {
            let err = rel_error(logits, &reference.logits[step]);
            assert!(err < 1e-5, "TP {tp} step {step}: {err:e}");
        }
    }
}

#[test]
fn a_rope_freqs_of_the_wrong_length_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.gguf");
    TinyLlama::default().write_gguf(&path, |_| GgmlDType::F32);
    let mut file = std::fs::File::open(&path).expect("open");
    let content = gguf_file::Content::read(&mut file).expect("read");
    let mut tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .filter(|name| *name != "rope_freqs.weight")
        .map(|name| {
            (
                name.clone(),
                content.tensor(&mut file, name, &Device::Cpu).expect("tensor"),
            )
        })
        .collect();
    let short = Tensor::ones(3, DType::F32, &Device::Cpu).expect("ones");
    tensors.push((
        "rope_freqs.weight".into(),
        QTensor::quantize(&short, GgmlDType::F32).expect("q"),
    ));
    let meta: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bad = dir.path().join("short-rope-freqs.gguf");
    gguf_file::write(&mut std::fs::File::create(&bad).expect("create"), &meta, &refs).expect("write");
    let err = tpinfer_llama::LlamaCheckpoint::open(&bad)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("rope_freqs.weight") && err.contains("must hold 4 positive divisors"),
        "{err}"
    );
}

/// A checkpoint written as a GGUF file by tpinfer (llama.cpp's names, Q/K row order, metadata
/// and Llama 3.1 scaling as rope_freqs) runs as the checkpoint itself, and the engine reads
/// the tokenizer.json beside a GGUF file that carries none.
#[test]
fn a_checkpoint_written_as_gguf_runs_as_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default();
    let hf = model.write(&dir.path().join("hf"));
    let gguf = hf.join("model.gguf");
    let checkpoint = tpinfer_llama::LlamaCheckpoint::open(&hf).expect("open");
    checkpoint.write_gguf(&gguf, &|_| GgmlDType::F32).expect("write gguf");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    for tp in [1, 3] {
        let reference = run_greedy(&hf, tp, DType::F32, &prompt, 4);
        let trace = run_greedy(&gguf, tp, DType::F32, &prompt, 4);
        for (step, logits) in trace.logits.iter().enumerate() {
            let err = rel_error(logits, &reference.logits[step]);
            assert!(err < 1e-5, "TP {tp} step {step}: {err:e}");
        }
    }
    let engine = tpinfer_engine::Engine::builder(&gguf).build().expect("engine");
    let request = tpinfer_engine::GenerateRequest::new(tpinfer_engine::Prompt::text("abc"), 3);
    let (_, ids, _) = engine
        .generate(request)
        .expect("generate")
        .collect_text()
        .expect("stream");
    assert!(!ids.is_empty());
}

/// A Qwen2 or Qwen3 GGUF as llama.cpp writes it (architecture `qwen2` or `qwen3`: its
/// metadata keys, Q and K rows unpermuted, Qwen2's Q/K/V biases, Qwen3's Q/K norms) runs as
/// its safetensors checkpoint at TP 1 and 3, and in Q4_K_M blocks kept as stored as its
/// dequantized self at TP 1 to 5; tpinfer's own writer gives a file that runs the same.
#[test]
fn qwen_ggufs_run_as_their_checkpoints() {
    for flavor in [Flavor::Qwen2, Flavor::Qwen3] {
        qwen_gguf_runs_as_its_checkpoint(flavor);
    }
}

fn qwen_gguf_runs_as_its_checkpoint(flavor: Flavor) {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama {
        flavor,
        llama3_rope_scaling: false,
        ..TinyLlama::default()
    };
    let hf = model.write(&dir.path().join("hf"));
    let gguf = dir.path().join("qwen2.gguf");
    model.write_gguf(&gguf, |_| GgmlDType::F32);
    let config = tpinfer_llama::LlamaCheckpoint::open(&gguf).expect("open").config;
    assert_eq!(
        (config.qkv_bias, config.o_bias, config.qk_norm),
        (flavor == Flavor::Qwen2, false, flavor == Flavor::Qwen3)
    );
    let written = dir.path().join("written.gguf");
    tpinfer_llama::LlamaCheckpoint::open(&hf)
        .expect("open")
        .write_gguf(&written, &|_| GgmlDType::F32)
        .expect("write gguf");

    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    for tp in [1, 3] {
        let reference = run_greedy(&hf, tp, DType::F32, &prompt, 4);
        for file in [&gguf, &written] {
            let trace = run_greedy(file, tp, DType::F32, &prompt, 4);
            assert_eq!(trace.tokens, reference.tokens, "{flavor:?} TP {tp}, {}", file.display());
            for (step, logits) in trace.logits.iter().enumerate() {
                let err = rel_error(logits, &reference.logits[step]);
                assert!(
                    err < 1e-5,
                    "{flavor:?} TP {tp} step {step}, {}: {err:e}",
                    file.display()
                );
            }
        }
    }
    // Q4_K_M blocks kept as stored equal their dequantized self at TP 1 to 5 (a model wide
    // enough for 256-value blocks at every width).
    let q4 = dir.path().join("q4_k_m.gguf");
    TinyLlama {
        flavor,
        llama3_rope_scaling: false,
        ..wide_tiny_llama()
    }
    .write_gguf(&q4, q4_k_m);
    kept_against_dequantized(&q4);
}

/// In Q4_K_M, Q and K (Q4_K) stack into one weight and V (Q6_K) stays apart: one product
/// fewer a layer, each activation quantization to Q8_1 with it. The joined blocks expand to
/// Q's rows, then K's.
#[test]
fn q4_k_m_joins_q_and_k_and_keeps_v_apart() {
    use tpinfer_llama::{LlamaCheckpoint, LlamaShard};
    use tpinfer_weights::{ShardLoader, Weight};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q4_k_m.gguf");
    wide_tiny_llama().write_gguf(&path, q4_k_m);
    let checkpoint = LlamaCheckpoint::open_with(&path, WeightFormat::AsStored).expect("open");
    let shard = LlamaShard::new(&checkpoint.config, 2, 1).expect("shard");
    let decls = checkpoint.weight_decls(&shard);
    let names = ["q_proj", "k_proj", "v_proj"].map(|p| format!("model.layers.0.self_attn.{p}.weight"));
    let names = names.each_ref().map(String::as_str);
    let expand = |w: &Weight| match w {
        Weight::Quantized(q) => q.dequantize(&Device::Cpu).expect("dequantize"),
        _ => panic!("a dense or FP8 weight where GGML blocks were kept"),
    };
    let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
    let mut apart = ShardLoader::new(&*checkpoint.store, &decls, DType::F32, &Device::Cpu);
    let separate = names.map(|n| expand(&apart.take_weight(n).expect("take")));
    let mut joined = ShardLoader::new(&*checkpoint.store, &decls, DType::F32, &Device::Cpu);
    let stacked = joined.take_stacked(&names).expect("stack");
    let runs: Vec<_> = stacked.iter().map(|(_, run)| run.clone()).collect();
    assert_eq!(runs, [0..2, 2..3]);
    let qk = Tensor::cat(&separate[..2], 0).expect("cat");
    assert_eq!(flat(&expand(&stacked[0].0)), flat(&qk));
    assert_eq!(flat(&expand(&stacked[1].0)), flat(&separate[2]));
}

/// A GGML rank's plan on CUDA counts what candle's MMQ kernels take for a prompt of more than
/// 8 rows: the largest product's f32 input and output, the Q8_1 workspace and the 16 MiB
/// stream-k fixup buffer. A decode step's 8 rows or fewer run MMVQ, with none of it; nor does
/// an f32 run copy its input and output.
#[test]
fn a_ggml_rank_plans_candles_mmq_copies_and_workspaces_on_cuda() {
    use tpinfer_plan::Accelerator;
    let (model, shards) = wide_q4_k_m_shard();
    let bytes = |dtype, accelerator, rows| shards[0].quantized_product_bytes(dtype, accelerator, rows);
    assert_eq!(bytes(DType::BF16, Accelerator::Cuda, 8), 0);
    let (rows, fixup) = (128, 16 << 20);
    // The fused gate/up is the widest: its f32 input and output.
    let gate_up = rows * (model.hidden + 2 * model.intermediate) * 4;
    let bf16 = bytes(DType::BF16, Accelerator::Cuda, rows);
    assert!(bf16 > fixup + gate_up, "{bf16}");
    assert!(bf16 < fixup + gate_up + rows * model.intermediate * 2, "{bf16}");
    let f32 = bytes(DType::F32, Accelerator::Cuda, rows);
    assert_eq!(bf16 - f32, gate_up);
    // CPU ranks expand the blocks instead: the largest merged weight in f32, then in bf16.
    let expanded = 2 * model.intermediate * model.hidden * (4 + 2);
    assert_eq!(bytes(DType::BF16, Accelerator::Cpu, rows), expanded);
}

/// A GGML rank on CUDA keeps one Q8_1 row for each product of its decode step (candle's row,
/// padded to 512 values, 36 bytes a block of 32), and its plan counts one per GGML matrix.
#[test]
fn a_ggml_rank_plans_a_q8_1_row_per_product_on_cuda() {
    use tpinfer_plan::{Accelerator, RankShard};
    use tpinfer_weights::Quant;
    let (model, shards) = wide_q4_k_m_shard();
    let decls = shards[0].weight_decls();
    let matrices = |name: &str| {
        decls
            .iter()
            .filter(|d| matches!(d.quant, Some(Quant::Ggml(_))) && d.shape.len() == 2 && d.name.contains(name))
            .count()
    };
    // Q, K, V, O, gate, up and down in each of the 2 layers; every input is 1,280 wide here,
    // a row of 1,536 padded values.
    assert_eq!(matrices("layers."), 7 * model.layers);
    let row = 1536 / 32 * 36;
    let others = decls
        .iter()
        .filter(|d| matches!(d.quant, Some(Quant::Ggml(_))) && !d.name.contains("layers."))
        .map(|d| d.shape[1].next_multiple_of(512) / 32 * 36)
        .sum::<usize>();
    assert_eq!(tpinfer_layers::mmvq_row_bytes(decls), 7 * model.layers * row + others);
    // In f32 (no flash attention, so no captured step's buffers on either) a CUDA rank's
    // buffers are a CPU rank's and the rows, allocated at load.
    let placement = tpinfer_plan::Placement::llm(256, 1);
    let footprint = |accelerator| {
        shards[0]
            .footprint(DType::F32, placement, accelerator)
            .expect("footprint")
    };
    let (cuda, cpu) = (footprint(Accelerator::Cuda), footprint(Accelerator::Cpu));
    assert_eq!(cuda.buffers - cpu.buffers, tpinfer_layers::mmvq_row_bytes(decls) as u64);
    assert_eq!(cuda.at_load - cpu.at_load, cuda.buffers - cpu.buffers);
}

/// A GGUF of an architecture tpinfer does not read is refused, naming it and those it reads.
#[test]
fn a_gguf_of_another_architecture_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.gguf");
    TinyLlama::default().write_gguf(&path, |_| GgmlDType::F32);
    let mut file = std::fs::File::open(&path).expect("open");
    let content = gguf_file::Content::read(&mut file).expect("read");
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            (
                name.clone(),
                content.tensor(&mut file, name, &Device::Cpu).expect("tensor"),
            )
        })
        .collect();
    let mut metadata = content.metadata.clone();
    metadata.insert("general.architecture".into(), gguf_file::Value::String("phi3".into()));
    let meta: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let other = dir.path().join("phi3.gguf");
    gguf_file::write(&mut std::fs::File::create(&other).expect("create"), &meta, &refs).expect("write");
    let err = tpinfer_llama::LlamaCheckpoint::open(&other)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("`phi3`") && err.contains("llama, qwen2"), "{err}");
}

/// A Qwen2 checkpoint with YaRN (`rope_scaling.type = yarn`, as Qwen2.5's long-context
/// config adds it) reaches its original context times the factor, runs differently from the
/// same weights without it, and runs the same from a GGUF file that carries it as llama.cpp's
/// `rope.scaling.*` keys, at TP 1 and 3.
#[test]
fn a_yarn_scaled_qwen2_runs_the_same_from_its_gguf_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama {
        flavor: Flavor::Qwen2,
        llama3_rope_scaling: false,
        ..TinyLlama::default()
    };
    let plain = model.write(&dir.path().join("plain"));
    let hf = model.write(&dir.path().join("yarn"));
    let config_path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("read")).expect("json");
    config["rope_scaling"] =
        serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256});
    std::fs::write(&config_path, config.to_string()).expect("write config");
    let checkpoint = tpinfer_llama::LlamaCheckpoint::open(&hf).expect("open");
    assert_eq!(checkpoint.config.max_position_embeddings, 1024);
    let gguf = dir.path().join("yarn.gguf");
    checkpoint.write_gguf(&gguf, &|_| GgmlDType::F32).expect("write gguf");
    let read_back = tpinfer_llama::LlamaCheckpoint::open(&gguf).expect("open gguf");
    assert_eq!(read_back.config.rope_scaling, checkpoint.config.rope_scaling);
    assert_eq!(read_back.config.max_position_embeddings, 1024);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    let unscaled = run_greedy(&plain, 1, DType::F32, &prompt, 1);
    for tp in [1, 3] {
        let reference = run_greedy(&hf, tp, DType::F32, &prompt, 4);
        let err = rel_error(&reference.logits[0], &unscaled.logits[0]);
        assert!(err > 1e-3, "TP {tp}: YaRN changed nothing ({err:e})");
        let trace = run_greedy(&gguf, tp, DType::F32, &prompt, 4);
        assert_eq!(trace.tokens, reference.tokens, "TP {tp}");
        for (step, logits) in trace.logits.iter().enumerate() {
            let err = rel_error(logits, &reference.logits[step]);
            assert!(err < 1e-5, "TP {tp} step {step}: {err:e}");
        }
    }
}
