use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::DType;
use serde::Deserialize;
use serde_json::Value as Json;
use std::collections::HashMap;
use tpinfer_layers::RopeScaling;

/// A Llama model's hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the query, key and value projections (Llama's `attention_bias`; always in
    /// Qwen2).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`; never in Qwen2).
    pub o_bias: bool,
    /// An RMSNorm over each query and key head before the rotation (Qwen3's `q_norm` and
    /// `k_norm`, a weight of `head_dim` each).
    pub qk_norm: bool,
    pub mlp_bias: bool,
    /// The dtype the checkpoint was trained and saved in, if it says.
    pub dtype: Option<DType>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The values per quant block along the inner dimension of the row-parallel weights
    /// (attention output, FFN down) as the ranks hold them: a split falls on its multiples.
    /// 1 for dense weights; a GGUF file kept quantized sets it.
    pub row_block: usize,
}

/// The Llama-architecture families tpinfer runs: `model_type` and the architecture
/// transformers names. Mistral is Llama with a sliding window; Qwen2 adds biases to the query,
/// key and value projections; Qwen3 an RMSNorm over each query and key head instead.
const FAMILIES: [(&str, &str); 4] = [
    ("llama", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
];

/// The GGUF architectures (llama.cpp's `general.architecture`) tpinfer reads.
pub const GGUF_ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// Why a configuration could not be read. The message names the file and field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}; the model directory needs a config.json")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not valid JSON: {detail}")]
    Json { path: PathBuf, detail: String },
    #[error("{origin}: missing field `{field}`; add it (see the model's published config)")]
    Missing { origin: String, field: String },
    #[error("{origin}: field `{field}` {detail}")]
    Invalid {
        origin: String,
        field: String,
        detail: String,
    },
    #[error("{origin}: {detail}")]
    Unsupported { origin: String, detail: String },
}

/// `config.json` as either transformers generation writes it; every field optional so that a
/// missing one is reported by name, with its file.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<Json>,
    use_sliding_window: Option<bool>,
    hidden_act: Option<String>,
    // transformers 4
    rope_theta: Option<f64>,
    rope_scaling: Option<Json>,
    torch_dtype: Option<String>,
    // transformers 5
    rope_parameters: Option<Json>,
    quantization_config: Option<Json>,
    dtype: Option<String>,
    bos_token_id: Option<Json>,
    eos_token_id: Option<Json>,
}

