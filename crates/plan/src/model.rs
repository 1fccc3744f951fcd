use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use serde::Serialize;
use tpinfer_llama::{LlamaCheckpoint, LlamaConfig};
use tpinfer_wan::WanConfig;

use crate::PlanError;

/// Built-in models, from their published shapes.
pub const PRESETS: &[&str] = &[
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "wan2.1-t2v-1.3b",
    "wan2.1-t2v-14b",
    "wan2.2-s2v-14b",
];

/// A model to plan: a preset, or a local directory read for its config and tensor headers.
#[derive(Clone)]
pub enum ModelSpec {
    Llama {
        name: String,
        config: LlamaConfig,
        /// The opened checkpoint of a local directory: its headers are checked against what
        /// each rank reads.
        checkpoint: Option<Arc<LlamaCheckpoint>>,
    },
    Wan {
        name: String,
        config: WanConfig,
    },
}

/// What runs on the ranks, besides the TP width and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Placement {
    /// An LLM holding `batch` sequences of up to `max_context` positions each (the engine
    /// serves batch 1; larger batches are planning figures).
    Llm { max_context: usize, batch: usize },
    /// A DiT denoising `frames` frames of `width` × `height` pixels, with classifier-free
    /// guidance (`cfg`: its unconditional passes run in turn with the conditional ones).
    Dit {
        frames: usize,
        width: usize,
        height: usize,
        cfg: bool,
    },
}

fn llama_preset(json: &str, name: &str) -> Result<LlamaConfig, PlanError> {
    LlamaConfig::from_json(json, name).map_err(|e| PlanError::Model(e.to_string()))
}

impl ModelSpec {
    /// A preset by name, or a model directory (Llama: `config.json` + safetensors, or a GGUF
    /// file; Wan: a diffusers transformer directory).
    pub fn open(name_or_path: &str) -> Result<Self, PlanError> {
        let name = name_or_path.to_string();
        let llama = |json: &str| -> Result<Self, PlanError> {
            Ok(Self::Llama {
                name: name.clone(),
                config: llama_preset(json, name_or_path)?,
                checkpoint: None,
            })
        };
        match name_or_path.to_ascii_lowercase().as_str() {
            "llama-3-8b" => return llama(LLAMA_3_8B),
            "llama-3-70b" => return llama(LLAMA_3_70B),
            "llama-3.2-1b" => return llama(LLAMA_32_1B),
            "llama-3.2-3b" => return llama(LLAMA_32_3B),
            "wan2.1-t2v-1.3b" => return Ok(Self::wan(name, WanConfig::wan21_t2v_1_3b())),
            "wan2.1-t2v-14b" => return Ok(Self::wan(name, WanConfig::wan21_t2v_14b())),
            "wan2.2-s2v-14b" => return Ok(Self::wan(name, WanConfig::wan22_s2v_14b())),
            _ => {}
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            return Err(PlanError::Model(format!(
                "{name_or_path} is neither a model path nor a preset; presets: {}",
                PRESETS.join(", ")
            )));
        }
        if path.is_dir() && tpinfer_wan::WanCheckpoint::is_wan_dir(path) {
            let config = WanConfig::from_dir(path).map_err(|e| PlanError::Model(e.to_string()))?;
            return Ok(Self::wan(name, config));
        }
        let checkpoint = LlamaCheckpoint::open(path).map_err(|e| PlanError::Model(e.to_string()))?;
        Ok(Self::Llama {
            name,
            config: checkpoint.config.clone(),
            checkpoint: Some(Arc::new(checkpoint)),
        })
    }

    /// A Llama model already opened for loading.
    pub fn from_checkpoint(name: impl Into<String>, checkpoint: Arc<LlamaCheckpoint>) -> Self {
        Self::Llama {
            name: name.into(),
            config: checkpoint.config.clone(),
            checkpoint: Some(checkpoint),
        }
    }

    fn wan(name: String, config: WanConfig) -> Self {
        Self::Wan { name, config }
    }

    pub fn name(&self) -> &str {
        match self {
            Self::Llama { name, .. } | Self::Wan { name, .. } => name,
        }
    }

    /// The widest TP the model shards to: its attention heads.
    pub fn max_tp(&self) -> usize {
        match self {
            Self::Llama { config, .. } => config.num_attention_heads,
            Self::Wan { config, .. } => config.num_attention_heads,
        }
    }

    /// The checkpoint's dtype where it says, else bf16.
    pub fn default_dtype(&self) -> DType {
        match self {
            Self::Llama { config, .. } => config.dtype.unwrap_or(DType::BF16),
            Self::Wan { .. } => DType::BF16,
        }
    }

    /// The placement when the user gives none: 8192 positions (at most the model's), or
    /// 81 frames at 832 × 480.
    pub fn default_placement(&self) -> Placement {
        match self {
            Self::Llama { config, .. } => Placement::Llm {
                max_context: config.max_position_embeddings.min(8192),
                batch: 1,
            },
            Self::Wan { .. } => Placement::Dit {
                frames: 81,
                width: 832,
                height: 480,
                cfg: true,
            },
        }
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
