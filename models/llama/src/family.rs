//! Llama as a [`Family`]: presets, the split over ranks, each rank's footprint and its load.

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use tpinfer_family::{preset_has_no_weights, Family, LoadContext};
use tpinfer_plan::{
    boxed_shards, numbered_unit, Accelerator, Footprint, Placement, PlanError, RankShard, ShardedModel,
};
use tpinfer_weights::{Quant, WeightDecl, WeightFormat};

use crate::memory::{flash_attention, prefill_chunk, Batch, RankMemory};
use crate::{CheckpointError, LlamaCheckpoint, LlamaConfig, LlamaRank, LlamaShard};

/// The most sequences a plan holds at once: far past any one box's memory, and far from any
/// product that could wrap.
const MAX_BATCH: usize = 1 << 16;

/// What a CUDA rank's forward keeps outside the tensor pool from its first request, MiB:
/// cuBLAS and the decode step's kernels (bf16 and FP8 alike); with GGML weights, candle's
/// quantized kernels besides, one large module. Measured (the device beyond its context,
/// 631 and 693 MiB; benches/RESULTS.md, *Memory*).
const LIBRARIES_MIB: u64 = 66;
const GGML_LIBRARIES_MIB: u64 = 128;

/// A Llama model to plan or load: a preset's config, or an opened checkpoint.
#[derive(Clone)]
pub struct LlamaModel {
    name: String,
    config: Arc<LlamaConfig>,
    checkpoint: Option<Arc<LlamaCheckpoint>>,
    /// The form a preset's linear weights are planned in (a checkpoint carries its own).
    format: WeightFormat,
}

/// One rank's part of a Llama model: its heads, FFN columns and vocabulary rows, with the
/// tensors it reads.
#[derive(Clone)]
pub struct LlamaRankShard {
    pub shard: LlamaShard,
    config: Arc<LlamaConfig>,
    decls: Arc<[WeightDecl]>,
}

impl LlamaModel {
    /// Opens a Hugging Face directory or a GGUF file (config and headers only).
    pub fn open_checkpoint(path: &Path) -> Result<Self, CheckpointError> {
        Self::open_checkpoint_with(path, WeightFormat::AsStored)
    }

    /// [`Self::open_checkpoint`], the linear weights to be held in `format`.
    pub fn open_checkpoint_with(path: &Path, format: WeightFormat) -> Result<Self, CheckpointError> {
        Ok(Self::from_checkpoint(
            path.display().to_string(),
            Arc::new(LlamaCheckpoint::open_with(path, format)?),
        ))
    }

    /// A model already opened for loading.
    pub fn from_checkpoint(name: impl Into<String>, checkpoint: Arc<LlamaCheckpoint>) -> Self {
        Self {
            name: name.into(),
            config: Arc::new(checkpoint.config.clone()),
            format: checkpoint.weight_format(),
            checkpoint: Some(checkpoint),
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Whether any linear weight is held in FP8 (an FP8 checkpoint's, or `--quantize fp8`).
    pub fn holds_fp8(&self) -> bool {
        self.shards(1).is_ok_and(|shards| {
            shards
                .iter()
                .any(|s| s.decls.iter().any(|d| d.quant == Some(Quant::Fp8)))
        })
    }

    /// The opened checkpoint; `None` for a preset.
    pub fn checkpoint(&self) -> Option<&Arc<LlamaCheckpoint>> {
        self.checkpoint.as_ref()
    }
}

impl ShardedModel for LlamaModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_tp(&self) -> usize {
        self.config.num_attention_heads
    }

    fn default_dtype(&self) -> DType {
        self.config.dtype.unwrap_or(DType::BF16)
    }

    /// 8192 positions, at most the model's.
    fn default_placement(&self) -> Placement {
        Placement::llm(self.config.max_position_embeddings.min(8192), 1)
    }

    fn max_context(&self) -> Option<usize> {
        Some(self.config.max_position_embeddings)
    }

    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }

    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        match &self.checkpoint {
            Some(checkpoint) => checkpoint
                .check_decls(decls)
                .map_err(|e| PlanError::Model(e.to_string())),
            None => Ok(()),
        }
    }

    fn fsdp_unit(&self, tensor: &str) -> Option<String> {
        numbered_unit(tensor, crate::shard::names::LAYERS)
    }
}

