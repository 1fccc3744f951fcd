//! Llama 3 / 3.1 / 3.2, sharded over tensor-parallel ranks.
//!
//! [`LlamaConfig`] reads `config.json` in both the transformers-4 and transformers-5 forms, or
//! a GGUF file's metadata. [`LlamaShard`] says what one rank holds (its heads, FFN columns and
//! vocabulary rows) and declares the slices it reads; [`LlamaRank`] is that rank's model.
//! [`LlamaModel`] is the family's seam (`tpinfer_family::Family`): presets, the split over
//! ranks, each rank's memory footprint and its load.

mod checkpoint;
mod config;
mod family;
#[cfg(feature = "cuda")]
mod graph;
pub mod memory;
mod model;
mod shard;

pub use checkpoint::{CheckpointError, LlamaCheckpoint, ModelFormat};
pub use config::{ConfigError, LlamaConfig};
pub use family::{LlamaModel, LlamaRankShard};
pub use model::{GreedyStep, LlamaRank, PagedCache, SequenceChunk};
pub use shard::LlamaShard;
