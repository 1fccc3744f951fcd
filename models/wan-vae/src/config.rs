use std::path::Path;

use serde_json::Value;
use tpinfer_family::ConfigError;

/// The shape of a Wan video VAE, in the terms of diffusers' `AutoencoderKLWan` config.
#[derive(Debug, Clone, PartialEq)]
pub struct WanVaeConfig {
    /// The decoder's base width (`decoder_base_dim`, else `base_dim`).
    pub base_dim: usize,
    /// The encoder's base width (`base_dim`).
    pub encoder_base_dim: usize,
    /// Latent channels.
    pub z_dim: usize,
    /// Width multipliers of the encoder's levels; the decoder runs them in reverse.
    pub dim_mult: Vec<usize>,
    pub num_res_blocks: usize,
    /// Which encoder levels halve time; the decoder doubles time where they halved it.
    pub temperal_downsample: Vec<bool>,
    /// Per latent channel: the DiT's latents are `(z - mean) / std`.
    pub latents_mean: Vec<f32>,
    pub latents_std: Vec<f32>,
    pub out_channels: usize,
}

/// Bounds no published VAE comes near, so that no loop runs away and no product wraps.
const MAX_WIDTH: usize = 1 << 14;
const MAX_LEVELS: usize = 8;
const MAX_RES_BLOCKS: usize = 64;

