//! Fixtures for tpinfer's tests and CPU benchmarks: tiny Llama models written in the real
//! formats (`config.json`, `model.safetensors`, `tokenizer.json`), and a runner that drives a
//! model's ranks on threads exactly as the engine does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use tpinfer_comm::{Communicator, ThreadGroup};
use tpinfer_llama::{LlamaCheckpoint, LlamaRank, LlamaShard};
use tpinfer_weights::WeightFormat;

mod fake_hub;
mod gguf;
mod pipeline;
mod torch_save;
mod umt5;
mod vae;
mod wan;
pub use fake_hub::FakeHub;
pub use pipeline::{TinyWanPipeline, END_OF_TEXT};
pub use torch_save::write_torch_save;
pub use umt5::TinyUmt5;
pub use vae::{reference_vae_decode, vae_latents, TinyWanVae};
pub use wan::{open_wan, run_wan, run_wan_as, run_wan_from, wan_inputs, TinyWan};

/// The shape of a tiny Llama.
#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub tie_embeddings: bool,
    pub llama3_rope_scaling: bool,
    /// Q/K/V/O biases (`attention_bias`), as some Llama derivatives have.
    pub attention_bias: bool,
    /// The Llama-architecture family whose `config.json` it writes.
    pub flavor: Flavor,
    /// Write `config.json` in the transformers-5 form (`rope_parameters`, `dtype`).
    pub transformers5: bool,
    /// Split the weights over this many safetensors files with an index (1: `model.safetensors`).
    pub files: usize,
    pub seed: u64,
}

impl Default for TinyLlama {
    /// 8 heads over 4 KV heads, 2 layers; at TP 3 the head split (3, 3, 2) makes a GQA group
    /// straddle ranks and the FFN split (32, 32, 32 of 96) is aligned.
    fn default() -> Self {
        Self {
            hidden: 64,
            intermediate: 96,
            layers: 2,
            heads: 8,
            kv_heads: 4,
            head_dim: 8,
            vocab: 320,
            tie_embeddings: false,
            llama3_rope_scaling: true,
            attention_bias: false,
            flavor: Flavor::Llama,
            transformers5: false,
            files: 1,
            seed: 7,
        }
    }
}

/// Which Llama-architecture family a [`TinyLlama`] is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Llama,
    /// `Qwen2ForCausalLM`: biases on Q, K and V (not O), its sliding window off.
    Qwen2,
    /// `Qwen3ForCausalLM`: an RMSNorm over each query and key head (`q_norm`, `k_norm`), no
    /// biases.
    Qwen3,
    /// `MistralForCausalLM` with this `sliding_window` (`null` when `None`).
    Mistral(Option<usize>),
}

/// Token ids of the tiny tokenizer's special tokens.
pub const BOS: u32 = 256;
pub const EOS: u32 = 257;
pub const EOT: u32 = 258;

