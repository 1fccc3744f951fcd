use std::collections::BTreeMap;

use candle_core::DType;
use serde::Serialize;
use tpinfer_llama::memory::{flash_attention, prefill_chunk, RankMemory};
use tpinfer_llama::{LlamaConfig, LlamaShard};
use tpinfer_wan::memory::{DitMemory, ForwardPath, Video};
use tpinfer_wan::{WanConfig, WanShard};
use tpinfer_weights::{ShardLoader, WeightDecl};

use crate::{DeviceProfile, ModelSpec, Placement};

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Model(String),
    #[error("cannot shard the model over {tp} ranks: {detail}")]
    Sharding { tp: usize, detail: String },
    #[error("{0}")]
    Placement(String),
}

/// One rank's planned device bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RankPlan {
    pub rank: usize,
    /// Its weight slices in the compute dtype: exactly what the loader places.
    pub weights: u64,
    /// Model buffers: rotary tables, indices.
    pub buffers: u64,
    /// The KV cache (LLM), or the sampler's latents and text embeddings (DiT).
    pub cache: u64,
    /// The activation peak of one forward.
    pub activations: u64,
    /// What the device's allocator may hold beyond live tensors at that peak (CUDA's pool:
    /// freed blocks split by smaller allocations).
    pub allocator_slack: u64,
    /// cuBLAS and NCCL.
    pub workspace: u64,
    /// The CUDA context.
    pub context: u64,
}

impl RankPlan {
    pub fn total(&self) -> u64 {
        self.weights
            + self.buffers
            + self.cache
            + self.activations
            + self.allocator_slack
            + self.workspace
            + self.context
    }

    /// A rank of a `world`-wide group on `device` holding `weights` bytes and the model's
    /// `[buffers, cache, activations, pool slack]`.
    fn on_device(
        rank: usize,
        weights: u64,
        [buffers, cache, activations, slack]: [usize; 4],
        device: DeviceProfile,
        world: usize,
    ) -> Self {
        Self {
            rank,
            weights,
            buffers: buffers as u64,
            cache: cache as u64,
            activations: activations as u64,
            allocator_slack: if device.pooled { slack as u64 } else { 0 },
            workspace: device.workspace(world),
            context: device.context_reserve,
        }
    }

    /// The total with the temporaries of one particular request instead of the worst case.
    pub fn total_with(&self, activations: u64, allocator_slack: u64) -> u64 {
        self.total() - self.activations - self.allocator_slack + activations + allocator_slack
    }
}

/// The same model under FSDP on as many GPUs, for comparison: every GPU holds an even shard
/// of the flat parameters, gathers one whole wrapped unit (a block, or the root module with
/// everything outside the blocks) before running it, and computes the full activations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp {
    pub world: usize,
    /// One GPU's bytes apart from the gather: its weight shard (`weights`), the full KV cache
    /// or latents, full activations, workspace and context.
    pub gpu: RankPlan,
    pub unshard_buffer: u64,
    /// The wrapped unit whose gather needs the buffer.
    pub largest_unit: String,
}

impl Fsdp {
    pub fn total(&self) -> u64 {
        self.gpu.total() + self.unshard_buffer
    }
}

/// A placement's per-rank device bytes.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub model: String,
    pub tp: usize,
    pub dtype: String,
    pub placement: Placement,
    pub device: DeviceProfile,
    pub ranks: Vec<RankPlan>,
    pub fsdp: Fsdp,
    /// LLM: prompt positions per forward. DiT: video tokens per forward.
    pub tokens_per_forward: usize,
}

