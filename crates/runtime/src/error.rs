use tpinfer_comm::CommError;

/// Why a rank group could not start, or why a rank's task failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot shard the model over {tp} ranks: {detail}")]
    Sharding { tp: usize, detail: String },
    #[error("--device cuda needs a build with `--features cuda,nccl`; this binary was built for CPU ranks only")]
    CudaNotBuilt,
    #[error("--tp must be at least 1")]
    NoRanks,
    #[error("{0}")]
    Option(String),
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
    #[error(
        "rank {rank}: a library could not run a kernel ({detail}); on a device nearly full that is \
         how running out of memory shows (a kernel loaded at first use finds no room for its code): \
         free the device or lower --gpu-mem, and see `tpinfer plan` for what fits"
    )]
    KernelNotRun { rank: usize, detail: String },
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
    #[error("the ranks have stopped: {0}")]
    Stopped(String),
    #[error("{0}")]
    Model(String),
    #[error("the group holds no such model at {index}: a handle of another group")]
    WrongModel { index: usize },
    #[error("model {index} is not loaded yet: it loads in the next turn (RankGroup::next_turn)")]
    NotLoaded { index: usize },
    #[error("model {index} was freed after its turn, to fit the models after it in the memory budget")]
    Freed { index: usize },
}

impl From<CommError> for RuntimeError {
    fn from(e: CommError) -> Self {
        Self::Comm(Box::new(e))
    }
}

impl RuntimeError {
    /// A layer error as rank `rank` reports it. A CUDA out-of-memory is told apart from the
    /// rest: it must never surface as a communication failure.
    pub fn of_rank(rank: usize, source: tpinfer_layers::Error) -> Self {
        match &source {
            // Only the rank's own allocation failure: a peer's OOM arrives as a communication
            // error.
            tpinfer_layers::Error::Tensor(e) if is_out_of_memory(&e.to_string()) => Self::OutOfMemory {
                rank,
                detail: e.to_string(),
            },
            // cuBLAS(Lt) says only that its kernel did not run; short of memory that is what
            // a rank sees (measured at the least card a DiT runs on, benches/RESULTS.md).
            tpinfer_layers::Error::Tensor(e) if e.to_string().contains("CUBLAS_STATUS_EXECUTION_FAILED") => {
                Self::KernelNotRun {
                    rank,
                    detail: e.to_string(),
                }
            }
            _ => Self::Rank { rank, source },
        }
    }

    /// Whether this error only reports that a peer failed, rather than being a root cause.
    pub fn is_peer_report(&self) -> bool {
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

fn is_out_of_memory(text: &str) -> bool {
    text.contains("OUT_OF_MEMORY") || text.contains("out of memory") || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
}

/// An error a rank's task may return: the group reads the runtime error inside it, if any, to
/// tell a root cause from a peer's report, and a silent exit or a panic from the rest.
pub trait RankFailure: From<RuntimeError> + std::fmt::Display + Send + 'static {
    fn as_runtime(&self) -> Option<&RuntimeError>;
}

impl RankFailure for RuntimeError {
    fn as_runtime(&self) -> Option<&RuntimeError> {
        Some(self)
    }
}

/// Of the ranks' errors, the one that is not merely a report of a failed peer.
pub(crate) fn root_cause<E: RankFailure>(mut errors: Vec<E>) -> Option<E> {
    let is_report = |e: &E| e.as_runtime().is_some_and(RuntimeError::is_peer_report);
    match errors.iter().position(|e| !is_report(e)) {
        Some(i) => Some(errors.swap_remove(i)),
        None => errors.into_iter().next(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_ranks_own_allocation_failure_is_its_oom() {
        let own =
            tpinfer_layers::Error::Tensor(candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY)".into()));
        assert!(matches!(
            RuntimeError::of_rank(1, own),
            RuntimeError::OutOfMemory { rank: 1, .. }
        ));
        let peer = tpinfer_layers::Error::from(CommError::PeerFailed {
            rank: 1,
            cause: "rank 1 is out of device memory".into(),
        });
        let reported = RuntimeError::of_rank(0, peer);
        assert!(matches!(reported, RuntimeError::Rank { rank: 0, .. }), "{reported}");
        assert!(reported.is_peer_report(), "rank 0 only reports rank 1's failure");
    }

    #[test]
    fn a_library_kernel_that_did_not_run_names_memory() {
        let tensor = |text: &str| tpinfer_layers::Error::Tensor(candle_core::Error::Msg(text.into()));
        let alloc = RuntimeError::of_rank(2, tensor("cuBLASLt: CublasError(CUBLAS_STATUS_ALLOC_FAILED)"));
        assert!(matches!(alloc, RuntimeError::OutOfMemory { rank: 2, .. }), "{alloc}");
        let not_run = RuntimeError::of_rank(0, tensor("cuBLASLt: CublasError(CUBLAS_STATUS_EXECUTION_FAILED)"));
        assert!(
            matches!(not_run, RuntimeError::KernelNotRun { rank: 0, .. }),
            "{not_run}"
        );
        let text = not_run.to_string();
        assert!(
            text.contains("CUBLAS_STATUS_EXECUTION_FAILED")
                && text.contains("out of memory")
                && text.contains("--gpu-mem"),
            "{text}"
        );
        assert!(!not_run.is_peer_report());
    }
}
