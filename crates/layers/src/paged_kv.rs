use candle_core::{DType, Device, Tensor};

use crate::{Error, Result, Rope};

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

    /// Writes keys `k` and values `v` `[t, heads, head_dim]` of `t` positions at `slots`
    /// (`[t]` u32, from [`BlockTable::slots`]).
    pub fn write(&self, k: &Tensor, v: &Tensor, slots: &Tensor) -> Result<()> {
        let (t, heads, d) = k.dims3()?;
        let source = Tensor::stack(&[k, v], 0)?.reshape((2, t, heads * d))?;
        let rows = slots
            .reshape((1, t, 1))?
            .broadcast_as((2, t, heads * d))?
            .contiguous()?;
        let (_, total, _, _) = self.kv.dims4()?;
        self.kv.reshape((2, total, heads * d))?.scatter_set(&rows, &source, 1)?;
        Ok(())
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

/// [`Rope`] applied to `x` `[t, heads, head_dim]` at one position per row (`positions`, `[t]`
/// u32): the halves of each head rotated as Hugging Face's `rotate_half`, computed in f32
/// and returned in `x`'s dtype.
pub fn rotate_at(x: &Tensor, rope: &Rope, positions: &Tensor) -> Result<Tensor> {
    let (t, _, d) = x.dims3()?;
    if d % 2 != 0 || positions.dims() != [t] {
        return Err(Error::Shard(format!(
            "rotary: rows {:?} need an even head size and one position each, got positions {:?}",
            x.dims(),
            positions.dims()
        )));
    }
    // [t, 1, d / 2], broadcast over the heads.
    let at = |i: usize| -> Result<Tensor> {
        let rows = rope.table().get(i)?.index_select(positions, 0)?;
        Ok(rows.to_dtype(DType::F32)?.unsqueeze(1)?)
    };
    let (cos, sin) = (at(0)?, at(1)?);
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let (x1, x2) = (x.narrow(2, 0, d / 2)?, x.narrow(2, d / 2, d / 2)?);
    let first = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let second = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Ok(Tensor::cat(&[first, second], 2)?.to_dtype(dtype)?)
}