impl Plan {
    /// Plans `model` at TP `tp` in `dtype` for `placement` on `device`. Reads headers only.
    pub fn new(
        model: &ModelSpec,
        tp: usize,
        dtype: DType,
        placement: Placement,
        device: DeviceProfile,
    ) -> Result<Self, PlanError> {
        let (ranks, fsdp, tokens) = match (model, placement) {
            (ModelSpec::Llama { config, checkpoint, .. }, Placement::Llm { max_context, batch }) => {
                if max_context == 0 || max_context > config.max_position_embeddings {
                    return Err(PlanError::Placement(format!(
                        "--max-context {max_context} must be between 1 and the model's {} positions",
                        config.max_position_embeddings
                    )));
                }
                if batch == 0 {
                    return Err(PlanError::Placement("--batch must be at least 1".into()));
                }
                let mut ranks = Vec::with_capacity(tp);
                let mut rank0_chunk = 0;
                for rank in 0..tp {
                    let shard = LlamaShard::new(config, tp, rank).map_err(|e| PlanError::Sharding {
                        tp,
                        detail: e.to_string(),
                    })?;
                    if let Some(checkpoint) = checkpoint {
                        checkpoint.check(&shard).map_err(|e| PlanError::Model(e.to_string()))?;
                    }
                    let weights = weight_bytes(&shard.weight_decls(config), dtype)?;
                    let flash = flash_attention(device.is_cuda(), dtype, config.head_dim, &shard);
                    let chunk = prefill_chunk(shard.heads.q_heads.len(), max_context, flash);
                    if rank == 0 {
                        rank0_chunk = chunk;
                    }
                    let m = RankMemory::batched(config, &shard, dtype, max_context, chunk, batch, flash);
                    let temporaries = [m.buffers, m.kv_cache, m.activations, m.pool_slack];
                    ranks.push(RankPlan::on_device(rank, weights, temporaries, device, tp));
                }
                let fsdp = llama_fsdp(config, tp, dtype, max_context, batch, device)?;
                (ranks, fsdp, rank0_chunk)
            }
            (
                ModelSpec::Wan { config, .. },
                Placement::Dit {
                    frames,
                    width,
                    height,
                    cfg,
                },
            ) => {
                if frames % 4 != 1 || width % 16 != 0 || height % 16 != 0 || width == 0 || height == 0 {
                    return Err(PlanError::Placement(format!(
                        "--frames {frames} --size {width}x{height}: frames must be 4k + 1 (e.g. 21, 41, 81) and the \
                         size multiples of 16 (e.g. 832x480, 1280x720)"
                    )));
                }
                let video = Video {
                    frames,
                    width,
                    height,
                    cfg,
                };
                let mut ranks = Vec::with_capacity(tp);
                for rank in 0..tp {
                    let shard = WanShard::new(config, tp, rank).map_err(|detail| PlanError::Sharding { tp, detail })?;
                    let weights = weight_bytes(&shard.weight_decls(config), dtype)?;
                    let m = DitMemory::new(config, &shard, dtype, video, forward_path(config, dtype, device));
                    let temporaries = [m.buffers, m.latents, m.activations, m.pool_slack];
                    ranks.push(RankPlan::on_device(rank, weights, temporaries, device, tp));
                }
                let fsdp = wan_fsdp(config, tp, dtype, video, device)?;
                (ranks, fsdp, config.video_tokens(frames, width, height))
            }
            (ModelSpec::Llama { .. }, Placement::Dit { .. }) => {
                return Err(PlanError::Placement(
                    "--frames and --size are for video DiT models; give an LLM --max-context".into(),
                ))
            }
            (ModelSpec::Wan { .. }, Placement::Llm { .. }) => {
                return Err(PlanError::Placement(
                    "--max-context is for LLMs; give a video DiT --frames and --size".into(),
                ))
            }
        };
        Ok(Self {
            model: model.name().to_string(),
            tp,
            dtype: format!("{dtype:?}").to_lowercase(),
            placement,
            device,
            ranks,
            fsdp,
            tokens_per_forward: tokens,
        })
    }

    /// The rank that needs the most.
    pub fn peak(&self) -> &RankPlan {
        self.ranks
            .iter()
            .max_by_key(|r| (r.total(), std::cmp::Reverse(r.rank)))
            .unwrap_or(&self.ranks[0])
    }