impl LlamaConfig {
    /// Reads `config.json`, and the EOS ids of `generation_config.json` beside it if present.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let mut config = Self::from_json_file(&path)?;
        let generation = dir.join("generation_config.json");
        if let Ok(text) = std::fs::read_to_string(&generation) {
            let json: Json = serde_json::from_str(&text).map_err(|e| ConfigError::Json {
                path: generation.clone(),
                detail: e.to_string(),
            })?;
            let origin = generation.display().to_string();
            for id in token_ids(json.get("eos_token_id"), &origin, "eos_token_id")? {
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    pub fn from_json_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Parses `config.json` text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        // A field of the wrong type is named (serde_json alone says only where it is).
        let raw: RawConfig =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text)).map_err(|e| {
                match e.inner().classify() {
                    serde_json::error::Category::Data => ConfigError::Invalid {
                        origin: origin.to_string(),
                        field: e.path().to_string(),
                        detail: format!("has the wrong type or value: {}", e.inner()),
                    },
                    _ => ConfigError::Json {
                        path: PathBuf::from(origin),
                        detail: e.inner().to_string(),
                    },
                }
            })?;
        let missing = |field: &str| ConfigError::Missing {
            origin: origin.to_string(),
            field: field.to_string(),
        };
        let unsupported = |detail: String| ConfigError::Unsupported {
            origin: origin.to_string(),
            detail,
        };
        // The family's architecture that `model_type` (Llama's when absent) names, and that
        // `architectures`, when given, must list.
        let family = FAMILIES
            .iter()
            .find(|(model_type, _)| raw.model_type.as_deref().unwrap_or("llama") == *model_type)
            .filter(|(_, arch)| raw.architectures.as_ref().is_none_or(|a| a.iter().any(|a| a == arch)));
        let Some(&(model_type, _)) = family else {
            return Err(unsupported(format!(
                "model_type {:?} / architectures {:?} is not one tpinfer runs: {}",
                raw.model_type,
                raw.architectures,
                FAMILIES.map(|(_, arch)| arch).join(", ")
            )));
        };
        let (qwen2, qwen3) = (model_type == "qwen2", model_type == "qwen3");
        if (qwen2 || qwen3) && raw.use_sliding_window == Some(true) {
            return Err(ConfigError::Invalid {
                origin: origin.to_string(),
                field: "use_sliding_window".into(),
                detail: format!(
                    "is true; tpinfer runs {model_type} with full attention (its published configs say false)"
                ),
            });
        }
        // Mistral's window: within it, attention is the full causal one, so contexts up to
        // the window run exactly and longer ones are not offered.
        let window = match (model_type, &raw.sliding_window) {
            ("mistral", Some(w)) if !w.is_null() => {
                Some(w.as_u64().filter(|&w| w > 0).ok_or_else(|| ConfigError::Invalid {
                    origin: origin.to_string(),
                    field: "sliding_window".into(),
                    detail: format!("is {w}; it must be a positive number of positions, or null"),
                })? as usize)
            }
            _ => None,
        };
        // The MLP is SiLU-gated: another activation would run as SiLU without a word.
        if let Some(act) = raw.hidden_act.as_deref().filter(|act| *act != "silu") {
            return Err(ConfigError::Invalid {
                origin: origin.to_string(),
                field: "hidden_act".into(),
                detail: format!("is `{act}`; tpinfer runs Llama's `silu`"),
            });
        }
        let hidden_size = raw.hidden_size.ok_or_else(|| missing("hidden_size"))?;
        let num_attention_heads = raw.num_attention_heads.ok_or_else(|| missing("num_attention_heads"))?;
        // transformers 5 moves rope settings into `rope_parameters`; 4 keeps `rope_theta` and
        // `rope_scaling`. Both may be present in converted files; the newer form wins.
        let rope = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) => Some(("rope_parameters", p)),
            (None, Some(s)) => Some(("rope_scaling", s)),
            (None, None) => None,
        };
        let rope_theta = match raw.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")) {
            Some(theta) => theta.as_f64().ok_or_else(|| ConfigError::Invalid {
                origin: origin.to_string(),
                field: "rope_parameters.rope_theta".into(),
                detail: format!("is {theta}; it must be a number"),
            })?,
            None => raw.rope_theta.unwrap_or(10_000.0),
        };
        if let Some(method) = raw.quantization_config.as_ref().map(|q| q.get("quant_method")) {
            let method = method.and_then(Json::as_str).unwrap_or("none given");
            if method != "compressed-tensors" {
                return Err(ConfigError::Unsupported {
                    origin: origin.to_string(),
                    detail: format!(
                        "quantization_config.quant_method `{method}` is not supported: tpinfer loads FP8 \
                         compressed-tensors checkpoints and GGUF files; or give a bf16 checkpoint with --quantize fp8"
                    ),
                });
            }
        }
        let dtype_name = raw.dtype.as_deref().or(raw.torch_dtype.as_deref());
        let trained = raw
            .max_position_embeddings
            .ok_or_else(|| missing("max_position_embeddings"))?;
        let rope_scaling = rope_scaling(rope, trained, origin)?;
        let max_position_embeddings = RopeScaling::reach(rope_scaling.as_ref(), trained);
        let config = Self {
            hidden_size,
            intermediate_size: raw.intermediate_size.ok_or_else(|| missing("intermediate_size"))?,
            num_hidden_layers: raw.num_hidden_layers.ok_or_else(|| missing("num_hidden_layers"))?,
            num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim: raw.head_dim.unwrap_or(hidden_size / num_attention_heads.max(1)),
            vocab_size: raw.vocab_size.ok_or_else(|| missing("vocab_size"))?,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: max_position_embeddings.min(window.unwrap_or(usize::MAX)),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: qwen2 || raw.attention_bias.unwrap_or(false),
            o_bias: !qwen2 && raw.attention_bias.unwrap_or(false),
            qk_norm: qwen3,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            dtype: dtype_name.and_then(parse_dtype),
            bos_token_id: token_ids(raw.bos_token_id.as_ref(), origin, "bos_token_id")?
                .first()
                .copied(),
            eos_token_ids: token_ids(raw.eos_token_id.as_ref(), origin, "eos_token_id")?,
            row_block: 1,
        };
        config.validate(origin)?;
        Ok(config)
    }

    /// Reads the hyper-parameters of a GGUF file of llama.cpp's `llama` architecture (Llama,
    /// and Mistral, which llama.cpp writes as llama), `qwen2` or `qwen3`.
    pub fn from_gguf(
        metadata: &HashMap<String, Value>,
        has_output_weight: bool,
        origin: &str,
    ) -> Result<Self, ConfigError> {
        let missing = |field: &str| ConfigError::Missing {
            origin: origin.to_string(),
            field: field.to_string(),
        };
        let arch = metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| missing("general.architecture"))?;
        if !GGUF_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(ConfigError::Unsupported {
                origin: origin.to_string(),
                detail: format!(
                    "GGUF architecture `{arch}` is not one tpinfer reads: {} (Mistral's files are llama's)",
                    GGUF_ARCHITECTURES.join(", ")
                ),
            });
        }
        // The keys are prefixed by the architecture: `llama.block_count`, `qwen2.block_count`.
        let key = |field: &str| format!("{arch}.{field}");
        let int = |field: &str| -> Result<usize, ConfigError> {
            let key = key(field);
            let v = metadata.get(&key).ok_or_else(|| missing(&key))?;
            v.to_u32()
                .map(|x| x as usize)
                .or_else(|_| v.to_u64().map(|x| x as usize))
                .map_err(|e| ConfigError::Invalid {
                    origin: origin.to_string(),
                    field: key.clone(),
                    detail: e.to_string(),
                })
        };
        let float = |field: &str| metadata.get(&key(field)).and_then(|v| v.to_f32().ok()).map(f64::from);
        let hidden_size = int("embedding_length")?;
        let num_attention_heads = int("attention.head_count")?;
        let vocab_size = match int("vocab_size") {
            Ok(v) => v,
            Err(_) => metadata
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.to_vec().ok())
                .map(Vec::len)
                .ok_or_else(|| missing(&key("vocab_size")))?,
        };
        let token = |key: &str| metadata.get(key).and_then(|v| v.to_u32().ok());
        let trained = int("context_length")?;
        let rope_scaling = gguf_rope_scaling(metadata, arch, trained, origin)?;
        let max_position_embeddings = RopeScaling::reach(rope_scaling.as_ref(), trained);
        let config = Self {
            hidden_size,
            intermediate_size: int("feed_forward_length")?,
            num_hidden_layers: int("block_count")?,
            num_attention_heads,
            num_key_value_heads: int("attention.head_count_kv").unwrap_or(num_attention_heads),
            head_dim: int("rope.dimension_count").unwrap_or(hidden_size / num_attention_heads.max(1)),
            vocab_size,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: float("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: !has_output_weight,
            qkv_bias: arch == "qwen2",
            o_bias: false,
            qk_norm: arch == "qwen3",
            mlp_bias: false,
            dtype: None,
            bos_token_id: token("tokenizer.ggml.bos_token_id"),
            eos_token_ids: token("tokenizer.ggml.eos_token_id").into_iter().collect(),
            row_block: 1,
        };
        config.validate(origin)?;
        Ok(config)
    }

    /// The GGUF architecture this model is written as: `qwen3` with per-head Q/K norms,
    /// `qwen2` where only Q, K and V have biases (Qwen2's layout), else `llama`.
    pub fn gguf_architecture(&self) -> &'static str {
        match (self.qk_norm, self.qkv_bias && !self.o_bias) {
            (true, _) => "qwen3",
            (false, true) => "qwen2",
            (false, false) => "llama",
        }
    }

    fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = |field: &str, detail: String| ConfigError::Invalid {
            origin: origin.to_string(),
            field: field.to_string(),
            detail,
        };
        for (field, value) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be positive".to_string()));
            }
        }
        // Bounds no published model comes near, so that no loop runs a billion layers and no
        // product the plan takes wraps.
        for (field, value, limit) in [
            ("hidden_size", self.hidden_size, 1 << 17),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("num_hidden_layers", self.num_hidden_layers, 1024),
            ("num_attention_heads", self.num_attention_heads, 1024),
            ("num_key_value_heads", self.num_key_value_heads, 1024),
            ("head_dim", self.head_dim, 1024),
            ("vocab_size", self.vocab_size, 1 << 24),
            ("max_position_embeddings", self.max_position_embeddings, 1 << 24),
        ] {
            if value > limit {
                return Err(invalid(field, format!("is {value}, above the {limit} tpinfer takes")));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "({}) must divide num_attention_heads ({})",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("({}) must be even for rotary embeddings", self.head_dim),
            ));
        }
        Ok(())
    }
}

