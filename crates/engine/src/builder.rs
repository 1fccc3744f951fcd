use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;
use tpinfer_comm::CommOptions;
use tpinfer_runtime::LoadProgress;
use tpinfer_runtime::{DeviceKind, GroupOptions};
use tpinfer_wan::SelfAttention;
use tpinfer_weights::{LoraAdapter, WeightFormat};

use crate::{Engine, EngineError};

/// A failure injected into one rank at one decode step (step 0 is the forward after the first
/// generated token), to test that every failure is
/// reported with its rank and that no rank hangs. A test switch: never set in production.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The rank returns an error.
    Error { rank: usize, step: usize },
    /// The rank panics.
    Panic { rank: usize, step: usize },
    /// The rank allocates more device memory than any GPU has: a real CUDA out-of-memory.
    Oom { rank: usize, step: usize },
    /// The rank's thread ends without a word, as a killed process would.
    Exit { rank: usize, step: usize },
    /// The rank's logits turn NaN from this step on, as a NaN that reached its KV cache would
    /// make them.
    NonFinite { rank: usize, step: usize },
}

impl Fault {
    pub(crate) fn at(&self, rank: usize, step: usize) -> bool {
        self.place() == (rank, step)
    }

    /// The rank and decode step the fault strikes.
    pub(crate) fn place(&self) -> (usize, usize) {
        match *self {
            Self::Error { rank, step }
            | Self::Panic { rank, step }
            | Self::Oom { rank, step }
            | Self::Exit { rank, step }
            | Self::NonFinite { rank, step } => (rank, step),
        }
    }
}

/// Configures and starts an [`Engine`] (or a [`crate::VideoEngine`]).
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    pub(crate) model: PathBuf,
    pub(crate) tp: usize,
    pub(crate) device: DeviceKind,
    pub(crate) dtype: Option<DType>,
    pub(crate) max_context: Option<usize>,
    pub(crate) max_seqs: usize,
    pub(crate) step_tokens: usize,
    pub(crate) fault: Option<Fault>,
    pub(crate) group: GroupOptions,
    pub(crate) weight_format: WeightFormat,
    pub(crate) lora: Option<Arc<LoraAdapter>>,
    pub(crate) self_attention: SelfAttention,
    pub(crate) chat_template: Option<String>,
}

/// Context used when none is given, so that a 128k-context model does not reserve rotary
/// tables and cache growth for 128k positions by default.
pub const DEFAULT_MAX_CONTEXT: usize = 8192;

/// New tokens per batched step when none is given: a long prompt is prefilled this many
/// positions a step beside the other sequences' decode tokens. Larger budgets take fewer,
/// longer steps: on an H200 (8B, 512-token prompts) 1,024 served 2–7% more tokens a second
/// than 512 at 32 to 128 requests, with a shorter p99 time to the first token and a longer
/// p99 between tokens (benches/RESULTS.md, *Serving*).
pub const DEFAULT_STEP_TOKENS: usize = 1024;

impl EngineBuilder {
    /// A builder for the model at `model`: a Hugging Face directory or a GGUF file.
    pub fn new(model: impl AsRef<Path>) -> Self {
        Self {
            model: model.as_ref().to_path_buf(),
            tp: 1,
            device: DeviceKind::Cpu,
            dtype: None,
            max_context: None,
            max_seqs: 1,
            step_tokens: DEFAULT_STEP_TOKENS,
            fault: None,
            group: GroupOptions::default(),
            weight_format: WeightFormat::AsStored,
            lora: None,
            self_attention: SelfAttention::ComputeDtype,
            chat_template: None,
        }
    }

    /// The tensor-parallel width: the number of ranks (1 to the number of attention heads).
    pub fn tp(mut self, tp: usize) -> Self {
        self.tp = tp;
        self
    }

    /// The tensor-parallel width it starts at.
    pub fn width(&self) -> usize {
        self.tp
    }

    pub fn device(mut self, device: DeviceKind) -> Self {
        self.device = device;
        self
    }

    /// The form the ranks hold the linear weights in. Default: as stored (GGUF blocks and FP8
    /// matrices kept); [`WeightFormat::Dequantized`] expands them to the compute dtype,
    /// [`WeightFormat::Fp8`] quantizes every linear weight at load (and
    /// [`WeightFormat::Fp8WithLmHead`] a language model's LM head too).
    pub fn weight_format(mut self, format: WeightFormat) -> Self {
        self.weight_format = format;
        self
    }

