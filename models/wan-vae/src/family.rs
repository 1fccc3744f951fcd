//! The Wan VAE as a [`Family`]: the preset, the split over ranks, each rank's footprint and
//! its load.

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use tpinfer_family::{preset_has_no_weights, Family, LoadContext};
use tpinfer_plan::{boxed_shards, Accelerator, Footprint, Placement, PlanError, RankShard, ShardedModel};
use tpinfer_weights::{CountingStore, PthStore, RenamedStore, SafetensorsStore, ShardLoader, WeightDecl, WeightStore};

use crate::memory::{DecodeDevice, DecodeMemory, DecodeShape};
use crate::{is_encoder_tensor, WanVaeConfig, WanVaeRank, WanVaeShard};

/// The widest frame a plan takes, in pixels: far past any box's memory, and far from any
/// product that could wrap.
const MAX_SIDE: usize = 16_384;
/// The longest video a plan takes (17 minutes at 16 fps).
const MAX_FRAMES: usize = 16_385;

/// What a CUDA rank's decode keeps outside the tensor pool from its first request, MiB:
/// cuDNN's handle and convolution kernels, cuBLAS (the device beyond its context, 607 MiB;
/// benches/RESULTS.md, *Memory*). The encoder runs the same kernels.
pub(crate) const LIBRARIES_MIB: u64 = 42;

/// A Wan VAE to plan or load: the preset's config, or a `vae/` directory opened for its
/// config and tensor headers.
#[derive(Clone)]
pub struct WanVaeModel {
    name: String,
    config: Arc<WanVaeConfig>,
    store: Option<Arc<dyn WeightStore>>,
}

/// One rank's part of the VAE: its band of rows, with the tensors it reads (all of them).
#[derive(Clone)]
pub struct WanVaeRankShard {
    pub shard: WanVaeShard,
    config: Arc<WanVaeConfig>,
    decls: Arc<[WeightDecl]>,
}

impl WanVaeModel {
    /// Wan's own VAE checkpoint, as the official Wan layouts ship it (`Wan2.1_VAE.pth`): a
    /// `.pth` state dict in Wan's tensor names, with no config beside it.
    pub fn open_original(pth: &Path) -> Result<Self, PlanError> {
        let origin = pth.display().to_string();
        let store = PthStore::open(pth).map_err(|e| PlanError::Model(e.to_string()))?;
        let config = crate::original::config(&store, &origin).map_err(PlanError::Model)?;
        let names = crate::original::names(&config).map_err(PlanError::Model)?;
        Ok(Self {
            name: origin,
            config: Arc::new(config),
            store: Some(Arc::new(RenamedStore::new(Arc::new(store), names))),
        })
    }

    /// The checkpoint's tensors, in diffusers' names (`None` for a preset).
    pub fn store(&self) -> Option<&Arc<dyn WeightStore>> {
        self.store.as_ref()
    }

    pub fn config(&self) -> &WanVaeConfig {
        &self.config
    }
}

impl ShardedModel for WanVaeModel {
    fn name(&self) -> &str {
        &self.name
    }

    /// Ranks split frames by latent rows; the placement's height decides how many there are
    /// (the footprint refuses a width past them).
    fn max_tp(&self) -> usize {
        MAX_SIDE / self.config.spatial_factor()
    }

    fn default_dtype(&self) -> DType {
        DType::BF16
    }

    /// The video Wan2.1's DiT makes by default: 81 frames at 832 × 480.
    fn default_placement(&self) -> Placement {
        Placement::Dit {
            frames: 81,
            width: 832,
            height: 480,
            cfg: true,
        }
    }

    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }

    /// Every decoder tensor, with its shape; the encoder half is left alone.
    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        match &self.store {
            Some(store) => {
                ShardLoader::check(&**store, decls, &is_encoder_tensor).map_err(|e| PlanError::Model(e.to_string()))
            }
            None => Ok(()),
        }
    }

    /// The whole decoder is one unit: FSDP pipelines keep their VAE whole.
    fn fsdp_unit(&self, _tensor: &str) -> Option<String> {
        None
    }
}

