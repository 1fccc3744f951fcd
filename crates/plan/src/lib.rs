//! Per-rank device memory plans: before a GPU is touched, how many bytes each rank of a
//! tensor-parallel placement needs, against a budget, and what would fit instead.
//!
//! A plan counts, per rank: the weight slices (exact, from the same declarations the loader
//! reads), model buffers, the KV cache (LLMs) or sampler latents (DiT), the activation peak
//! (each model's activation model, beside its forward), what its libraries and kernels keep
//! (cuBLAS, cuDNN; measured per family), NCCL's buffers and
//! the CUDA context. [`Fsdp`] estimates the same model under FSDP, for comparison.
//!
//! The planner knows no model family: each one answers [`ShardedModel`] (its ranks'
//! declarations and [`Footprint`]s), and a plan is arithmetic over the answers.

mod device;
mod model;
mod plan;
mod search;

pub use device::DeviceProfile;
pub use model::{boxed_shards, numbered_unit, Accelerator, Footprint, Placement, RankShard, ShardedModel};
pub use plan::{held_together, Fsdp, Plan, PlanError, RankPlan, Residency, Split};
pub use search::{
    fit_table, kv_sequences_that_fit, over_budget_message, searched_widths, smallest_width, with_kv_sequences,
    WidthFit, WIDEST_SEARCHED,
};

/// Parses a byte size such as `24GiB`, `22.5 GB` or `1048576`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    text.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("`{text}` is not a byte size (e.g. 24GiB): {e}"))
}

/// `bytes` in MiB, for tables.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// `bytes` in GiB, for messages.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
