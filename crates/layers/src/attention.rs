use candle_core::{DType, Device, Tensor};

use crate::{HeadShard, Result};

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

/// Attention of `q` `[b, q_local, s, d]` over KV heads `k`, `v` `[b, kv_local, t, d]` shared by
/// GQA groups. When every KV head serves `g` consecutive Q heads, the queries of a group are
/// stacked against their one KV head, so the cache is never copied per Q head; when a group
/// straddles ranks, each Q head's KV head is gathered by index.
pub fn grouped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: &HeadShard,
    kv_index: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let (b, n_q, s, d) = q.dims4()?;
    let n_kv = k.dim(1)?;
    match heads.uniform_group() {
        Some(g) => {
            let q = q.contiguous()?.reshape((b, n_kv, g * s, d))?;
            // Each group's mask is the same `[s, t]`: apply it per query row of the stack.
            let grouped_mask = match mask {
                Some(m) => Some(m.repeat((g, 1))?),
                None => None,
            };
            let out = causal_attention(&q, k, v, grouped_mask.as_ref(), scale)?;
            Ok(out.reshape((b, n_q, s, d))?)
        }
        None => {
            let gather = |kv: &Tensor| kv.contiguous()?.index_select(kv_index, 1);
            causal_attention(q, &gather(k)?, &gather(v)?, mask, scale)
        }
    }
}
