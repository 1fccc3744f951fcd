use std::ops::Range;

use tpinfer_layers::{split_aligned, split_evenly, ColumnParallelLinear, RowParallelLinear};
use tpinfer_weights::{ShardSpec, WeightDecl};

use crate::WanConfig;

/// What one rank of a `world`-wide tensor-parallel group holds of a Wan DiT: a shard of heads
/// in every attention (self, cross, and S2V's audio cross-attention) and of FFN columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WanShard {
    pub rank: usize,
    pub world: usize,
    pub heads: Range<usize>,
    pub ffn_cols: Range<usize>,
}

impl WanShard {
    /// Fails, naming the limit, when the model cannot be split `world` ways.
    pub fn new(config: &WanConfig, world: usize, rank: usize) -> Result<Self, String> {
        let heads = config.num_attention_heads;
        if world == 0 || world > heads {
            return Err(format!(
                "TP width {world} must be between 1 and the {heads} attention heads: use --tp {heads} or less"
            ));
        }
        Ok(Self {
            rank,
            world,
            heads: split_evenly(heads, world)[rank].clone(),
            ffn_cols: split_aligned(config.ffn_dim, world)[rank].clone(),
        })
    }

    /// This rank's channels of the model width: its heads' slice of Q/K/V outputs.
    pub fn channels(&self, c: &WanConfig) -> Range<usize> {
        self.heads.start * c.attention_head_dim..self.heads.end * c.attention_head_dim
    }

    /// Every tensor this rank reads, in diffusers' names, with its full shape and its slice.
    pub fn weight_decls(&self, c: &WanConfig) -> Vec<WeightDecl> {
        let d = c.hidden_size();
        let full = |name: String, shape: &[usize]| WeightDecl::new(name, shape, ShardSpec::Replicated);
        let linear = |prefix: &str, out_dim: usize, in_dim: usize| {
            vec![
                full(format!("{prefix}.weight"), &[out_dim, in_dim]),
                full(format!("{prefix}.bias"), &[out_dim]),
            ]
        };
        let [pt, ph, pw] = c.patch_size;
        let mut decls = vec![
            full("patch_embedding.weight".into(), &[d, c.in_channels, pt, ph, pw]),
            full("patch_embedding.bias".into(), &[d]),
        ];
        decls.extend(linear("condition_embedder.time_embedder.linear_1", d, c.freq_dim));
        decls.extend(linear("condition_embedder.time_embedder.linear_2", d, d));
        decls.extend(linear("condition_embedder.time_proj", 6 * d, d));
        decls.extend(linear("condition_embedder.text_embedder.linear_1", d, c.text_dim));
        decls.extend(linear("condition_embedder.text_embedder.linear_2", d, d));
        for i in 0..c.num_layers {
            let p = format!("blocks.{i}");
            decls.push(full(format!("{p}.scale_shift_table"), &[1, 6, d]));
            for attn in ["attn1", "attn2"] {
                decls.extend(self.attention_decls(&format!("{p}.{attn}"), c, ["to_q", "to_k", "to_v", "to_out.0"]));
            }
            if c.cross_attn_norm {
                decls.push(full(format!("{p}.norm2.weight"), &[d]));
                decls.push(full(format!("{p}.norm2.bias"), &[d]));
            }
            decls.extend(ColumnParallelLinear::decls(
                &format!("{p}.ffn.net.0.proj"),
                d,
                c.ffn_dim,
                self.ffn_cols.clone(),
                true,
            ));
            decls.extend(RowParallelLinear::decls(
                &format!("{p}.ffn.net.2"),
                c.ffn_dim,
                d,
                self.ffn_cols.clone(),
                true,
            ));
        }
        decls.push(full("scale_shift_table".into(), &[1, 2, d]));
        decls.extend(linear("proj_out", c.out_channels * pt * ph * pw, d));
        if let Some(s2v) = &c.s2v {
            decls.extend(self.s2v_decls(c, s2v));
        }
        decls
    }

    /// An attention sharded by heads: Q/K/V column-parallel with their slice of the
    /// full-width QK RMSNorm weights, the output row-parallel.
    fn attention_decls(&self, prefix: &str, c: &WanConfig, names: [&str; 4]) -> Vec<WeightDecl> {
        let d = c.hidden_size();
        let channels = self.channels(c);
        let [q, k, v, o] = names;
        let mut decls = Vec::new();
        for proj in [q, k, v] {
            decls.extend(ColumnParallelLinear::decls(
                &format!("{prefix}.{proj}"),
                d,
                d,
                channels.clone(),
                true,
            ));
        }
        decls.extend(RowParallelLinear::decls(
            &format!("{prefix}.{o}"),
            d,
            d,
            channels.clone(),
            true,
        ));
        for norm in ["norm_q", "norm_k"] {
            decls.push(WeightDecl::new(
                format!("{prefix}.{norm}.weight"),
                &[d],
                ShardSpec::range(0, channels.clone()),
            ));
        }
        decls
    }

