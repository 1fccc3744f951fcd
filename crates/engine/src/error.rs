use candle_core::{DType, Tensor};
use tpinfer_comm::CommError;
use tpinfer_runtime::{RankFailure, RuntimeError};

/// Why the engine could not start or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Checkpoint(Box<tpinfer_llama::CheckpointError>),
    #[error(transparent)]
    Tokenizer(Box<tpinfer_tokenizer::TokenizerError>),
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
    #[error("rank {rank}: injected fault: {fault}")]
    Injected { rank: usize, fault: String },
    #[error("sampling: {0}")]
    Sampling(String),
    #[error("the {what} hold NaN or infinite values after {stage}: the weights or the inputs are not finite")]
    NonFinite { what: &'static str, stage: String },
    /// The ranks: their start, their plan, their devices and collectives, their failures.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
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
        Self::Runtime(e.into())
    }
}

impl RankFailure for EngineError {
    fn as_runtime(&self) -> Option<&RuntimeError> {
        match self {
            Self::Runtime(e) => Some(e),
            _ => None,
        }
    }
}

/// Whether every element of `x` is finite: its sum is not, where one is not.
pub(crate) fn finite(x: &Tensor) -> candle_core::Result<bool> {
    let sum = x.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    Ok(sum.is_finite())
}
