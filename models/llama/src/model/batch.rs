//! Many sequences in one forward pass over a paged KV cache: the continuous-batching step.
//!
//! Every sequence's new tokens (a decode step's one, or a chunk of its prompt) run as the rows
//! of one matrix through the linears, so the weights are read once for the whole batch. One
//! kernel rotates every row and writes its key and value into its sequence's block; the
//! decode rows attend in one kernel over their tables, prompt chunks one by one.

use candle_core::{DType, Tensor};
use tpinfer_layers::{
    causal_mask, flash_attention, grouped_attention, BlockTable, DecodeRows, LoneRow, Result, RowsAt,
};

use super::{add_norm, DecoderLayer, LayerContext, LlamaRank, StepKv};

/// One sequence's part of a batched forward: `tokens` at positions `start..start +
/// tokens.len()`, its positions before `start` already cached in the blocks of `table`, which
/// must cover every position up to the last token.
#[derive(Debug, Clone, Copy)]
pub struct SequenceChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub table: &'a BlockTable,
}

/// Where each sequence's rows and cached positions are, for every layer of one pass.
pub(crate) struct BatchLayout {
    /// Each token's position, `[rows]` u32.
    positions: Tensor,
    /// Each token's KV slot, `[rows]` u32.
    slots: Tensor,
    /// The sequences with one new token (decode steps), attended together.
    decodes: Option<DecodeGroup>,
    /// The sequences with several (prompt chunks), attended one by one.
    prompts: Vec<SequenceRows>,
    /// Where each row's attention output lands among the decode group's rows, then the
    /// prompts' (`None` when that is already the batch's order).
    order: Option<Tensor>,
}

#[cfg(feature = "cuda")]
impl BatchLayout {
    /// A step of decode rows alone, row `i` the sequence `i`: the buffers a captured step
    /// reads (`tables` `[rows, blocks]`, the rest `[rows]`, u32).
    pub(crate) fn decodes(positions: &Tensor, slots: &Tensor, rows: &Tensor, tables: &Tensor, lens: &Tensor) -> Self {
        Self {
            positions: positions.clone(),
            slots: slots.clone(),
            decodes: Some(DecodeGroup {
                rows: rows.clone(),
                tables: tables.clone(),
                lens: lens.clone(),
            }),
            prompts: Vec::new(),
            order: None,
        }
    }
}

/// Decode steps' attention inputs (see [`DecodeRows`]).
struct DecodeGroup {
    /// Each sequence's row of the batch, `[n]` u32.
    rows: Tensor,
    /// `[n, most blocks]` u32: each sequence's blocks, then block 0 as padding.
    tables: Tensor,
    /// Each sequence's cached positions, its new token's included, `[n]` u32.
    lens: Tensor,
}

struct SequenceRows {
    /// The sequence's first row in the batch, and how many it has.
    first: usize,
    len: usize,
    /// The slots of all its positions up to its last token, `[start + len]` u32.
    context: Tensor,
}