impl TinyLlama {
    /// Writes the model into `dir` and returns `dir`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).expect("create model dir");
        std::fs::write(dir.join("config.json"), self.config_json().to_string()).expect("write config");
        std::fs::write(
            dir.join("generation_config.json"),
            json!({"bos_token_id": BOS, "eos_token_id": [EOS, EOT]}).to_string(),
        )
        .expect("write generation config");
        self.write_weights(dir);
        write_tokenizer(dir);
        dir.to_path_buf()
    }

    /// [`Self::write`] with the weights as an older transformers checkpoint ships them:
    /// `pytorch_model.bin` (`torch.save`), or `files` shards and their index.
    pub fn write_torch(&self, dir: &Path, files: usize) -> PathBuf {
        self.write(dir);
        std::fs::remove_file(dir.join("model.safetensors")).expect("rm safetensors");
        let tensors = self.tensors();
        let per_file = tensors.len().div_ceil(files);
        let mut weight_map = serde_json::Map::new();
        for (i, chunk) in tensors.chunks(per_file).enumerate() {
            let file = match files {
                1 => "pytorch_model.bin".to_string(),
                n => format!("pytorch_model-{:05}-of-{n:05}.bin", i + 1),
            };
            for (name, _, _) in chunk {
                weight_map.insert(name.clone(), json!(file));
            }
            write_torch_save(&dir.join(&file), chunk);
        }
        if files > 1 {
            let index = json!({"metadata": {}, "weight_map": weight_map});
            std::fs::write(dir.join("pytorch_model.bin.index.json"), index.to_string()).expect("write index");
        }
        dir.to_path_buf()
    }

    pub fn config_json(&self) -> serde_json::Value {
        let scaling = json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64
        });
        let mut config = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 512,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
        });
        let obj = config.as_object_mut().expect("object");
        match self.flavor {
            Flavor::Llama => {}
            Flavor::Qwen2 => {
                obj.insert("architectures".into(), json!(["Qwen2ForCausalLM"]));
                obj.insert("model_type".into(), json!("qwen2"));
                obj.remove("attention_bias");
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), json!(4096));
                obj.insert("max_window_layers".into(), json!(self.layers));
                obj.insert("hidden_act".into(), json!("silu"));
            }
            Flavor::Qwen3 => {
                obj.insert("architectures".into(), json!(["Qwen3ForCausalLM"]));
                obj.insert("model_type".into(), json!("qwen3"));
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), json!(null));
                obj.insert("max_window_layers".into(), json!(self.layers));
                obj.insert("hidden_act".into(), json!("silu"));
            }
            Flavor::Mistral(window) => {
                obj.insert("architectures".into(), json!(["MistralForCausalLM"]));
                obj.insert("model_type".into(), json!("mistral"));
                obj.insert("sliding_window".into(), json!(window));
                obj.insert("hidden_act".into(), json!("silu"));
            }
        }
        if self.transformers5 {
            let mut params = if self.llama3_rope_scaling {
                scaling
            } else {
                json!({"rope_type": "default"})
            };
            params["rope_theta"] = json!(50000.0);
            obj.insert("rope_parameters".into(), params);
            obj.insert("dtype".into(), json!("float32"));
        } else {
            obj.insert("rope_theta".into(), json!(50000.0));
            obj.insert(
                "rope_scaling".into(),
                if self.llama3_rope_scaling { scaling } else { json!(null) },
            );
            obj.insert("torch_dtype".into(), json!("float32"));
        }
        config
    }

    /// Every tensor of the model, name → (shape, f32 values).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let (h, d) = (self.hidden, self.head_dim);
        let mut out = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, rng: &mut StdRng, norm: bool| {
            let n: usize = shape.iter().product();
            // Scaled so that activations stay O(1) through the layers, like trained weights.
            let scale = if norm {
                0.1
            } else {
                1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt()
            };
            let values = (0..n)
                .map(|_| {
                    let x: f32 = rng.random_range(-1.0..1.0) * scale * 1.7;
                    if norm {
                        1.0 + x
                    } else {
                        x
                    }
                })
                .collect();
            out.push((name, shape, values));
        };
        add("model.embed_tokens.weight".into(), vec![self.vocab, h], &mut rng, false);
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            add(format!("{p}.input_layernorm.weight"), vec![h], &mut rng, true);
            add(
                format!("{p}.self_attn.q_proj.weight"),
                vec![self.heads * d, h],
                &mut rng,
                false,
            );
            add(
                format!("{p}.self_attn.k_proj.weight"),
                vec![self.kv_heads * d, h],
                &mut rng,
                false,
            );
            add(
                format!("{p}.self_attn.v_proj.weight"),
                vec![self.kv_heads * d, h],
                &mut rng,
                false,
            );
            add(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, self.heads * d],
                &mut rng,
                false,
            );
            let qwen2 = self.flavor == Flavor::Qwen2;
            if self.attention_bias || qwen2 {
                let biases = [
                    ("q", self.heads * d),
                    ("k", self.kv_heads * d),
                    ("v", self.kv_heads * d),
                    ("o", h),
                ];
                for (name, len) in biases.into_iter().filter(|&(name, _)| !(qwen2 && name == "o")) {
                    add(format!("{p}.self_attn.{name}_proj.bias"), vec![len], &mut rng, false);
                }
            }
            if self.flavor == Flavor::Qwen3 {
                for name in ["q_norm", "k_norm"] {
                    add(format!("{p}.self_attn.{name}.weight"), vec![d], &mut rng, true);
                }
            }
            add(format!("{p}.post_attention_layernorm.weight"), vec![h], &mut rng, true);
            add(
                format!("{p}.mlp.gate_proj.weight"),
                vec![self.intermediate, h],
                &mut rng,
                false,
            );
            add(
                format!("{p}.mlp.up_proj.weight"),
                vec![self.intermediate, h],
                &mut rng,
                false,
            );
            add(
                format!("{p}.mlp.down_proj.weight"),
                vec![h, self.intermediate],
                &mut rng,
                false,
            );
        }
        add("model.norm.weight".into(), vec![h], &mut rng, true);
        if !self.tie_embeddings {
            add("lm_head.weight".into(), vec![self.vocab, h], &mut rng, false);
        }
        out
    }

    fn write_weights(&self, dir: &Path) {
        let tensors = self.tensors();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(name, shape, values)| (name, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect()))
            .collect();
        let per_file = bytes.len().div_ceil(self.files);
        let mut weight_map = serde_json::Map::new();
        for (i, chunk) in bytes.chunks(per_file).enumerate() {
            let file = match self.files {
                1 => "model.safetensors".to_string(),
                n => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
            };
            let views: Vec<(String, TensorView)> = chunk
                .iter()
                .map(|(name, shape, data)| {
                    weight_map.insert(name.clone(), json!(file));
                    (
                        name.clone(),
                        TensorView::new(Dtype::F32, shape.clone(), data).expect("tensor view"),
                    )
                })
                .collect();
            safetensors::serialize_to_file(views, None, &dir.join(&file)).expect("write safetensors");
        }
        if self.files > 1 {
            let index = json!({"metadata": {}, "weight_map": weight_map});
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("write index");
        }
    }
}

