use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_layers::{rms_norm, MergedColumnParallelLinear, Result, RowParallelLinear, VocabParallelEmbedding};
use tpinfer_weights::{ShardLoader, TensorInfo, WeightDecl, WeightFormat, WeightStore};

use crate::position::distance_buckets;
use crate::shard::names;
use crate::{Umt5Config, Umt5Shard};

/// One rank's part of a umT5 encoder.
pub struct Umt5Rank {
    config: Umt5Config,
    embed: VocabParallelEmbedding,
    layers: Vec<Layer>,
    final_norm: Tensor,
    bytes_loaded: usize,
}

struct Layer {
    attention_norm: Tensor,
    qkv: MergedColumnParallelLinear,
    o: RowParallelLinear,
    /// This rank's heads' columns of the relative position bias table, `[buckets, heads]`,
    /// f32: the scores it is added to are f32.
    position_bias: Tensor,
    ffn_norm: Tensor,
    /// `wi_0` (through the GELU) and `wi_1`.
    gate_up: MergedColumnParallelLinear,
    down: RowParallelLinear,
}

/// The tensors `shard` reads, the blocks' linear weights in `format` (`stored` giving a
/// tensor's header where there is a checkpoint).
pub(crate) fn weight_decls(
    config: &Umt5Config,
    shard: &Umt5Shard,
    format: WeightFormat,
    stored: impl Fn(&str) -> Option<TensorInfo>,
) -> Vec<WeightDecl> {
    let mut decls = shard.weight_decls(config);
    let linear = |d: &WeightDecl| {
        d.name.starts_with("encoder.block.") && d.shape.len() == 2 && !d.name.contains("relative_attention_bias")
    };
    tpinfer_weights::hold_matrices(&mut decls, format, linear, linear, stored);
    decls
}

impl Umt5Rank {
    /// Loads this rank's slices from `store` onto `device`, in `dtype`. `shard` must have
    /// been checked against the store's headers (`Umt5Model::check` does): the reads trust
    /// its shapes.
    pub fn load(
        config: &Umt5Config,
        store: &dyn WeightStore,
        shard: &Umt5Shard,
        format: WeightFormat,
        comm: Arc<dyn Communicator>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let decls = weight_decls(config, shard, format, |name| store.info(name));
        let mut w = ShardLoader::new(store, &decls, dtype, device);
        let vocab_parts = Umt5Shard::vocab_parts(config, shard.world);
        let embed = VocabParallelEmbedding::load(&mut w, names::EMBED, &vocab_parts, comm.clone())?;
        let layers = (0..config.num_layers)
            .map(|i| {
                let n = names::LayerNames::of(i);
                Ok(Layer {
                    attention_norm: w.take(&n.attention_norm)?,
                    qkv: MergedColumnParallelLinear::load(&mut w, &[&n.q, &n.k, &n.v], false)?,
                    o: RowParallelLinear::load(&mut w, &n.o, false, comm.clone())?,
                    position_bias: w.take(&n.position_bias)?.to_dtype(DType::F32)?,
                    ffn_norm: w.take(&n.ffn_norm)?,
                    gate_up: MergedColumnParallelLinear::load(&mut w, &[&n.gate, &n.up], false)?,
                    down: RowParallelLinear::load(&mut w, &n.down, false, comm.clone())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = w.take(names::FINAL_NORM)?;
        Ok(Self {
            config: config.clone(),
            embed,
            layers,
            final_norm,
            bytes_loaded: w.bytes_read(),
        })
    }

    /// The weight bytes this rank copied out of the checkpoint.
    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    /// The encoder's last hidden states of the token `ids` (one prompt, its `</s>` included):
    /// `[tokens, d_model]` in the compute dtype, the same on every rank.
    ///
    /// Only the prompt's own tokens are run. A padded batch's masked keys add nothing to a
    /// real token's attention and the bias depends only on relative positions, so these are
    /// the states a padded, masked run gives its real tokens.
    pub fn encode(&self, ids: &[u32]) -> Result<Tensor> {
        let c = &self.config;
        if ids.is_empty() {
            return Err(tpinfer_layers::Error::Shard(
                "umT5: nothing to encode (no tokens)".into(),
            ));
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(tpinfer_layers::Error::Shard(format!(
                "umT5: token id {id} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let device = self.final_norm.device();
        let s = ids.len();
        let eps = c.layer_norm_epsilon as f32;
        let mut x = self.embed.embed(&Tensor::new(ids, device)?.unsqueeze(0)?)?.squeeze(0)?;
        let buckets = Tensor::new(
            distance_buckets(s, c.relative_attention_num_buckets, c.relative_attention_max_distance),
            device,
        )?;
        for layer in &self.layers {
            let attention = layer.attention(&rms_norm(&x, &layer.attention_norm, eps)?, &buckets, c)?;
            x = (x + layer.o.forward(&attention)?)?;
            let gate_up = layer.gate_up.forward_merged(&rms_norm(&x, &layer.ffn_norm, eps)?)?;
            // transformers' `gelu_new`: GELU's tanh approximation.
            x = (x + layer.down.forward(&tpinfer_kernels::gelu_tanh_mul(&gate_up)?)?)?;
        }
        Ok(rms_norm(&x, &self.final_norm, eps)?)
    }
}

impl Layer {
    /// Self-attention of the normed states `h` `[s, d]` over this rank's heads: T5's scores
    /// are not scaled by 1/√d, and carry the relative position bias of each key − query
    /// distance's bucket (`buckets`); softmax in f32.
    fn attention(&self, h: &Tensor, buckets: &Tensor, c: &Umt5Config) -> Result<Tensor> {
        let s = h.dim(0)?;
        let heads = self.position_bias.dim(1)?;
        let per_head = |t: &Tensor| t.reshape((s, heads, c.d_kv))?.transpose(0, 1)?.contiguous();
        let [q, k, v] = <[Tensor; 3]>::try_from(self.qkv.forward(h)?)
            .map_err(|_| tpinfer_layers::Error::Shard("umT5: q/k/v did not split in three".into()))?;
        let (q, k, v) = (per_head(&q)?, per_head(&k)?, per_head(&v)?);
        let p = tpinfer_kernels::softmax_relative_bias(&q.matmul(&k.t()?)?, &self.position_bias, buckets)?;
        Ok(p.matmul(&v)?.transpose(0, 1)?.reshape((s, heads * c.d_kv))?)
    }
}
