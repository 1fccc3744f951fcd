//! umT5 as a [`Family`]: the preset, the split over ranks, each rank's footprint and its load.

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use tpinfer_family::{check_no_lm_head, preset_has_no_weights, Family, LoadContext};
use tpinfer_plan::{
    boxed_shards, numbered_unit, Accelerator, Footprint, Placement, PlanError, RankShard, ShardedModel,
};
use tpinfer_weights::{
    CountingStore, PthStore, RenamedStore, SafetensorsStore, ShardLoader, WeightDecl, WeightFormat, WeightStore,
};

use crate::memory::EncodeMemory;
use crate::shard::{names, original};
use crate::{Umt5Config, Umt5Rank, Umt5Shard};

/// The prompt length Wan's pipelines encode to (`max_sequence_length`).
pub const TEXT_TOKENS: usize = 512;

/// What a CUDA rank's encode keeps outside the tensor pool from its first request, MiB:
/// cuBLAS(Lt) and the layer's kernels (the device beyond its context, 597–599 MiB;
/// benches/RESULTS.md, *Memory*).
const LIBRARIES_MIB: u64 = 34;

/// A umT5 encoder to plan or load: the preset's config, or a text encoder directory opened
/// for its config and tensor headers.
#[derive(Clone)]
pub struct Umt5Model {
    name: String,
    config: Arc<Umt5Config>,
    store: Option<Arc<dyn WeightStore>>,
    /// The form the blocks' linear weights are held in.
    format: WeightFormat,
}

/// One rank's part of a umT5 encoder, with the tensors it reads.
#[derive(Clone)]
pub struct Umt5RankShard {
    pub shard: Umt5Shard,
    config: Arc<Umt5Config>,
    decls: Arc<[WeightDecl]>,
}

impl Umt5Model {
    pub fn config(&self) -> &Umt5Config {
        &self.config
    }

    /// Wan's own umT5 checkpoint, as the official Wan layouts ship it
    /// (`models_t5_umt5-xxl-enc-bf16.pth`): a `.pth` state dict in Wan's tensor names, with no
    /// config beside it; its config follows from its tensors' shapes.
    pub fn open_original(pth: &Path) -> Result<Self, PlanError> {
        let origin = pth.display().to_string();
        let store = PthStore::open(pth).map_err(|e| PlanError::Model(e.to_string()))?;
        let config = original::config(&store, &origin)
            .map_err(PlanError::Model)?
            .validated(&origin)
            .map_err(|e| PlanError::Model(e.to_string()))?;
        let store = RenamedStore::new(Arc::new(store), original::names(config.num_layers));
        Ok(Self {
            name: origin,
            config: Arc::new(config),
            store: Some(Arc::new(store)),
            format: WeightFormat::AsStored,
        })
    }
}

impl ShardedModel for Umt5Model {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_tp(&self) -> usize {
        self.config.num_heads
    }

    fn default_dtype(&self) -> DType {
        DType::BF16
    }

    /// One prompt of Wan's 512 tokens. An encoder is placed as a prompt is: `max_context`
    /// tokens a sequence, `batch` sequences.
    fn default_placement(&self) -> Placement {
        Placement::llm(TEXT_TOKENS, 1)
    }

    /// Relative positions carry no limit; past 512 the planner searches up to 4,096.
    fn max_context(&self) -> Option<usize> {
        Some(8 * TEXT_TOKENS)
    }

    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }

    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        match &self.store {
            Some(store) => {
                ShardLoader::check(&**store, decls, &names::ignored).map_err(|e| PlanError::Model(e.to_string()))
            }
            None => Ok(()),
        }
    }

    fn fsdp_unit(&self, tensor: &str) -> Option<String> {
        numbered_unit(tensor, names::LAYERS)
    }
}

impl RankShard for Umt5RankShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }

    /// Prompts are encoded one at a time: the temporaries are one prompt's.
    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Llm { max_context, batch, .. } = placement else {
            return Err(PlanError::Placement(
                "a text encoder is placed with the prompt's tokens (--max-context), not --frames and --size".into(),
            ));
        };
        if max_context == 0 || batch == 0 || max_context > 1 << 16 || batch > 1 << 16 {
            return Err(PlanError::Placement(format!(
                "a text encoder takes 1 to {} prompts of 1 to {} tokens; got {batch} of {max_context}",
                1 << 16,
                1 << 16
            )));
        }
        let m = EncodeMemory::new(&self.config, &self.shard, dtype, max_context);
        // An FP8 product beside the peak: on CUDA its quantized input, elsewhere its expanded
        // weight (the merged gate/up's two).
        let fp8 =
            tpinfer_layers::fp8_product_bytes(&self.decls, dtype, accelerator == Accelerator::Cuda, max_context, 2);
        Ok(Footprint {
            activations: (m.peak + fp8) as u64,
            pool_slack: m.pool_slack as u64,
            libraries: accelerator.libraries(LIBRARIES_MIB),
            tokens_per_forward: max_context,
            ..Footprint::default()
        })
    }
}

impl Family for Umt5Model {
    const NAME: &'static str = "umt5";
    const PRESETS: &'static [&'static str] = &["umt5-xxl"];
    type Shard = Umt5RankShard;
    type Rank = Umt5Rank;

    fn detect(path: &Path) -> bool {
        path.is_dir() && Umt5Config::is_umt5_dir(path)
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        let config = Umt5Config::from_dir(path).map_err(|e| PlanError::Model(e.to_string()))?;
        let store = SafetensorsStore::open(path).map_err(|e| PlanError::Model(e.to_string()))?;
        Ok(Self {
            name: path.display().to_string(),
            config: Arc::new(config),
            store: Some(Arc::new(store)),
            format: WeightFormat::AsStored,
        })
    }

    fn preset(name: &str) -> Option<Self> {
        name.eq_ignore_ascii_case("umt5-xxl").then(|| Self {
            name: name.to_string(),
            config: Arc::new(Umt5Config::umt5_xxl()),
            store: None,
            format: WeightFormat::AsStored,
        })
    }

    fn shards(&self, tp: usize) -> Result<Vec<Umt5RankShard>, PlanError> {
        (0..tp)
            .map(|rank| {
                let shard =
                    Umt5Shard::new(&self.config, tp, rank).map_err(|detail| PlanError::Sharding { tp, detail })?;
                let store = self.store.clone();
                let decls =
                    crate::model::weight_decls(&self.config, &shard, self.format, |name| store.as_ref()?.info(name))
                        .into();
                Ok(Umt5RankShard {
                    shard,
                    config: self.config.clone(),
                    decls,
                })
            })
            .collect()
    }

    fn load(
        &self,
        shard: &Umt5RankShard,
        _placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<Umt5Rank, tpinfer_layers::Error> {
        let store = self.store.as_ref().ok_or_else(|| preset_has_no_weights(&self.name))?;
        Umt5Rank::load(
            &self.config,
            &CountingStore::new(store.clone(), ctx.progress, ctx.dtype),
            &shard.shard,
            self.format,
            ctx.comm.clone(),
            ctx.dtype,
            ctx.device,
        )
    }

    /// FP8 (`--quantize fp8`) holds the blocks' linear weights in E4M3; the embedding and
    /// the relative position biases, looked up rather than multiplied, stay as they are.
    fn with_format(self, format: WeightFormat) -> Result<Self, PlanError> {
        check_no_lm_head(Self::NAME, format)?;
        Ok(Self { format, ..self })
    }

    fn bytes_loaded(rank: &Umt5Rank) -> usize {
        rank.bytes_loaded()
    }
}