impl LlamaRankShard {
    /// The bytes a product of a quantized weight takes beyond a dense one's while it runs,
    /// for the largest (merged) weight of `rows` input rows. On CUDA, FP8 products quantize
    /// their input (a byte a value and a scale a row; the plan's GPU has FP8 tensor cores,
    /// compute capability 8.9 or later) and GGML blocks are multiplied as they are, through
    /// candle's MMQ kernels' f32 copies and workspaces for more than a few rows. On CPU ranks
    /// the weight is expanded: FP8 to E4M3 values and the product in the compute dtype, GGML
    /// blocks to f32, then the compute dtype.
    pub fn quantized_product_bytes(&self, dtype: DType, accelerator: Accelerator, rows: usize) -> usize {
        let gate = format!("{}.weight", crate::shard::names::LayerNames::of(0).gate);
        let quant = self.decls.iter().find(|d| d.name == gate).and_then(|d| d.quant);
        if quant == Some(Quant::Fp8) && accelerator == Accelerator::Cuda {
            // The merged gate/up: two weights expanded at once where a side is not 16-aligned.
            return tpinfer_layers::fp8_product_bytes(&self.decls, dtype, true, rows, 2);
        }
        let (h, d) = (self.config.hidden_size, self.config.head_dim);
        let (q, kv, ffn) = (
            self.shard.heads.q_heads.len() * d,
            self.shard.heads.kv_heads.len() * d,
            self.shard.ffn_cols.len(),
        );
        if matches!(quant, Some(Quant::Ggml(_))) && accelerator == Accelerator::Cuda {
            // A prompt's products; its logits come from its last row alone.
            let products = [(h, q + 2 * kv), (q, h), (h, 2 * ffn), (ffn, h)];
            return tpinfer_layers::mmq_product_bytes(&products, dtype, rows);
        }
        let per_value = match quant {
            Some(Quant::Fp8) => 2 * dtype.size_in_bytes(),
            Some(Quant::Ggml(_)) => 4 + if dtype == DType::F32 { 0 } else { dtype.size_in_bytes() },
            None => return 0,
        };
        // The merged Q/K/V and gate/up hold the others' rows; a quantized LM head (GGUF's
        // own output matrix) may be larger still.
        let head_quantized = self
            .decls
            .iter()
            .any(|d| d.name == crate::shard::names::LM_HEAD && d.quant.is_some());
        let head = if head_quantized {
            self.shard.vocab_rows.len() * h
        } else {
            0
        };
        let largest = ((q + 2 * kv) * h).max(2 * ffn * h).max(head);
        largest * per_value
    }
}

impl RankShard for LlamaRankShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }

    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Llm {
            max_context,
            batch,
            kv_sequences,
        } = placement
        else {
            return Err(PlanError::Placement(
                "--frames and --size are for video DiT models; give an LLM --max-context".into(),
            ));
        };
        let config = &self.config;
        if max_context == 0 || max_context > config.max_position_embeddings {
            return Err(PlanError::Placement(format!(
                "--max-context {max_context} must be between 1 and the model's {} positions",
                config.max_position_embeddings
            )));
        }
        if batch == 0 || batch > MAX_BATCH {
            return Err(PlanError::Placement(format!(
                "--max-seqs {batch} must be between 1 and {MAX_BATCH}"
            )));
        }
        let flash = flash_attention(accelerator == Accelerator::Cuda, dtype, config.head_dim, &self.shard);
        let chunk = prefill_chunk(self.shard.heads.q_heads.len(), max_context, flash);
        if kv_sequences == Some(0) {
            return Err(PlanError::Placement(
                "a KV cache must hold at least one sequence at full length".into(),
            ));
        }
        let batch = Batch {
            sequences: batch,
            kv_sequences,
        };
        let m = RankMemory::batched(config, &self.shard, dtype, max_context, chunk, batch, flash);
        // A CUDA rank's GGML products keep a Q8_1 row each for the decode step.
        let buffers = m.buffers
            + match accelerator {
                Accelerator::Cuda => tpinfer_layers::mmvq_row_bytes(&self.decls),
                _ => 0,
            };
        Ok(Footprint {
            buffers: buffers as u64,
            cache: m.kv_cache as u64,
            activations: (m.activations + self.quantized_product_bytes(dtype, accelerator, chunk.max(batch.sequences)))
                as u64,
            pool_slack: m.pool_slack as u64,
            // Rotary tables and the KV cache are allocated at load, for the whole context.
            at_load: (buffers + m.kv_cache) as u64,
            libraries: accelerator.libraries(
                match self.decls.iter().any(|d| matches!(d.quant, Some(Quant::Ggml(_)))) {
                    true => GGML_LIBRARIES_MIB,
                    false => LIBRARIES_MIB,
                },
            ),
            tokens_per_forward: chunk,
        })
    }
}

