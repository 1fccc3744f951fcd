use std::ops::Range;

use tpinfer_layers::{split_aligned, split_evenly, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding};
use tpinfer_weights::{ShardSpec, WeightDecl};

use crate::Umt5Config;

/// What one rank of a `world`-wide tensor-parallel group holds of a umT5 encoder: a shard of
/// every layer's heads (their columns of Q, K, V and rows of O, and their columns of the
/// relative position bias table), of the FFN's columns, and of the vocabulary's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Umt5Shard {
    pub rank: usize,
    pub world: usize,
    pub heads: Range<usize>,
    pub ffn_cols: Range<usize>,
    pub vocab_rows: Range<usize>,
}

impl Umt5Shard {
    /// Fails, naming the limit, when the encoder cannot be split `world` ways.
    pub fn new(config: &Umt5Config, world: usize, rank: usize) -> Result<Self, String> {
        let heads = config.num_heads;
        if world == 0 || world > heads || rank >= world {
            return Err(format!(
                "TP width {world} must be between 1 and the {heads} attention heads: use --tp {heads} or less"
            ));
        }
        Ok(Self {
            rank,
            world,
            heads: split_evenly(heads, world)[rank].clone(),
            ffn_cols: split_aligned(config.d_ff, world)[rank].clone(),
            vocab_rows: Self::vocab_parts(config, world)[rank].clone(),
        })
    }

    /// Every rank's rows of the vocabulary, in rank order.
    pub fn vocab_parts(config: &Umt5Config, world: usize) -> Vec<Range<usize>> {
        split_aligned(config.vocab_size, world)
    }

    /// This rank's channels of the attention's inner width: its heads' slice of Q, K, V.
    pub fn channels(&self, c: &Umt5Config) -> Range<usize> {
        self.heads.start * c.d_kv..self.heads.end * c.d_kv
    }

    /// Every tensor this rank reads, in transformers' names, with its full shape and slice.
    pub fn weight_decls(&self, c: &Umt5Config) -> Vec<WeightDecl> {
        let (d, inner) = (c.d_model, c.inner_dim());
        let norm = |name: String| WeightDecl::new(name, &[d], ShardSpec::Replicated);
        let mut decls = VocabParallelEmbedding::decls(names::EMBED, c.vocab_size, d, self.vocab_rows.clone());
        for i in 0..c.num_layers {
            let n = names::LayerNames::of(i);
            decls.push(norm(n.attention_norm.clone()));
            for q_k_v in [&n.q, &n.k, &n.v] {
                decls.extend(ColumnParallelLinear::decls(q_k_v, d, inner, self.channels(c), false));
            }
            decls.extend(RowParallelLinear::decls(&n.o, inner, d, self.channels(c), false));
            decls.push(WeightDecl::new(
                n.position_bias.clone(),
                &[c.relative_attention_num_buckets, c.num_heads],
                ShardSpec::range(1, self.heads.clone()),
            ));
            decls.push(norm(n.ffn_norm.clone()));
            for gate_up in [&n.gate, &n.up] {
                decls.extend(ColumnParallelLinear::decls(
                    gate_up,
                    d,
                    c.d_ff,
                    self.ffn_cols.clone(),
                    false,
                ));
            }
            decls.extend(RowParallelLinear::decls(
                &n.down,
                c.d_ff,
                d,
                self.ffn_cols.clone(),
                false,
            ));
        }
        decls.push(norm(names::FINAL_NORM.to_string()));
        decls
    }
}

/// Checkpoint tensor names (transformers' `UMT5EncoderModel`).
pub(crate) mod names {
    pub const EMBED: &str = "shared.weight";
    pub const FINAL_NORM: &str = "encoder.final_layer_norm.weight";
    /// What every layer's names start with, before its index.
    pub const LAYERS: &str = "encoder.block.";

    /// One layer's tensors: its norms' and bias table's weights, and its projections'
    /// prefixes (`.weight`; umT5 has no biases).
    pub struct LayerNames {
        pub attention_norm: String,
        pub q: String,
        pub k: String,
        pub v: String,
        pub o: String,
        pub position_bias: String,
        pub ffn_norm: String,
        /// `wi_0`, through the GELU.
        pub gate: String,
        /// `wi_1`.
        pub up: String,
        /// `wo`.
        pub down: String,
    }

