use candle_core::Tensor;

use crate::Result;

/// Keys or values of past positions for one layer, `[batch, heads, len, head_dim]`, in a
/// buffer that grows by doubling so that appending a token is not a copy of the whole past.
#[derive(Default)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
}

impl KvCache {
    /// Appends `k`, `v` of shape `[b, h, s, d]` and returns all cached keys and values.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let needed = self.len + k.dim(2)?;
        let (ck, cv) = match (self.k.take(), self.v.take()) {
            (Some(ck), Some(cv)) if fits(&ck, k, needed)? => (ck, cv),
            (old_k, old_v) => {
                let capacity = old_k.as_ref().map_or(Ok(0), |t| t.dim(2))?;
                let capacity = needed.max(2 * capacity).next_multiple_of(64);
                (grow(old_k, k, self.len, capacity)?, grow(old_v, v, self.len, capacity)?)
            }
        };
        ck.slice_set(&k.contiguous()?, 2, self.len)?;
        cv.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        let out = (ck.narrow(2, 0, needed)?, cv.narrow(2, 0, needed)?);
        self.k = Some(ck);
        self.v = Some(cv);
        Ok(out)
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

/// Whether `buffer` can take `needed` positions of tensors shaped like `like`.
fn fits(buffer: &Tensor, like: &Tensor, needed: usize) -> Result<bool> {
    let (b, h, cap, d) = buffer.dims4()?;
    let (lb, lh, _, ld) = like.dims4()?;
    Ok((b, h, d) == (lb, lh, ld) && needed <= cap && buffer.dtype() == like.dtype())
}

fn grow(old: Option<Tensor>, like: &Tensor, len: usize, capacity: usize) -> Result<Tensor> {
    let (b, h, _, d) = like.dims4()?;
    let buffer = Tensor::zeros((b, h, capacity, d), like.dtype(), like.device())?;
    if let Some(old) = old.filter(|o| o.dims()[..2] == like.dims()[..2]) {
        if len > 0 {
            buffer.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
        }
    }
    Ok(buffer)
}