impl RankShard for WanVaeRankShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }

    /// The decode of the DiT's video: a placement of frames and size, as the DiT's.
    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Dit {
            frames, width, height, ..
        } = placement
        else {
            return Err(PlanError::Placement(
                "a video VAE decodes --frames of --size, not an LLM's --max-context".into(),
            ));
        };
        let c = &self.config;
        let (time, space) = (c.temporal_factor(), c.spatial_factor());
        if frames > MAX_FRAMES || width > MAX_SIDE || height > MAX_SIDE {
            return Err(PlanError::Placement(format!(
                "--frames {frames} --size {width}x{height}: at most {MAX_FRAMES} frames of {MAX_SIDE} pixels a side"
            )));
        }
        if frames % time != 1 % time || width % space != 0 || height % space != 0 || width == 0 || height == 0 {
            return Err(PlanError::Placement(format!(
                "--frames {frames} --size {width}x{height}: the VAE decodes {time}k + 1 frames of sides that are \
                 multiples of {space}"
            )));
        }
        let band = self.shard.band(c, height).map_err(|detail| PlanError::Sharding {
            tp: self.shard.world,
            detail,
        })?;
        let video = DecodeShape {
            latent_frames: (frames - 1) / time + 1,
            height,
            width,
        };
        let device = DecodeDevice::new(dtype, accelerator == Accelerator::Cuda);
        let m = DecodeMemory::new(c, device, video, band);
        Ok(Footprint {
            activations: m.peak as u64,
            pool_slack: m.pool_slack as u64,
            libraries: accelerator.libraries(LIBRARIES_MIB),
            tokens_per_forward: video.latent_frames * (height / space) * (width / space),
            ..Footprint::default()
        })
    }
}

impl Family for WanVaeModel {
    const NAME: &'static str = "wan-vae";
    const PRESETS: &'static [&'static str] = &["wan2.1-vae"];
    type Shard = WanVaeRankShard;
    type Rank = WanVaeRank;

    fn detect(path: &Path) -> bool {
        path.is_dir() && WanVaeConfig::is_wan_vae_dir(path)
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        let config = WanVaeConfig::from_dir(path).map_err(|e| PlanError::Model(e.to_string()))?;
        let store = SafetensorsStore::open(path).map_err(|e| PlanError::Model(e.to_string()))?;
        Ok(Self {
            name: path.display().to_string(),
            config: Arc::new(config),
            store: Some(Arc::new(store)),
        })
    }

    fn preset(name: &str) -> Option<Self> {
        name.eq_ignore_ascii_case("wan2.1-vae").then(|| Self {
            name: name.to_string(),
            config: Arc::new(WanVaeConfig::wan21()),
            store: None,
        })
    }

    fn shards(&self, tp: usize) -> Result<Vec<WanVaeRankShard>, PlanError> {
        if tp == 0 || tp > self.max_tp() {
            return Err(PlanError::Sharding {
                tp,
                detail: format!(
                    "the VAE splits frames by latent rows, at most {} of them: use --tp {} or less",
                    self.max_tp(),
                    self.max_tp()
                ),
            });
        }
        let decls: Arc<[WeightDecl]> = WanVaeShard::new(1, 0)
            .map_err(PlanError::Model)?
            .weight_decls(&self.config)
            .into();
        (0..tp)
            .map(|rank| {
                Ok(WanVaeRankShard {
                    shard: WanVaeShard::new(tp, rank).map_err(|detail| PlanError::Sharding { tp, detail })?,
                    config: self.config.clone(),
                    decls: decls.clone(),
                })
            })
            .collect()
    }

    fn load(
        &self,
        shard: &WanVaeRankShard,
        _placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<WanVaeRank, tpinfer_layers::Error> {
        let store = self.store.as_ref().ok_or_else(|| preset_has_no_weights(&self.name))?;
        let store = CountingStore::new(store.clone(), ctx.progress, ctx.dtype);
        WanVaeRank::load(&self.config, &store, shard.shard, ctx.dtype, ctx.device)
    }

    fn bytes_loaded(rank: &WanVaeRank) -> usize {
        rank.bytes_loaded()
    }
}
