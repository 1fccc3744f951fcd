//! The VAE's encoder as a [`Family`], for pipelines that encode pixels (Wan2.2-S2V's reference
//! image and motion frames): every rank holds the whole encoder and encodes whole frames, a
//! clip's few, so no rank waits on another; the planner counts its weights and its encode's
//! peak ([`crate::memory::EncodeMemory`]).

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use tpinfer_family::{preset_has_no_weights, Family, LoadContext};
use tpinfer_plan::{boxed_shards, Accelerator, Footprint, Placement, PlanError, RankShard, ShardedModel};
use tpinfer_weights::{CountingStore, ShardLoader, WeightDecl, WeightStore};

use crate::memory::{DecodeDevice, EncodeMemory};
use crate::{encoder_weight_decls, is_encoder_tensor, WanVaeConfig, WanVaeEncoder, WanVaeModel};

/// The longest run of frames an encode takes (a thousand chunks of four).
const MAX_FRAMES: usize = 4_001;
const MAX_SIDE: usize = 16_384;

/// The encoder of a [`WanVaeModel`]'s checkpoint.
#[derive(Clone)]
pub struct WanVaeEncoderModel {
    name: String,
    config: Arc<WanVaeConfig>,
    store: Option<Arc<dyn WeightStore>>,
}

/// One rank's copy of the encoder.
#[derive(Clone)]
pub struct WanVaeEncoderShard {
    config: Arc<WanVaeConfig>,
    decls: Arc<[WeightDecl]>,
}

impl WanVaeEncoderModel {
    /// The encoder of `vae`'s checkpoint.
    pub fn of(vae: &WanVaeModel) -> Self {
        Self {
            name: format!("{} (encoder)", vae.name()),
            config: Arc::new(vae.config().clone()),
            store: vae.store().cloned(),
        }
    }
}

impl ShardedModel for WanVaeEncoderModel {
    fn name(&self) -> &str {
        &self.name
    }

    /// Every rank holds it whole: any width.
    fn max_tp(&self) -> usize {
        1 << 16
    }

    fn default_dtype(&self) -> DType {
        DType::BF16
    }

    /// S2V's motion frames: 73 at 832 × 480.
    fn default_placement(&self) -> Placement {
        Placement::Dit {
            frames: 73,
            width: 832,
            height: 480,
            cfg: false,
        }
    }

    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }

    /// Every encoder tensor, with its shape; the decoder half is left alone.
    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        match &self.store {
            Some(store) => ShardLoader::check(&**store, decls, &|name: &str| !is_encoder_tensor(name))
                .map_err(|e| PlanError::Model(e.to_string())),
            None => Ok(()),
        }
    }

    fn fsdp_unit(&self, _tensor: &str) -> Option<String> {
        None
    }
}

impl RankShard for WanVaeEncoderShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }

    /// The encode of `frames` (the most at once) at `--size`.
    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Dit {
            frames, width, height, ..
        } = placement
        else {
            return Err(PlanError::Placement(
                "a video VAE encodes frames of --size, not an LLM's --max-context".into(),
            ));
        };
        let (time, space) = (self.config.temporal_factor(), self.config.spatial_factor());
        if frames == 0 || frames > MAX_FRAMES || width > MAX_SIDE || height > MAX_SIDE {
            return Err(PlanError::Placement(format!(
                "an encode of {frames} frames of {width}x{height}: 1 to {MAX_FRAMES} frames of at most {MAX_SIDE} \
                 pixels a side"
            )));
        }
        if (frames - 1) % time != 0 || width % space != 0 || height % space != 0 || width == 0 || height == 0 {
            return Err(PlanError::Placement(format!(
                "an encode of {frames} frames of {width}x{height}: the VAE encodes {time}k + 1 frames of sides that \
                 are multiples of {space}"
            )));
        }
        let device = DecodeDevice::new(dtype, accelerator == Accelerator::Cuda);
        let m = EncodeMemory::new(&self.config, device, frames, height, width);
        Ok(Footprint {
            activations: m.peak as u64,
            pool_slack: m.pool_slack as u64,
            libraries: accelerator.libraries(crate::family::LIBRARIES_MIB),
            tokens_per_forward: frames * (height / space) * (width / space),
            ..Footprint::default()
        })
    }
}

impl Family for WanVaeEncoderModel {
    const NAME: &'static str = "wan-vae-encoder";
    const PRESETS: &'static [&'static str] = &["wan2.1-vae-encoder"];
    type Shard = WanVaeEncoderShard;
    type Rank = WanVaeEncoder;

    fn detect(path: &Path) -> bool {
        WanVaeModel::detect(path)
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        Ok(Self::of(&WanVaeModel::open(path)?))
    }

    fn preset(name: &str) -> Option<Self> {
        name.eq_ignore_ascii_case("wan2.1-vae-encoder")
            .then(|| WanVaeModel::preset("wan2.1-vae").map(|vae| Self::of(&vae)))
            .flatten()
    }

    fn shards(&self, tp: usize) -> Result<Vec<WanVaeEncoderShard>, PlanError> {
        if tp == 0 || tp > self.max_tp() {
            return Err(PlanError::Sharding {
                tp,
                detail: format!("from 1 to {} ranks", self.max_tp()),
            });
        }
        let decls: Arc<[WeightDecl]> = encoder_weight_decls(&self.config).into();
        Ok(vec![
            WanVaeEncoderShard {
                config: self.config.clone(),
                decls,
            };
            tp
        ])
    }

    fn load(
        &self,
        _shard: &WanVaeEncoderShard,
        _placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<WanVaeEncoder, tpinfer_layers::Error> {
        let store = self.store.as_ref().ok_or_else(|| preset_has_no_weights(&self.name))?;
        let store = CountingStore::new(store.clone(), ctx.progress, ctx.dtype);
        WanVaeEncoder::load(&self.config, &store, ctx.dtype, ctx.device)
    }

    fn bytes_loaded(rank: &WanVaeEncoder) -> usize {
        rank.bytes_loaded()
    }
}