    /// A language model's chat template (Jinja source) in place of the one its tokenizer
    /// ships, or for a model that ships none (vLLM's `--chat-template`); checked at build by
    /// rendering a one-message chat. A video model refuses one.
    pub fn chat_template(mut self, source: impl Into<String>) -> Self {
        self.chat_template = Some(source.into());
        self
    }

    /// A LoRA adapter merged into a Wan DiT's weights at load, each rank merging only its
    /// own slices; a language model refuses one.
    pub fn lora(mut self, adapter: Arc<LoraAdapter>) -> Self {
        self.lora = Some(adapter);
        self
    }

    /// The precision of a Wan DiT's self-attention products. Default: the compute dtype;
    /// [`SelfAttention::Fp8`] runs them on E4M3 operands (Hopper and Ada GPUs in bf16; other ranks
    /// refuse it at load), which changes the video. A language model refuses it.
    pub fn self_attention(mut self, precision: SelfAttention) -> Self {
        self.self_attention = precision;
        self
    }

    /// The compute dtype. Default: f32 on CPU ranks, the checkpoint's dtype on GPUs.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// The longest sequence (prompt and generated tokens) a request may reach.
    /// Default: the model's limit, at most 8192.
    pub fn max_context(mut self, tokens: usize) -> Self {
        self.max_context = Some(tokens);
        self
    }

    /// The most sequences decoding at once. 1 (the default) serves one request at a time
    /// through the captured single-sequence decode step; more batch every running sequence's
    /// tokens into each forward over a paged KV cache of this many full contexts, or of as
    /// many as the memory budget holds where that is fewer ([`Self::gpu_mem`]; CPU ranks given
    /// none share half of the host's available memory; at least one), shorter sequences
    /// sharing it finer (continuous batching).
    pub fn max_seqs(mut self, sequences: usize) -> Self {
        self.max_seqs = sequences;
        self
    }

    /// New tokens (decode tokens and prompt chunks) per batched step, with `max_seqs` > 1.
    /// Default: [`DEFAULT_STEP_TOKENS`].
    pub fn step_tokens(mut self, tokens: usize) -> Self {
        self.step_tokens = tokens;
        self
    }

    /// How long a rank waits for its peers in a collective before it reports them.
    pub fn comm_timeout(mut self, timeout: Duration) -> Self {
        self.group.comm_timeout = timeout;
        self
    }

    /// How long the ranks may take to form their communicator (NCCL init) before the ranks
    /// that have not joined are reported.
    pub fn init_timeout(mut self, timeout: Duration) -> Self {
        self.group.init_timeout = timeout;
        self
    }

    /// The device memory each rank may use, in bytes. Every start plans each rank's bytes
    /// first and refuses a placement over budget before any allocation or NCCL init. On GPUs
    /// the budget is also at most each device's free memory less a 2% margin (the default);
    /// CPU ranks are checked only against this.
    pub fn gpu_mem(mut self, bytes: u64) -> Self {
        self.group.gpu_mem = Some(bytes);
        self
    }

    /// The share of each GPU's total memory each rank may use, above 0 and at most 1 (vLLM's
    /// `gpu_memory_utilization`): a GPU budget like [`Self::gpu_mem`], and at most it where
    /// both are given.
    pub fn gpu_memory_utilization(mut self, share: f64) -> Self {
        self.group.gpu_share = Some(share);
        self
    }

    /// Runs every decode step kernel by kernel instead of replaying it as a captured CUDA
    /// graph (the default on GPUs with flash attention): slower, for debugging and comparison.
    pub fn enforce_eager(mut self, eager: bool) -> Self {
        self.group.rank.cuda_graphs = !eager;
        self
    }

    /// Launches a decode step's kernels as one chain on Hopper and newer GPUs (the default),
    /// or one after the other.
    pub fn kernel_chains(mut self, on: bool) -> Self {
        self.group.rank.kernel_chains = on;
        self
    }

    /// Which of tpinfer's own paths between GPUs with peer access NCCL ranks may take (all by
    /// default; see [`CommOptions`]).
    pub fn comm_options(mut self, options: CommOptions) -> Self {
        self.group.comm = options;
        self
    }

    /// Counts the weight bytes the ranks load into `progress`, for a progress bar the caller
    /// draws from its clone.
    pub fn load_progress(mut self, progress: LoadProgress) -> Self {
        self.group.progress = progress;
        self
    }

    /// Injects `fault` into every request (see [`Fault`]): for failure tests only.
    pub fn inject_fault(mut self, fault: Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Opens the model, shards it and loads every rank. Fails with the first rank's error.
    pub fn build(self) -> Result<Engine, EngineError> {
        Engine::start(self)
    }
}
