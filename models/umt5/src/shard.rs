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
