//! The wav2vec2 speech encoder of Wan2.2-S2V (transformers' `Wav2Vec2Model`, read from the
//! `Wav2Vec2ForCTC` checkpoint S2V ships), sharded over tensor-parallel ranks: attention by
//! heads, the FFN by columns; the feature convolutions and the positional convolution,
//! a few percent of the weights, whole on every rank.
//!
//! [`Wav2Vec2Config`] reads `config.json`; [`Wav2Vec2Shard`] says what one rank holds and
//! declares the slices it reads; [`Wav2Vec2Rank`] is that rank's encoder; [`Wav2Vec2Model`] is
//! the family's seam (`tpinfer_family::Family`); [`per_video_frame`] turns its 50 Hz states
//! into the per-frame features S2V's DiT takes.

mod config;
mod family;
mod frames;
pub mod memory;
mod model;
mod shard;

pub use config::{ConvLayer, Wav2Vec2Config};
pub use family::{Wav2Vec2Model, Wav2Vec2RankShard, PLANNED_SECONDS};
pub use frames::{per_video_frame, VideoFrameFeatures, SAMPLE_RATE, STATES_FOR_A_FRAME, STATES_PER_SECOND};
pub use model::{Wav2Vec2Rank, FEATURE_CHUNK_FRAMES};
pub use shard::{Names, PositionWeight, Wav2Vec2Shard};
