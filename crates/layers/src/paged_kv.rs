use candle_core::{DType, Device, Tensor};
use tpinfer_kernels::{DecodeRows, DecodeScratch, PagedSequence, RowWeight, RowsAt};

use crate::{Error, Result, Rope};

/// A lone sequence's decode row in a paged pool, as a batched step of one sequence runs it
/// through the one-row kernels: `[1]` u32 `position` and `slot` (where its key and value go),
/// and its block table `blocks` `[blocks]` u32, all read when the kernels run.
#[derive(Debug, Clone, Copy)]
pub struct LoneRow<'a> {
    pub position: &'a Tensor,
    pub slot: &'a Tensor,
    pub blocks: &'a Tensor,
}

/// Keys and values of many sequences for one layer, in a pool of fixed-size blocks: `[2,
/// blocks · block_size, heads, head_dim]` (keys, then values; each position a token-major
/// row, as paged attention kernels read them). A sequence's positions live in the blocks of
/// its block table, in order; which blocks those are is the scheduler's business (see
/// [`BlockTable`]), so that sequences grow, end and are preempted without copying.
pub struct PagedKvCache {
    kv: Tensor,
    block_size: usize,
}

impl PagedKvCache {
    pub fn new(
        heads: usize,
        blocks: usize,
        block_size: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            kv: Tensor::zeros((2, blocks * block_size, heads, head_dim), dtype, device)?,
            block_size,
        })
    }

    /// The bytes [`Self::new`] allocates: keys and values.
    pub fn bytes(heads: usize, blocks: usize, block_size: usize, head_dim: usize, dtype: DType) -> usize {
        2 * blocks * block_size * heads * head_dim * dtype.size_in_bytes()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The number of positions the pool holds, over every block.
    pub fn slots(&self) -> usize {
        self.kv.dims()[1]
    }

    /// The query heads of the fused QKV projection `qkv` `[t, (q_heads + 2 · kv_heads) · d]`
    /// rotated for each row's position, `[t, q_heads, d]`, after writing each row's rotated
    /// keys and its values at its slot (`rows`, from [`BlockTable::slots`]). One kernel.
    pub fn write_rotated(&self, qkv: &Tensor, rope: &Rope, rows: RowsAt<'_>, q_heads: usize) -> Result<Tensor> {
        Ok(tpinfer_kernels::rotary_qkv_paged(
            &self.kv,
            qkv,
            rope.table(),
            rows,
            q_heads,
        )?)
    }

    /// Attention of each decode row's query in `q` `[t, q_heads, d]` over its own sequence's
    /// cached positions, `[n, q_heads, d]`; see [`tpinfer_kernels::paged_decode_attention`].
    pub fn decode_attention(&self, q: &Tensor, decode: DecodeRows<'_>, scale: f64) -> Result<Tensor> {
        Ok(tpinfer_kernels::paged_decode_attention(q, &self.kv, decode, scale)?)
    }

    /// The rotated query heads of one row `x`'s QKV product with the fused weight `w` (and its
    /// `bias`) written into `queries`, its key (rotated) and value into the pool at `row`'s
    /// slot: one CUDA kernel ([`tpinfer_kernels::gemv_rotary_qkv_paged_into`]), a chain link.
    /// The caller has checked the position against the table and the slot against the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn write_projected_rotated_into(
        &self,
        x: impl Into<tpinfer_kernels::GemvRow>,
        w: RowWeight,
        bias: Option<&Tensor>,
        rope: &Rope,
        row: LoneRow<'_>,
        q_heads: usize,
        queries: &Tensor,
    ) -> Result<()> {
        Ok(tpinfer_kernels::gemv_rotary_qkv_paged_into(
            &self.kv,
            x,
            w,
            bias,
            rope.table(),
            row.position,
            row.slot,
            q_heads,
            queries,
        )?)
    }

    /// Attention of `row`'s query `q` `[1, q_heads, d]` over its sequence's cached positions,
    /// written into `out`: the one-sequence decode kernel reading through the block table
    /// ([`tpinfer_kernels::paged_decode_attention_into`]), a chain link.
    pub fn lone_decode_attention_into(
        &self,
        q: &Tensor,
        row: LoneRow<'_>,
        scale: f64,
        scratch: &DecodeScratch,
        out: &Tensor,
    ) -> Result<()> {
        let sequence = PagedSequence {
            position: row.position,
            blocks: row.blocks,
            block_size: self.block_size,
        };
        Ok(tpinfer_kernels::paged_decode_attention_into(
            q, &self.kv, sequence, scale, scratch, out,
        )?)
    }

    /// The keys and values at `slots` (`[t]` u32), `[t, heads, head_dim]` each.
    pub fn read(&self, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let part = |i: usize| self.kv.get(i)?.index_select(slots, 0);
        Ok((part(0)?, part(1)?))
    }
}

/// The blocks of one sequence's KV positions, in order: position `p` lives in slot
/// `blocks[p / block_size] · block_size + p % block_size` of every layer's [`PagedKvCache`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
}

impl BlockTable {
    /// The slots of positions `range`, which the table's blocks must cover.
    pub fn slots(&self, range: std::ops::Range<usize>, block_size: usize) -> Result<Vec<u32>> {
        let capacity = self.blocks.len() * block_size;
        if range.end > capacity {
            return Err(Error::CacheFull {
                needed: range.end,
                capacity,
            });
        }
        Ok(range
            .map(|p| self.blocks[p / block_size] * block_size as u32 + (p % block_size) as u32)
            .collect())
    }
}