impl WanVaeConfig {
    /// Reads a VAE directory's `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let (text, origin) = tpinfer_family::read_config(dir)?;
        Self::from_json(&text, &origin)
    }

    /// Parses an `AutoencoderKLWan` config; `origin` names it in errors. Absent fields take
    /// diffusers' defaults, which are Wan2.1's VAE; a field of the wrong type is an error.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let v: Value = tpinfer_family::parse_config(text, origin, "an AutoencoderKLWan config")?;
        let field = |detail: String| ConfigError::Field {
            path: origin.to_string(),
            detail,
        };
        let present = |key: &str| v.get(key).filter(|x| !x.is_null());
        let int = |key: &str, default: usize, limit: usize| -> Result<usize, ConfigError> {
            match present(key) {
                None => Ok(default),
                Some(x) => match x.as_u64() {
                    Some(n) if n >= 1 && n <= limit as u64 => Ok(n as usize),
                    _ => Err(field(format!(
                        "`{key}` is {x}; it must be a whole number from 1 to {limit}"
                    ))),
                },
            }
        };
        let list = |key: &str| -> Result<Option<&Vec<Value>>, ConfigError> {
            match present(key) {
                None => Ok(None),
                Some(Value::Array(items)) => Ok(Some(items)),
                Some(x) => Err(field(format!("`{key}` is {x}; it must be a list"))),
            }
        };
        if let Some(x) = present("is_residual").filter(|x| **x != Value::Bool(false)) {
            return Err(field(format!(
                "`is_residual` is {x}: that is Wan2.2's VAE, which tpinfer does not decode yet (Wan2.1's VAE only)"
            )));
        }
        if let Some(x) = present("patch_size") {
            return Err(field(format!(
                "`patch_size` is {x}: patchified VAEs (Wan2.2's) are not supported; Wan2.1's has none"
            )));
        }
        let base = int("base_dim", 96, MAX_WIDTH)?;
        let base_dim = int("decoder_base_dim", base, MAX_WIDTH)?;
        let z_dim = int("z_dim", 16, MAX_WIDTH)?;
        let dim_mult = match list("dim_mult")? {
            None => vec![1, 2, 4, 4],
            Some(items) => items
                .iter()
                .map(|x| match x.as_u64() {
                    Some(n) if (1..=64).contains(&n) => Ok(n as usize),
                    _ => Err(field(format!(
                        "`dim_mult` holds {x}; each must be a whole number from 1 to 64"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        if dim_mult.is_empty() || dim_mult.len() > MAX_LEVELS {
            return Err(field(format!(
                "`dim_mult` has {} levels; it must have 1 to {MAX_LEVELS}",
                dim_mult.len()
            )));
        }
        let temperal_downsample = match list("temperal_downsample")? {
            None => vec![false, true, true],
            Some(items) => items
                .iter()
                .map(|x| {
                    x.as_bool()
                        .ok_or_else(|| field(format!("`temperal_downsample` holds {x}; each must be true or false")))
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        if temperal_downsample.len() != dim_mult.len() - 1 {
            return Err(field(format!(
                "`temperal_downsample` has {} entries; with {} levels in `dim_mult` it needs {}",
                temperal_downsample.len(),
                dim_mult.len(),
                dim_mult.len() - 1
            )));
        }
        let per_channel = |key: &str, default: &[f32], positive: bool| -> Result<Vec<f32>, ConfigError> {
            let values = match list(key)? {
                None if z_dim == 16 => return Ok(default.to_vec()),
                None => {
                    return Err(field(format!(
                        "missing `{key}` (one value per latent channel, {z_dim})"
                    )))
                }
                Some(items) => items
                    .iter()
                    .map(|x| match x.as_f64() {
                        Some(f) if f.is_finite() && (!positive || f > 0.0) => Ok(f as f32),
                        _ => Err(field(format!(
                            "`{key}` holds {x}; each must be a finite number{}",
                            if positive { " above 0" } else { "" }
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            };
            match values.len() == z_dim {
                true => Ok(values),
                false => Err(field(format!(
                    "`{key}` has {} values for {z_dim} latent channels (`z_dim`)",
                    values.len()
                ))),
            }
        };
        let config = Self {
            base_dim,
            encoder_base_dim: base,
            z_dim,
            latents_mean: per_channel("latents_mean", &WAN21_LATENTS_MEAN, false)?,
            latents_std: per_channel("latents_std", &WAN21_LATENTS_STD, true)?,
            num_res_blocks: int("num_res_blocks", 2, MAX_RES_BLOCKS)?,
            out_channels: int("out_channels", 3, 64)?,
            dim_mult,
            temperal_downsample,
        };
        if config.widths().iter().any(|&w| w > MAX_WIDTH || w % 2 == 1) {
            return Err(field(format!(
                "`base_dim` {} × `dim_mult` {:?} gives widths {:?}; each must be even and at most {MAX_WIDTH}",
                config.base_dim,
                config.dim_mult,
                config.widths()
            )));
        }
        Ok(config)
    }

    /// Wan2.1's VAE (`Wan2.1_VAE.pth`, diffusers' `vae/` of every Wan2.1 and Wan2.2 A14B
    /// pipeline).
    pub fn wan21() -> Self {
        Self {
            base_dim: 96,
            encoder_base_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temperal_downsample: vec![false, true, true],
            latents_mean: WAN21_LATENTS_MEAN.to_vec(),
            latents_std: WAN21_LATENTS_STD.to_vec(),
            out_channels: 3,
        }
    }

    /// Whether a directory's `config.json` is an `AutoencoderKLWan`'s.
    pub fn is_wan_vae_dir(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json")).is_ok_and(|t| t.contains("AutoencoderKLWan"))
    }

    /// The decoder's widths: the middle's, then each up block's output, from the latent side.
    pub fn widths(&self) -> Vec<usize> {
        let mut widths = vec![self.base_dim * self.dim_mult[self.dim_mult.len() - 1]];
        widths.extend(self.dim_mult.iter().rev().map(|m| self.base_dim * m));
        widths
    }

    /// For each up block, from the latent side: whether it doubles time. The last block does
    /// not upsample at all.
    pub fn temporal_upsample(&self) -> Vec<bool> {
        self.temperal_downsample.iter().rev().copied().collect()
    }

    /// How many pixels a latent spans in height and width.
    pub fn spatial_factor(&self) -> usize {
        1 << (self.dim_mult.len() - 1)
    }

    /// How many frames each latent frame after the first decodes to.
    pub fn temporal_factor(&self) -> usize {
        1 << self.temperal_downsample.iter().filter(|&&t| t).count()
    }

    /// The frames `latent_frames` latent frames decode to: the first to one, each other to
    /// [`Self::temporal_factor`].
    pub fn frames(&self, latent_frames: usize) -> usize {
        match latent_frames {
            0 => 0,
            n => 1 + (n - 1) * self.temporal_factor(),
        }
    }
}

const WAN21_LATENTS_MEAN: [f32; 16] = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632, -0.1922,
    -0.9497, 0.2503, -0.2921,
];
const WAN21_LATENTS_STD: [f32; 16] = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253,
    2.8251, 1.9160,
];