/// A byte-level BPE tokenizer: the 256 byte symbols, a few merges, and Llama-3-style special
/// tokens, with a post-processor that prepends BOS. Written with the `tokenizers` crate, so the
/// file is the real format.
pub fn write_tokenizer(dir: &Path) {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;

    let alphabet = ByteLevel::alphabet();
    let mut symbols: Vec<char> = alphabet.into_iter().collect();
    symbols.sort();
    let vocab: HashMap<String, u32> = symbols
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, Vec::new()).build().expect("bpe");
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer
        .add_special_tokens([
            AddedToken::from("<|begin_of_text|>", true),
            AddedToken::from("<|end_of_text|>", true),
            AddedToken::from("<|eot_id|>", true),
        ])
        .expect("special tokens");
    let processor = TemplateProcessing::builder()
        .try_single("<|begin_of_text|> $A")
        .expect("template")
        .special_tokens(vec![("<|begin_of_text|>".to_string(), BOS)])
        .build()
        .expect("processor");
    tokenizer.with_post_processor(Some(processor));
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .expect("save tokenizer");
    let template = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let config = json!({
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write tokenizer config");
}

/// Where `scripts/build/fetch-assets.sh` puts the registry-fetched model files.
pub fn assets_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/assets");
    assert!(
        dir.join("smollm2").exists() && dir.join("llama3-tokenizer").exists(),
        "test assets missing: run scripts/build/fetch-assets.sh (the README's test command does)"
    );
    dir
}

/// The logits of a run: prefill, then greedy decode steps.
#[derive(Debug, Clone)]
pub struct LogitsTrace {
    /// Per step (prefill first), the f32 logits over the vocabulary.
    pub logits: Vec<Vec<f32>>,
    /// The greedy tokens chosen after each step.
    pub tokens: Vec<u32>,
    /// All-reduces per rank during the prefill forward.
    pub prefill_all_reduces: u64,
}

/// Runs `model` at TP `tp` on CPU rank threads: the prompt, then `steps` greedy decode steps.
/// Every rank computes the same logits; rank 0's are returned.
pub fn run_greedy(model: &Path, tp: usize, dtype: DType, prompt: &[u32], steps: usize) -> LogitsTrace {
    run_greedy_with(model, tp, dtype, prompt, steps, None, false)
}

/// [`run_greedy`] with the prompt run in chunks of `prefill_chunk` positions, and attention
/// through the fused flash kernel's CPU twin when `flash` (the path CUDA ranks take in bf16).
pub fn run_greedy_with(
    model: &Path,
    tp: usize,
    dtype: DType,
    prompt: &[u32],
    steps: usize,
    prefill_chunk: Option<usize>,
    flash: bool,
) -> LogitsTrace {
    run_greedy_set(model, tp, dtype, prompt, steps, |rank| {
        if let Some(chunk) = prefill_chunk {
            rank.set_prefill_chunk(chunk);
        }
        if flash {
            rank.set_flash_attention(true).expect("flash attention");
        }
    })
}