    /// Wan2.2-S2V's modules, in the original checkpoint's names: the audio modules
    /// ([`Self::s2v_audio_decls`]), the frame packer, the condition encoder and mask.
    fn s2v_decls(&self, c: &WanConfig, s2v: &crate::S2vModules) -> Vec<WeightDecl> {
        let d = c.hidden_size();
        let full = |name: String, shape: &[usize]| WeightDecl::new(name, shape, ShardSpec::Replicated);
        let mut decls = self.s2v_audio_decls(c, s2v);
        // Frame pack: motion latents patched at three temporal/spatial scales.
        for (name, kernel) in [("proj", [1, 2, 2]), ("proj_2x", [2, 4, 4]), ("proj_4x", [4, 8, 8])] {
            decls.push(full(
                format!("frame_packer.{name}.weight"),
                &[d, c.in_channels, kernel[0], kernel[1], kernel[2]],
            ));
            decls.push(full(format!("frame_packer.{name}.bias"), &[d]));
        }
        let [pt, ph, pw] = c.patch_size;
        decls.push(full("cond_encoder.weight".into(), &[d, s2v.cond_dim, pt, ph, pw]));
        decls.push(full("cond_encoder.bias".into(), &[d]));
        decls.push(full("trainable_cond_mask.weight".into(), &[3, d]));
        decls
    }

    /// S2V's audio modules ([`crate::S2vAudio`]), in the original checkpoint's names: the
    /// audio cross-attentions are sharded by heads like the DiT's; the causal audio encoder
    /// and the AdaIN projections are replicated.
    pub fn s2v_audio_decls(&self, c: &WanConfig, s2v: &crate::S2vModules) -> Vec<WeightDecl> {
        let d = c.hidden_size();
        let full = |name: String, shape: &[usize]| WeightDecl::new(name, shape, ShardSpec::Replicated);
        let mut decls = Vec::new();
        for i in 0..s2v.audio_inject_layers.len() {
            decls.extend(self.attention_decls(&format!("audio_injector.injector.{i}"), c, ["q", "k", "v", "o"]));
            let adain = format!("audio_injector.injector_adain_layers.{i}.linear");
            decls.push(full(format!("{adain}.weight"), &[2 * d, d]));
            decls.push(full(format!("{adain}.bias"), &[2 * d]));
        }
        // The causal audio encoder: causal 1-D convolutions (kernel 3) from the audio width
        // to the model width, local per audio token and global; held and run in f32, as S2V's
        // reference runs it.
        let wide = |name: String, shape: &[usize]| full(name, shape).wide();
        let enc = "casual_audio_encoder.encoder";
        let a = s2v.audio_dim;
        let tokens = s2v.num_audio_token;
        for (name, out_ch, in_ch) in [
            ("conv1_local", d / 4 * tokens, a),
            ("conv1_global", d / 4, a),
            ("conv2", d / 2, d / 4),
            ("conv3", d, d / 2),
        ] {
            decls.push(wide(format!("{enc}.{name}.conv.weight"), &[out_ch, in_ch, 3]));
            decls.push(wide(format!("{enc}.{name}.conv.bias"), &[out_ch]));
        }
        decls.push(wide(format!("{enc}.final_linear.weight"), &[d, d]));
        decls.push(wide(format!("{enc}.final_linear.bias"), &[d]));
        decls.push(wide(format!("{enc}.padding_tokens"), &[1, 1, 1, d]));
        decls.push(wide(
            "casual_audio_encoder.weights".into(),
            &[1, crate::s2v_audio::AUDIO_LAYERS, 1, 1],
        ));
        decls
    }
}

/// The original Wan checkpoints' name for each diffusers name that differs (`wan/modules/
/// model.py`): pairs of (diffusers name, original name), for a [`tpinfer_weights::RenamedStore`].
pub fn original_names(c: &WanConfig) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    let mut linear = |diffusers: &str, original: &str| {
        for part in ["weight", "bias"] {
            pairs.push((format!("{diffusers}.{part}"), format!("{original}.{part}")));
        }
    };
    linear("condition_embedder.time_embedder.linear_1", "time_embedding.0");
    linear("condition_embedder.time_embedder.linear_2", "time_embedding.2");
    linear("condition_embedder.time_proj", "time_projection.1");
    linear("condition_embedder.text_embedder.linear_1", "text_embedding.0");
    linear("condition_embedder.text_embedder.linear_2", "text_embedding.2");
    linear("proj_out", "head.head");
    for i in 0..c.num_layers {
        let (d, o) = (format!("blocks.{i}"), format!("blocks.{i}"));
        for (attn, orig) in [("attn1", "self_attn"), ("attn2", "cross_attn")] {
            for (proj, orig_proj) in [("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o")] {
                linear(&format!("{d}.{attn}.{proj}"), &format!("{o}.{orig}.{orig_proj}"));
            }
        }
        // diffusers' norm2 (cross-attention, affine) is the original norm3.
        linear(&format!("{d}.norm2"), &format!("{o}.norm3"));
        linear(&format!("{d}.ffn.net.0.proj"), &format!("{o}.ffn.0"));
        linear(&format!("{d}.ffn.net.2"), &format!("{o}.ffn.2"));
    }
    for i in 0..c.num_layers {
        for (attn, orig) in [("attn1", "self_attn"), ("attn2", "cross_attn")] {
            for norm in ["norm_q", "norm_k"] {
                pairs.push((
                    format!("blocks.{i}.{attn}.{norm}.weight"),
                    format!("blocks.{i}.{orig}.{norm}.weight"),
                ));
            }
        }
        pairs.push((
            format!("blocks.{i}.scale_shift_table"),
            format!("blocks.{i}.modulation"),
        ));
    }
    pairs.push(("scale_shift_table".into(), "head.modulation".into()));
    pairs
}
