//! Tensor-parallel layers, written once and composed by every model family.
//!
//! Vocabulary (as in Megatron and vLLM): a *column-parallel* linear splits its weight's output
//! rows over ranks and needs no communication; a *row-parallel* linear splits its input
//! columns, so each rank holds a partial sum that one all-reduce completes. Attention is
//! sharded by heads (Q/K/V column-parallel, output row-parallel) and a gated MLP by its hidden
//! columns (gate/up column-parallel, down row-parallel): two all-reduces per transformer layer.

mod attention;
mod embedding;
mod error;
mod kv_cache;
mod linear;
mod mlp;
mod paged_kv;
mod partition;
mod position;
mod rope;

pub use attention::{blockwise_attention, causal_attention, causal_mask, full_attention, grouped_attention};
pub use embedding::VocabParallelEmbedding;
pub use error::{Error, Result};
pub use kv_cache::KvCache;
pub use linear::{
    fp8_product_bytes, fp8_product_extra, mmq_product_bytes, mmvq_row_bytes, ColumnParallelLinear,
    MergedColumnParallelLinear, RowParallelLinear,
};
pub use mlp::{GatedMlp, GatedMlpNames};
pub use paged_kv::{BlockTable, LoneRow, PagedKvCache};
pub use partition::{split_aligned, split_blocks, split_evenly, HeadShard};
pub use position::Position;
pub use rope::{Rope, RopeScaling};
pub use tpinfer_kernels::{fp8_tensor_cores_on, sample_rows, DecodeRows, QueryGroups, RowSampling, RowsAt};

pub use candle_nn::ops::rms_norm;
#[cfg(feature = "cuda")]
pub use linear::reserve_quantized_product_scratch;
#[cfg(feature = "cuda")]
pub use tpinfer_kernels::graph;
pub use tpinfer_kernels::{
    add_rms_norm, add_rms_norm_into, argmax, chained, cuda_flash_attention_covers, decode_scratch_bytes,
    flash_attention, flash_attention_cached, flash_attention_cached_into, gemv_residual_squares,
    paged_decode_attention_into_covers, write_u32s, DecodeScratch, GemvRow, HeadNorms, ResidualNorm, U32Readback,
};
