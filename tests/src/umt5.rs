//! A tiny random umT5 encoder written as transformers saves `UMT5EncoderModel`
//! (`config.json`, `model.safetensors`), and an unsharded reference forward of it written from
//! T5's definition, independent of `tpinfer-umt5`.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

/// A umT5 encoder small enough for CPU tests: 6 heads, which split unevenly at 4 and 5 ranks,
/// and 8 buckets over a distance of 16, so that a 20-token prompt reaches exact, logarithmic
/// and saturated buckets.
#[derive(Debug, Clone)]
pub struct TinyUmt5 {
    pub vocab: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub layers: usize,
    pub buckets: usize,
    pub max_distance: usize,
    pub seed: u64,
}

impl Default for TinyUmt5 {
    fn default() -> Self {
        Self {
            vocab: 96,
            d_model: 32,
            d_kv: 8,
            heads: 6,
            d_ff: 40,
            layers: 2,
            buckets: 8,
            max_distance: 16,
            seed: 11,
        }
    }
}

impl TinyUmt5 {
    pub fn config_json(&self) -> serde_json::Value {
        json!({
            "architectures": ["UMT5EncoderModel"],
            "model_type": "umt5",
            "vocab_size": self.vocab,
            "d_model": self.d_model,
            "d_kv": self.d_kv,
            "d_ff": self.d_ff,
            "num_layers": self.layers,
            "num_heads": self.heads,
            "relative_attention_num_buckets": self.buckets,
            "relative_attention_max_distance": self.max_distance,
            "layer_norm_epsilon": 1e-6,
            "feed_forward_proj": "gated-gelu",
            "dense_act_fn": "gelu_new",
            "is_gated_act": true,
            "torch_dtype": "float32"
        })
    }