impl LlamaRank {
    /// Runs each sequence's chunk, caching their keys and values in the blocks of its table,
    /// and returns the f32 logits over the full vocabulary at each chunk's last token, `[chunks,
    /// vocab]`, ready to read on the host; every rank returns the same. Needs a rank loaded
    /// by [`Self::load_paged`].
    pub fn forward_batch(&mut self, chunks: &[SequenceChunk<'_>]) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if chunks.iter().all(|c| c.tokens.len() == 1) {
            if let Some(mut graphs) = self.batch_graphs.take() {
                let logits = match graphs.covers(chunks.len())? {
                    true => Some(graphs.step(self, chunks)),
                    false => None,
                };
                self.batch_graphs = Some(graphs);
                if let Some(logits) = logits {
                    let logits = logits?;
                    self.comm.wait()?;
                    return Ok(logits);
                }
            }
        }
        let layout = self.batch_layout(chunks)?;
        let device = self.norm.device();
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().copied()).collect();
        let ids = Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?;
        // Each chunk's last row.
        let last: Vec<u32> = chunks
            .iter()
            .scan(0, |end, c| {
                *end += c.tokens.len() as u32;
                Some(*end - 1)
            })
            .collect();
        let last = match last.len() == ids.dim(1)? {
            true => None,
            false => Some(Tensor::new(last.as_slice(), device)?),
        };
        let logits = self.forward_layout(&ids, &layout, last.as_ref())?;
        self.comm.wait()?;
        Ok(logits)
    }

    /// The f32 logits at the rows `last` (every row when `None`) of the batch `ids` `[1,
    /// rows]` laid out as `layout` says, `[rows picked, vocab]`. Queues work without waiting
    /// on the host: a captured decode step is exactly this call.
    pub(crate) fn forward_layout(&self, ids: &Tensor, layout: &BatchLayout, last: Option<&Tensor>) -> Result<Tensor> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        // A lone decode row runs the one-sequence step's chain, reading its keys through its
        // block table: a batched step of one sequence costs what a sequence alone does.
        if let Some(blocks) = self.lone_blocks(layout)? {
            let row = LoneRow {
                position: &layout.positions,
                slot: &layout.slots,
                blocks: &blocks,
            };
            let hidden = self.step_hidden_states(ids, StepKv::Paged(row))?.squeeze(0)?;
            return Ok(head.project(&hidden)?.to_dtype(DType::F32)?);
        }
        let mut x = self.embed.embed(ids)?;
        // Prompt chunks attend through the flash kernel where the rank does (causal in the
        // kernel), else with masks of their own.
        let ctx = self.layer_context(self.flash, None);
        let eps = self.config.rms_norm_eps;
        let mut pending = None;
        for layer in &self.layers {
            let (residual, h) = add_norm(x, pending.take(), &layer.input_norm, eps)?;
            let attn = layer.batch_attention(h, layout, &ctx)?;
            let (residual, h) = add_norm(residual, Some(attn), &layer.post_norm, eps)?;
            let mlp = layer.mlp.forward(&h)?;
            (x, pending) = (residual, Some(mlp));
        }
        let hidden = add_norm(x, pending, &self.norm, eps)?.1.squeeze(0)?;
        let last = match last {
            Some(rows) => hidden.index_select(rows, 0)?,
            None => hidden,
        };
        Ok(head.project(&last)?.to_dtype(DType::F32)?)
    }

    /// The block table `[blocks]` of `layout`'s sequence where it is one decode row alone and
    /// the rank runs such a row as a lone step (`LlamaRank::lone_steps`).
    fn lone_blocks(&self, layout: &BatchLayout) -> Result<Option<Tensor>> {
        match &layout.decodes {
            Some(group) if self.lone_steps && layout.prompts.is_empty() && layout.positions.dim(0)? == 1 => {
                Ok(Some(group.tables.get(0)?))
            }
            _ => Ok(None),
        }
    }

    fn batch_layout(&self, chunks: &[SequenceChunk<'_>]) -> Result<BatchLayout> {
        let Some(block_size) = self.paged.map(|p| p.block_size) else {
            return Err(tpinfer_layers::Error::Shard(
                "a batched forward needs a rank loaded with a paged KV cache (load_paged)".into(),
            ));
        };
        let device = self.norm.device();
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        let (mut decodes, mut prompts) = (Vec::new(), Vec::new());
        for chunk in chunks {
            let end = chunk.start + chunk.tokens.len();
            if chunk.tokens.is_empty() || end > self.max_positions() {
                return Err(tpinfer_layers::Error::CacheFull {
                    needed: end,
                    capacity: self.max_positions(),
                });
            }
            let context = chunk.table.slots(0..end, block_size)?;
            let first = positions.len();
            positions.extend(chunk.start as u32..end as u32);
            slots.extend_from_slice(&context[chunk.start..]);
            match chunk.tokens.len() {
                1 => decodes.push((first as u32, end, &chunk.table.blocks[..end.div_ceil(block_size)])),
                len => prompts.push(SequenceRows {
                    first,
                    len,
                    context: Tensor::new(context.as_slice(), device)?,
                }),
            }
        }
        // The attention outputs come out decode rows first, then each prompt's rows.
        let order: Vec<u32> = decodes
            .iter()
            .map(|&(row, _, _)| row)
            .chain(prompts.iter().flat_map(|p| p.first as u32..(p.first + p.len) as u32))
            .collect();
        let mut landing = vec![0u32; order.len()];
        for (at, &row) in order.iter().enumerate() {
            landing[row as usize] = at as u32;
        }
        let in_order = landing.iter().enumerate().all(|(i, &at)| at as usize == i);
        Ok(BatchLayout {
            positions: Tensor::new(positions.as_slice(), device)?,
            slots: Tensor::new(slots.as_slice(), device)?,
            decodes: Self::decode_group(&decodes, device)?,
            prompts,
            order: (!in_order)
                .then(|| Tensor::new(landing.as_slice(), device))
                .transpose()?,
        })
    }

    /// `decodes`: each decode sequence's row, cached length and blocks.
    fn decode_group(decodes: &[(u32, usize, &[u32])], device: &candle_core::Device) -> Result<Option<DecodeGroup>> {
        let Some(most) = decodes.iter().map(|(_, _, blocks)| blocks.len()).max() else {
            return Ok(None);
        };
        let n = decodes.len();
        let mut tables = vec![0u32; n * most];
        for (i, (_, _, blocks)) in decodes.iter().enumerate() {
            tables[i * most..i * most + blocks.len()].copy_from_slice(blocks);
        }
        let rows: Vec<u32> = decodes.iter().map(|&(row, _, _)| row).collect();
        let lens: Vec<u32> = decodes.iter().map(|&(_, len, _)| len as u32).collect();
        Ok(Some(DecodeGroup {
            rows: Tensor::new(rows.as_slice(), device)?,
            tables: Tensor::from_vec(tables, (n, most), device)?,
            lens: Tensor::new(lens.as_slice(), device)?,
        }))
    }
}

