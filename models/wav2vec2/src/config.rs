use std::path::Path;

use serde_json::Value;
use tpinfer_family::ConfigError;

/// The most samples one encoder frame may span (17 minutes at 16 kHz).
const MAX_RECEPTIVE_FIELD: usize = 1 << 24;

/// One layer of the convolutional feature encoder: `dim` output channels, a `kernel`-wide
/// window moved `stride` samples (or frames) at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvLayer {
    pub dim: usize,
    pub kernel: usize,
    pub stride: usize,
}

/// The shape of a wav2vec2 encoder, in the terms of transformers' `Wav2Vec2Config`. tpinfer
/// runs the "stable layer norm" form of the large models (pre-norm layers, a LayerNorm after
/// every feature convolution), which S2V's wav2vec2-large-xlsr-53-english is.
#[derive(Debug, Clone, PartialEq)]
pub struct Wav2Vec2Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub conv: Vec<ConvLayer>,
    pub conv_bias: bool,
    /// The positional convolution's kernel width and groups.
    pub num_conv_pos_embeddings: usize,
    pub num_conv_pos_embedding_groups: usize,
    pub layer_norm_eps: f64,
}

impl Wav2Vec2Config {
    /// Reads a speech encoder directory's `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let (text, origin) = tpinfer_family::read_config(dir)?;
        Self::from_json(&text, &origin)
    }

    /// Parses a `Wav2Vec2Config`; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let v: Value = tpinfer_family::parse_config(text, origin, "a wav2vec2 config")?;
        let field = |detail: String| ConfigError::Field {
            path: origin.to_string(),
            detail,
        };
        let positive = |key: &str, n: u64| match n {
            0 => Err(field(format!("`{key}` holds 0; it must be at least 1"))),
            n => Ok(n as usize),
        };
        let int = |key: &str, default: Option<usize>| -> Result<usize, ConfigError> {
            match (v.get(key).map(Value::as_u64), default) {
                (Some(Some(n)), _) => positive(key, n),
                (Some(None), _) => Err(field(format!("`{key}` is not a whole number"))),
                (None, Some(d)) => Ok(d),
                (None, None) => Err(field(format!("missing `{key}`"))),
            }
        };
        let list = |key: &str| -> Result<Vec<usize>, ConfigError> {
            let items = v
                .get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| field(format!("missing `{key}` (a list of whole numbers)")))?;
            items
                .iter()
                .map(|n| match n.as_u64() {
                    Some(n) => positive(key, n),
                    None => Err(field(format!("`{key}` holds {n}, not a whole number"))),
                })
                .collect()
        };
        let text_field = |key: &str, default: &str| v.get(key).and_then(Value::as_str).unwrap_or(default).to_string();
        for (key, default, wanted, why) in [
            (
                "feat_extract_norm",
                "group",
                "layer",
                "a LayerNorm after every feature convolution",
            ),
            ("hidden_act", "gelu", "gelu", "the exact (erf) GELU"),
            ("feat_extract_activation", "gelu", "gelu", "the exact (erf) GELU"),
        ] {
            let found = text_field(key, default);
            if found != wanted {
                return Err(field(format!(
                    "`{key}` is `{found}`: tpinfer runs wav2vec2 with `{wanted}` ({why}), as the large models S2V uses have it"
                )));
            }
        }
        if v.get("do_stable_layer_norm").and_then(Value::as_bool) != Some(true) {
            return Err(field(
                "`do_stable_layer_norm` is not true: tpinfer runs the pre-norm wav2vec2 of the large models S2V uses"
                    .into(),
            ));
        }
        let (dims, kernels, strides) = (list("conv_dim")?, list("conv_kernel")?, list("conv_stride")?);
        if dims.is_empty() || dims.len() != kernels.len() || dims.len() != strides.len() {
            return Err(field(format!(
                "`conv_dim`, `conv_kernel` and `conv_stride` must list the same layers, at least one; they hold {}, {} and {}",
                dims.len(),
                kernels.len(),
                strides.len()
            )));
        }
        let config = Self {
            hidden_size: int("hidden_size", None)?,
            num_hidden_layers: int("num_hidden_layers", None)?,
            num_attention_heads: int("num_attention_heads", None)?,
            intermediate_size: int("intermediate_size", None)?,
            conv: dims
                .iter()
                .zip(&kernels)
                .zip(&strides)
                .map(|((&dim, &kernel), &stride)| ConvLayer { dim, kernel, stride })
                .collect(),
            conv_bias: v.get("conv_bias").and_then(Value::as_bool).unwrap_or(false),
            num_conv_pos_embeddings: int("num_conv_pos_embeddings", Some(128))?,
            num_conv_pos_embedding_groups: int("num_conv_pos_embedding_groups", Some(16))?,
            layer_norm_eps: v.get("layer_norm_eps").and_then(Value::as_f64).unwrap_or(1e-5),
        };
        // Bounds no published model comes near, so that no loop runs a billion layers and no
        // product the plan takes wraps.
        let widest_conv = config
            .conv
            .iter()
            .map(|c| c.dim.max(c.kernel).max(c.stride))
            .max()
            .unwrap_or(0);
        for (key, value, limit) in [
            ("hidden_size", config.hidden_size, 1 << 16),
            ("num_hidden_layers", config.num_hidden_layers, 1024),
            ("num_attention_heads", config.num_attention_heads, 1024),
            ("intermediate_size", config.intermediate_size, 1 << 18),
            ("conv_dim, conv_kernel and conv_stride", widest_conv, 1 << 14),
            ("conv_dim (its length)", config.conv.len(), 64),
            ("num_conv_pos_embeddings", config.num_conv_pos_embeddings, 1 << 12),
        ] {
            if value > limit {
                return Err(field(format!("`{key}` is {value}, above the {limit} tpinfer takes")));
            }
        }
        // A frame's span of samples, and the hop between frames, grow with every layer's
        // stride: bounded, so that no product of strides wraps.
        let span = config
            .conv
            .iter()
            .rev()
            .try_fold(1usize, |n, c| (n - 1).checked_mul(c.stride)?.checked_add(c.kernel));
        let hop = config.conv.iter().try_fold(1usize, |n, c| n.checked_mul(c.stride));
        if span.max(hop).is_none_or(|n| n > MAX_RECEPTIVE_FIELD) || span.is_none() || hop.is_none() {
            return Err(field(format!(
                "`conv_kernel` and `conv_stride` make frames span or lie apart by more than {MAX_RECEPTIVE_FIELD} \
                 samples; wav2vec2's span 400 and lie 320 apart"
            )));
        }
        for (key, divisor) in [
            ("num_attention_heads", config.num_attention_heads),
            ("num_conv_pos_embedding_groups", config.num_conv_pos_embedding_groups),
        ] {
            if !config.hidden_size.is_multiple_of(divisor) {
                return Err(field(format!(
                    "`hidden_size` {} is not a multiple of `{key}` {divisor}",
                    config.hidden_size
                )));
            }
        }
        Ok(config)
    }

    /// jonatasgrosman/wav2vec2-large-xlsr-53-english, the encoder Wan2.2-S2V ships.
    pub fn xlsr_53() -> Self {
        let layer = |kernel, stride| ConvLayer {
            dim: 512,
            kernel,
            stride,
        };
        let mut conv = vec![layer(10, 5)];
        conv.extend([layer(3, 2); 4]);
        conv.extend([layer(2, 2); 2]);
        Self {
            hidden_size: 1024,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            intermediate_size: 4096,
            conv,
            conv_bias: true,
            num_conv_pos_embeddings: 128,
            num_conv_pos_embedding_groups: 16,
            layer_norm_eps: 1e-5,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The encoder frames of `samples` audio samples: each convolution's valid outputs.
    /// Zero when the audio is shorter than the encoder's receptive field.
    pub fn frames(&self, samples: usize) -> usize {
        self.conv.iter().fold(samples, |n, c| match n >= c.kernel {
            true => (n - c.kernel) / c.stride + 1,
            false => 0,
        })
    }

    /// The fewest samples that make one frame.
    pub fn receptive_field(&self) -> usize {
        self.samples_for(1)
    }

    /// The fewest samples that make `frames` frames (at least one).
    pub fn samples_for(&self, frames: usize) -> usize {
        self.conv
            .iter()
            .rev()
            .fold(frames.max(1), |n, c| (n - 1) * c.stride + c.kernel)
    }

    /// Whether a directory's `config.json` is a wav2vec2 model's.
    pub fn is_wav2vec2_dir(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json")).is_ok_and(|t| t.contains("\"wav2vec2\""))
    }
}