fn parse_dtype(name: &str) -> Option<DType> {
    match name {
        "float32" => Some(DType::F32),
        "float16" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        _ => None,
    }
}

fn token_ids(value: Option<&Json>, origin: &str, field: &str) -> Result<Vec<u32>, ConfigError> {
    let invalid = || ConfigError::Invalid {
        origin: origin.to_string(),
        field: field.to_string(),
        detail: "must be a token id or a list of token ids".to_string(),
    };
    let id = |v: &Json| v.as_u64().map(|x| x as u32).ok_or_else(invalid);
    match value {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(ids)) => ids.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

/// A GGUF file's rope scaling (`{arch}.rope.scaling.*`, llama.cpp's keys): YaRN, with its
/// factor, original context (else `trained`) and attention factor (llama.cpp's `attn_factor`
/// times YaRN's own), or none. Llama 3.1's comes as `rope_freqs` instead, read apart.
fn gguf_rope_scaling(
    metadata: &HashMap<String, Value>,
    arch: &str,
    trained: usize,
    origin: &str,
) -> Result<Option<RopeScaling>, ConfigError> {
    let key = |field: &str| format!("{arch}.rope.scaling.{field}");
    let kind = metadata.get(&key("type")).and_then(|v| v.to_string().ok());
    let number = |field: &str| -> Result<Option<f64>, ConfigError> {
        match metadata.get(&key(field)) {
            None => Ok(None),
            Some(v) => {
                let x = v
                    .to_f32()
                    .map(f64::from)
                    .or_else(|_| v.to_u32().map(f64::from))
                    .or_else(|_| v.to_u64().map(|x| x as f64))
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0);
                x.map(Some).ok_or_else(|| ConfigError::Invalid {
                    origin: origin.to_string(),
                    field: key(field),
                    detail: format!("is {v:?}; it must be a number above 0"),
                })
            }
        }
    };
    match kind.map(String::as_str) {
        None | Some("none") => Ok(None),
        Some("yarn") => {
            let factor = number("factor")?.ok_or_else(|| ConfigError::Missing {
                origin: origin.to_string(),
                field: key("factor"),
            })?;
            Ok(Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: number("original_context_length")?.unwrap_or(trained as f64) as usize,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: number("attn_factor")?.unwrap_or(1.0) * RopeScaling::yarn_mscale(factor, 1.0),
                truncate: true,
            }))
        }
        Some(other) => Err(ConfigError::Unsupported {
            origin: origin.to_string(),
            detail: format!("{}: `{other}` is not supported (tpinfer reads `yarn`)", key("type")),
        }),
    }
}

