//! A tiny random Wan VAE written in diffusers' format (`config.json`,
//! `diffusion_pytorch_model.safetensors`, the encoder's tensors too), and an unsplit
//! reference decoder written from diffusers' `AutoencoderKLWan` as a whole-video computation:
//! channels first, every causal convolution over the whole frame sequence with its zero
//! frames in front, no frame cache, no windows of rows.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tpinfer_wan_vae::{WanVaeConfig, WanVaeShard};

/// A VAE small enough for CPU tests, with Wan2.1's structure: four levels, time doubled by
/// the first two up blocks.
#[derive(Debug, Clone)]
pub struct TinyWanVae {
    pub base_dim: usize,
    pub z_dim: usize,
    pub num_res_blocks: usize,
    pub seed: u64,
}

impl Default for TinyWanVae {
    fn default() -> Self {
        Self {
            base_dim: 8,
            z_dim: 4,
            num_res_blocks: 1,
            seed: 23,
        }
    }
}

impl TinyWanVae {
    pub fn config(&self) -> WanVaeConfig {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x5eed);
        WanVaeConfig {
            base_dim: self.base_dim,
            encoder_base_dim: self.base_dim,
            z_dim: self.z_dim,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: self.num_res_blocks,
            temperal_downsample: vec![false, true, true],
            latents_mean: (0..self.z_dim).map(|_| rng.random_range(-1.0..1.0)).collect(),
            latents_std: (0..self.z_dim).map(|_| rng.random_range(0.5..3.0)).collect(),
            out_channels: 3,
        }
    }

    /// Writes `config.json` and the weights into `dir`; returns `dir`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).expect("create vae dir");
        let c = self.config();
        let config = json!({
            "_class_name": "AutoencoderKLWan", "_diffusers_version": "0.35.2", "attn_scales": [],
            "base_dim": c.base_dim, "dim_mult": c.dim_mult, "dropout": 0.0, "latents_mean": c.latents_mean,
            "latents_std": c.latents_std, "num_res_blocks": c.num_res_blocks,
            "temperal_downsample": c.temperal_downsample, "z_dim": c.z_dim
        });
        std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut decls = WanVaeShard::new(1, 0).expect("shard").weight_decls(&c);
        // A real checkpoint holds the encoder too, which decoding leaves alone.
        for (name, shape) in [
            ("encoder.conv_in.weight", vec![c.base_dim, 3, 3, 3, 3]),
            ("quant_conv.weight", vec![2 * c.z_dim, 2 * c.z_dim, 1, 1, 1]),
        ] {
            decls.push(tpinfer_weights::WeightDecl::new(
                name,
                &shape,
                tpinfer_weights::ShardSpec::Replicated,
            ));
        }
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = decls
            .into_iter()
            .map(|decl| {
                let n: usize = decl.shape.iter().product();
                let values: Vec<f32> = match decl.name.rsplit('.').next() {
                    Some("gamma") => (0..n).map(|_| rng.random_range(0.5..1.5)).collect(),
                    Some("bias") => (0..n).map(|_| rng.random_range(-0.1..0.1)).collect(),
                    _ => {
                        let fan_in = (n / decl.shape[0]) as f32;
                        (0..n)
                            .map(|_| rng.random_range(-1.0..1.0) * (3.0 / fan_in).sqrt())
                            .collect()
                    }
                };
                (
                    decl.name,
                    decl.shape,
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            })
            .collect();
        crate::write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &data);
        dir.to_path_buf()
    }
}

/// Normalised latents `[z, frames, h, w]` as a DiT leaves them: roughly unit normal.
pub fn vae_latents(z: usize, frames: usize, h: usize, w: usize, seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let values: Vec<f32> = (0..z * frames * h * w).map(|_| rng.random_range(-1.7..1.7)).collect();
    Tensor::from_vec(values, (z, frames, h, w), &Device::Cpu).expect("latents")
}

/// The reference decode of `latents` `[z, F, h, w]` with the VAE in `dir`: `[frames, 3, H, W]`
/// in [−1, 1], f32.
pub fn reference_vae_decode(dir: &Path, latents: &Tensor) -> Tensor {
    Reference::open(dir).decode(latents).expect("reference decode")
}

