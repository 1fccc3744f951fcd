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
/// optional additive `mask` `[s, t]` (see [`causal_mask`]); when `q` stacks several query
/// groups (`[b, h, g·s, d]`), the mask applies to each. Computed in f32 whatever the dtype:
/// scores rounded to bf16 before the softmax cost more accuracy than the rest of a layer
/// together. At most two score-sized buffers are alive at once (the memory planner's model).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    // Scaling the queries (s·d values) rather than the scores (s·t values) saves a buffer.
    let q = (f32(q)? * scale)?;
    let scores = q.matmul(&f32(k)?.t()?)?;
    let probs = masked_softmax(scores, mask)?;
    Ok(probs.matmul(&f32(v)?)?.to_dtype(v.dtype())?)
}

/// Softmax over the last dim after adding `mask`; takes `scores` by value so that each
/// buffer is freed as soon as the next one exists.
fn masked_softmax(scores: Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let masked = match mask {
        Some(mask) => {
            let dims = scores.dims().to_vec();
            let (rows, t) = (dims[dims.len() - 2], dims[dims.len() - 1]);
            let s = mask.dim(0)?;
            let n = scores.elem_count() / (rows * t);
            let masked = scores
                .reshape((n, rows / s, s, t))?
                .broadcast_add(mask)?
                .reshape(dims)?;
            drop(scores);
            masked
        }
        None => scores,
    };
    Ok(candle_nn::ops::softmax_last_dim(&masked)?)
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
            let out = causal_attention(&q, k, v, mask, scale)?;
            Ok(out.reshape((b, n_q, s, d))?)
        }
        None => {
            let gather = |kv: &Tensor| kv.contiguous()?.index_select(kv_index, 1);
            causal_attention(q, &gather(k)?, &gather(v)?, mask, scale)
        }
    }
}

/// Non-causal attention of `q` `[s, h, d]` over `k`, `v` `[t, h, d]` (any strides with `d`
/// contiguous); returns `[s, h, d]`. This is flash attention where it runs (CUDA in bf16/f16,
/// and its one-pass twin on CPU), which keeps no scores at all; otherwise (CUDA in f32)
/// [`blockwise_attention`]. Either way no `s × t` matrix per head group is materialized.
pub fn full_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, score_bytes: usize) -> Result<Tensor> {
    if tpinfer_kernels::flash_attention_supported(q) {
        return Ok(tpinfer_kernels::flash_attention(q, k, v, scale, false)?);
    }
    blockwise_attention(q, k, v, scale, score_bytes)
}

/// [`full_attention`] without a fused kernel: in f32, one head and one block of queries at a
/// time, so that no score buffer exceeds `score_bytes`. `[s, h, d]` in and out.
pub fn blockwise_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, score_bytes: usize) -> Result<Tensor> {
    let (s, heads, _) = q.dims3()?;
    let t = k.dim(0)?;
    let block = (score_bytes / (t * 4)).clamp(1, s.max(1));
    let head = |x: &Tensor, h: usize| -> Result<Tensor> { Ok(x.narrow(1, h, 1)?.squeeze(1)?.to_dtype(DType::F32)?) };
    let mut per_head = Vec::with_capacity(heads);
    for h in 0..heads {
        let kh = head(k, h)?.t()?.contiguous()?;
        let vh = head(v, h)?.contiguous()?;
        let qh = (head(q, h)? * scale)?;
        let mut rows = Vec::with_capacity(s.div_ceil(block));
        for start in (0..s).step_by(block) {
            let len = block.min(s - start);
            let scores = qh.narrow(0, start, len)?.matmul(&kh)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            drop(scores);
            rows.push(probs.matmul(&vh)?);
        }
        per_head.push(Tensor::cat(&rows, 0)?);
    }
    Ok(Tensor::stack(&per_head, 1)?.to_dtype(q.dtype())?)
}