/// [`run_greedy`] with each rank set up by `set` before its prompt.
pub fn run_greedy_set(
    model: &Path,
    tp: usize,
    dtype: DType,
    prompt: &[u32],
    steps: usize,
    set: impl Fn(&mut LlamaRank) + Sync,
) -> LogitsTrace {
    let traces = on_cpu_ranks(model, tp, dtype, |mut rank, comm| {
        set(&mut rank);
        let before = comm.stats().snapshot();
        let mut logits = rank.forward(prompt).expect("prefill");
        let prefill_all_reduces = comm.stats().snapshot().since(&before).all_reduces;
        let mut trace = LogitsTrace {
            logits: Vec::new(),
            tokens: Vec::new(),
            prefill_all_reduces,
        };
        for step in 0..=steps {
            let values = logits.squeeze(0).and_then(|l| l.to_vec1::<f32>()).expect("logits");
            let token = argmax(&values);
            trace.logits.push(values);
            trace.tokens.push(token);
            if step < steps {
                logits = rank.forward(&[token]).expect("decode");
            }
        }
        trace
    });
    traces.into_iter().next().expect("rank 0")
}

/// Greedy decoding kept on the device ([`LlamaRank::greedy_queue`], then
/// [`LlamaRank::greedy_take`] with up to `ahead` steps queued) at TP `tp` on CPU rank
/// threads: the prompt, then `steps` steps, rank r passing the flag r + 1 at step s (from 0)
/// where s is even, 0 where it is odd. Rank 0's trace, every rank's summed flags per step,
/// and rank 0's all-reduces over the steps.
pub fn run_device_greedy(
    model: &Path,
    tp: usize,
    dtype: DType,
    prompt: &[u32],
    steps: usize,
    ahead: usize,
) -> (LogitsTrace, Vec<Vec<u32>>, u64) {
    let runs = on_cpu_ranks(model, tp, dtype, |mut rank, comm| {
        let flag = |step: usize| (comm.rank() as u32 + 1) * step.is_multiple_of(2) as u32;
        let logits = rank.forward(prompt).expect("prefill");
        let values = |l: &Tensor| l.squeeze(0).and_then(|l| l.to_vec1::<f32>()).expect("logits");
        let mut trace = LogitsTrace {
            logits: vec![values(&logits)],
            tokens: vec![rank.greedy_start(&logits).expect("greedy start")],
            prefill_all_reduces: 0,
        };
        let mut flags = Vec::new();
        let before = comm.stats().snapshot();
        let mut queued = 0;
        for taken in 0..steps {
            while queued < steps && queued < taken + ahead {
                rank.greedy_queue(flag(queued)).expect("greedy step");
                queued += 1;
            }
            let step = rank.greedy_take().expect("greedy step");
            trace.logits.push(values(&step.logits));
            trace.tokens.push(step.token);
            flags.push(step.flags);
        }
        (trace, flags, comm.stats().snapshot().since(&before).all_reduces)
    });
    let flags = runs.iter().map(|(_, f, _)| f.clone()).collect();
    let (trace, _, all_reduces) = runs.into_iter().next().expect("rank 0");
    (trace, flags, all_reduces)
}

/// How [`run_batched_greedy`] batches: prompt chunks of `chunk` positions, blocks of
/// `block_size`, and prompt chunks through the flash kernel's CPU twin when `flash` (the
/// path CUDA ranks take in bf16).
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub chunk: usize,
    pub block_size: usize,
    pub flash: bool,
}

