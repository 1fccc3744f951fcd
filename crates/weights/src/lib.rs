//! Weight stores that hand each tensor-parallel rank exactly its own slice of every tensor.
//!
//! A model declares, per tensor, its full shape and its [`ShardSpec`] for a rank. The
//! [`ShardLoader`] checks each declaration against the checkpoint's header and copies only the
//! slice's bytes out of the memory-mapped file, so a rank never reads a tensor it does not own.
//! The same declarations give a rank's weight bytes from the headers alone, for the planner.

mod error;
mod gguf;
mod loader;
mod progress;
mod renamed;
mod safetensors_store;
mod shard;

pub use error::WeightError;
pub use gguf::{GgufStore, GgufTensorMap};
pub use loader::{ShardLoader, WeightDecl};
pub use progress::{CountingStore, LoadProgress};
pub use renamed::RenamedStore;
pub use safetensors_store::SafetensorsStore;
pub use shard::ShardSpec;

use candle_core::{DType, Tensor};

/// A tensor's header: its full shape and its dtype as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// Where a checkpoint's tensors come from.
pub trait WeightStore: Send + Sync {
    /// The header of `name`, without reading its data.
    fn info(&self, name: &str) -> Option<TensorInfo>;
    /// Every tensor name in the checkpoint.
    fn names(&self) -> Vec<String>;
    /// The `spec` slice of `name` on the CPU in its stored dtype, and the bytes read for it.
    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError>;
    /// Where the checkpoint lives, for messages.
    fn origin(&self) -> String;
    /// What says which tensors the checkpoint should hold, for messages: its `config.json`,
    /// unless the store knows better (a GGUF file's own metadata).
    fn config_origin(&self) -> String {
        "config.json".to_string()
    }
}
