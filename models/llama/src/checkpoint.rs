use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use tpinfer_layers::RopeScaling;
use tpinfer_weights::{
    CountingStore, GgufStore, GgufTensorMap, LoadProgress, SafetensorsStore, ShardLoader, TensorInfo, WeightDecl,
    WeightError, WeightFormat, WeightStore,
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
    /// The form the ranks hold the linear weights in.
    weight_format: WeightFormat,
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
            weight_format: self.weight_format,
        }
    }

    /// Opens a model directory or GGUF file, its weights held as stored. Reads config and
    /// headers only.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        Self::open_with(path, WeightFormat::AsStored)
    }

    /// [`Self::open`], the linear weights to be held in `format`.
    pub fn open_with(path: &Path, format: WeightFormat) -> Result<Self, CheckpointError> {
        if !path.exists() {
            return Err(CheckpointError::NotFound(path.to_path_buf()));
        }
        if path.is_file() {
            return Self::open_gguf(path, format);
        }
        let config = LlamaConfig::from_dir(path)?;
        let store = SafetensorsStore::open(path)?;
        Ok(Self {
            config,
            format: ModelFormat::HfDir(path.to_path_buf()),
            store: Arc::new(store),
            gguf: None,
            weight_format: format,
        })
    }

    fn open_gguf(path: &Path, format: WeightFormat) -> Result<Self, CheckpointError> {
        let store = GgufStore::open(path)?;
        let origin = path.display().to_string();
        let mut config = LlamaConfig::from_gguf(store.metadata(), store.has_gguf_tensor("output.weight"), &origin)?;
        if store.has_gguf_tensor(ROPE_FREQS) {
            // llama.cpp stores Llama 3.1's rope scaling as a divisor per frequency.
            config.rope_scaling = Some(rope_divisors(&store, &config, &origin)?);
        }
        if format == WeightFormat::AsStored {
            config.row_block = (0..config.num_hidden_layers)
                .flat_map(|i| {
                    [
                        format!("blk.{i}.attn_output.weight"),
                        format!("blk.{i}.ffn_down.weight"),
                    ]
                })
                .filter_map(|name| store.gguf_dtype(&name))
                .filter(|dtype| dtype.block_size() > 1)
                .map(|dtype| dtype.block_size())
                .max()
                .unwrap_or(1);
        }
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
            weight_format: format,
        })
    }

    /// The tensors `shard` reads, each linear weight in the checkpoint's [`WeightFormat`].
    pub fn weight_decls(&self, shard: &LlamaShard) -> Vec<WeightDecl> {
        let mut decls = shard.weight_decls(&self.config);
        hold_linears(&mut decls, self.weight_format, |name| self.store.info(name));
        decls
    }

    /// The form the ranks hold the linear weights in.
    pub fn weight_format(&self) -> WeightFormat {
        self.weight_format
    }

    /// The GGUF key/value metadata (tokenizer, chat template), when the checkpoint is GGUF.
    pub fn gguf_metadata(&self) -> Option<&HashMap<String, Value>> {
        self.gguf.as_deref().map(GgufStore::metadata)
    }

    /// Checks the checkpoint against what `shard` reads (names and shapes, from headers).
    pub fn check(&self, shard: &LlamaShard) -> Result<(), WeightError> {
        self.check_decls(&self.weight_decls(shard))
    }

    /// Checks the checkpoint against the tensors a rank reads (names and shapes, from headers).
    pub fn check_decls(&self, decls: &[WeightDecl]) -> Result<(), WeightError> {
        let tied = self.config.tie_word_embeddings;
        ShardLoader::check(&*self.store, decls, &|n| names::ignored(n, tied))
    }

    /// The bytes of weights `shard` will read, from the headers alone.
    pub fn shard_bytes(&self, shard: &LlamaShard) -> Result<usize, WeightError> {
        ShardLoader::planned_bytes(&*self.store, &self.weight_decls(shard))
    }
}

/// Sets each linear weight of `decls` to the form `format` holds it in, `stored` giving a
/// tensor's header (none for a preset). The embedding stays dense, its rows looked up rather
/// than multiplied; so does the LM head under `--quantize fp8`, as FP8 checkpoints keep it.
pub(crate) fn hold_linears(
    decls: &mut [WeightDecl],
    format: WeightFormat,
    stored: impl Fn(&str) -> Option<TensorInfo>,
) {
    let linear = |d: &WeightDecl| d.shape.len() == 2 && d.name != names::EMBED;
    tpinfer_weights::hold_matrices(decls, format, linear, |d| linear(d) && d.name != names::LM_HEAD, stored);
}

/// llama.cpp's rotary frequency divisors (Llama 3.1 and 3.2 GGUFs).
const ROPE_FREQS: &str = "rope_freqs.weight";

/// The file's `rope_freqs`, checked: one positive finite divisor per frequency of a head.
fn rope_divisors(store: &GgufStore, config: &LlamaConfig, origin: &str) -> Result<RopeScaling, CheckpointError> {
    let divisors = store.read_vector(ROPE_FREQS)?;
    let expected = config.head_dim / 2;
    if divisors.len() != expected || !divisors.iter().all(|d| d.is_finite() && *d > 0.0) {
        return Err(ConfigError::Invalid {
            origin: origin.to_string(),
            field: ROPE_FREQS.to_string(),
            detail: format!(
                "must hold {expected} positive divisors (one per rotary frequency of a {}-wide head); it holds {} \
                 values: the file is corrupt, convert it again",
                config.head_dim,
                divisors.len()
            ),
        }
        .into());
    }
    Ok(RopeScaling::Divisors(divisors.into_iter().map(f64::from).collect()))
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
    add(names::ROPE_FREQS.into(), ROPE_FREQS.into(), None);
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
