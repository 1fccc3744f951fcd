use std::ops::Range;

use tpinfer_layers::{split_aligned, split_evenly, ColumnParallelLinear, RowParallelLinear};
use tpinfer_weights::{ShardSpec, WeightDecl};

use crate::Wav2Vec2Config;

/// What one rank of a `world`-wide tensor-parallel group holds of a wav2vec2 encoder: a shard
/// of every layer's heads (their columns of Q, K, V and rows of the output projection) and of
/// its FFN columns. The feature convolutions, the projection and the positional convolution,
/// a few percent of the weights, are whole on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wav2Vec2Shard {
    pub rank: usize,
    pub world: usize,
    pub heads: Range<usize>,
    pub ffn_cols: Range<usize>,
}

impl Wav2Vec2Shard {
    /// Fails, naming the limit, when the encoder cannot be split `world` ways.
    pub fn new(config: &Wav2Vec2Config, world: usize, rank: usize) -> Result<Self, String> {
        let heads = config.num_attention_heads;
        if world == 0 || world > heads || rank >= world {
            return Err(format!(
                "TP width {world} must be between 1 and the {heads} attention heads: use --tp {heads} or less"
            ));
        }
        Ok(Self {
            rank,
            world,
            heads: split_evenly(heads, world)[rank].clone(),
            ffn_cols: split_aligned(config.intermediate_size, world)[rank].clone(),
        })
    }

    /// This rank's channels of the hidden width: its heads' slice of Q, K, V.
    pub fn channels(&self, c: &Wav2Vec2Config) -> Range<usize> {
        self.heads.start * c.head_dim()..self.heads.end * c.head_dim()
    }

    /// Every tensor this rank reads, in the checkpoint's names, with its full shape and slice.
    pub fn weight_decls(&self, c: &Wav2Vec2Config, n: &Names) -> Vec<WeightDecl> {
        let h = c.hidden_size;
        let whole = |name: String, shape: &[usize]| WeightDecl::new(name, shape, ShardSpec::Replicated);
        let norm = |prefix: &str, width: usize| {
            [
                whole(format!("{prefix}.weight"), &[width]),
                whole(format!("{prefix}.bias"), &[width]),
            ]
        };
        let mut decls = Vec::new();
        let mut channels = 1;
        for (i, layer) in c.conv.iter().enumerate() {
            decls.push(whole(
                format!("{}.weight", n.conv(i)),
                &[layer.dim, channels, layer.kernel],
            ));
            if c.conv_bias {
                decls.push(whole(format!("{}.bias", n.conv(i)), &[layer.dim]));
            }
            decls.extend(norm(&n.conv_norm(i), layer.dim));
            channels = layer.dim;
        }
        decls.extend(norm(&n.projection_norm(), channels));
        decls.push(whole(format!("{}.weight", n.projection()), &[h, channels]));
        decls.push(whole(format!("{}.bias", n.projection()), &[h]));
        let (k, per_group) = (c.num_conv_pos_embeddings, h / c.num_conv_pos_embedding_groups);
        match n.position_weight {
            PositionWeight::Normed { magnitude, direction } => {
                decls.push(whole(format!("{}.{magnitude}", n.position()), &[1, 1, k]));
                decls.push(whole(format!("{}.{direction}", n.position()), &[h, per_group, k]));
            }
            PositionWeight::Plain => decls.push(whole(format!("{}.weight", n.position()), &[h, per_group, k])),
        }
        decls.push(whole(format!("{}.bias", n.position()), &[h]));
        for i in 0..c.num_hidden_layers {
            let l = n.layer(i);
            decls.extend(norm(&l.attention_norm, h));
            for q_k_v in [&l.q, &l.k, &l.v] {
                decls.extend(ColumnParallelLinear::decls(q_k_v, h, h, self.channels(c), true));
            }
            decls.extend(RowParallelLinear::decls(&l.o, h, h, self.channels(c), true));
            decls.extend(norm(&l.ffn_norm, h));
            decls.extend(ColumnParallelLinear::decls(
                &l.up,
                h,
                c.intermediate_size,
                self.ffn_cols.clone(),
                true,
            ));
            decls.extend(RowParallelLinear::decls(
                &l.down,
                c.intermediate_size,
                h,
                self.ffn_cols.clone(),
                true,
            ));
        }
        decls.extend(norm(&n.final_norm(), h));
        decls
    }
}

