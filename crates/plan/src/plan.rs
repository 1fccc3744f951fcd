use std::collections::BTreeMap;

use candle_core::DType;
use serde::Serialize;
use tpinfer_weights::{ShardLoader, WeightDecl};

use crate::{DeviceProfile, Footprint, Placement, RankShard, ShardedModel};

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
    /// What the forward's libraries and kernels keep on the device from its first request.
    pub libraries: u64,
    /// NCCL's buffers.
    pub comm: u64,
    /// The CUDA context.
    pub context: u64,
    /// Of `buffers` and `cache`, what the rank allocates when it loads.
    pub at_load: u64,
}

impl RankPlan {
    pub fn total(&self) -> u64 {
        self.weights
            + self.buffers
            + self.cache
            + self.activations
            + self.allocator_slack
            + self.libraries
            + self.comm
            + self.context
    }

    /// A rank of a `world`-wide group on `device` holding `weights` bytes and `footprint`.
    fn on_device(rank: usize, weights: u64, footprint: &Footprint, device: DeviceProfile, world: usize) -> Self {
        Self {
            rank,
            weights,
            buffers: footprint.buffers,
            cache: footprint.cache,
            activations: footprint.activations,
            allocator_slack: if device.pooled { footprint.pool_slack } else { 0 },
            libraries: footprint.libraries,
            comm: device.comm(world),
            context: device.context_reserve,
            at_load: footprint.at_load,
        }
    }

    /// The total with the temporaries of one particular request instead of the worst case.
    pub fn total_with(&self, activations: u64, allocator_slack: u64) -> u64 {
        self.total() - self.activations - self.allocator_slack + activations + allocator_slack
    }
}

/// One rank's bytes for several models held at once and run one at a time (a pipeline's
/// stages): every model's resident bytes (weights, buffers, caches), the largest temporaries
/// of any one, every model's libraries (each loads its kernels, kept once loaded; what they
/// share counts more than once) and the device's reserves once.
pub fn held_together<'a>(ranks: impl IntoIterator<Item = &'a RankPlan>) -> u64 {
    let (mut resident, mut temporaries, mut reserves) = (0, 0, 0);
    for r in ranks {
        resident += r.weights + r.buffers + r.cache + r.libraries;
        temporaries = temporaries.max(r.activations + r.allocator_slack);
        reserves = reserves.max(r.comm + r.context);
    }
    resident + temporaries + reserves
}

/// How a rank holds models that run one after another (a pipeline's stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Every model loaded at the start and kept: the models' weights load once for every run.
    Together,
    /// The first `first` models loaded at the start and run, then freed before the others load:
    /// a text encoder freed after encoding, when holding it beside the DiT would not fit.
    InTurns { first: usize },
}

impl Residency {
    /// How many of `models` load at the start: all of them, or the first turn's.
    pub fn loaded_first(self, models: usize) -> usize {
        match self {
            Self::Together => models,
            Self::InTurns { first } => first,
        }
    }

    /// One rank's bytes for its plans of the models (in the order they run) under this
    /// residency: the larger turn decides when they are held in turns.
    pub fn rank_bytes(self, ranks: &[&RankPlan]) -> u64 {
        match self {
            Self::Together => held_together(ranks.iter().copied()),
            Self::InTurns { first } => {
                let (early, late) = ranks.split_at(first.min(ranks.len()));
                held_together(early.iter().copied()).max(held_together(late.iter().copied()))
            }
        }
    }
}

