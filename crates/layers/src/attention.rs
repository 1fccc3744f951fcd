use candle_core::{DType, Device, Tensor};

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

/// The additive mask `[s, t]` for `s` queries that are the last `s` of `t` positions: query
/// `i` sees keys `0..=t - s + i`. Built on the device, once per forward.
pub fn causal_mask(s: usize, t: usize, device: &Device) -> Result<Tensor> {
    let rows = Tensor::arange((t - s) as u32, t as u32, device)?.reshape((s, 1))?;
    let cols = Tensor::arange(0u32, t as u32, device)?.reshape((1, t))?;
    let visible = cols.broadcast_le(&rows)?;
    let open = Tensor::zeros((s, t), DType::F32, device)?;
    let closed = Tensor::full(f32::NEG_INFINITY, (s, t), device)?;
    Ok(visible.where_cond(&open, &closed)?)
}

/// Scaled dot-product attention of `q` `[b, h, s, d]` over `k`, `v` `[b, h, t, d]`, with an
/// optional additive `mask` `[s, t]` (see [`causal_mask`]). Computed in f32 whatever the
/// dtype: scores rounded to bf16 before the softmax cost more accuracy than the rest of a
/// layer together.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    let scores = (f32(q)?.matmul(&f32(k)?.t()?)? * scale)?;
    let scores = match mask {
        Some(mask) => scores.broadcast_add(mask)?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    Ok(probs.matmul(&f32(v)?)?.to_dtype(v.dtype())?)
}
