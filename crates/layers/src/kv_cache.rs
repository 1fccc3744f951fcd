use candle_core::{DType, Device, Tensor};

use crate::{Error, Result, Rope};

/// Keys and values of past positions for one layer, `[2, heads, capacity, head_dim]` (keys,
/// then values), allocated once for the whole context: its bytes are known before the first
/// request, and a long generation cannot run out of memory halfway through it.
pub struct KvCache {
    kv: Tensor,
    len: usize,
}

impl KvCache {
    /// A cache for `capacity` positions of `heads` heads.
    pub fn new(heads: usize, capacity: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self {
            kv: Tensor::zeros((2, heads, capacity, head_dim), dtype, device)?,
            len: 0,
        })
    }

    /// The bytes [`Self::new`] allocates: keys and values.
    pub fn bytes(heads: usize, capacity: usize, head_dim: usize, dtype: DType) -> usize {
        2 * heads * capacity * head_dim * dtype.size_in_bytes()
    }

    /// Appends the keys (rotated by `rope`) and values of a fused QKV projection `qkv` `[s,
    /// (q_heads + 2 · heads) · head_dim]` at the next `s` positions, and returns views of all
    /// cached keys and values, `[1, heads, len, head_dim]` each.
    pub fn append_rotated(&mut self, qkv: &Tensor, rope: &Rope, q_heads: usize) -> Result<(Tensor, Tensor)> {
        let needed = self.len + qkv.dim(0)?;
        let capacity = self.kv.dim(2)?;
        if needed > capacity {
            return Err(Error::CacheFull { needed, capacity });
        }
        tpinfer_kernels::append_rotated_kv(&self.kv, qkv, rope.table(), self.len, q_heads)?;
        self.len = needed;
        let cached = |i: usize| self.kv.narrow(0, i, 1)?.narrow(2, 0, needed);
        Ok((cached(0)?, cached(1)?))
    }

    /// The number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the cached positions, keeping the buffers for the next sequence.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}
