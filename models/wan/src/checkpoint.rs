use std::path::Path;
use std::sync::Arc;

use tpinfer_weights::{LoraAdapter, LoraStore, RenamedStore, SafetensorsStore, WeightError, WeightStore};

use crate::{original_names, WanConfig};
use tpinfer_family::ConfigError;

/// A Wan DiT directory opened for sharded loading: its config and tensor headers, seen
/// through diffusers' names whichever naming it was saved in.
pub struct WanCheckpoint {
    pub config: WanConfig,
    pub store: Arc<dyn WeightStore>,
    /// The checkpoint in its own names, under the renaming.
    stored: Arc<dyn WeightStore>,
}

/// Why a Wan checkpoint could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum WanCheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

impl WanCheckpoint {
    pub fn open(dir: &Path) -> Result<Self, WanCheckpointError> {
        let config = WanConfig::from_dir(dir)?;
        let stored: Arc<dyn WeightStore> = Arc::new(SafetensorsStore::open(dir)?);
        Ok(Self {
            store: diffusers_view(stored.clone(), &config),
            config,
            stored,
        })
    }

    /// The same checkpoint with `adapter` merged into each rank's slices as they are read.
    /// The adapter may name the weights in either of Wan's namings, whichever the
    /// checkpoint is saved in: the original Wan code's (Live Avatar's adapter; ComfyUI's,
    /// under `diffusion_model.`) or diffusers'.
    pub fn with_lora(&self, adapter: Arc<LoraAdapter>) -> Result<Self, WeightError> {
        let aliases = original_names(&self.config);
        let merged: Arc<dyn WeightStore> = Arc::new(LoraStore::new(self.stored.clone(), adapter, &aliases)?);
        Ok(Self {
            config: self.config.clone(),
            store: diffusers_view(merged, &self.config),
            stored: self.stored.clone(),
        })
    }

    /// Whether `dir` holds a Wan DiT (rather than an LLM).
    pub fn is_wan_dir(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json"))
            .map(|t| t.contains("WanTransformer3DModel") || t.contains("\"ffn_dim\""))
            .unwrap_or(false)
    }
}

/// `stored` seen through diffusers' names: renamed when it is an original Wan checkpoint,
/// whose first block's query is `self_attn.q`.
fn diffusers_view(stored: Arc<dyn WeightStore>, config: &WanConfig) -> Arc<dyn WeightStore> {
    match stored.info("blocks.0.self_attn.q.weight") {
        Some(_) => Arc::new(RenamedStore::new(stored, original_names(config))),
        None => stored,
    }
}
