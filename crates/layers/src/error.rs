use tpinfer_comm::CommError;
use tpinfer_weights::WeightError;

/// Why a layer could not be built or run. Large causes are boxed so that `Result` stays
/// small on the hot path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Comm(Box<CommError>),
    #[error(transparent)]
    Weights(Box<WeightError>),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error("cannot shard: {0}")]
    Shard(String),
    /// An option this rank's device or dtype has no kernel for.
    #[error("{0}")]
    Unsupported(String),
    #[error("the sequence needs {needed} positions but the KV cache holds {capacity}; raise --max-context")]
    CacheFull { needed: usize, capacity: usize },
}

impl From<CommError> for Error {
    fn from(e: CommError) -> Self {
        Self::Comm(Box::new(e))
    }
}

impl From<WeightError> for Error {
    fn from(e: WeightError) -> Self {
        Self::Weights(Box::new(e))
    }
}

pub type Result<T> = std::result::Result<T, Error>;
