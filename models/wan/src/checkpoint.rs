use std::path::Path;
use std::sync::Arc;

use tpinfer_weights::{RenamedStore, SafetensorsStore, WeightError, WeightStore};

use crate::{original_names, WanConfig, WanConfigError};

/// A Wan DiT directory opened for sharded loading: its config and tensor headers, seen
/// through diffusers' names whichever naming it was saved in.
pub struct WanCheckpoint {
    pub config: WanConfig,
    pub store: Arc<dyn WeightStore>,
}

/// Why a Wan checkpoint could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum WanCheckpointError {
    #[error(transparent)]
    Config(#[from] WanConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

impl WanCheckpoint {
    pub fn open(dir: &Path) -> Result<Self, WanCheckpointError> {
        let config = WanConfig::from_dir(dir)?;
        let store: Arc<dyn WeightStore> = Arc::new(SafetensorsStore::open(dir)?);
        // The original Wan code names the first block's query `self_attn.q`.
        let store: Arc<dyn WeightStore> = match store.info("blocks.0.self_attn.q.weight") {
            Some(_) => Arc::new(RenamedStore::new(store, original_names(&config))),
            None => store,
        };
        Ok(Self { config, store })
    }

    /// Whether `dir` holds a Wan DiT (rather than an LLM).
    pub fn is_wan_dir(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json"))
            .map(|t| t.contains("WanTransformer3DModel") || t.contains("\"ffn_dim\""))
            .unwrap_or(false)
    }
}
