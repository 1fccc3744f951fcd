use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use tpinfer_weights::{
    CountingStore, GgufStore, GgufTensorMap, LoadProgress, SafetensorsStore, ShardLoader, WeightDecl, WeightError,
    WeightStore,
};

use crate::shard::names;
use crate::{ConfigError, LlamaConfig, LlamaShard};

/// The on-disk form of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFormat {
    /// A Hugging Face directory: `config.json`, safetensors, `tokenizer.json`.
    HfDir(PathBuf),
    /// A single GGUF file carrying weights, hyper-parameters and tokenizer.
    Gguf(PathBuf),
}

/// A Llama checkpoint opened for sharded loading: its config and its tensor headers.
pub struct LlamaCheckpoint {
    pub config: LlamaConfig,
    pub format: ModelFormat,
    pub store: Arc<dyn WeightStore>,
    /// The GGUF file's store when the checkpoint is one, for its tokenizer metadata.
    gguf: Option<Arc<GgufStore>>,
}

/// Why a checkpoint could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("model path {0} does not exist; pass a Hugging Face model directory or a .gguf file")]
    NotFound(PathBuf),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

impl LlamaCheckpoint {
    /// The same checkpoint, its reads counted into `progress` at `dtype`'s size.
    pub fn counted(&self, progress: &LoadProgress, dtype: candle_core::DType) -> Self {
        Self {
            config: self.config.clone(),
            format: self.format.clone(),
            store: Arc::new(CountingStore::new(self.store.clone(), progress, dtype)),
            gguf: self.gguf.clone(),
        }
    }

    /// Opens a model directory or GGUF file. Reads config and headers only.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        if !path.exists() {
            return Err(CheckpointError::NotFound(path.to_path_buf()));
        }
        if path.is_file() {
            return Self::open_gguf(path);
        }
        let config = LlamaConfig::from_dir(path)?;
        let store = SafetensorsStore::open(path)?;
        Ok(Self {
            config,
            format: ModelFormat::HfDir(path.to_path_buf()),
            store: Arc::new(store),
            gguf: None,
        })
    }

    fn open_gguf(path: &Path) -> Result<Self, CheckpointError> {
        let store = GgufStore::open(path)?;
        if store.has_gguf_tensor("rope_freqs.weight") {
            // llama.cpp stores Llama 3.1's rope scaling as precomputed factors; ignoring them
            // would silently change every position's rotation.
            return Err(ConfigError::Unsupported {
                origin: path.display().to_string(),
                detail:
                    "GGUF rope_freqs (Llama 3.1 rope scaling) is not supported yet; use the Hugging Face checkpoint"
                        .into(),
            }
            .into());
        }
        let config = LlamaConfig::from_gguf(
            store.metadata(),
            store.has_gguf_tensor("output.weight"),
            &path.display().to_string(),
        )?;
        let store = store.with_names(gguf_names(&config));
        if let Some(name) = store.unmapped_tensor() {
            return Err(WeightError::Unexpected {
                name: name.to_string(),
                origin: path.display().to_string(),
                config: store.config_origin(),
                hint: format!(
                    "the metadata describes {} layers (block_count) and no such tensor: the file's metadata and \
                     tensor table disagree",
                    config.num_hidden_layers
                ),
            }
            .into());
        }
        let store = Arc::new(store);
        Ok(Self {
            config,
            format: ModelFormat::Gguf(path.to_path_buf()),
            store: store.clone(),
            gguf: Some(store),
        })
    }

    /// The GGUF key/value metadata (tokenizer, chat template), when the checkpoint is GGUF.
    pub fn gguf_metadata(&self) -> Option<&HashMap<String, Value>> {
        self.gguf.as_deref().map(GgufStore::metadata)
    }

    /// Checks the checkpoint against what `shard` reads (names and shapes, from headers).
    pub fn check(&self, shard: &LlamaShard) -> Result<(), WeightError> {
        self.check_decls(&shard.weight_decls(&self.config))
    }

    /// Checks the checkpoint against the tensors a rank reads (names and shapes, from headers).
    pub fn check_decls(&self, decls: &[WeightDecl]) -> Result<(), WeightError> {
        let tied = self.config.tie_word_embeddings;
        ShardLoader::check(&*self.store, decls, &|n| names::ignored(n, tied))
    }

    /// The bytes of weights `shard` will read, from the headers alone.
    pub fn shard_bytes(&self, shard: &LlamaShard) -> Result<usize, WeightError> {
        ShardLoader::planned_bytes(&*self.store, &shard.weight_decls(&self.config))
    }
}

/// Hugging Face names → llama.cpp names. Q and K rows were permuted by llama.cpp's converter.
fn gguf_names(c: &LlamaConfig) -> GgufTensorMap {
    let mut map = HashMap::new();
    let mut add = |hf: String, gguf: String, heads: Option<usize>| {
        map.insert(hf, (gguf, heads));
    };
    add(names::EMBED.into(), "token_embd.weight".into(), None);
    add(names::NORM.into(), "output_norm.weight".into(), None);
    add(names::LM_HEAD.into(), "output.weight".into(), None);
    for i in 0..c.num_hidden_layers {
        let (n, b) = (names::LayerNames::of(i), format!("blk.{i}"));
        let weight = |prefix: &str| format!("{prefix}.weight");
        add(weight(&n.q), format!("{b}.attn_q.weight"), Some(c.num_attention_heads));
        add(weight(&n.k), format!("{b}.attn_k.weight"), Some(c.num_key_value_heads));
        add(weight(&n.v), format!("{b}.attn_v.weight"), None);
        add(weight(&n.o), format!("{b}.attn_output.weight"), None);
        add(weight(&n.gate), format!("{b}.ffn_gate.weight"), None);
        add(weight(&n.up), format!("{b}.ffn_up.weight"), None);
        add(weight(&n.down), format!("{b}.ffn_down.weight"), None);
        add(n.input_norm, format!("{b}.attn_norm.weight"), None);
        add(n.post_norm, format!("{b}.ffn_norm.weight"), None);
    }
    map
}