impl Family for LlamaModel {
    const NAME: &'static str = "llama";
    const PRESETS: &'static [&'static str] = &[
        "llama-3-8b",
        "llama-3-70b",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "qwen2.5-7b",
        "qwen2.5-72b",
        "qwen3-8b",
        "mistral-7b",
    ];
    type Shard = LlamaRankShard;
    type Rank = LlamaRank;

    /// A GGUF file, or a directory whose `config.json` has a transformer LM's `hidden_size`.
    fn detect(path: &Path) -> bool {
        match path.is_file() {
            true => path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")),
            false => std::fs::read_to_string(path.join("config.json")).is_ok_and(|t| t.contains("\"hidden_size\"")),
        }
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        Self::open_checkpoint(path).map_err(|e| PlanError::Model(e.to_string()))
    }

    fn preset(name: &str) -> Option<Self> {
        let json = match name.to_ascii_lowercase().as_str() {
            "llama-3-8b" => LLAMA_3_8B,
            "llama-3-70b" => LLAMA_3_70B,
            "llama-3.2-1b" => LLAMA_32_1B,
            "llama-3.2-3b" => LLAMA_32_3B,
            "qwen2.5-7b" => QWEN_25_7B,
            "qwen2.5-72b" => QWEN_25_72B,
            "qwen3-8b" => QWEN3_8B,
            "mistral-7b" => MISTRAL_7B,
            _ => return None,
        };
        // The presets are constants of this file, parsed by its tests.
        let config = LlamaConfig::from_json(json, name).ok()?;
        Some(Self {
            name: name.to_string(),
            config: Arc::new(config),
            checkpoint: None,
            format: WeightFormat::AsStored,
        })
    }

    fn shards(&self, tp: usize) -> Result<Vec<LlamaRankShard>, PlanError> {
        (0..tp)
            .map(|rank| {
                let shard = LlamaShard::new(&self.config, tp, rank).map_err(|e| PlanError::Sharding {
                    tp,
                    // The plan's error says it cannot shard; the layer's detail alone follows.
                    detail: match e {
                        tpinfer_layers::Error::Shard(detail) => detail,
                        other => other.to_string(),
                    },
                })?;
                let decls = match &self.checkpoint {
                    Some(checkpoint) => checkpoint.weight_decls(&shard),
                    None => {
                        let mut decls = shard.weight_decls(&self.config);
                        crate::checkpoint::hold_linears(&mut decls, self.format, |_| None);
                        decls
                    }
                }
                .into();
                Ok(LlamaRankShard {
                    shard,
                    config: self.config.clone(),
                    decls,
                })
            })
            .collect()
    }

    fn load(
        &self,
        shard: &LlamaRankShard,
        placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<LlamaRank, tpinfer_layers::Error> {
        let checkpoint = self
            .checkpoint
            .as_ref()
            .ok_or_else(|| preset_has_no_weights(&self.name))?;
        let Placement::Llm { max_context, batch, .. } = placement else {
            return Err(tpinfer_layers::Error::Shard(
                "a Llama model is placed with a context length".into(),
            ));
        };
        let checkpoint = checkpoint.counted(ctx.progress, ctx.dtype);
        let (shard, comm) = (shard.shard.clone(), ctx.comm.clone());
        // Several sequences share a paged cache (`memory::RankMemory::batched`).
        if let Some(blocks) = crate::memory::paged_blocks(placement) {
            let paged = crate::PagedCache {
                blocks,
                block_size: crate::memory::KV_BLOCK_SIZE,
                max_seqs: batch,
            };
            let mut rank = LlamaRank::load_paged(&checkpoint, shard, comm, ctx.dtype, ctx.device, max_context, paged)?;
            rank.set_cuda_graphs(ctx.options.cuda_graphs)?;
            return Ok(rank);
        }
        let mut rank = LlamaRank::load(&checkpoint, shard, comm, ctx.dtype, ctx.device, max_context)?;
        rank.set_cuda_graphs(ctx.options.cuda_graphs)?;
        rank.set_kernel_chains(ctx.options.kernel_chains);
        Ok(rank)
    }

    /// A checkpoint opened for another format is opened again: the row-parallel block size
    /// of its config depends on whether its GGUF blocks are kept.
    fn with_format(self, format: WeightFormat) -> Result<Self, PlanError> {
        match &self.checkpoint {
            _ if format == self.format => Ok(self),
            None => {
                crate::checkpoint::check_head_format(&self.config, format, &self.name)
                    .map_err(|e| PlanError::Model(e.to_string()))?;
                Ok(Self { format, ..self })
            }
            Some(checkpoint) => {
                let path = match &checkpoint.format {
                    crate::ModelFormat::HfDir(path) | crate::ModelFormat::Gguf(path) => path.clone(),
                };
                Self::open_checkpoint_with(&path, format).map_err(|e| PlanError::Model(e.to_string()))
            }
        }
    }

    fn bytes_loaded(rank: &LlamaRank) -> usize {
        rank.bytes_loaded()
    }
}

// Published shapes (Hugging Face config.json of meta-llama's models, bf16).
const LLAMA_3_8B: &str = r#"{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;
const LLAMA_3_70B: &str = r#"{"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
 "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;
const LLAMA_32_1B: &str = r#"{"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
 "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
 "original_max_position_embeddings": 8192}}"#;
const LLAMA_32_3B: &str = r#"{"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
 "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
 "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
 "original_max_position_embeddings": 8192}}"#;
// The published configs of Qwen2.5-7B and -72B (Instruct alike), Qwen3-8B and Mistral-7B v0.3
// (no sliding window), the fields the plan reads.
const QWEN_25_7B: &str = r#"{"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "use_sliding_window": false,
 "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;
const QWEN_25_72B: &str = r#"{"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568,
 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "use_sliding_window": false,
 "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;
const QWEN3_8B: &str = r#"{"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "use_sliding_window": false,
 "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;
const MISTRAL_7B: &str = r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
 "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": null,
 "tie_word_embeddings": false, "torch_dtype": "bfloat16"}"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses() {
        for name in LlamaModel::PRESETS {
            assert!(LlamaModel::preset(name).is_some(), "{name}");
        }
        assert!(LlamaModel::preset("wan2.1-t2v-14b").is_none());
    }
}
