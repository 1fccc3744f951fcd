//! A tiny Llama written as llama.cpp's converter writes a GGUF file: its metadata keys, Q/K
//! rows permuted for interleaved rotary, Llama 3.1 scaling as `rope_freqs` divisors, and the
//! matrices in GGML blocks of the caller's choosing. The Qwen flavors are written as llama.cpp's
//! `qwen2` and `qwen3` architectures: their keys, Q/K rows as they are (they rotate halves),
//! Qwen2's biases and Qwen3's Q/K norms.

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::{Flavor, TinyLlama};

impl TinyLlama {
    /// Writes the model as a GGUF file at `path`, each matrix but the embedding in the blocks
    /// `quant` names for its GGUF name (norms stay f32). Read back dequantized, it is the
    /// model [`TinyLlama::write`] writes.
    pub fn write_gguf(&self, path: &Path, quant: impl Fn(&str) -> GgmlDType) {
        let u = |v: usize| Value::U32(v as u32);
        let arch = match self.flavor {
            Flavor::Qwen2 => "qwen2",
            Flavor::Qwen3 => "qwen3",
            Flavor::Llama | Flavor::Mistral(_) => "llama",
        };
        // llama.cpp permutes Q and K rows for its `llama` architecture alone.
        let permuted = arch == "llama";
        let mut metadata = vec![("general.architecture".to_string(), Value::String(arch.into()))];
        for (field, value) in [
            ("block_count", u(self.layers)),
            ("embedding_length", u(self.hidden)),
            ("feed_forward_length", u(self.intermediate)),
            ("attention.head_count", u(self.heads)),
            ("attention.head_count_kv", u(self.kv_heads)),
            ("rope.dimension_count", u(self.head_dim)),
            ("context_length", u(512)),
            ("rope.freq_base", Value::F32(50_000.0)),
            ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
            ("vocab_size", u(self.vocab)),
        ] {
            metadata.push((format!("{arch}.{field}"), value));
        }
        metadata.push(("tokenizer.ggml.bos_token_id".into(), u(crate::BOS as usize)));
        let mut tensors: Vec<(String, QTensor)> = self
            .tensors()
            .into_iter()
            .map(|(name, shape, values)| {
                let gguf = gguf_name(&name);
                let mut t = Tensor::from_vec(values, shape.as_slice(), &Device::Cpu).expect("tensor");
                if gguf.ends_with("attn_q.weight") && permuted {
                    t = permute_rotary_rows(&t, self.heads);
                } else if gguf.ends_with("attn_k.weight") && permuted {
                    t = permute_rotary_rows(&t, self.kv_heads);
                }
                let dtype = match shape.len() == 2 && gguf != "token_embd.weight" {
                    true => quant(&gguf),
                    false => GgmlDType::F32,
                };
                (gguf, QTensor::quantize(&t, dtype).expect("quantize"))
            })
            .collect();
        if self.llama3_rope_scaling {
            let divisors = Tensor::new(self.rope_divisors(), &Device::Cpu).expect("rope_freqs");
            tensors.push((
                "rope_freqs.weight".into(),
                QTensor::quantize(&divisors, GgmlDType::F32).expect("quantize"),
            ));
        }
        let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut file = std::fs::File::create(path).expect("create gguf");
        gguf_file::write(&mut file, &meta, &refs).expect("write gguf");
    }

    /// llama.cpp's `rope_freqs` for the Llama 3.1 scaling of [`TinyLlama::config_json`]: the
    /// divisor that takes each frequency to its scaled value.
    fn rope_divisors(&self) -> Vec<f32> {
        let (factor, low, high, old) = (8.0f64, 1.0f64, 4.0f64, 64.0f64);
        (0..self.head_dim / 2)
            .map(|i| {
                let freq = 1.0 / 50_000f64.powf(2.0 * i as f64 / self.head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let scaled = if wavelen < old / high {
                    freq
                } else if wavelen > old / low {
                    freq / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * freq / factor + smooth * freq
                };
                (freq / scaled) as f32
            })
            .collect()
    }
}

/// llama.cpp's converter's row permutation of Q and K: rotary pairs made adjacent.
fn permute_rotary_rows(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().expect("matrix");
    w.reshape((heads, 2, rows / heads / 2, cols))
        .and_then(|t| t.transpose(1, 2))
        .and_then(|t| t.reshape((rows, cols)))
        .expect("permute")
}

/// The GGUF name of a Hugging Face Llama tensor name.
fn gguf_name(name: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, gguf)) = fixed.iter().find(|(hf, _)| *hf == name) {
        return gguf.to_string();
    }
    let rest = name.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, tail) = rest.split_once('.').expect("layer index");
    let part = [
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("self_attn.q_norm.weight", "attn_q_norm.weight"),
        ("self_attn.k_norm.weight", "attn_k_norm.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ]
    .iter()
    .find(|(hf, _)| *hf == tail)
    .map(|(_, gguf)| *gguf)
    .expect("a Llama tensor, Qwen2's Q/K/V bias or Qwen3's Q/K norm");
    format!("blk.{layer}.{part}")
}
