//! The Wan DiT as a [`Family`]: presets, the split over ranks, each rank's footprint and its
//! load.

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use tpinfer_family::{check_no_lm_head, preset_has_no_weights, Family, LoadContext};
use tpinfer_plan::{
    boxed_shards, numbered_unit, Accelerator, Footprint, Placement, PlanError, RankShard, ShardedModel,
};
use tpinfer_weights::{CountingStore, Quant, ShardLoader, WeightDecl, WeightFormat};

use crate::memory::{DitMemory, ForwardPath, LinearWeights, SelfAttention, Video};
use crate::{WanCheckpoint, WanCheckpointError, WanConfig, WanRank, WanShard};

/// The longest video a plan takes (17 minutes at 16 fps) and the widest side: far past any
/// box's memory, and far from any product that could wrap.
const MAX_FRAMES: usize = 16_385;
const MAX_SIDE: usize = 16_384;

/// What a CUDA rank's forward keeps outside the tensor pool from its first request, MiB:
/// cuBLAS(Lt) and the block's kernels, the same in bf16, f32 and FP8 (the device beyond its
/// context, 599 MiB; benches/RESULTS.md, *Memory*).
const LIBRARIES_MIB: u64 = 34;

/// A Wan DiT to plan or load: a preset's config, or an opened checkpoint.
#[derive(Clone)]
pub struct WanModel {
    name: String,
    config: Arc<WanConfig>,
    checkpoint: Option<Arc<WanCheckpoint>>,
    /// The form the blocks' linear weights are held in.
    format: WeightFormat,
    self_attention: SelfAttention,
}

/// One rank's part of a Wan DiT: its heads and FFN columns, with the tensors it reads.
#[derive(Clone)]
pub struct WanRankShard {
    pub shard: WanShard,
    config: Arc<WanConfig>,
    self_attention: SelfAttention,
    decls: Arc<[WeightDecl]>,
}

impl WanModel {
    /// Opens a diffusers transformer directory (or an original Wan checkpoint's): config and
    /// headers only.
    pub fn open_checkpoint(dir: &Path) -> Result<Self, WanCheckpointError> {
        let checkpoint = WanCheckpoint::open(dir)?;
        Ok(Self {
            name: dir.display().to_string(),
            config: Arc::new(checkpoint.config.clone()),
            checkpoint: Some(Arc::new(checkpoint)),
            format: WeightFormat::AsStored,
            self_attention: SelfAttention::ComputeDtype,
        })
    }

    pub fn config(&self) -> &WanConfig {
        &self.config
    }

    /// The same model with a LoRA adapter merged into every rank's slices at load (each rank
    /// merges only its own). A preset has no weights to merge into.
    pub fn with_lora(self, adapter: Arc<tpinfer_weights::LoraAdapter>) -> Result<Self, WanCheckpointError> {
        let checkpoint = match &self.checkpoint {
            Some(c) => Arc::new(c.with_lora(adapter)?),
            None => {
                return Err(WanCheckpointError::Weights(tpinfer_weights::WeightError::Shard {
                    name: self.name.clone(),
                    detail: "a preset has no weights to merge a LoRA adapter into; give a model directory".into(),
                }))
            }
        };
        Ok(Self {
            checkpoint: Some(checkpoint),
            ..self
        })
    }

    /// The same model with its self-attention at `precision` on every rank (planned so; a rank
    /// without a kernel for it refuses at load).
    pub fn with_self_attention(self, precision: SelfAttention) -> Self {
        Self {
            self_attention: precision,
            ..self
        }
    }

    /// The tensors `shard` reads, in the model's weight format.
    fn decls(&self, shard: &WanShard) -> Vec<WeightDecl> {
        let store = self.checkpoint.as_ref().map(|c| c.store.clone());
        crate::model::weight_decls(&self.config, shard, self.format, |name| store.as_ref()?.info(name))
    }

    fn from_config(name: &str, config: WanConfig) -> Self {
        Self {
            name: name.to_string(),
            config: Arc::new(config),
            checkpoint: None,
            format: WeightFormat::AsStored,
            self_attention: SelfAttention::ComputeDtype,
        }
    }
}

impl ShardedModel for WanModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_tp(&self) -> usize {
        self.config.num_attention_heads
    }

    fn default_dtype(&self) -> DType {
        DType::BF16
    }

    /// 81 frames at 832 × 480 (S2V: a clip of 80), with guidance.
    fn default_placement(&self) -> Placement {
        Placement::Dit {
            frames: match self.config.s2v {
                Some(_) => 80,
                None => 81,
            },
            width: 832,
            height: 480,
            cfg: true,
        }
    }

    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }

    /// Names and shapes of what the rank reads; tensors no layer reads are left alone, as
    /// loading always did.
    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        match &self.checkpoint {
            Some(checkpoint) => {
                ShardLoader::check(&*checkpoint.store, decls, &|_| true).map_err(|e| PlanError::Model(e.to_string()))
            }
            None => Ok(()),
        }
    }

    fn fsdp_unit(&self, tensor: &str) -> Option<String> {
        numbered_unit(tensor, "blocks.")
    }
}

