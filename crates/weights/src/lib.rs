//! Weight stores that hand each tensor-parallel rank exactly its own slice of every tensor:
//! safetensors (sharded too), GGUF, and PyTorch `.pth` state dicts (read without unpickling code).
//!
//! A model declares, per tensor, its full shape and its [`ShardSpec`] for a rank. The
//! [`ShardLoader`] checks each declaration against the checkpoint's header and copies only the
//! slice's bytes out of the memory-mapped file, so a rank never reads a tensor it does not own.
//! The same declarations give a rank's weight bytes from the headers alone, for the planner.

mod error;
mod fp8;
mod gguf;
mod loader;
mod lora;
mod progress;
mod pth_store;
mod renamed;
mod safetensors_store;
mod shard;

pub use error::WeightError;
pub use fp8::quantize_rows;
pub use gguf::{GgufStore, GgufTensorMap};
pub use loader::{hold_matrices, ShardLoader, Weight, WeightDecl};
pub use lora::{LoraAdapter, LoraStore};
pub use progress::{CountingStore, LoadProgress};
pub use pth_store::{PthDirStore, PthStore, PTH_INDEX, PTH_SINGLE};
pub use renamed::RenamedStore;
pub use safetensors_store::SafetensorsStore;
pub use shard::ShardSpec;

use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};

/// A model directory's tensors: its safetensors (see [`SafetensorsStore::open`]), or where it
/// has none, its `pytorch_model.bin` or the shards its index names (`torch.save`d state
/// dicts, [`PthDirStore`]), as older transformers checkpoints ship only those.
pub fn open_model_dir(dir: &Path) -> Result<Box<dyn WeightStore>, WeightError> {
    match SafetensorsStore::open(dir) {
        Ok(store) => Ok(Box::new(store)),
        Err(WeightError::NoWeights { .. }) if dir.join(PTH_SINGLE).is_file() || dir.join(PTH_INDEX).is_file() => {
            Ok(Box::new(PthDirStore::open(dir)?))
        }
        // Shards without the index that says which holds what.
        Err(WeightError::NoWeights { pickle: Some(file), .. }) => Err(WeightError::BadIndex {
            path: dir.join(PTH_INDEX),
            detail: format!("it is missing, and the pickled shards beside it ({file}) need it"),
        }),
        Err(e) => Err(e),
    }
}

/// A tensor's header: its full shape and its dtype as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The GGML block type the tensor is stored in, when the store can hand it over as
    /// stored ([`WeightStore::read_quantized`]); `dtype` is then what a dense read gives.
    pub quant: Option<GgmlDType>,
}

/// The form a rank holds a checkpoint's matrices in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// As stored: GGUF blocks and FP8 matrices stay so (device memory follows the file),
    /// the rest is in the compute dtype.
    #[default]
    AsStored,
    /// Everything in the compute dtype (`--dequantize`).
    Dequantized,
    /// Every linear weight of the model's layers in FP8 E4M3 with one scale per output row
    /// (`--quantize fp8`), quantized at load unless stored so. A language model's LM head
    /// stays in the compute dtype, as FP8 checkpoints and vLLM keep it.
    Fp8,
    /// [`WeightFormat::Fp8`], and a language model's own (untied) LM head too
    /// (`--quantize fp8 --quantize-lm-head`): its bytes halve again, and a decode step reads
    /// them once per token.
    Fp8WithLmHead,
}

/// How a matrix is held on its rank when not in the compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    /// GGML blocks, as a GGUF file stores them.
    Ggml(GgmlDType),
    /// FP8 E4M3 values with one f32 scale per output row.
    Fp8,
}

/// A rank's slice of a quantized tensor, still in its blocks: whole rows of whole blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizedSlice {
    pub dtype: GgmlDType,
    /// The slice's shape, `[rows, cols]`.
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Where a checkpoint's tensors come from.
pub trait WeightStore: Send + Sync {
    /// The header of `name`, without reading its data.
    fn info(&self, name: &str) -> Option<TensorInfo>;
    /// Every tensor name in the checkpoint.
    fn names(&self) -> Vec<String>;
    /// The `spec` slice of `name` on the CPU in its stored dtype, and the bytes read for it.
    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError>;
    /// The `spec` slice of `name` in the blocks it is stored in, and the bytes read for it;
    /// for stores whose [`TensorInfo::quant`] is set.
    fn read_quantized(&self, name: &str, _spec: &ShardSpec) -> Result<(QuantizedSlice, usize), WeightError> {
        Err(WeightError::Shard {
            name: name.to_string(),
            detail: format!("{} holds no quantized tensors", self.origin()),
        })
    }
    /// Where the checkpoint lives, for messages.
    fn origin(&self) -> String;
    /// What says which tensors the checkpoint should hold, for messages: its `config.json`,
    /// unless the store knows better (a GGUF file's own metadata).
    fn config_origin(&self) -> String {
        "config.json".to_string()
    }
}