impl DecoderLayer {
    /// Attention of every sequence's rows `h` `[1, rows, hidden]` over its own cached
    /// positions and these.
    fn batch_attention(&self, h: Tensor, layout: &BatchLayout, ctx: &LayerContext) -> Result<Tensor> {
        let Some(cache) = &self.paged else {
            return Err(tpinfer_layers::Error::Shard("no paged KV cache".into()));
        };
        let (c, heads) = (ctx.config, &ctx.shard.heads);
        let (n_q, n_kv, d) = (heads.q_heads.len(), heads.kv_heads.len(), c.head_dim);
        let rows = h.dim(1)?;
        let qkv = self.qkv.forward_merged(&h)?.reshape((rows, (n_q + 2 * n_kv) * d))?;
        drop(h);
        let qkv = self.qk_normed(qkv, ctx)?;
        let at = RowsAt {
            positions: &layout.positions,
            slots: &layout.slots,
        };
        let q = cache.write_rotated(&qkv, ctx.rope, at, n_q)?;
        drop(qkv);
        let scale = 1.0 / (d as f64).sqrt();
        let mut outs = Vec::with_capacity(1 + layout.prompts.len());
        if let Some(group) = &layout.decodes {
            let decode = DecodeRows {
                q_rows: &group.rows,
                tables: &group.tables,
                lens: &group.lens,
                block_size: cache.block_size(),
                groups: heads.query_groups(),
            };
            let out = cache.decode_attention(&q, decode, scale)?;
            outs.push(out.reshape((group.rows.dim(0)?, n_q * d))?);
        }
        // [t, heads, d] to [1, heads, t, d].
        let head_major = |x: Tensor| -> Result<Tensor> { Ok(x.transpose(0, 1)?.contiguous()?.unsqueeze(0)?) };
        for s in &layout.prompts {
            let (k, v) = cache.read(&s.context)?;
            let q = q.narrow(0, s.first, s.len)?;
            let out = match ctx.flash {
                true => flash_attention(&q, &k, &v, scale, true)?,
                false => {
                    let mask = causal_mask(s.len, k.dim(0)?, q.device())?;
                    let (q, k, v) = (head_major(q)?, head_major(k)?, head_major(v)?);
                    let out = grouped_attention(&q, &k, &v, heads, ctx.kv_index, Some(&mask), scale)?;
                    out.squeeze(0)?.transpose(0, 1)?
                }
            };
            outs.push(out.reshape((s.len, n_q * d))?);
        }
        let attn = match outs.len() {
            1 => outs.swap_remove(0),
            _ => Tensor::cat(&outs, 0)?,
        };
        let attn = match &layout.order {
            Some(order) => attn.index_select(order, 0)?,
            None => attn,
        };
        self.o_proj.forward(&attn.unsqueeze(0)?)
    }
}