impl RankShard for WanRankShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }

    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Dit {
            frames,
            width,
            height,
            cfg,
        } = placement
        else {
            return Err(PlanError::Placement(
                "--max-context is for LLMs; give a video DiT --frames and --size".into(),
            ));
        };
        if frames > MAX_FRAMES || width > MAX_SIDE || height > MAX_SIDE {
            return Err(PlanError::Placement(format!(
                "--frames {frames} --size {width}x{height}: at most {MAX_FRAMES} frames of {MAX_SIDE} pixels a side"
            )));
        }
        let c = &self.config;
        // S2V's clips follow its motion frames: 4k frames (80 by default), not 4k + 1.
        let (whole, form) = match c.s2v {
            Some(_) => (frames % 4 == 0 && frames > 0, "4k (e.g. 48, 80)"),
            None => (frames % 4 == 1, "4k + 1 (e.g. 21, 41, 81)"),
        };
        if !whole || width % 16 != 0 || height % 16 != 0 || width == 0 || height == 0 {
            return Err(PlanError::Placement(format!(
                "--frames {frames} --size {width}x{height}: frames must be {form} and the size \
                 multiples of 16 (e.g. 832x480, 1280x720)"
            )));
        }
        let video = Video {
            frames,
            width,
            height,
            cfg,
        };
        let cuda = accelerator == Accelerator::Cuda;
        // The blocks' products are FP8 together (`model::weight_decls`).
        let weights = match self.decls.iter().any(|d| d.quant == Some(Quant::Fp8)) {
            true => LinearWeights::Fp8 { tensor_cores: cuda },
            false => LinearWeights::Dense,
        };
        let path = ForwardPath::for_device(cuda, dtype, c.attention_head_dim)
            .with_self_attention(self.self_attention)
            .with_linear_weights(weights);
        let m = DitMemory::new(c, &self.shard, dtype, video, path);
        let tokens = c.sequence_tokens(frames, width, height);
        Ok(Footprint {
            buffers: m.buffers as u64,
            cache: m.latents as u64,
            activations: m.activations as u64,
            pool_slack: m.pool_slack as u64,
            // Latents and text states are made by a request, not at load.
            at_load: 0,
            libraries: accelerator.libraries(LIBRARIES_MIB),
            tokens_per_forward: tokens,
        })
    }
}

impl Family for WanModel {
    const NAME: &'static str = "wan-dit";
    const PRESETS: &'static [&'static str] = &["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-s2v-14b"];
    type Shard = WanRankShard;
    type Rank = WanRank;

    fn detect(path: &Path) -> bool {
        path.is_dir() && WanCheckpoint::is_wan_dir(path)
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        Self::open_checkpoint(path).map_err(|e| PlanError::Model(e.to_string()))
    }

    fn preset(name: &str) -> Option<Self> {
        let config = match name.to_ascii_lowercase().as_str() {
            "wan2.1-t2v-1.3b" => WanConfig::wan21_t2v_1_3b(),
            "wan2.1-t2v-14b" => WanConfig::wan21_t2v_14b(),
            "wan2.2-s2v-14b" => WanConfig::wan22_s2v_14b(),
            _ => return None,
        };
        Some(Self::from_config(name, config))
    }

    fn shards(&self, tp: usize) -> Result<Vec<WanRankShard>, PlanError> {
        (0..tp)
            .map(|rank| {
                let shard =
                    WanShard::new(&self.config, tp, rank).map_err(|detail| PlanError::Sharding { tp, detail })?;
                let decls: Arc<[WeightDecl]> = self.decls(&shard).into();
                Ok(WanRankShard {
                    shard,
                    config: self.config.clone(),
                    self_attention: self.self_attention,
                    decls,
                })
            })
            .collect()
    }

    fn load(
        &self,
        shard: &WanRankShard,
        _placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<WanRank, tpinfer_layers::Error> {
        let checkpoint = self
            .checkpoint
            .as_ref()
            .ok_or_else(|| preset_has_no_weights(&self.name))?;
        WanRank::load(
            &self.config,
            &CountingStore::new(checkpoint.store.clone(), ctx.progress, ctx.dtype),
            shard.shard.clone(),
            self.format,
            ctx.comm.clone(),
            ctx.dtype,
            ctx.device,
        )?
        .with_self_attention(self.self_attention)
    }

    /// FP8 (`--quantize fp8`) holds the blocks' linear weights in E4M3; the embedders and the
    /// output projection, a sliver of the model, stay in the compute dtype.
    fn with_format(self, format: WeightFormat) -> Result<Self, PlanError> {
        check_no_lm_head(Self::NAME, format)?;
        Ok(Self { format, ..self })
    }

    fn bytes_loaded(rank: &WanRank) -> usize {
        rank.bytes_loaded()
    }
}
