//! What the planner asks of a model: the seam every model family implements, so that the
//! planner is arithmetic over what the families answer and knows none of them.

use candle_core::DType;
use serde::Serialize;
use tpinfer_weights::WeightDecl;

use crate::PlanError;

/// What runs on the ranks, besides the TP width and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Placement {
    /// An LLM running up to `batch` sequences of up to `max_context` positions each at once.
    /// More than one share a paged KV cache that holds `kv_sequences` sequences at full
    /// length (shorter ones share it finer), or with `None` all `batch` of them (see
    /// [`crate::kv_sequences_that_fit`]).
    Llm {
        max_context: usize,
        batch: usize,
        #[serde(skip_serializing_if = "Option::is_none")]
        kv_sequences: Option<usize>,
    },
    /// A DiT denoising `frames` frames of `width` × `height` pixels, with classifier-free
    /// guidance (`cfg`: its unconditional passes run in turn with the conditional ones).
    Dit {
        frames: usize,
        width: usize,
        height: usize,
        cfg: bool,
    },
}

impl Placement {
    /// An LLM's placement with a KV cache for every sequence at full length.
    pub fn llm(max_context: usize, batch: usize) -> Self {
        Self::Llm {
            max_context,
            batch,
            kv_sequences: None,
        }
    }
}

/// The kind of device a rank computes on, which decides the kernels its forward runs and so
/// its temporaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Accelerator {
    Cpu,
    Cuda,
}

impl Accelerator {
    /// A family's [`Footprint::libraries`]: `cuda_mib` measured on a GPU, none on CPU ranks.
    pub fn libraries(self, cuda_mib: u64) -> u64 {
        match self {
            Self::Cuda => cuda_mib << 20,
            Self::Cpu => 0,
        }
    }
}

/// One rank's device bytes for a placement, apart from its weights (which the planner counts
/// from the rank's declarations).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Footprint {
    /// Model buffers: rotary tables, indices, a captured graph's own memory.
    pub buffers: u64,
    /// The KV cache (LLM), or the sampler's latents and text embeddings (DiT).
    pub cache: u64,
    /// The activation peak of one forward.
    pub activations: u64,
    /// What a stream-ordered pool (CUDA's) may hold beyond the live tensors at that peak.
    pub pool_slack: u64,
    /// Of `buffers` and `cache`, what the rank allocates when it loads, before any request.
    pub at_load: u64,
    /// What the forward's first request adds outside the tensor pool and keeps: cuBLAS's and
    /// cuDNN's handles and workspaces, and the kernel modules loaded at first use. Measured
    /// per family on the test host (`tpinfer-bench` prints it as "outside the pool" less the
    /// context; benches/RESULTS.md, *Memory*).
    pub libraries: u64,
    /// LLM: prompt positions per forward. DiT: video tokens per forward.
    pub tokens_per_forward: usize,
}

/// A model as the planner sees it: a preset or an opened checkpoint of one family.
pub trait ShardedModel: Send + Sync {
    /// The preset's name or the path it was opened from.
    fn name(&self) -> &str;
    /// The widest TP the model shards to (its attention heads).
    fn max_tp(&self) -> usize;
    /// The checkpoint's dtype where it says, else the family's usual one.
    fn default_dtype(&self) -> DType;
    /// The placement when the user gives none.
    fn default_placement(&self) -> Placement;
    /// The most positions a sequence may reach, for models that take [`Placement::Llm`].
    fn max_context(&self) -> Option<usize> {
        None
    }
    /// Every rank's part of the model split `tp` ways, in rank order. Fails, naming the
    /// limit, where the model cannot be split so. Reads nothing: see [`Self::check`].
    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError>;
    /// Checks the opened checkpoint's headers against what a rank reads (`decls`): every
    /// tensor there, with the declared shape. A preset has nothing to check.
    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError>;
    /// The unit FSDP would wrap `tensor` in (a block), or `None` for the root module.
    fn fsdp_unit(&self, tensor: &str) -> Option<String>;
}

/// One rank's part of a split model.
pub trait RankShard: Send + Sync {
    /// Every tensor the rank reads, with the full shape the config implies and its slice.
    fn weight_decls(&self) -> &[WeightDecl];
    /// The rank's bytes besides its weights for `placement` in `dtype` on `accelerator`.
    /// Fails, naming the option, for a placement the family does not take.
    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError>;
}

/// Boxes a family's typed shards for [`ShardedModel::rank_shards`].
pub fn boxed_shards<S: RankShard + 'static>(shards: Vec<S>) -> Vec<Box<dyn RankShard>> {
    shards.into_iter().map(|s| Box::new(s) as Box<dyn RankShard>).collect()
}

/// `prefix.N` of a tensor named `prefix.N.rest`: a numbered block as FSDP wraps it.
pub fn numbered_unit(name: &str, prefix: &str) -> Option<String> {
    let rest = name.strip_prefix(prefix)?;
    let index = rest.split('.').next()?;
    Some(format!("{prefix}{index}"))
}
