use tpinfer_comm::CommError;

/// Why the engine could not start or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Checkpoint(Box<tpinfer_llama::CheckpointError>),
    #[error(transparent)]
    Tokenizer(Box<tpinfer_tokenizer::TokenizerError>),
    #[error("cannot shard the model over {tp} ranks: {detail}")]
    Sharding { tp: usize, detail: String },
    #[error("the prompt has {tokens} tokens but the context holds {context}: shorten the prompt or raise --max-context (the model allows up to {model_max})")]
    PromptTooLong {
        tokens: usize,
        context: usize,
        model_max: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("--device cuda needs a build with `--features cuda,nccl`; this binary was built for CPU ranks only")]
    CudaNotBuilt,
    #[error("rank {rank}: {source}")]
    Rank {
        rank: usize,
        #[source]
        source: tpinfer_layers::Error,
    },
    #[error("rank {rank} exited during the request (its thread ended without reporting)")]
    RankExited { rank: usize },
    #[error("rank {rank} is out of device memory: {detail}")]
    OutOfMemory { rank: usize, detail: String },
    #[error("rank {rank}: injected fault: {fault}")]
    Injected { rank: usize, fault: String },
    #[error("rank {rank} panicked: {message}")]
    RankPanicked { rank: usize, message: String },
    #[error("{0}")]
    Comm(Box<CommError>),
    #[error("rank {rank}: {detail}")]
    Device { rank: usize, detail: String },
    #[error("rank(s) {missing:?} did not join the communicator within {waited:?} (NCCL init hang); check `tpinfer doctor`, or try NCCL_P2P_DISABLE=1 on PCIe boxes and NCCL_IB_DISABLE=1 without InfiniBand")]
    InitTimeout {
        missing: Vec<usize>,
        waited: std::time::Duration,
    },
    #[error("--gpus names {given} GPU(s) but --tp is {tp}: give one GPU per rank")]
    GpuCount { given: usize, tp: usize },
    #[error("the placement does not fit the memory budget: {0}")]
    OverBudget(String),
    #[error("cannot plan the placement: {0}")]
    Plan(String),
    #[error("sampling: {0}")]
    Sampling(String),
    #[error("the engine has stopped: {0}")]
    Stopped(String),
}

impl From<tpinfer_llama::CheckpointError> for EngineError {
    fn from(e: tpinfer_llama::CheckpointError) -> Self {
        Self::Checkpoint(Box::new(e))
    }
}

impl From<tpinfer_tokenizer::TokenizerError> for EngineError {
    fn from(e: tpinfer_tokenizer::TokenizerError) -> Self {
        Self::Tokenizer(Box::new(e))
    }
}

impl From<CommError> for EngineError {
    fn from(e: CommError) -> Self {
        Self::Comm(Box::new(e))
    }
}

impl EngineError {
    /// Whether this error only reports that a peer failed, rather than being a root cause.
    pub(crate) fn is_peer_report(&self) -> bool {
        let comm: &CommError = match self {
            Self::Comm(e) => e,
            Self::Rank {
                source: tpinfer_layers::Error::Comm(e),
                ..
            } => e,
            _ => return false,
        };
        matches!(
            *comm,
            CommError::PeerFailed { .. } | CommError::PeerExited { .. } | CommError::Timeout { .. }
        )
    }
}