/// How the checkpoint holds the positional convolution's weight: as weight normalization's
/// magnitude and direction (under the names of `torch.nn.utils.parametrizations.weight_norm`
/// or of the older `weight_norm`), or already multiplied out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositionWeight {
    Normed {
        magnitude: &'static str,
        direction: &'static str,
    },
    Plain,
}

/// A checkpoint's tensor names: transformers' `Wav2Vec2Model`, or under `wav2vec2.` the
/// `Wav2Vec2ForCTC` S2V ships (whose CTC head tpinfer does not read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Names {
    pub prefix: &'static str,
    pub position_weight: PositionWeight,
}

/// One layer's names: its norms' and projections' prefixes (`.weight`, `.bias`).
pub struct LayerNames {
    pub attention_norm: String,
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub ffn_norm: String,
    pub up: String,
    pub down: String,
}

impl Names {
    const CTC_PREFIX: &'static str = "wav2vec2.";
    const POSITION: &'static str = "encoder.pos_conv_embed.conv";

    /// The names of a checkpoint that holds `has` tensors (the preset's: the current
    /// transformers' names of a CTC model).
    pub fn detect(has: impl Fn(&str) -> bool) -> Self {
        let prefix = match has(&format!("{}feature_projection.projection.weight", Self::CTC_PREFIX)) {
            true => Self::CTC_PREFIX,
            false => "",
        };
        let position = format!("{prefix}{}", Self::POSITION);
        let position_weight = if has(&format!("{position}.weight_g")) {
            PositionWeight::Normed {
                magnitude: "weight_g",
                direction: "weight_v",
            }
        } else if has(&format!("{position}.weight")) {
            PositionWeight::Plain
        } else {
            PositionWeight::Normed {
                magnitude: "parametrizations.weight.original0",
                direction: "parametrizations.weight.original1",
            }
        };
        Self {
            prefix,
            position_weight,
        }
    }

    /// The preset's names.
    pub fn ctc() -> Self {
        Self::detect(|name| name.starts_with(Self::CTC_PREFIX))
    }

    pub fn conv(&self, i: usize) -> String {
        format!("{}feature_extractor.conv_layers.{i}.conv", self.prefix)
    }

    pub fn conv_norm(&self, i: usize) -> String {
        format!("{}feature_extractor.conv_layers.{i}.layer_norm", self.prefix)
    }

    pub fn projection_norm(&self) -> String {
        format!("{}feature_projection.layer_norm", self.prefix)
    }

    pub fn projection(&self) -> String {
        format!("{}feature_projection.projection", self.prefix)
    }

    pub fn position(&self) -> String {
        format!("{}{}", self.prefix, Self::POSITION)
    }

    pub fn final_norm(&self) -> String {
        format!("{}encoder.layer_norm", self.prefix)
    }

    /// What every layer's names start with, before its index.
    pub fn layers(&self) -> String {
        format!("{}encoder.layers.", self.prefix)
    }

    pub fn layer(&self, i: usize) -> LayerNames {
        let l = format!("{}{i}", self.layers());
        LayerNames {
            attention_norm: format!("{l}.layer_norm"),
            q: format!("{l}.attention.q_proj"),
            k: format!("{l}.attention.k_proj"),
            v: format!("{l}.attention.v_proj"),
            o: format!("{l}.attention.out_proj"),
            ffn_norm: format!("{l}.final_layer_norm"),
            up: format!("{l}.feed_forward.intermediate_dense"),
            down: format!("{l}.feed_forward.output_dense"),
        }
    }

    /// Names checkpoints carry that the encoder does not read: the CTC head, the
    /// pre-training quantizer and projections, and the training-time mask embedding.
    pub fn ignored(name: &str) -> bool {
        [
            "lm_head.",
            "quantizer.",
            "project_q.",
            "project_hid.",
            "dropout_features",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || name.ends_with("masked_spec_embed")
    }
}
