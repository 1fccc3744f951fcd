use std::path::Path;

use serde_json::Value;
use tpinfer_family::ConfigError;

/// The shape of a umT5 encoder, in the terms of transformers' `UMT5Config`.
#[derive(Debug, Clone, PartialEq)]
pub struct Umt5Config {
    pub vocab_size: usize,
    pub d_model: usize,
    /// Each head's width.
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub layer_norm_epsilon: f64,
}

impl Umt5Config {
    /// Reads a text encoder directory's `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let (text, origin) = tpinfer_family::read_config(dir)?;
        Self::from_json(&text, &origin)
    }

    /// Parses a `UMT5Config`; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let v: Value = tpinfer_family::parse_config(text, origin, "a UMT5 config")?;
        let field = |detail: String| ConfigError::Field {
            path: origin.to_string(),
            detail,
        };
        let int = |key: &str, default: Option<usize>| -> Result<usize, ConfigError> {
            match (v.get(key).and_then(Value::as_u64), default) {
                (Some(n), _) if n > 0 => Ok(n as usize),
                (Some(n), _) => Err(field(format!("`{key}` is {n}; it must be at least 1"))),
                (None, Some(d)) => Ok(d),
                (None, None) => Err(field(format!("missing `{key}`"))),
            }
        };
        // Wan's encoder: gated GELU (tanh approximation) feed-forward.
        let ffn = v
            .get("feed_forward_proj")
            .and_then(Value::as_str)
            .unwrap_or("gated-gelu");
        if ffn != "gated-gelu" {
            return Err(field(format!(
                "`feed_forward_proj` is `{ffn}`: tpinfer runs umT5's `gated-gelu` only"
            )));
        }
        if v.get("is_decoder").and_then(Value::as_bool) == Some(true) {
            return Err(field("`is_decoder` is true: tpinfer runs the umT5 encoder only".into()));
        }
        let config = Self {
            vocab_size: int("vocab_size", None)?,
            d_model: int("d_model", None)?,
            d_kv: int("d_kv", None)?,
            d_ff: int("d_ff", None)?,
            num_layers: int("num_layers", None)?,
            num_heads: int("num_heads", None)?,
            relative_attention_num_buckets: int("relative_attention_num_buckets", Some(32))?,
            relative_attention_max_distance: int("relative_attention_max_distance", Some(128))?,
            layer_norm_epsilon: v.get("layer_norm_epsilon").and_then(Value::as_f64).unwrap_or(1e-6),
        };
        config.validated(origin)
    }

    /// This config, if tpinfer runs it; `origin` names where it came from in errors.
    pub fn validated(self, origin: &str) -> Result<Self, ConfigError> {
        let config = self;
        let field = |detail: String| ConfigError::Field {
            path: origin.to_string(),
            detail,
        };
        // Bounds no published model comes near, so that no loop runs a billion layers and no
        // product the plan takes wraps.
        for (key, value, limit) in [
            ("vocab_size", config.vocab_size, 1 << 24),
            ("d_model", config.d_model, 1 << 17),
            ("d_kv", config.d_kv, 1024),
            ("d_ff", config.d_ff, 1 << 20),
            ("num_layers", config.num_layers, 1024),
            ("num_heads", config.num_heads, 1024),
            (
                "relative_attention_num_buckets",
                config.relative_attention_num_buckets,
                1024,
            ),
            (
                "relative_attention_max_distance",
                config.relative_attention_max_distance,
                1 << 20,
            ),
        ] {
            if value > limit {
                return Err(field(format!("`{key}` is {value}, above the {limit} tpinfer takes")));
            }
        }
        // The bidirectional buckets split in two halves, each with an exact and a log part.
        if config.relative_attention_num_buckets < 4 {
            return Err(field(format!(
                "`relative_attention_num_buckets` is {}; it must be at least 4",
                config.relative_attention_num_buckets
            )));
        }
        Ok(config)
    }

    /// google/umt5-xxl's encoder, as Wan2.1 and Wan2.2 ship it.
    pub fn umt5_xxl() -> Self {
        Self {
            vocab_size: 256_384,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10_240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
        }
    }

    /// The width of the attention's queries, keys and values over all heads.
    pub fn inner_dim(&self) -> usize {
        self.num_heads * self.d_kv
    }

    /// Whether a directory's `config.json` is a umT5 encoder's.
    pub fn is_umt5_dir(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json"))
            .is_ok_and(|t| t.contains("UMT5EncoderModel") || t.contains("\"umt5\""))
    }
}
