use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// Keys and values of past positions for one layer, `[1, heads, capacity, head_dim]`, allocated
/// once for the whole context: its bytes are known before the first request, and a long
/// generation cannot run out of memory halfway through it.
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl KvCache {
    /// A cache for `capacity` positions of `heads` heads.
    pub fn new(heads: usize, capacity: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        let shape = (1, heads, capacity, head_dim);
        Ok(Self {
            k: Tensor::zeros(shape, dtype, device)?,
            v: Tensor::zeros(shape, dtype, device)?,
            len: 0,
        })
    }

    /// The bytes [`Self::new`] allocates: keys and values.
    pub fn bytes(heads: usize, capacity: usize, head_dim: usize, dtype: DType) -> usize {
        2 * heads * capacity * head_dim * dtype.size_in_bytes()
    }

    /// Appends `k`, `v` of shape `[1, h, s, d]` and returns views of all cached keys and values.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let needed = self.len + k.dim(2)?;
        let capacity = self.k.dim(2)?;
        if needed > capacity {
            return Err(Error::CacheFull { needed, capacity });
        }
        self.k.slice_set(&k.contiguous()?, 2, self.len)?;
        self.v.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok((self.k.narrow(2, 0, needed)?, self.v.narrow(2, 0, needed)?))
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