type R<T> = candle_core::Result<T>;

struct Reference {
    w: HashMap<String, Tensor>,
    c: WanVaeConfig,
}

impl Reference {
    fn open(dir: &Path) -> Self {
        let c = WanVaeConfig::from_dir(dir).expect("config");
        let w = candle_core::safetensors::load(dir.join("diffusion_pytorch_model.safetensors"), &Device::Cpu)
            .expect("weights");
        Self { w, c }
    }

    fn t(&self, name: &str) -> &Tensor {
        self.w.get(name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn decode(&self, latents: &Tensor) -> R<Tensor> {
        let z = self.c.z_dim;
        let mean = Tensor::from_slice(&self.c.latents_mean, (z, 1, 1, 1), &Device::Cpu)?;
        let std = Tensor::from_slice(&self.c.latents_std, (z, 1, 1, 1), &Device::Cpu)?;
        // [C, T, H, W] throughout.
        let x = latents.broadcast_mul(&std)?.broadcast_add(&mean)?;
        let x = self.conv3d(&x, "post_quant_conv")?;
        let x = self.conv3d(&x, "decoder.conv_in")?;
        let x = self.res(&x, "decoder.mid_block.resnets.0")?;
        let x = self.attention(&x, "decoder.mid_block.attentions.0")?;
        let mut x = self.res(&x, "decoder.mid_block.resnets.1")?;
        let temporal = self.c.temporal_upsample();
        for i in 0..self.c.dim_mult.len() {
            for j in 0..=self.c.num_res_blocks {
                x = self.res(&x, &format!("decoder.up_blocks.{i}.resnets.{j}"))?;
            }
            // Every level but the last upsamples.
            if let Some(&temporal) = temporal.get(i) {
                x = self.upsample(&x, &format!("decoder.up_blocks.{i}.upsamplers.0"), temporal)?;
            }
        }
        let x = self.conv3d(&silu(&self.norm(&x, "decoder.norm_out")?)?, "decoder.conv_out")?;
        x.clamp(-1f32, 1f32)?.permute((1, 0, 2, 3))?.contiguous()
    }

    /// A causal 3-D convolution over the whole sequence: time zero-padded in front by
    /// taps − 1, space by k / 2 on every side; each output frame the sum of its taps'
    /// 2-D convolutions.
    fn conv3d(&self, x: &Tensor, name: &str) -> R<Tensor> {
        let weight = self.t(&format!("{name}.weight"));
        let bias = self.t(&format!("{name}.bias"));
        let (cout, _, taps, k, _) = weight.dims5()?;
        let frames = x.dim(1)?;
        let x = x.pad_with_zeros(1, taps - 1, 0)?;
        let mut out = Vec::with_capacity(frames);
        for t in 0..frames {
            let mut sum: Option<Tensor> = None;
            for tap in 0..taps {
                let frame = x.narrow(1, t + tap, 1)?.squeeze(1)?.unsqueeze(0)?;
                let kernel = weight.narrow(2, tap, 1)?.squeeze(2)?.contiguous()?;
                let y = frame.conv2d(&kernel, k / 2, 1, 1, 1)?;
                sum = Some(match sum {
                    Some(s) => (s + y)?,
                    None => y,
                });
            }
            let y = sum.expect("taps").squeeze(0)?;
            out.push(y.broadcast_add(&bias.reshape((cout, 1, 1))?)?);
        }
        Tensor::stack(&out, 1)
    }

    /// F.normalize over channels (dim 0 here), times √C and γ.
    fn norm(&self, x: &Tensor, name: &str) -> R<Tensor> {
        let c = x.dim(0)?;
        let gamma = self.t(&format!("{name}.gamma")).reshape((c, 1, 1, 1))?;
        let norm = x.sqr()?.sum_keepdim(0)?.sqrt()?.maximum(1e-12)?;
        (x.broadcast_div(&norm)? * (c as f64).sqrt())?.broadcast_mul(&gamma)
    }

    fn res(&self, x: &Tensor, name: &str) -> R<Tensor> {
        let skip = match self.w.contains_key(&format!("{name}.conv_shortcut.weight")) {
            true => self.conv3d(x, &format!("{name}.conv_shortcut"))?,
            false => x.clone(),
        };
        let h = self.conv3d(
            &silu(&self.norm(x, &format!("{name}.norm1"))?)?,
            &format!("{name}.conv1"),
        )?;
        let h = self.conv3d(
            &silu(&self.norm(&h, &format!("{name}.norm2"))?)?,
            &format!("{name}.conv2"),
        )?;
        h + skip
    }

    /// One head over each frame's pixels, softmax(q kᵀ / √C) v, all queries at once.
    fn attention(&self, x: &Tensor, name: &str) -> R<Tensor> {
        let (c, frames, h, w) = x.dims4()?;
        let normed = self.norm(x, &format!("{name}.norm"))?;
        let mut out = Vec::with_capacity(frames);
        for t in 0..frames {
            let frame = normed.narrow(1, t, 1)?.squeeze(1)?.unsqueeze(0)?;
            let qkv = conv1x1(
                &frame,
                self.t(&format!("{name}.to_qkv.weight")),
                self.t(&format!("{name}.to_qkv.bias")),
            )?
            .reshape((3 * c, h * w))?
            .t()?;
            let q = qkv.narrow(1, 0, c)?;
            let k = qkv.narrow(1, c, c)?;
            let v = qkv.narrow(1, 2 * c, c)?;
            let scores = (q.matmul(&k.t()?)? / (c as f64).sqrt())?;
            let p = candle_nn_softmax(&scores)?;
            let o = p.matmul(&v)?.t()?.reshape((1, c, h, w))?;
            let o = conv1x1(
                &o,
                self.t(&format!("{name}.proj.weight")),
                self.t(&format!("{name}.proj.bias")),
            )?;
            out.push(o.squeeze(0)?);
        }
        Tensor::stack(&out, 1)? + x
    }

    /// Nearest 2× in space; the temporal kind first runs its time convolution over every
    /// frame but the first (causal, zero-padded) and makes each of them two.
    fn upsample(&self, x: &Tensor, name: &str, temporal: bool) -> R<Tensor> {
        let (c, frames, h, w) = x.dims4()?;
        let x = match temporal && frames > 1 {
            true => {
                let rest = self.conv3d(&x.narrow(1, 1, frames - 1)?, &format!("{name}.time_conv"))?;
                // [2C, T−1] → frame 2j is the first half of channels of frame j, 2j+1 the second.
                let pairs = rest.reshape((2, c, frames - 1, h, w))?;
                let doubled =
                    Tensor::stack(&[pairs.get(0)?, pairs.get(1)?], 2)?.reshape((c, 2 * (frames - 1), h, w))?;
                Tensor::cat(&[&x.narrow(1, 0, 1)?, &doubled], 1)?
            }
            false => x.clone(),
        };
        let frames = x.dim(1)?;
        let weight = self.t(&format!("{name}.resample.1.weight"));
        let bias = self.t(&format!("{name}.resample.1.bias"));
        let mut out = Vec::with_capacity(frames);
        for t in 0..frames {
            let frame = x.narrow(1, t, 1)?.squeeze(1)?.unsqueeze(0)?;
            let up = frame.upsample_nearest2d(2 * h, 2 * w)?;
            let y = up
                .conv2d(weight, 1, 1, 1, 1)?
                .broadcast_add(&bias.reshape((1, c / 2, 1, 1))?)?;
            out.push(y.squeeze(0)?);
        }
        Tensor::stack(&out, 1)
    }
}

/// x · σ(x).
fn silu(x: &Tensor) -> R<Tensor> {
    x / (x.neg()?.exp()? + 1.0)?
}

fn candle_nn_softmax(x: &Tensor) -> R<Tensor> {
    let max = x.max_keepdim(1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(1)?)
}

fn conv1x1(x: &Tensor, weight: &Tensor, bias: &Tensor) -> R<Tensor> {
    let c = weight.dim(0)?;
    x.conv2d(weight, 0, 1, 1, 1)?
        .broadcast_add(&bias.reshape((1, c, 1, 1))?)
}
