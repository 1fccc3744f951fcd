//! The umT5 text encoder of Wan's pipelines (transformers' `UMT5EncoderModel`), sharded over
//! tensor-parallel ranks: attention by heads (each layer's relative position bias table sliced
//! with them), the gated-GELU FFN by columns, the embedding by vocabulary rows.
//!
//! [`Umt5Config`] reads `config.json`; [`Umt5Shard`] says what one rank holds and declares the
//! slices it reads; [`Umt5Rank`] is that rank's encoder; [`Umt5Model`] is the family's seam
//! (`tpinfer_family::Family`).

mod config;
mod family;
pub mod memory;
mod model;
mod position;
mod shard;

pub use config::Umt5Config;
pub use family::{Umt5Model, Umt5RankShard, TEXT_TOKENS};
pub use model::Umt5Rank;
pub use shard::Umt5Shard;
