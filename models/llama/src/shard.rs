use std::ops::Range;

use tpinfer_layers::{
    split_aligned, split_blocks, ColumnParallelLinear, GatedMlp, HeadShard, RowParallelLinear, VocabParallelEmbedding,
};
use tpinfer_weights::{ShardSpec, WeightDecl};

use crate::LlamaConfig;

/// What one rank of a `world`-wide tensor-parallel group holds of a Llama model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaShard {
    pub rank: usize,
    pub world: usize,
    pub heads: HeadShard,
    /// This rank's columns of the FFN's hidden layer.
    pub ffn_cols: Range<usize>,
    /// This rank's rows of the vocabulary (embedding and LM head).
    pub vocab_rows: Range<usize>,
}

impl LlamaShard {
    /// Fails, naming the limit, when the model cannot be split `world` ways. The row-parallel
    /// weights' inner dimensions split on whole quant blocks ([`LlamaConfig::row_block`]).
    pub fn new(config: &LlamaConfig, world: usize, rank: usize) -> tpinfer_layers::Result<Self> {
        let block = config.row_block;
        let heads_per_block = block / gcd(block, config.head_dim);
        let heads = HeadShard::in_units(
            config.num_attention_heads,
            config.num_key_value_heads,
            world,
            rank,
            heads_per_block,
        )?;
        Ok(Self {
            rank,
            world,
            heads,
            ffn_cols: split_blocks(config.intermediate_size, world, block)?[rank].clone(),
            vocab_rows: Self::vocab_parts(config, world)[rank].clone(),
        })
    }

    /// Every rank's rows of the vocabulary, in rank order.
    pub fn vocab_parts(config: &LlamaConfig, world: usize) -> Vec<Range<usize>> {
        split_aligned(config.vocab_size, world)
    }

    /// Every tensor this rank reads, with the full shape the config implies and its slice.
    pub fn weight_decls(&self, c: &LlamaConfig) -> Vec<WeightDecl> {
        let (h, d) = (c.hidden_size, c.head_dim);
        let q_out = self.heads.q_heads.start * d..self.heads.q_heads.end * d;
        let kv_out = self.heads.kv_heads.start * d..self.heads.kv_heads.end * d;
        let norm = |name: String| WeightDecl::new(name, &[h], ShardSpec::Replicated);
        let mut decls = VocabParallelEmbedding::decls(names::EMBED, c.vocab_size, h, self.vocab_rows.clone());
        for i in 0..c.num_hidden_layers {
            let n = names::LayerNames::of(i);
            let bias = c.qkv_bias;
            decls.push(norm(n.input_norm.clone()));
            let (q_heads, kv_heads) = (c.num_attention_heads * d, c.num_key_value_heads * d);
            decls.extend(ColumnParallelLinear::decls(&n.q, h, q_heads, q_out.clone(), bias));
            decls.extend(ColumnParallelLinear::decls(&n.k, h, kv_heads, kv_out.clone(), bias));
            decls.extend(ColumnParallelLinear::decls(&n.v, h, kv_heads, kv_out.clone(), bias));
            decls.extend(RowParallelLinear::decls(&n.o, q_heads, h, q_out.clone(), c.o_bias));
            if c.qk_norm {
                for name in [&n.q_norm, &n.k_norm] {
                    decls.push(WeightDecl::new(name.clone(), &[d], ShardSpec::Replicated));
                }
            }
            decls.push(norm(n.post_norm.clone()));
            decls.extend(GatedMlp::decls(&n.mlp(), h, c.intermediate_size, self.ffn_cols.clone()));
        }
        decls.push(norm(names::NORM.to_string()));
        if !c.tie_word_embeddings {
            decls.extend(VocabParallelEmbedding::decls(
                names::LM_HEAD,
                c.vocab_size,
                h,
                self.vocab_rows.clone(),
            ));
        }
        decls
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// Checkpoint tensor names (Hugging Face's).
pub(crate) mod names {
    use tpinfer_layers::GatedMlpNames;

    pub const EMBED: &str = "model.embed_tokens.weight";
    pub const NORM: &str = "model.norm.weight";
    pub const LM_HEAD: &str = "lm_head.weight";
    /// A GGUF file's rotary frequency divisors, read into the config, not by a layer.
    pub const ROPE_FREQS: &str = "rope_freqs";
    /// What every decoder layer's names start with, before its index.
    pub const LAYERS: &str = "model.layers.";

    /// One decoder layer's tensors: its norms' weights, and the prefixes of its projections
    /// (`.weight`, `.bias`). Written once, for the declarations, the load and the GGUF names.
    pub struct LayerNames {
        pub input_norm: String,
        pub q: String,
        pub k: String,
        pub v: String,
        pub o: String,
        /// Qwen3's per-head norms of the queries and keys.
        pub q_norm: String,
        pub k_norm: String,
        pub post_norm: String,
        pub gate: String,
        pub up: String,
        pub down: String,
    }

    impl LayerNames {
        pub fn of(i: usize) -> Self {
            let p = format!("{LAYERS}{i}");
            Self {
                input_norm: format!("{p}.input_layernorm.weight"),
                q: format!("{p}.self_attn.q_proj"),
                k: format!("{p}.self_attn.k_proj"),
                v: format!("{p}.self_attn.v_proj"),
                o: format!("{p}.self_attn.o_proj"),
                q_norm: format!("{p}.self_attn.q_norm.weight"),
                k_norm: format!("{p}.self_attn.k_norm.weight"),
                post_norm: format!("{p}.post_attention_layernorm.weight"),
                gate: format!("{p}.mlp.gate_proj"),
                up: format!("{p}.mlp.up_proj"),
                down: format!("{p}.mlp.down_proj"),
            }
        }

        pub fn mlp(&self) -> GatedMlpNames<'_> {
            GatedMlpNames {
                gate: &self.gate,
                up: &self.up,
                down: &self.down,
            }
        }
    }

    /// Names that checkpoints carry but no layer reads.
    pub fn ignored(name: &str, tied: bool) -> bool {
        name.ends_with("rotary_emb.inv_freq")
            || name == ROPE_FREQS
            || (tied && name == LM_HEAD)
            // An FP8 checkpoint's scales, read with their weights; activations are scaled per
            // token as they come, so a static input scale goes unused.
            || name.ends_with(".weight_scale")
            || name.ends_with(".input_scale")
    }
}
