use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use tpinfer_layers::RopeScaling;
use tpinfer_weights::{
    CountingStore, GgufStore, GgufTensorMap, LoadProgress, ShardLoader, ShardSpec, TensorInfo, WeightDecl, WeightError,
    WeightFormat, WeightStore,
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
    #[error(
        "{origin}: --quantize-lm-head asks for an FP8 LM head, but this model's head is its embedding \
         (tie_word_embeddings), whose rows stay in the compute dtype; leave the flag out"
    )]
    TiedHead { origin: String },
}

/// Fails where `format` quantizes an LM head that `config` does not have: the head is the
/// embedding, looked up by rows.
pub(crate) fn check_head_format(
    config: &LlamaConfig,
    format: WeightFormat,
    origin: &str,
) -> Result<(), CheckpointError> {
    match format == WeightFormat::Fp8WithLmHead && config.tie_word_embeddings {
        true => Err(CheckpointError::TiedHead {
            origin: origin.to_string(),
        }),
        false => Ok(()),
    }
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
        check_head_format(&config, format, &path.display().to_string())?;
        let store = tpinfer_weights::open_model_dir(path)?;
        Ok(Self {
            config,
            format: ModelFormat::HfDir(path.to_path_buf()),
            store: Arc::from(store),
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
        check_head_format(&config, format, &origin)?;
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
/// than multiplied; so does the LM head under `--quantize fp8`, as FP8 checkpoints keep it,
/// unless `--quantize-lm-head` ([`WeightFormat::Fp8WithLmHead`]).
pub(crate) fn hold_linears(
    decls: &mut [WeightDecl],
    format: WeightFormat,
    stored: impl Fn(&str) -> Option<TensorInfo>,
) {
    let linear = |d: &WeightDecl| d.shape.len() == 2 && d.name != names::EMBED;
    let head = format == WeightFormat::Fp8WithLmHead;
    let fp8 = |d: &WeightDecl| linear(d) && (head || d.name != names::LM_HEAD);
    tpinfer_weights::hold_matrices(decls, format, linear, fp8, stored);
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

impl LlamaCheckpoint {
    /// Writes the checkpoint as a llama.cpp GGUF file at `path`: its metadata, Q/K rows in
    /// llama.cpp's order, a Llama 3.1 scaling as `rope_freqs`, and each matrix in the GGML type
    /// `quant` gives for its GGUF name (norms in f32). Matrices are read and quantized in
    /// parallel, one at a time each; no tokenizer goes in (the engine then reads the
    /// `tokenizer.json` beside the file).
    pub fn write_gguf(&self, path: &Path, quant: &(dyn Fn(&str) -> GgmlDType + Sync)) -> Result<(), CheckpointError> {
        use rayon::prelude::*;
        let c = &self.config;
        let names = gguf_names(c);
        let mut hf: Vec<(&String, &(String, Option<usize>))> = names
            .iter()
            .filter(|(name, _)| self.store.info(name).is_some())
            .collect();
        hf.sort_by(|a, b| a.1 .0.cmp(&b.1 .0));
        let tensor_err = |name: &str| {
            let name = name.to_string();
            move |source| WeightError::Tensor {
                name: name.clone(),
                source,
            }
        };
        let mut tensors = hf
            .par_iter()
            .map(|(name, (gguf, heads))| {
                let (t, _) = self.store.read(name, &ShardSpec::Replicated)?;
                let mut t = t.to_dtype(candle_core::DType::F32).map_err(tensor_err(name))?;
                if let Some(heads) = heads {
                    t = permute_rotary_rows(&t, *heads).map_err(tensor_err(name))?;
                }
                let dtype = if t.rank() == 2 { quant(gguf) } else { GgmlDType::F32 };
                let q = QTensor::quantize(&t, dtype).map_err(tensor_err(name))?;
                Ok((gguf.clone(), q))
            })
            .collect::<Result<Vec<_>, WeightError>>()?;
        let yarn = gguf_yarn(c.rope_scaling.as_ref(), path)?;
        if let Some(scaling) = c.rope_scaling.as_ref().filter(|_| yarn.is_none()) {
            let divisors: Vec<f32> = scaling
                .divisors(c.head_dim, c.rope_theta)
                .into_iter()
                .map(|d| d as f32)
                .collect();
            let t = candle_core::Tensor::new(divisors, &candle_core::Device::Cpu)
                .and_then(|t| QTensor::quantize(&t, GgmlDType::F32))
                .map_err(tensor_err(ROPE_FREQS))?;
            tensors.push((ROPE_FREQS.to_string(), t));
        }
        let u = |v: usize| Value::U32(v as u32);
        let arch = c.gguf_architecture();
        let mut metadata = vec![("general.architecture".to_string(), Value::String(arch.into()))];
        metadata.extend(
            [
                ("block_count", u(c.num_hidden_layers)),
                ("embedding_length", u(c.hidden_size)),
                ("feed_forward_length", u(c.intermediate_size)),
                ("attention.head_count", u(c.num_attention_heads)),
                ("attention.head_count_kv", u(c.num_key_value_heads)),
                ("rope.dimension_count", u(c.head_dim)),
                ("context_length", u(c.max_position_embeddings)),
                ("rope.freq_base", Value::F32(c.rope_theta as f32)),
                ("attention.layer_norm_rms_epsilon", Value::F32(c.rms_norm_eps as f32)),
                ("vocab_size", u(c.vocab_size)),
            ]
            .into_iter()
            .map(|(field, v)| (format!("{arch}.{field}"), v)),
        );
        metadata.extend(
            yarn.into_iter()
                .flatten()
                .map(|(field, v)| (format!("{arch}.rope.scaling.{field}"), v)),
        );
        let token = |key: &str, id: u32| (key.to_string(), Value::U32(id));
        metadata.extend(c.bos_token_id.map(|id| token("tokenizer.ggml.bos_token_id", id)));
        metadata.extend(
            c.eos_token_ids
                .first()
                .map(|&id| token("tokenizer.ggml.eos_token_id", id)),
        );
        let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let io = |source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        gguf_file::write(&mut file, &meta, &refs).map_err(|e| WeightError::Gguf {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        std::io::Write::flush(&mut file).map_err(io)?;
        Ok(())
    }
}

/// A YaRN scaling as llama.cpp's GGUF keys (`rope.scaling.*`), `None` for any other scaling;
/// refused where the keys cannot carry it (other betas, an untruncated ramp).
fn gguf_yarn(
    scaling: Option<&RopeScaling>,
    path: &Path,
) -> Result<Option<Vec<(&'static str, Value)>>, CheckpointError> {
    let Some(&RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        attention_factor,
        truncate,
    }) = scaling
    else {
        return Ok(None);
    };
    if beta_fast != 32.0 || beta_slow != 1.0 || !truncate {
        return Err(CheckpointError::Weights(WeightError::Gguf {
            path: path.to_path_buf(),
            detail: format!(
                "a YaRN scaling with beta_fast {beta_fast}, beta_slow {beta_slow} and truncate {truncate} has no GGUF \
                 keys (llama.cpp's take 32, 1 and true)"
            ),
        }));
    }
    Ok(Some(vec![
        ("type", Value::String("yarn".into())),
        ("factor", Value::F32(factor as f32)),
        (
            "original_context_length",
            Value::U32(original_max_position_embeddings as u32),
        ),
        (
            "attn_factor",
            Value::F32((attention_factor / RopeScaling::yarn_mscale(factor, 1.0)) as f32),
        ),
    ]))
}

/// llama.cpp's converter's order of Q/K rows (`reshape(h, 2, d/2, in).swapaxes(1, 2)`), the
/// inverse of the store's unpermuting.
fn permute_rotary_rows(w: &candle_core::Tensor, heads: usize) -> candle_core::Result<candle_core::Tensor> {
    let (rows, cols) = w.dims2()?;
    w.reshape((heads, 2, rows / heads / 2, cols))?
        .transpose(1, 2)?
        .reshape((rows, cols))
}

/// Hugging Face names → llama.cpp names. For the `llama` architecture, llama.cpp's converter
/// permuted Q and K rows (it rotates adjacent pairs there); `qwen2` and `qwen3` rotate halves,
/// as Hugging Face does, and keep them, with Qwen2's Q, K and V biases and Qwen3's Q and K
/// norms beside them.
fn gguf_names(c: &LlamaConfig) -> GgufTensorMap {
    let arch = c.gguf_architecture();
    let rotary = |heads: usize| (arch == "llama").then_some(heads);
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
        add(
            weight(&n.q),
            format!("{b}.attn_q.weight"),
            rotary(c.num_attention_heads),
        );
        add(
            weight(&n.k),
            format!("{b}.attn_k.weight"),
            rotary(c.num_key_value_heads),
        );
        add(weight(&n.v), format!("{b}.attn_v.weight"), None);
        if arch == "qwen2" {
            for (hf, gguf) in [(&n.q, "attn_q"), (&n.k, "attn_k"), (&n.v, "attn_v")] {
                add(format!("{hf}.bias"), format!("{b}.{gguf}.bias"), None);
            }
        }
        if c.qk_norm {
            add(n.q_norm.clone(), format!("{b}.attn_q_norm.weight"), None);
            add(n.k_norm.clone(), format!("{b}.attn_k_norm.weight"), None);
        }
        add(weight(&n.o), format!("{b}.attn_output.weight"), None);
        add(weight(&n.gate), format!("{b}.ffn_gate.weight"), None);
        add(weight(&n.up), format!("{b}.ffn_up.weight"), None);
        add(weight(&n.down), format!("{b}.ffn_down.weight"), None);
        add(n.input_norm, format!("{b}.attn_norm.weight"), None);
        add(n.post_norm, format!("{b}.ffn_norm.weight"), None);
    }
    map
}
