use tpinfer_comm::CommError;
use tpinfer_weights::WeightError;

/// Why a layer could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error("cannot shard: {0}")]
    Shard(String),
}

pub type Result<T> = std::result::Result<T, Error>;
