//! The Wan2.1/2.2 video diffusion transformer (diffusers' `WanTransformer3DModel`), sharded
//! over tensor-parallel ranks: its configuration, what each rank holds, and the device bytes
//! the memory planner counts for it.

mod checkpoint;
mod config;
mod family;
pub mod memory;
mod model;
mod profile;
mod s2v;
mod s2v_audio;
pub mod sampler;
mod shard;

pub use checkpoint::{WanCheckpoint, WanCheckpointError};
pub use config::{S2vModules, WanConfig, S2V_MOTION_FRAMES, S2V_NEGATIVE_PROMPT};
pub use family::{WanModel, WanRankShard};
pub use memory::SelfAttention;
pub use model::WanRank;
pub use profile::StageTimes;
pub use s2v::{S2vClip, S2vCondition};
pub use s2v_audio::{AudioEmbedding, S2vAudio, AUDIO_LAYERS};
pub use shard::{original_names, WanShard};
