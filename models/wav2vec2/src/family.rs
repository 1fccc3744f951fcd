//! wav2vec2 as a [`Family`]: the preset, the split over ranks, each rank's footprint and its
//! load.

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use tpinfer_family::{preset_has_no_weights, Family, LoadContext};
use tpinfer_plan::{
    boxed_shards, numbered_unit, Accelerator, Footprint, Placement, PlanError, RankShard, ShardedModel,
};
use tpinfer_weights::{open_model_dir, CountingStore, ShardLoader, WeightDecl, WeightStore};

use crate::memory::EncodeMemory;
use crate::shard::Names;
use crate::{Wav2Vec2Config, Wav2Vec2Rank, Wav2Vec2Shard, STATES_PER_SECOND};

/// The audio a plan holds room for when none is given: a minute of speech, as encoder
/// frames (`--max-context`, 50 a second).
pub const PLANNED_SECONDS: usize = 60;

/// What a CUDA rank's encode keeps outside the tensor pool from its first request, MiB:
/// cuBLAS(Lt) and the layer's kernels (the device beyond its context, 599 MiB;
/// benches/RESULTS.md, *Memory*).
const LIBRARIES_MIB: u64 = 34;

/// A wav2vec2 encoder to plan or load: the preset's config, or a speech encoder directory
/// opened for its config and tensor headers.
#[derive(Clone)]
pub struct Wav2Vec2Model {
    name: String,
    config: Arc<Wav2Vec2Config>,
    names: Names,
    store: Option<Arc<dyn WeightStore>>,
}

/// One rank's part of a wav2vec2 encoder, with the tensors it reads.
#[derive(Clone)]
pub struct Wav2Vec2RankShard {
    pub shard: Wav2Vec2Shard,
    config: Arc<Wav2Vec2Config>,
    decls: Arc<[WeightDecl]>,
}

impl Wav2Vec2Model {
    pub fn config(&self) -> &Wav2Vec2Config {
        &self.config
    }
}

impl ShardedModel for Wav2Vec2Model {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_tp(&self) -> usize {
        self.config.num_attention_heads
    }

    /// S2V runs its speech encoder in f32.
    fn default_dtype(&self) -> DType {
        DType::F32
    }

    /// A minute of speech, as encoder frames.
    fn default_placement(&self) -> Placement {
        Placement::llm(PLANNED_SECONDS * STATES_PER_SECOND, 1)
    }

    /// An hour of speech, the longest audio tpinfer decodes.
    fn max_context(&self) -> Option<usize> {
        Some(3600 * STATES_PER_SECOND)
    }

    fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
        Ok(boxed_shards(self.shards(tp)?))
    }

    fn check(&self, decls: &[WeightDecl]) -> Result<(), PlanError> {
        match &self.store {
            Some(store) => {
                ShardLoader::check(&**store, decls, &Names::ignored).map_err(|e| PlanError::Model(e.to_string()))
            }
            None => Ok(()),
        }
    }

    fn fsdp_unit(&self, tensor: &str) -> Option<String> {
        numbered_unit(tensor, &self.names.layers())
    }
}

impl RankShard for Wav2Vec2RankShard {
    fn weight_decls(&self) -> &[WeightDecl] {
        &self.decls
    }

    /// One audio at a time: the temporaries are those of its `max_context` encoder frames.
    fn footprint(&self, dtype: DType, placement: Placement, accelerator: Accelerator) -> Result<Footprint, PlanError> {
        let Placement::Llm { max_context, batch, .. } = placement else {
            return Err(PlanError::Placement(
                "a speech encoder is placed with the audio's encoder frames (--max-context, 50 a second), not --frames and --size".into(),
            ));
        };
        let most = 3600 * STATES_PER_SECOND;
        if max_context == 0 || batch != 1 || max_context > most {
            return Err(PlanError::Placement(format!(
                "a speech encoder takes one audio of 1 to {most} encoder frames (an hour at 50 a second); got {batch} of {max_context}"
            )));
        }
        let m = EncodeMemory::new(&self.config, &self.shard, dtype, max_context);
        Ok(Footprint {
            // The linears' biases go into cuBLASLt's epilogue in 16-bit on CUDA: its
            // workspace stays in the pool from the first product on.
            buffers: tpinfer_kernels::fused_linear_workspace(accelerator == Accelerator::Cuda, dtype) as u64,
            activations: m.peak as u64,
            pool_slack: m.pool_slack as u64,
            libraries: accelerator.libraries(LIBRARIES_MIB),
            tokens_per_forward: max_context,
            ..Footprint::default()
        })
    }
}

impl Family for Wav2Vec2Model {
    const NAME: &'static str = "wav2vec2";
    const PRESETS: &'static [&'static str] = &["wav2vec2-large-xlsr-53"];
    type Shard = Wav2Vec2RankShard;
    type Rank = Wav2Vec2Rank;

    fn detect(path: &Path) -> bool {
        path.is_dir() && Wav2Vec2Config::is_wav2vec2_dir(path)
    }

    fn open(path: &Path) -> Result<Self, PlanError> {
        let config = Wav2Vec2Config::from_dir(path).map_err(|e| PlanError::Model(e.to_string()))?;
        let store: Arc<dyn WeightStore> = open_model_dir(path)
            .map_err(|e| PlanError::Model(e.to_string()))?
            .into();
        let names = Names::detect(|name| store.info(name).is_some());
        Ok(Self {
            name: path.display().to_string(),
            config: Arc::new(config),
            names,
            store: Some(store),
        })
    }

    fn preset(name: &str) -> Option<Self> {
        Self::PRESETS
            .iter()
            .any(|p| p.eq_ignore_ascii_case(name))
            .then(|| Self {
                name: name.to_string(),
                config: Arc::new(Wav2Vec2Config::xlsr_53()),
                names: Names::ctc(),
                store: None,
            })
    }

    fn shards(&self, tp: usize) -> Result<Vec<Wav2Vec2RankShard>, PlanError> {
        (0..tp)
            .map(|rank| {
                let shard =
                    Wav2Vec2Shard::new(&self.config, tp, rank).map_err(|detail| PlanError::Sharding { tp, detail })?;
                let decls = shard.weight_decls(&self.config, &self.names).into();
                Ok(Wav2Vec2RankShard {
                    shard,
                    config: self.config.clone(),
                    decls,
                })
            })
            .collect()
    }

    fn load(
        &self,
        shard: &Wav2Vec2RankShard,
        _placement: Placement,
        ctx: &LoadContext<'_>,
    ) -> Result<Wav2Vec2Rank, tpinfer_layers::Error> {
        let store = self.store.as_ref().ok_or_else(|| preset_has_no_weights(&self.name))?;
        Wav2Vec2Rank::load(
            &self.config,
            &CountingStore::new(store.clone(), ctx.progress, ctx.dtype),
            &shard.shard,
            ctx.comm.clone(),
            ctx.dtype,
            ctx.device,
        )
    }

    fn bytes_loaded(rank: &Wav2Vec2Rank) -> usize {
        rank.bytes_loaded()
    }
}