    /// Every tensor, as transformers names it, with its shape and seeded values. The
    /// encoder's copy of the tied embedding is written too, as some checkpoints carry it.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut t = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
            let n = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|_| offset + scale * (rng.random::<f32>() - 0.5)).collect();
            (name, shape, values)
        };
        let (d, inner, ff) = (self.d_model, self.heads * self.d_kv, self.d_ff);
        let mut all = vec![t("shared.weight".into(), vec![self.vocab, d], 2.0, 0.0)];
        for i in 0..self.layers {
            let (a, f) = (
                format!("encoder.block.{i}.layer.0"),
                format!("encoder.block.{i}.layer.1"),
            );
            all.push(t(format!("{a}.layer_norm.weight"), vec![d], 0.4, 1.0));
            for name in ["q", "k", "v"] {
                all.push(t(format!("{a}.SelfAttention.{name}.weight"), vec![inner, d], 0.6, 0.0));
            }
            all.push(t(format!("{a}.SelfAttention.o.weight"), vec![d, inner], 0.6, 0.0));
            all.push(t(
                format!("{a}.SelfAttention.relative_attention_bias.weight"),
                vec![self.buckets, self.heads],
                4.0,
                0.0,
            ));
            all.push(t(format!("{f}.layer_norm.weight"), vec![d], 0.4, 1.0));
            all.push(t(format!("{f}.DenseReluDense.wi_0.weight"), vec![ff, d], 0.6, 0.0));
            all.push(t(format!("{f}.DenseReluDense.wi_1.weight"), vec![ff, d], 0.6, 0.0));
            all.push(t(format!("{f}.DenseReluDense.wo.weight"), vec![d, ff], 0.6, 0.0));
        }
        all.push(t("encoder.final_layer_norm.weight".into(), vec![d], 0.4, 1.0));
        let embed = all[0].2.clone();
        all.push(("encoder.embed_tokens.weight".into(), vec![self.vocab, d], embed));
        all
    }

    /// Writes `config.json` and `model.safetensors` into `dir`.
    pub fn write(&self, dir: &Path) {
        std::fs::write(dir.join("config.json"), self.config_json().to_string()).expect("config.json");
        let tensors = self.tensors();
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), data)| {
                (
                    name.clone(),
                    TensorView::new(Dtype::F32, shape.clone(), data).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write safetensors");
    }

    /// The encoder's last hidden states `[tokens, d_model]` for `ids`, unsharded, in f32 on
    /// the CPU, from T5's definition: RMS norms without mean or bias, unscaled scores plus the
    /// bucketed relative position bias, a gated FFN through the tanh GELU.
    pub fn reference(&self, ids: &[u32]) -> Tensor {
        let tensors = self.tensors();
        let get = |name: &str| {
            let (_, shape, values) = tensors.iter().find(|(n, _, _)| n == name).expect("tensor");
            Tensor::from_slice(values, shape.as_slice(), &Device::Cpu).expect("tensor")
        };
        let rms = |x: &Tensor, w: &Tensor| -> Tensor {
            let variance = x.sqr().and_then(|v| v.mean_keepdim(1)).expect("variance");
            x.broadcast_div(&(variance + 1e-6).and_then(|v| v.sqrt()).expect("rms"))
                .and_then(|y| y.broadcast_mul(w))
                .expect("norm")
        };
        let linear = |x: &Tensor, w: &str| x.matmul(&get(w).t().expect("t")).expect("linear");
        let s = ids.len();
        let (heads, dk) = (self.heads, self.d_kv);
        let ids_t = Tensor::from_slice(ids, s, &Device::Cpu).expect("ids");
        let mut x = get("shared.weight").index_select(&ids_t, 0).expect("embed");
        for i in 0..self.layers {
            let (a, f) = (
                format!("encoder.block.{i}.layer.0"),
                format!("encoder.block.{i}.layer.1"),
            );
            let h = rms(&x, &get(&format!("{a}.layer_norm.weight")));
            let split = |t: Tensor| {
                t.reshape((s, heads, dk))
                    .and_then(|t| t.transpose(0, 1))
                    .expect("heads")
            };
            let q = split(linear(&h, &format!("{a}.SelfAttention.q.weight")));
            let k = split(linear(&h, &format!("{a}.SelfAttention.k.weight")));
            let v = split(linear(&h, &format!("{a}.SelfAttention.v.weight")));
            let table = get(&format!("{a}.SelfAttention.relative_attention_bias.weight"));
            let table: Vec<Vec<f32>> = table.to_vec2().expect("table");
            let bias: Vec<f32> = (0..heads)
                .flat_map(|hd| {
                    let table = &table;
                    (0..s).flat_map(move |qi| (0..s).map(move |ki| table[self.bucket(ki as i64 - qi as i64)][hd]))
                })
                .collect();
            let bias = Tensor::from_vec(bias, (heads, s, s), &Device::Cpu).expect("bias");
            let scores = (q.matmul(&k.t().expect("t")).expect("scores") + bias).expect("biased");
            let max = scores.max_keepdim(2).expect("max");
            let exp = scores.broadcast_sub(&max).and_then(|e| e.exp()).expect("exp");
            let p = exp.broadcast_div(&exp.sum_keepdim(2).expect("sum")).expect("softmax");
            let attn = p
                .matmul(&v)
                .and_then(|o| o.transpose(0, 1))
                .and_then(|o| o.reshape((s, heads * dk)))
                .expect("attention");
            x = (x + linear(&attn, &format!("{a}.SelfAttention.o.weight"))).expect("residual");
            let h = rms(&x, &get(&format!("{f}.layer_norm.weight")));
            let gate = linear(&h, &format!("{f}.DenseReluDense.wi_0.weight"));
            // gelu_new: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))
            let inner = ((&gate + (gate.powf(3.0).expect("cube") * 0.044715).expect("scaled")).expect("sum")
                * (2.0 / std::f64::consts::PI).sqrt())
            .expect("inner");
            let gelu =
                (&gate * ((inner.tanh().expect("tanh") + 1.0).expect("one") * 0.5).expect("half")).expect("gelu");
            let up = linear(&h, &format!("{f}.DenseReluDense.wi_1.weight"));
            let ffn = linear(&(gelu * up).expect("product"), &format!("{f}.DenseReluDense.wo.weight"));
            x = (x + ffn).expect("residual");
        }
        rms(&x, &get("encoder.final_layer_norm.weight"))
            .to_dtype(DType::F32)
            .expect("f32")
    }

    /// T5's bidirectional bucket of a key `relative` positions after its query, written out
    /// from transformers' formula in f64.
    fn bucket(&self, relative: i64) -> usize {
        let half = self.buckets / 2;
        let base = if relative > 0 { half } else { 0 };
        let distance = relative.unsigned_abs() as f64;
        let exact = (half / 2) as f64;
        if distance < exact {
            return base + distance as usize;
        }
        let large = exact + ((distance / exact).ln() / (self.max_distance as f64 / exact).ln() * (half as f64 - exact));
        base + (large as usize).min(half - 1)
    }
}