    /// Whether every rank fits in `budget` bytes.
    pub fn fits(&self, budget: u64) -> bool {
        self.peak().total() <= budget
    }
}

fn weight_bytes(decls: &[WeightDecl], dtype: DType) -> Result<u64, PlanError> {
    ShardLoader::device_bytes(decls, dtype)
        .map(|b| b as u64)
        .map_err(|e| PlanError::Model(e.to_string()))
}

/// The total bytes of `decls` and the largest FSDP unit: each `unit_of` group, and the root
/// unit holding every tensor outside the groups.
fn fsdp_units(
    decls: &[WeightDecl],
    dtype: DType,
    unit_of: impl Fn(&str) -> Option<String>,
) -> Result<(u64, u64, String), PlanError> {
    let mut units: BTreeMap<String, u64> = BTreeMap::new();
    let mut total = 0;
    for decl in decls {
        let bytes = weight_bytes(std::slice::from_ref(decl), dtype)?;
        total += bytes;
        let unit = unit_of(&decl.name).unwrap_or_else(|| "root module (all but the blocks)".to_string());
        *units.entry(unit).or_default() += bytes;
    }
    let (name, bytes) = units
        .into_iter()
        .max_by_key(|(_, b)| *b)
        .unwrap_or_else(|| ("none".into(), 0));
    Ok((total, bytes, name))
}

/// `prefix.N` of a tensor named `prefix.N.rest`.
fn numbered_unit(name: &str, prefix: &str) -> Option<String> {
    let rest = name.strip_prefix(prefix)?;
    let index = rest.split('.').next()?;
    Some(format!("{prefix}{index}"))
}

fn llama_fsdp(
    config: &LlamaConfig,
    world: usize,
    dtype: DType,
    max_context: usize,
    batch: usize,
    device: DeviceProfile,
) -> Result<Fsdp, PlanError> {
    let whole = LlamaShard::new(config, 1, 0).map_err(|e| PlanError::Model(e.to_string()))?;
    let (total, unit, name) = fsdp_units(&whole.weight_decls(config), dtype, |n| {
        numbered_unit(n, "model.layers.")
    })?;
    let flash = flash_attention(device.is_cuda(), dtype, config.head_dim, &whole);
    let chunk = prefill_chunk(whole.heads.q_heads.len(), max_context, flash);
    let memory = RankMemory::batched(config, &whole, dtype, max_context, chunk, batch, flash);
    let temporaries = [memory.buffers, memory.kv_cache, memory.activations, memory.pool_slack];
    Ok(fsdp_estimate(world, total, unit, name, temporaries, device))
}

fn forward_path(config: &WanConfig, dtype: DType, device: DeviceProfile) -> ForwardPath {
    ForwardPath::for_device(device.is_cuda(), dtype, config.attention_head_dim)
}

fn wan_fsdp(
    config: &WanConfig,
    world: usize,
    dtype: DType,
    video: Video,
    device: DeviceProfile,
) -> Result<Fsdp, PlanError> {
    let whole = WanShard::new(config, 1, 0).map_err(PlanError::Model)?;
    let (total, unit, name) = fsdp_units(&whole.weight_decls(config), dtype, |n| numbered_unit(n, "blocks."))?;
    let memory = DitMemory::new(config, &whole, dtype, video, forward_path(config, dtype, device));
    let temporaries = [memory.buffers, memory.latents, memory.activations, memory.pool_slack];
    Ok(fsdp_estimate(world, total, unit, name, temporaries, device))
}

/// One FSDP GPU: an even shard of `total` weight bytes, the gather of the largest unit, and the
/// unsharded model's `[buffers, cache, activations, pool slack]`.
fn fsdp_estimate(
    world: usize,
    total: u64,
    unit: u64,
    name: String,
    temporaries: [usize; 4],
    device: DeviceProfile,
) -> Fsdp {
    Fsdp {
        world,
        gpu: RankPlan::on_device(0, total.div_ceil(world as u64), temporaries, device, world),
        unshard_buffer: unit,
        largest_unit: name,
    }
}
