use candle_core::{DType, Device, Tensor};

use crate::{Error, Position, Result, Rope};

/// Keys and values of past positions for one layer, `[2, heads, capacity, head_dim]` (keys,
/// then values), allocated once for the whole context: its bytes are known before the first
/// request, and a long generation cannot run out of memory halfway through it. The model
/// counts the filled positions; the cache only holds them.
pub struct KvCache {
    kv: Tensor,
}

impl KvCache {
    /// A cache for `capacity` positions of `heads` heads.
    pub fn new(heads: usize, capacity: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self {
            kv: Tensor::zeros((2, heads, capacity, head_dim), dtype, device)?,
        })
    }

    /// The bytes [`Self::new`] allocates: keys and values.
    pub fn bytes(heads: usize, capacity: usize, head_dim: usize, dtype: DType) -> usize {
        2 * heads * capacity * head_dim * dtype.size_in_bytes()
    }

    /// The number of positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.kv.dims()[2]
    }

    /// Writes the keys (rotated by `rope`) and values of a fused QKV projection `qkv` `[s,
    /// (q_heads + 2 · heads) · head_dim]` at slots `at..at + s`, and returns its query heads,
    /// rotated, `[s, q_heads, head_dim]`: one fused kernel.
    pub fn append_rotated(&self, qkv: &Tensor, rope: &Rope, at: &Position, q_heads: usize) -> Result<Tensor> {
        self.check_room(qkv.dim(0)?, rope, at)?;
        Ok(tpinfer_kernels::rotary_qkv(
            &self.kv,
            qkv,
            rope.table(),
            at.tensor(),
            q_heads,
        )?)
    }

    /// [`Self::append_rotated`] with the rotated queries written into `queries` (contiguous,
    /// `[rows, q_heads, d]`'s elements): a decode step's buffer that outlives it. With `norms`,
    /// each query and key head is RMS-normed first (Qwen3's `q_norm` and `k_norm`), in the
    /// same kernel.
    pub fn append_rotated_into(
        &self,
        qkv: &Tensor,
        norms: Option<tpinfer_kernels::HeadNorms>,
        rope: &Rope,
        at: &Position,
        q_heads: usize,
        queries: &Tensor,
    ) -> Result<()> {
        self.check_room(qkv.dim(0)?, rope, at)?;
        Ok(tpinfer_kernels::rotary_qkv_into(
            &self.kv,
            qkv,
            norms,
            rope.table(),
            at.tensor(),
            q_heads,
            queries,
        )?)
    }

    /// [`Self::append_rotated_into`] of the QKV product of one row `x` with the fused weight
    /// `w` (`[(q_heads + 2 · heads) · head_dim, k]`, dense or FP8) and its `bias`, the product
    /// computed by the same kernel: where [`tpinfer_kernels::gemv_on_cuda`] holds for `x` and
    /// `w`, with `x` in 16 bits.
    #[allow(clippy::too_many_arguments)]
    pub fn append_projected_rotated_into(
        &self,
        x: impl Into<tpinfer_kernels::GemvRow>,
        w: tpinfer_kernels::RowWeight,
        bias: Option<&Tensor>,
        rope: &Rope,
        at: &Position,
        q_heads: usize,
        queries: &Tensor,
    ) -> Result<()> {
        self.check_room(1, rope, at)?;
        Ok(tpinfer_kernels::gemv_rotary_qkv_into(
            &self.kv,
            x,
            w,
            bias,
            rope.table(),
            at.tensor(),
            q_heads,
            queries,
        )?)
    }

    fn check_room(&self, rows: usize, rope: &Rope, at: &Position) -> Result<()> {
        // The rope table covers the positions the cache was sized for, or more.
        let needed = at.value() + rows;
        let capacity = self.capacity().min(rope.max_positions());
        match needed > capacity {
            true => Err(Error::CacheFull { needed, capacity }),
            false => Ok(()),
        }
    }

    /// Views of the keys and values of the first `len` positions, `[1, heads, len, head_dim]`.
    pub fn filled(&self, len: usize) -> Result<(Tensor, Tensor)> {
        let part = |i: usize| self.kv.narrow(0, i, 1)?.narrow(2, 0, len);
        Ok((part(0)?, part(1)?))
    }

    /// Views of the keys and values over the full capacity, `[capacity, heads, head_dim]`
    /// (token-major, no copies), for attention that reads the filled length at run time.
    pub fn slots(&self) -> Result<(Tensor, Tensor)> {
        let part = |i: usize| self.kv.get(i)?.transpose(0, 1);
        Ok((part(0)?, part(1)?))
    }
}
