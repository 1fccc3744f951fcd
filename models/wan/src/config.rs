use std::path::Path;

use serde::Deserialize;

/// The shape of a Wan DiT, in the terms of diffusers' `WanTransformer3DModel` config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct WanConfig {
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub text_dim: usize,
    pub freq_dim: usize,
    pub ffn_dim: usize,
    pub num_layers: usize,
    pub patch_size: [usize; 3],
    /// Whether cross-attention has an affine LayerNorm (`norm2`) before it.
    #[serde(default = "yes")]
    pub cross_attn_norm: bool,
    /// The speech-to-video modules of Wan2.2-S2V, when the model has them.
    #[serde(skip)]
    pub s2v: Option<S2vModules>,
}

fn yes() -> bool {
    true
}

/// Wan2.2-S2V's modules around the DiT (`wan/modules/s2v/model_s2v.py`): audio cross-attention
/// injected after some blocks, with AdaIN; a causal audio encoder; the frame-pack motion
/// encoder; a pose/condition encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S2vModules {
    /// Blocks followed by an audio cross-attention.
    pub audio_inject_layers: usize,
    /// Width of the wav2vec features the audio encoder reads.
    pub audio_dim: usize,
    /// Audio tokens per latent frame.
    pub num_audio_token: usize,
    /// Channels of the condition (pose) latents.
    pub cond_dim: usize,
}

/// Why a Wan config could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WanConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a WanTransformer3DModel config: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

impl WanConfig {
    /// Reads a diffusers transformer directory's `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, WanConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| WanConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| WanConfigError::Parse {
            path: path.display().to_string(),
            source,
        })
    }

    /// Wan2.1-T2V-1.3B as published.
    pub fn wan21_t2v_1_3b() -> Self {
        Self::t2v(12, 8960, 30)
    }

    /// Wan2.1-T2V-14B (and each expert of Wan2.2-T2V-A14B) as published.
    pub fn wan21_t2v_14b() -> Self {
        Self::t2v(40, 13824, 40)
    }

    /// Wan2.2-S2V-14B: the 14B DiT with the speech-to-video modules of its published config
    /// (`wan/configs/wan_s2v_14B.py`: audio injected after 12 blocks, AdaIN, frame pack).
    pub fn wan22_s2v_14b() -> Self {
        Self {
            s2v: Some(S2vModules {
                audio_inject_layers: 12,
                audio_dim: 1024,
                num_audio_token: 4,
                cond_dim: 16,
            }),
            ..Self::wan21_t2v_14b()
        }
    }

    fn t2v(heads: usize, ffn_dim: usize, layers: usize) -> Self {
        Self {
            num_attention_heads: heads,
            attention_head_dim: 128,
            in_channels: 16,
            out_channels: 16,
            text_dim: 4096,
            freq_dim: 256,
            ffn_dim,
            num_layers: layers,
            patch_size: [1, 2, 2],
            cross_attn_norm: true,
            s2v: None,
        }
    }

    /// The model width: heads × head dim.
    pub fn hidden_size(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// The number of video tokens for `frames` frames (4k + 1) of `width` × `height` pixels:
    /// the VAE compresses time 4× and space 8×, then patches are 1 × 2 × 2 latents.
    pub fn video_tokens(&self, frames: usize, width: usize, height: usize) -> usize {
        let latent_frames = (frames.saturating_sub(1)) / 4 + 1;
        let [pt, ph, pw] = self.patch_size;
        latent_frames.div_ceil(pt) * (height / 8).div_ceil(ph) * (width / 8).div_ceil(pw)
    }

    /// The number of latent values of one video: channels × latent frames × latent pixels.
    pub fn latent_elements(&self, frames: usize, width: usize, height: usize) -> usize {
        self.in_channels * ((frames.saturating_sub(1)) / 4 + 1) * (height / 8) * (width / 8)
    }
}
