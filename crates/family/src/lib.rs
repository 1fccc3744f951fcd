//! The seam every model family implements, so that a family costs one crate and one line in
//! the engine's registry.
//!
//! A family answers, from a directory or a preset and a TP width:
//! - whether a directory holds one of its models ([`Family::detect`]) and its config
//!   ([`Family::open`], [`Family::preset`]);
//! - which tensors each rank reads and how many bytes it needs for a placement
//!   ([`tpinfer_plan::ShardedModel`], [`tpinfer_plan::RankShard`]), which is all the planner
//!   knows of it;
//! - how to load one rank ([`Family::load`]), which the runtime's rank group calls on the
//!   rank's own thread.
//!
//! Families know nothing of engines: the engines call the loaded ranks' forwards.

mod config;

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use tpinfer_comm::Communicator;
use tpinfer_plan::{Placement, PlanError, RankShard, ShardedModel};
use tpinfer_weights::{LoadProgress, WeightFormat};

pub use config::{parse_config, read_config, ConfigError};

/// A model family: its configs, its split over ranks and its rank model.
pub trait Family: ShardedModel + Sized + 'static {
    /// The family's name, for messages and the registry.
    const NAME: &'static str;
    /// The built-in models [`Family::preset`] knows, from their published shapes.
    const PRESETS: &'static [&'static str];
    /// One rank's part of the model, derived once per start and handed to that rank's load.
    type Shard: RankShard + Clone + Send + 'static;
    /// One rank's loaded model. It lives on its rank's thread only.
    type Rank: 'static;

    /// Whether `path` holds a model of this family (from its config alone).
    fn detect(path: &Path) -> bool;
    /// Opens the model at `path`: its config and tensor headers, no weights.
    fn open(path: &Path) -> Result<Self, PlanError>;
    /// A preset by name (case-insensitive), if the family has it. A preset plans but cannot
    /// load: it has no checkpoint.
    fn preset(name: &str) -> Option<Self>;
    /// Every rank's shard for `tp` ranks, in rank order (not yet checked against the
    /// checkpoint: [`ShardedModel::check`]).
    fn shards(&self, tp: usize) -> Result<Vec<Self::Shard>, PlanError>;
    /// Loads `shard` on the calling rank for `placement` (the one it was planned for).
    fn load(
        &self,
        shard: &Self::Shard,
        placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<Self::Rank, tpinfer_layers::Error>;
    /// The same model with its linear weights held in `format`. Families that hold every
    /// weight in the compute dtype refuse any other form than as stored.
    fn with_format(self, format: WeightFormat) -> Result<Self, PlanError> {
        match format {
            WeightFormat::AsStored => Ok(self),
            other => Err(PlanError::Model(format!(
                "{} models hold their weights in the compute dtype; {other:?} weights are for Llama models so far",
                Self::NAME
            ))),
        }
    }
    /// The weight bytes a loaded rank read from the checkpoint.
    fn bytes_loaded(rank: &Self::Rank) -> usize;
}

/// The error of a preset asked to load: it has a config and no checkpoint.
pub fn preset_has_no_weights(name: &str) -> tpinfer_layers::Error {
    tpinfer_layers::Error::Shard(format!(
        "{name} is a preset: it has no weights to load; give a model directory"
    ))
}

/// Fails where `format` asks a family without an LM head (a DiT, a text encoder) to quantize
/// one: `--quantize-lm-head` is for language models.
pub fn check_no_lm_head(name: &str, format: WeightFormat) -> Result<(), PlanError> {
    match format {
        WeightFormat::Fp8WithLmHead => Err(PlanError::Model(format!(
            "{name}: --quantize-lm-head is for language models; this model has no LM head (leave the flag out)"
        ))),
        _ => Ok(()),
    }
}

/// What a rank loads with: its communicator, its device, the compute dtype, the options its
/// forward runs with, and the group's load progress, which its weight loader counts into.
pub struct LoadContext<'a> {
    pub comm: &'a Arc<dyn Communicator>,
    pub device: &'a Device,
    pub dtype: DType,
    pub options: RankOptions,
    pub progress: &'a LoadProgress,
}

/// How a rank's forwards run: switches for measured alternatives, chosen by the caller (the
/// CLI fills them from its flags and environment), never read by a library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOptions {
    /// Replay a decode step as a captured CUDA graph (LLMs on GPUs); off runs it kernel by
    /// kernel.
    pub cuda_graphs: bool,
    /// Launch a decode step's kernels as one chain (programmatic dependent launch, Hopper
    /// and newer): each starts while the one before it finishes.
    pub kernel_chains: bool,
}

impl Default for RankOptions {
    fn default() -> Self {
        Self {
            cuda_graphs: true,
            kernel_chains: true,
        }
    }
}
