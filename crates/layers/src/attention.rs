use candle_core::{DType, Tensor};

use crate::{HeadShard, Result};

/// Gives each local Q head its KV head: `[b, kv_local, t, d]` → `[b, q_local, t, d]`.
/// GQA groups may straddle ranks, so a rank's heads need not share one group size; the
/// general case gathers by index, the uniform one repeats.
pub fn expand_kv_heads(kv: &Tensor, heads: &HeadShard, kv_index: &Tensor) -> Result<Tensor> {
    match heads.uniform_group() {
        Some(1) => Ok(kv.clone()),
        Some(g) => {
            let (b, n_kv, t, d) = kv.dims4()?;
            Ok(kv
                .unsqueeze(2)?
                .expand((b, n_kv, g, t, d))?
                .reshape((b, n_kv * g, t, d))?)
        }
        None => Ok(kv.contiguous()?.index_select(kv_index, 1)?),
    }
}

/// Scaled dot-product attention of `q` `[b, h, s, d]` over `k`, `v` `[b, h, t, d]`, where the
/// queries are the last `s` of the `t` positions: query `i` sees keys `0..=t - s + i`.
/// Scores and softmax are computed in f32.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, _, s, _) = q.dims4()?;
    let t = k.dim(2)?;
    let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?.to_dtype(DType::F32)?;
    let scores = if s > 1 {
        let offset = t - s;
        let mask: Vec<f32> = (0..s)
            .flat_map(|i| {
                (0..t).map(move |j| {
                    if j > i + offset {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (s, t), q.device())?;
        scores.broadcast_add(&mask)?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    Ok(probs.matmul(&v.contiguous()?)?)
}
