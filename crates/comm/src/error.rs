use std::fmt;
use std::time::Duration;

/// The kinds of collective, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    AllReduceSum,
    ReduceScatterSum,
    AllGather {
        dim: usize,
    },
    Broadcast {
        root: usize,
    },
    Barrier,
    /// Not a collective: the host's wait for a rank's queued device work (collectives included).
    Wait,
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AllReduceSum => write!(f, "all_reduce_sum"),
            Self::ReduceScatterSum => write!(f, "reduce_scatter_sum"),
            Self::AllGather { dim } => write!(f, "all_gather(dim {dim})"),
            Self::Broadcast { root } => write!(f, "broadcast(root {root})"),
            Self::Barrier => write!(f, "barrier"),
            Self::Wait => write!(f, "the wait for the device"),
        }
    }
}

/// Why a collective failed. Every variant names the rank at fault.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank} failed: {cause}")]
    PeerFailed { rank: usize, cause: String },
    #[error("rank {rank} exited before entering {op}")]
    PeerExited { rank: usize, op: Collective },
    #[error(
        "rank(s) {missing:?} did not enter {op} within {waited:?} (rank {rank} waited); \
         a rank is stalled or deadlocked"
    )]
    Timeout {
        rank: usize,
        op: Collective,
        waited: Duration,
        missing: Vec<usize>,
    },
    #[error("ranks disagree on the collective: rank {rank} entered {got} while others entered {expected}")]
    Mismatch {
        rank: usize,
        expected: Collective,
        got: Collective,
    },
    #[error("rank {rank}: {op} got incompatible tensors: {detail}")]
    Shape {
        rank: usize,
        op: Collective,
        detail: String,
    },
    #[error("root rank {root} is outside the group of {world} ranks")]
    BadRoot { root: usize, world: usize },
    #[error("rank {rank}: tensor error in {op}: {source}")]
    Tensor {
        rank: usize,
        op: Collective,
        source: candle_core::Error,
    },
    #[error("rank {rank}: NCCL {op} failed: {detail}")]
    Nccl { rank: usize, op: String, detail: String },
}

impl CommError {
    /// The rank this error blames: the root cause a launcher should report.
    pub fn culprit(&self) -> usize {
        match self {
            Self::PeerFailed { rank, .. }
            | Self::PeerExited { rank, .. }
            | Self::Mismatch { rank, .. }
            | Self::Shape { rank, .. }
            | Self::Tensor { rank, .. }
            | Self::Nccl { rank, .. } => *rank,
            Self::Timeout { missing, rank, .. } => missing.first().copied().unwrap_or(*rank),
            Self::BadRoot { root, .. } => *root,
        }
    }
}
