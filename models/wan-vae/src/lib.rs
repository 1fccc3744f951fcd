//! The Wan2.1 video VAE (diffusers' `AutoencoderKLWan`): its decoder, the frames split by rows
//! over tensor-parallel ranks, and its encoder ([`WanVaeEncoder`]), whole on each rank.
//!
//! Every rank holds the whole decoder (127 M parameters, 0.25 GB in bf16) and decodes a band
//! of every frame's rows with the halo its convolutions read ([`rows`]), one tile at a time,
//! streaming the latent frames through causal convolutions with their frame caches. The
//! bands join into exactly the frames an unsplit decode gives.
//!
//! [`WanVaeConfig`] reads `vae/config.json`; [`WanVaeShard`] says which rows a rank decodes;
//! [`WanVaeRank`] is that rank's decoder; [`WanVaeModel`] is the family's seam
//! (`tpinfer_family::Family`); [`memory`] is its footprint for the planner. The layers in
//! `conv` and `blocks` are the ones the VAE's encoder is made of too.

mod blocks;
mod config;
mod conv;
mod decoder;
mod encoder;
mod encoder_family;
mod family;
mod layout;
pub mod memory;
pub mod original;
mod rank;
pub mod rows;
mod shard;

pub use config::WanVaeConfig;
pub use decoder::is_encoder_tensor;
pub use encoder::{encoder_weight_decls, WanVaeEncoder};
pub use encoder_family::{WanVaeEncoderModel, WanVaeEncoderShard};
pub use family::WanVaeModel;
pub use rank::WanVaeRank;
pub use shard::WanVaeShard;