/// Greedy decoding of several prompts together through [`LlamaRank::forward_batch`] at TP
/// `tp` on CPU rank threads, as continuous batching runs them: sequence `i` joins at step `i`,
/// prompts are prefilled `chunk` positions a step beside the others' decode steps, and the
/// paged cache's blocks of `block_size` positions are handed out in a scrambled order, so
/// that no sequence's blocks are contiguous. Per sequence, rank 0's trace (the logits at the
/// prompt's end and after each of `steps` decode steps).
pub fn run_batched_greedy(
    model: &Path,
    tp: usize,
    dtype: DType,
    prompts: &[Vec<u32>],
    steps: usize,
    how: Batching,
) -> Vec<LogitsTrace> {
    let Batching {
        chunk,
        block_size,
        flash,
    } = how;
    struct Sequence {
        prompt: usize,
        context: Vec<u32>,
        cached: usize,
        table: tpinfer_layers::BlockTable,
        trace: LogitsTrace,
    }
    let blocks = prompts
        .iter()
        .map(|p| (p.len() + steps).div_ceil(block_size))
        .sum::<usize>();
    let runs = on_cpu_ranks_paged(model, tp, dtype, Some((blocks, block_size)), |mut rank, _| {
        if flash {
            rank.set_flash_attention(true).expect("flash attention");
        }
        // Odd blocks first, then even ones, each run backwards.
        let mut free: Vec<u32> = (0..blocks as u32)
            .filter(|b| b % 2 == 0)
            .chain((0..blocks as u32).filter(|b| b % 2 == 1))
            .collect();
        let mut sequences: Vec<Sequence> = Vec::new();
        for step in 0.. {
            if let Some(prompt) = prompts.get(step) {
                sequences.push(Sequence {
                    prompt: prompt.len(),
                    context: prompt.clone(),
                    cached: 0,
                    table: Default::default(),
                    trace: LogitsTrace {
                        logits: Vec::new(),
                        tokens: Vec::new(),
                        prefill_all_reduces: 0,
                    },
                });
            }
            let running: Vec<usize> = (0..sequences.len())
                .filter(|&i| sequences[i].trace.tokens.len() <= steps)
                .collect();
            if running.is_empty() {
                break;
            }
            let mut lens = Vec::new();
            for &i in &running {
                let s = &mut sequences[i];
                let len = match s.cached < s.prompt {
                    true => chunk.min(s.prompt - s.cached),
                    false => 1,
                };
                while s.table.blocks.len() * block_size < s.cached + len {
                    s.table.blocks.push(free.pop().expect("a free block"));
                }
                lens.push(len);
            }
            let chunks: Vec<tpinfer_llama::SequenceChunk> = running
                .iter()
                .zip(&lens)
                .map(|(&i, &len)| {
                    let s = &sequences[i];
                    tpinfer_llama::SequenceChunk {
                        tokens: &s.context[s.cached..s.cached + len],
                        start: s.cached,
                        table: &s.table,
                    }
                })
                .collect();
            let logits = rank.forward_batch(&chunks).expect("batched forward");
            drop(chunks);
            for (row, (&i, &len)) in running.iter().zip(&lens).enumerate() {
                let s = &mut sequences[i];
                s.cached += len;
                if s.cached >= s.prompt {
                    let values = logits.get(row).and_then(|l| l.to_vec1::<f32>()).expect("logits");
                    let token = argmax(&values);
                    s.trace.logits.push(values);
                    s.trace.tokens.push(token);
                    s.context.push(token);
                }
            }
        }
        sequences.into_iter().map(|s| s.trace).collect::<Vec<_>>()
    });
    runs.into_iter().next().expect("rank 0")
}

/// Loads every rank of `checkpoint` at each of `widths` on the CPU in `dtype` and checks that it
/// holds exactly the weight bytes its declarations plan; `each` sees each rank's declarations.
pub fn each_rank_holds_its_planned_bytes(
    checkpoint: &LlamaCheckpoint,
    widths: &[usize],
    dtype: DType,
    mut each: impl FnMut(&[tpinfer_weights::WeightDecl]),
) {
    let format = checkpoint.weight_format();
    for &tp in widths {
        for rank in 0..tp {
            let shard = LlamaShard::new(&checkpoint.config, tp, rank).expect("shard");
            let decls = checkpoint.weight_decls(&shard);
            let planned = tpinfer_weights::ShardLoader::device_bytes(&decls, dtype).expect("bytes");
            let mut loader = tpinfer_weights::ShardLoader::new(&*checkpoint.store, &decls, dtype, &Device::Cpu);
            for decl in &decls {
                loader.take_weight(&decl.name).expect("take");
            }
            assert_eq!(loader.bytes_on_device(), planned, "{format:?} TP {tp} rank {rank}");
            each(&decls);
        }
    }
}

