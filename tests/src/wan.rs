//! A tiny random Wan DiT written in a real checkpoint format, and a runner for its ranks.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tpinfer_comm::{Communicator, ThreadGroup};
use tpinfer_wan::{original_names, WanConfig, WanRank, WanShard};
use tpinfer_weights::{WeightFormat, WeightStore};

/// A Wan DiT small enough for CPU tests: odd heads (5) and an FFN (100 columns) that splits
/// unevenly at most widths.
#[derive(Debug, Clone)]
pub struct TinyWan {
    pub heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub layers: usize,
    pub channels: usize,
    pub text_dim: usize,
    /// Write the original Wan code's config and tensor names instead of diffusers'.
    pub original_names: bool,
    pub seed: u64,
}

impl Default for TinyWan {
    fn default() -> Self {
        Self {
            heads: 5,
            head_dim: 12,
            ffn: 100,
            layers: 2,
            channels: 4,
            text_dim: 24,
            original_names: false,
            seed: 11,
        }
    }
}

impl TinyWan {
    pub fn config(&self) -> WanConfig {
        WanConfig {
            num_attention_heads: self.heads,
            attention_head_dim: self.head_dim,
            in_channels: self.channels,
            out_channels: self.channels,
            text_dim: self.text_dim,
            freq_dim: 16,
            ffn_dim: self.ffn,
            num_layers: self.layers,
            patch_size: [1, 2, 2],
            cross_attn_norm: true,
            eps: 1e-6,
            s2v: None,
        }
    }

    /// Writes `config.json` and `diffusion_pytorch_model.safetensors` into `dir`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).expect("create model dir");
        let c = self.config();
        let config = match self.original_names {
            true => json!({
                "_class_name": "WanModel", "model_type": "t2v", "dim": c.hidden_size(), "ffn_dim": c.ffn_dim,
                "freq_dim": c.freq_dim, "in_dim": c.in_channels, "out_dim": c.out_channels, "num_heads": c.num_attention_heads,
                "num_layers": c.num_layers, "text_dim": c.text_dim, "eps": c.eps, "text_len": 512
            }),
            false => json!({
                "_class_name": "WanTransformer3DModel", "num_attention_heads": c.num_attention_heads,
                "attention_head_dim": c.attention_head_dim, "in_channels": c.in_channels,
                "out_channels": c.out_channels, "text_dim": c.text_dim, "freq_dim": c.freq_dim, "ffn_dim": c.ffn_dim,
                "num_layers": c.num_layers, "patch_size": [1, 2, 2], "cross_attn_norm": true,
                "qk_norm": "rms_norm_across_heads", "eps": c.eps, "image_dim": null, "added_kv_proj_dim": null,
                "rope_max_seq_len": 1024
            }),
        };
        std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
        let renames: std::collections::HashMap<String, String> = match self.original_names {
            true => original_names(&c).into_iter().collect(),
            false => Default::default(),
        };
        let mut rng = StdRng::seed_from_u64(self.seed);
        let whole = WanShard::new(&c, 1, 0).expect("shard");
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = whole
            .weight_decls(&c)
            .into_iter()
            .map(|decl| {
                let n: usize = decl.shape.iter().product();
                let fan_in = decl.shape.get(1).copied().unwrap_or(1).max(1) as f32;
                let values: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0) / fan_in.sqrt()).collect();
                let name = renames.get(&decl.name).cloned().unwrap_or(decl.name);
                (name, decl.shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
            })
            .collect();
        crate::write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &data);
        dir.to_path_buf()
    }
}

/// Opens a Wan directory in either naming, as a store with diffusers' names.
pub fn open_wan(dir: &Path) -> (WanConfig, Arc<dyn WeightStore>) {
    let checkpoint = tpinfer_wan::WanCheckpoint::open(dir).expect("open Wan checkpoint");
    (checkpoint.config, checkpoint.store)
}

/// Random latents `[channels, frames, height, width]` and text states `[tokens, text_dim]`.
pub fn wan_inputs(model: &TinyWan, frames: usize, height: usize, width: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut random = |n: usize| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>();
    let latents = Tensor::from_vec(
        random(model.channels * frames * height * width),
        (model.channels, frames, height, width),
        &Device::Cpu,
    )
    .expect("latents");
    let text = Tensor::from_vec(random(7 * model.text_dim), (7, model.text_dim), &Device::Cpu).expect("text");
    (latents, text)
}

/// Rank 0's velocity for `latents` at `timestep`, with the model sharded `tp` ways on CPU
/// rank threads; also each rank's all-reduce count for the forward.
pub fn run_wan(dir: &Path, tp: usize, dtype: DType, latents: &Tensor, text: &Tensor, timestep: f64) -> (Vec<f32>, u64) {
    run_wan_as(dir, tp, dtype, WeightFormat::AsStored, latents, text, timestep)
}

/// [`run_wan`] with the blocks' linear weights held in `format`.
pub fn run_wan_as(
    dir: &Path,
    tp: usize,
    dtype: DType,
    format: WeightFormat,
    latents: &Tensor,
    text: &Tensor,
    timestep: f64,
) -> (Vec<f32>, u64) {
    let checkpoint = tpinfer_wan::WanCheckpoint::open(dir).expect("open Wan checkpoint");
    run_wan_from(&checkpoint, tp, dtype, format, latents, text, timestep)
}

/// [`run_wan_as`] of an opened checkpoint (with an adapter merged in, say).
pub fn run_wan_from(
    checkpoint: &tpinfer_wan::WanCheckpoint,
    tp: usize,
    dtype: DType,
    format: WeightFormat,
    latents: &Tensor,
    text: &Tensor,
    timestep: f64,
) -> (Vec<f32>, u64) {
    let (config, store) = (&checkpoint.config, &checkpoint.store);
    let comms = ThreadGroup::ranks(tp, Duration::from_secs(60));
    let outs: Vec<(Vec<f32>, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (config, store) = (config.clone(), store.clone());
                s.spawn(move || {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let shard = WanShard::new(&config, tp, comm.rank()).expect("shard");
                    let rank = WanRank::load(&config, &*store, shard, format, comm.clone(), dtype, &Device::Cpu)
                        .expect("load");
                    let context = rank.embed_text(text).expect("text");
                    let before = comm.stats().snapshot();
                    let v = rank.forward(latents, timestep, &context).expect("forward");
                    let reduces = comm.stats().snapshot().since(&before).all_reduces;
                    (
                        v.flatten_all().and_then(|v| v.to_vec1::<f32>()).expect("values"),
                        reduces,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    outs.into_iter().next().expect("rank 0")
}