/// The same model under FSDP on as many GPUs, for comparison: every GPU holds an even shard
/// of the flat parameters, gathers one whole wrapped unit (a block, or the root module with
/// everything outside the blocks) before running it, and computes the full activations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fsdp {
    pub world: usize,
    /// One GPU's bytes apart from the gather: its weight shard (`weights`), the full KV cache
    /// or latents, full activations, libraries, NCCL's buffers and context.
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
    /// Plans `model` at TP `tp` in `dtype` for `placement` on `device`, checking each rank's
    /// declarations against the checkpoint's headers. Reads headers only.
    pub fn new(
        model: &dyn ShardedModel,
        tp: usize,
        dtype: DType,
        placement: Placement,
        device: DeviceProfile,
    ) -> Result<Self, PlanError> {
        Split::new(model, tp, dtype)?.plan(placement, device)
    }

    /// Plans the given rank shards of `model` (one per rank, in rank order): for a caller
    /// that has split the model and checked the shards already, and loads these very ones.
    pub fn for_shards(
        model: &dyn ShardedModel,
        shards: &[&dyn RankShard],
        dtype: DType,
        placement: Placement,
        device: DeviceProfile,
    ) -> Result<Self, PlanError> {
        let weights = shards
            .iter()
            .map(|s| weight_bytes(s.weight_decls(), dtype))
            .collect::<Result<Vec<_>, _>>()?;
        Self::of_ranks(model, shards.iter().copied(), &weights, dtype, placement, device)
    }

    fn of_ranks<'s>(
        model: &dyn ShardedModel,
        shards: impl ExactSizeIterator<Item = &'s dyn RankShard>,
        weights: &[u64],
        dtype: DType,
        placement: Placement,
        device: DeviceProfile,
    ) -> Result<Self, PlanError> {
        let tp = shards.len();
        let (ranks, tokens_per_forward) = rank_plans(shards, weights, dtype, placement, device)?;
        Ok(Self {
            model: model.name().to_string(),
            tp,
            dtype: format!("{dtype:?}").to_lowercase(),
            placement,
            device,
            ranks,
            fsdp: fsdp(model, tp, dtype, placement, device)?,
            tokens_per_forward,
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

/// One TP width of a model, split into its rank shards and checked once, with each rank's
/// weight bytes: what a search plans many placements of (contexts, frames, pool sizes).
/// Splitting a model (its tensors' names) and summing its declarations cost far more than a
/// rank's footprint: replanned for every placement, `tpinfer plan` without `--tp` took 27 s
/// for Llama-3-70B in a debug build.
pub struct Split<'a> {
    model: &'a dyn ShardedModel,
    shards: Vec<Box<dyn RankShard>>,
    dtype: DType,
    weights: Vec<u64>,
}

impl<'a> Split<'a> {
    /// `model`'s shards at TP `tp` in `dtype`, each rank's declarations checked against the
    /// checkpoint's headers.
    pub fn new(model: &'a dyn ShardedModel, tp: usize, dtype: DType) -> Result<Self, PlanError> {
        let shards = model.rank_shards(tp)?;
        // Ranks that hold the same declarations (a replicated model, the VAE's bands) share
        // one list: checked once, not once a rank at every width a search plans.
        let mut checked: Option<&[WeightDecl]> = None;
        let mut weights = Vec::with_capacity(shards.len());
        for shard in &shards {
            let decls = shard.weight_decls();
            if !checked.is_some_and(|c| std::ptr::eq(c, decls)) {
                model.check(decls)?;
                checked = Some(decls);
            }
            weights.push(weight_bytes(decls, dtype)?);
        }
        Ok(Self {
            model,
            shards,
            dtype,
            weights,
        })
    }

    pub fn model(&self) -> &'a dyn ShardedModel {
        self.model
    }

    pub fn tp(&self) -> usize {
        self.shards.len()
    }

    /// The plan of `placement` on `device`, with its FSDP comparison.
    pub fn plan(&self, placement: Placement, device: DeviceProfile) -> Result<Plan, PlanError> {
        let shards = self.shards.iter().map(|s| &**s);
        Plan::of_ranks(self.model, shards, &self.weights, self.dtype, placement, device)
    }

    /// The rank that needs the most at `placement` on `device` (the first of equals), without
    /// the FSDP comparison a [`Plan`] carries.
    pub fn peak(&self, placement: Placement, device: DeviceProfile) -> Result<RankPlan, PlanError> {
        let shards = self.shards.iter().map(|s| &**s);
        let (ranks, _) = rank_plans(shards, &self.weights, self.dtype, placement, device)?;
        ranks
            .into_iter()
            .rev()
            .max_by_key(RankPlan::total)
            .ok_or_else(|| PlanError::Model(format!("{} split {} ways has no rank", self.model.name(), self.tp())))
    }

    /// Whether every rank fits `budget` bytes at `placement` on `device` (false where the
    /// placement cannot be planned).
    pub fn fits(&self, placement: Placement, device: DeviceProfile, budget: u64) -> bool {
        self.peak(placement, device).is_ok_and(|p| p.total() <= budget)
    }
}

/// Each rank's plan, from its shard and weight bytes, and the first rank's tokens per forward.
fn rank_plans<'s>(
    shards: impl ExactSizeIterator<Item = &'s dyn RankShard>,
    weights: &[u64],
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
) -> Result<(Vec<RankPlan>, usize), PlanError> {
    let tp = shards.len();
    let mut ranks = Vec::with_capacity(tp);
    let mut tokens_per_forward = 0;
    for ((rank, shard), &weights) in shards.enumerate().zip(weights) {
        let footprint = shard.footprint(dtype, placement, device.accelerator())?;
        if rank == 0 {
            tokens_per_forward = footprint.tokens_per_forward;
        }
        ranks.push(RankPlan::on_device(rank, weights, &footprint, device, tp));
    }
    Ok((ranks, tokens_per_forward))
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
        // The FSDP stack holds every parameter in the model's dtype (the layers its autocast
        // runs in f32 widen at run time), where tpinfer holds some small ones `wide`.
        let held = WeightDecl {
            wide: false,
            ..decl.clone()
        };
        let bytes = weight_bytes(std::slice::from_ref(&held), dtype)?;
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

/// The same model under FSDP on `world` GPUs: the whole model's tensors grouped by the
/// family's FSDP units, and its unsharded footprint.
fn fsdp(
    model: &dyn ShardedModel,
    world: usize,
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
) -> Result<Fsdp, PlanError> {
    let whole = model.rank_shards(1)?;
    let whole = whole
        .first()
        .ok_or_else(|| PlanError::Model("the model split one way has no rank".into()))?;
    let (total, unit, name) = fsdp_units(whole.weight_decls(), dtype, |n| model.fsdp_unit(n))?;
    let footprint = whole.footprint(dtype, placement, device.accelerator())?;
    Ok(fsdp_estimate(world, total, unit, name, &footprint, device))
}

/// One FSDP GPU: an even shard of `total` weight bytes, the gather of the largest unit, and the
/// unsharded model's footprint.
fn fsdp_estimate(
    world: usize,
    total: u64,
    unit: u64,
    name: String,
    footprint: &Footprint,
    device: DeviceProfile,
) -> Fsdp {
    Fsdp {
        world,
        gpu: RankPlan::on_device(0, total.div_ceil(world as u64), footprint, device, world),
        unshard_buffer: unit,
        largest_unit: name,
    }
}