/// The logits of `model` at TP `tp` on CPU rank threads, its quantized weights `quantized`,
/// fed the prompt and then `forced` one token at a time whatever it predicts (teacher
/// forcing): runs that disagree on a near tie still compare step by step. Prefill first.
pub fn run_forced(model: &Path, tp: usize, quantized: WeightFormat, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let values = |l: Tensor| l.squeeze(0).and_then(|l| l.to_vec1::<f32>()).expect("logits");
    let runs = on_cpu_ranks_with(model, tp, DType::F32, None, quantized, |mut rank, _| {
        let mut logits = vec![values(rank.forward(prompt).expect("prefill"))];
        for &token in forced {
            logits.push(values(rank.forward(&[token]).expect("decode")));
        }
        logits
    });
    runs.into_iter().next().expect("rank 0")
}

/// Loads `model` at TP `tp` on CPU rank threads (a 512-position cache each) and runs `f` on
/// every rank with its communicator. The ranks' results, in rank order.
fn on_cpu_ranks<T: Send>(
    model: &Path,
    tp: usize,
    dtype: DType,
    f: impl Fn(LlamaRank, &dyn Communicator) -> T + Sync,
) -> Vec<T> {
    on_cpu_ranks_paged(model, tp, dtype, None, f)
}

fn on_cpu_ranks_paged<T: Send>(
    model: &Path,
    tp: usize,
    dtype: DType,
    paged: Option<(usize, usize)>,
    f: impl Fn(LlamaRank, &dyn Communicator) -> T + Sync,
) -> Vec<T> {
    on_cpu_ranks_with(model, tp, dtype, paged, WeightFormat::AsStored, f)
}

/// [`on_cpu_ranks`] with the ranks loaded with a paged KV cache of `paged` (blocks, block
/// size) where it is set, and a GGUF file's quantized weights `quantized`.
fn on_cpu_ranks_with<T: Send>(
    model: &Path,
    tp: usize,
    dtype: DType,
    paged: Option<(usize, usize)>,
    quantized: WeightFormat,
    f: impl Fn(LlamaRank, &dyn Communicator) -> T + Sync,
) -> Vec<T> {
    let checkpoint = Arc::new(LlamaCheckpoint::open_with(model, quantized).expect("open checkpoint"));
    let comms = ThreadGroup::ranks(tp, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (checkpoint, f) = (checkpoint.clone(), &f);
                s.spawn(move || {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let shard = LlamaShard::new(&checkpoint.config, tp, comm.rank()).expect("shard");
                    let (c, device) = (comm.clone(), &Device::Cpu);
                    let rank = match paged {
                        None => LlamaRank::load(&checkpoint, shard, c, dtype, device, 512),
                        Some((blocks, block_size)) => {
                            let paged = tpinfer_llama::PagedCache {
                                blocks,
                                block_size,
                                max_seqs: 8,
                            };
                            LlamaRank::load_paged(&checkpoint, shard, c, dtype, device, 512, paged)
                        }
                    }
                    .expect("load");
                    f(rank, &*comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

pub fn argmax(values: &[f32]) -> u32 {
    values
        .iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |(bi, bv), (i, &v)| {
                if v > bv {
                    (i, v)
                } else {
                    (bi, bv)
                }
            },
        )
        .0 as u32
}

/// Writes f32 tensors (name, shape, little-endian bytes) as one safetensors file.
pub fn write_f32_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), bytes).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write safetensors");
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// ‖a − b‖ / ‖b‖ for tensors of the same shape.
pub fn tensor_rel_error(a: &Tensor, b: &Tensor) -> f64 {
    let flat = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("flatten")
    };
    rel_error(&flat(a), &flat(b))
}

/// The commit that [`hub_snapshot`]'s `main` names.
pub const HUB_COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// The snapshot directory of `repo` (`ORG/NAME`) at [`HUB_COMMIT`] in a Hugging Face cache at
/// `root`, laid out as `huggingface_hub` writes it, with `refs/main` naming it; the caller
/// writes the model into it.
pub fn hub_snapshot(root: &Path, repo: &str, commit: &str) -> PathBuf {
    let dir = root.join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(dir.join("refs")).expect("refs");
    std::fs::write(dir.join("refs/main"), format!("{commit}\n")).expect("ref");
    dir.join("snapshots").join(commit)
}