/// Reads a `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) object,
/// `key` naming which in errors; `trained` is the config's `max_position_embeddings`.
fn rope_scaling(
    value: Option<(&str, &Json)>,
    trained: usize,
    origin: &str,
) -> Result<Option<RopeScaling>, ConfigError> {
    let Some((key, value)) = value.filter(|(_, v)| !v.is_null()) else {
        return Ok(None);
    };
    let invalid = |name: &str, detail: String| ConfigError::Invalid {
        origin: origin.to_string(),
        field: format!("{key}.{name}"),
        detail,
    };
    let kind = match value.get("rope_type").or_else(|| value.get("type")) {
        None => "default",
        Some(kind) => kind.as_str().ok_or_else(|| {
            invalid(
                "rope_type",
                format!("is {kind}; it must be a name, `default`, `llama3` or `yarn`"),
            )
        })?,
    };
    let field = |name: &str| -> Result<f64, ConfigError> {
        match value.get(name) {
            None => Err(ConfigError::Missing {
                origin: origin.to_string(),
                field: format!("{key}.{name}"),
            }),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| invalid(name, format!("is {v}; it must be a number above 0"))),
        }
    };
    // An optional positive number, `default` where absent or null.
    let optional = |name: &str, default: f64| -> Result<f64, ConfigError> {
        match value.get(name).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(_) => field(name),
        }
    };
    match kind {
        "default" => Ok(None),
        // transformers' `yarn`, as vLLM reads it: the factor as given (transformers 5 takes
        // max_position_embeddings / original_max_position_embeddings instead where the
        // latter is given, which for Qwen2.5's config is 1: no scaling).
        "yarn" => {
            let factor = field("factor")?;
            let mscale = |all: &str| optional(all, 0.0);
            let attention_factor = match (
                value.get("attention_factor").filter(|v| !v.is_null()),
                mscale("mscale")?,
                mscale("mscale_all_dim")?,
            ) {
                (Some(_), _, _) => field("attention_factor")?,
                (None, m, all) if m > 0.0 && all > 0.0 => {
                    RopeScaling::yarn_mscale(factor, m) / RopeScaling::yarn_mscale(factor, all)
                }
                _ => RopeScaling::yarn_mscale(factor, 1.0),
            };
            let truncate = match value.get("truncate") {
                None | Some(Json::Null) => true,
                Some(t) => t
                    .as_bool()
                    .ok_or_else(|| invalid("truncate", format!("is {t}; it must be true or false")))?,
            };
            Ok(Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: optional("original_max_position_embeddings", trained as f64)?
                    as usize,
                beta_fast: optional("beta_fast", 32.0)?,
                beta_slow: optional("beta_slow", 1.0)?,
                attention_factor,
                truncate,
            }))
        }
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: field("factor")?,
            low_freq_factor: field("low_freq_factor")?,
            high_freq_factor: field("high_freq_factor")?,
            original_max_position_embeddings: field("original_max_position_embeddings")? as usize,
        })),
        other => Err(ConfigError::Unsupported {
            origin: origin.to_string(),
            detail: format!("rope type `{other}` is not supported (tpinfer supports `default`, `llama3` and `yarn`)"),
        }),
    }
}