    impl LayerNames {
        pub fn of(i: usize) -> Self {
            let (attn, ffn) = (format!("{LAYERS}{i}.layer.0"), format!("{LAYERS}{i}.layer.1"));
            Self {
                attention_norm: format!("{attn}.layer_norm.weight"),
                q: format!("{attn}.SelfAttention.q"),
                k: format!("{attn}.SelfAttention.k"),
                v: format!("{attn}.SelfAttention.v"),
                o: format!("{attn}.SelfAttention.o"),
                position_bias: format!("{attn}.SelfAttention.relative_attention_bias.weight"),
                ffn_norm: format!("{ffn}.layer_norm.weight"),
                gate: format!("{ffn}.DenseReluDense.wi_0"),
                up: format!("{ffn}.DenseReluDense.wi_1"),
                down: format!("{ffn}.DenseReluDense.wo"),
            }
        }
    }

    /// Names that checkpoints carry but no layer reads: the encoder's copy of the tied
    /// embedding.
    pub fn ignored(name: &str) -> bool {
        name == "encoder.embed_tokens.weight"
    }
}

/// The official Wan checkpoints' umT5 encoder (`models_t5_umt5-xxl-enc-bf16.pth`, Wan's own
/// `T5Encoder` of `wan/modules/t5.py`): its tensor names, and the config its shapes imply.
pub mod original {
    use tpinfer_weights::WeightStore;

    use super::names::{LayerNames, EMBED, FINAL_NORM};
    use crate::Umt5Config;

    /// Wan's T5 has no config file; these are fixed in its code (`T5RelativeEmbedding`'s
    /// `max_dist`, `T5LayerNorm`'s eps).
    const MAX_DISTANCE: usize = 128;
    const EPS: f64 = 1e-6;

    /// Pairs of (transformers' name, Wan's name) for every tensor of a `layers`-layer encoder,
    /// for a [`tpinfer_weights::RenamedStore`].
    pub fn names(layers: usize) -> Vec<(String, String)> {
        let mut pairs = vec![
            (EMBED.to_string(), "token_embedding.weight".to_string()),
            (FINAL_NORM.to_string(), "norm.weight".to_string()),
        ];
        for i in 0..layers {
            let ours = LayerNames::of(i);
            let b = format!("blocks.{i}");
            for (ours, theirs) in [
                (ours.attention_norm, format!("{b}.norm1.weight")),
                (format!("{}.weight", ours.q), format!("{b}.attn.q.weight")),
                (format!("{}.weight", ours.k), format!("{b}.attn.k.weight")),
                (format!("{}.weight", ours.v), format!("{b}.attn.v.weight")),
                (format!("{}.weight", ours.o), format!("{b}.attn.o.weight")),
                (ours.position_bias, format!("{b}.pos_embedding.embedding.weight")),
                (ours.ffn_norm, format!("{b}.norm2.weight")),
                (format!("{}.weight", ours.gate), format!("{b}.ffn.gate.0.weight")),
                (format!("{}.weight", ours.up), format!("{b}.ffn.fc1.weight")),
                (format!("{}.weight", ours.down), format!("{b}.ffn.fc2.weight")),
            ] {
                pairs.push((ours, theirs));
            }
        }
        pairs
    }

    /// The config of the encoder `store` holds in Wan's names, from its tensors' shapes;
    /// `origin` names the file in errors.
    pub fn config(store: &dyn WeightStore, origin: &str) -> Result<Umt5Config, String> {
        let shape = |name: &str| -> Result<Vec<usize>, String> {
            store
                .info(name)
                .map(|i| i.shape)
                .ok_or_else(|| format!("{origin} has no `{name}`: it is not Wan's umT5 encoder (T5Encoder)"))
        };
        let dims2 = |name: &str| -> Result<(usize, usize), String> {
            match shape(name)?.as_slice() {
                &[a, b] if a > 0 && b > 0 => Ok((a, b)),
                other => Err(format!("{origin}: `{name}` has shape {other:?}, not a matrix")),
            }
        };
        let layers = store
            .names()
            .iter()
            .filter_map(|n| n.strip_prefix("blocks.")?.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |last| last + 1);
        if layers == 0 {
            return Err(format!(
                "{origin} holds no `blocks.N` layers: it is not Wan's umT5 encoder"
            ));
        }
        let (vocab_size, d_model) = dims2("token_embedding.weight")?;
        let (buckets, num_heads) = dims2("blocks.0.pos_embedding.embedding.weight")?;
        let (inner, _) = dims2("blocks.0.attn.q.weight")?;
        let (d_ff, _) = dims2("blocks.0.ffn.fc1.weight")?;
        if !inner.is_multiple_of(num_heads) {
            return Err(format!(
                "{origin}: the queries' {inner} columns do not split into the position table's {num_heads} heads"
            ));
        }
        Ok(Umt5Config {
            vocab_size,
            d_model,
            d_kv: inner / num_heads,
            d_ff,
            num_layers: layers,
            num_heads,
            relative_attention_num_buckets: buckets,
            relative_attention_max_distance: MAX_DISTANCE,
            layer_norm_epsilon: EPS,
        })
    }
}
