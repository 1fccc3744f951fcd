//! A continuous-batching step over a paged KV cache `pool` `[2, slots, kv_heads, d]` (keys,
//! then values; one token-major row per slot): rotary embedding fused with the write of every
//! row's key and value into its own slot, and the decode attention of many sequences, each
//! over the blocks of its own table, in one launch each. They replace the gather of every
//! sequence's keys into a padded f32 copy per layer, which cost a step a millisecond per
//! sequence, and some forty small launches per layer.

use std::sync::Mutex;

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};

/// The rows of a batched step: row `r` of the QKV projection is at position `positions[r]`,
/// and its key and value go to pool slot `slots[r]` (`[rows]` u32 each).
#[derive(Debug, Clone, Copy)]
pub struct RowsAt<'a> {
    pub positions: &'a Tensor,
    pub slots: &'a Tensor,
}

/// The decode rows of a batched step: sequence `i` has its query at row `q_rows[i]` and its
/// keys at positions `0..lens[i]`, position `p` in slot `tables[i, p / block_size] ·
/// block_size + p % block_size` (`q_rows`, `lens` `[n]` u32, `tables` `[n, max_blocks]` u32).
/// On CUDA the block size is a power of two.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRows<'a> {
    pub q_rows: &'a Tensor,
    pub tables: &'a Tensor,
    pub lens: &'a Tensor,
    pub block_size: usize,
    pub groups: QueryGroups,
}

/// Which KV head each query head reads: local query head `h` reads local KV head `(h +
/// offset) / group`. A rank's shard of GQA heads may start inside a group (`offset <
/// group`), when the query heads do not split evenly over the ranks by whole groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryGroups {
    pub group: usize,
    pub offset: usize,
}

impl QueryGroups {
    /// The KV head of query head `h`.
    pub fn kv_head(&self, h: usize) -> usize {
        (h + self.offset) / self.group
    }
}

/// The sizes both ops check their tensors against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Slots of the pool.
    pub slots: usize,
}

impl Sizes {
    fn of_pool(pool: &Tensor, q_heads: usize, like: &Tensor, op: &str) -> Result<Self> {
        let (two, slots, kv_heads, head_dim) = pool.dims4()?;
        if two != 2
            || !pool.is_contiguous()
            || pool.dtype() != like.dtype()
            || !pool.device().same_device(like.device())
        {
            candle_core::bail!(
                "{op}: the pool {:?} {:?} is not a contiguous [2, slots, kv_heads, d] of {:?} beside it",
                pool.dims(),
                pool.dtype(),
                like.dtype()
            );
        }
        Ok(Self {
            q_heads,
            kv_heads,
            head_dim,
            slots,
        })
    }
}

/// Checks that `t` is a contiguous u32 tensor of `dims` on `like`'s device.
fn check_index(t: &Tensor, dims: &[usize], like: &Tensor, op: &str, name: &str) -> Result<()> {
    if t.dtype() != DType::U32 || t.dims() != dims || !t.is_contiguous() || !t.device().same_device(like.device()) {
        candle_core::bail!(
            "{op}: {name} must be a contiguous u32 {dims:?} on {:?}, got {:?} {:?}",
            like.device().location(),
            t.dtype(),
            t.dims()
        );
    }
    Ok(())
}

/// The query heads of `qkv` `[rows, (q_heads + 2 · kv_heads) · d]` rotated for each row's
/// position, `[rows, q_heads, d]`, after writing each row's rotated key heads and value heads
/// into `pool` at its slot. `table` `[2, positions, d / 2]` (cos, then sin) in `qkv`'s dtype.
/// f32 arithmetic, one rounding, the same bits as [`crate::rotary_qkv`]. The caller checks
/// the positions and slots (CPU tensors are checked again; the CUDA kernel skips rows outside
/// the table or the pool).
pub fn rotary_qkv_paged(
    pool: &Tensor,
    qkv: &Tensor,
    table: &Tensor,
    rows: RowsAt<'_>,
    q_heads: usize,
) -> Result<Tensor> {
    const OP: &str = "rotary_qkv_paged";
    let s = Sizes::of_pool(pool, q_heads, qkv, OP)?;
    let (n, width) = qkv.dims2()?;
    let (two, positions, half) = table.dims3()?;
    if two != 2
        || 2 * half != s.head_dim
        || width != (q_heads + 2 * s.kv_heads) * s.head_dim
        || table.dtype() != qkv.dtype()
    {
        candle_core::bail!(
            "{OP}: qkv {:?} is not [rows, ({q_heads} + 2 · {}) · {}], or the table {:?} {:?} is not [2, positions, {}]",
            qkv.dims(),
            s.kv_heads,
            s.head_dim,
            table.dims(),
            table.dtype(),
            s.head_dim / 2
        );
    }
    if n == 0 {
        candle_core::bail!("{OP}: no rows");
    }
    check_index(rows.positions, &[n], qkv, OP, "positions")?;
    check_index(rows.slots, &[n], qkv, OP, "slots")?;
    let (qkv, table) = (qkv.contiguous()?, table.contiguous()?);
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        let queries = crate::empty(&[n, q_heads, s.head_dim], qkv.dtype(), qkv.device())?;
        cuda::rotary_qkv_paged(pool, &qkv, &table, rows, &queries, s, positions)?;
        return Ok(queries);
    }
    let op = RotaryPaged {
        sizes: s,
        table_positions: positions,
        positions: rows.positions.to_vec1()?,
        slots: rows.slots.to_vec1()?,
        queries: Mutex::new(None),
    };
    pool.inplace_op3(&qkv, &table, &op)?;
    let queries = op
        .queries
        .into_inner()
        .map_err(|_| candle_core::Error::Msg(format!("{OP}: the queries' lock is poisoned")))?
        .ok_or_else(|| candle_core::Error::Msg(format!("{OP}: no queries came out")))?;
    Ok(Tensor::from_storage(
        Storage::Cpu(queries),
        (n, q_heads, s.head_dim),
        BackpropOp::none(),
        false,
    ))
}

/// The CPU twin: writes the pool in place and keeps the queries for [`rotary_qkv_paged`].
struct RotaryPaged {
    sizes: Sizes,
    table_positions: usize,
    positions: Vec<u32>,
    slots: Vec<u32>,
    queries: Mutex<Option<CpuStorage>>,
}

impl candle_core::InplaceOp3 for RotaryPaged {
    fn name(&self) -> &'static str {
        "rotary_qkv_paged"
    }

    fn cpu_fwd(
        &self,
        pool: &mut CpuStorage,
        pl: &Layout,
        qkv: &CpuStorage,
        ql: &Layout,
        table: &CpuStorage,
        tl: &Layout,
    ) -> Result<()> {
        let geometry = crate::cpu::PagedRows {
            sizes: self.sizes,
            table_positions: self.table_positions,
            positions: &self.positions,
            at: &self.slots,
        };
        let queries = crate::cpu::rotary_qkv_paged((pool, pl), (qkv, ql), (table, tl), &geometry)?;
        *self
            .queries
            .lock()
            .map_err(|_| candle_core::Error::Msg("rotary_qkv_paged: the queries' lock is poisoned".into()))? =
            Some(queries);
        Ok(())
    }
}

/// Head sizes the CUDA [`paged_decode_attention`] kernel is compiled for.
pub const PAGED_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Attention of each decode row's query (rows of `q` `[rows, q_heads, d]`) over its own
/// sequence's keys and values in `pool`, `[n, q_heads, d]`: softmax of the scores scaled by
/// `scale`, in f32, rounded once. Slots past a sequence's length are never read. On CUDA the
/// head size must be one of [`PAGED_HEAD_DIMS`].
pub fn paged_decode_attention(q: &Tensor, pool: &Tensor, decode: DecodeRows<'_>, scale: f64) -> Result<Tensor> {
    const OP: &str = "paged_decode_attention";
    let (rows, q_heads, d) = q.dims3()?;
    let s = Sizes::of_pool(pool, q_heads, q, OP)?;
    let n = decode.q_rows.elem_count();
    let max_blocks = decode.tables.dims().get(1).copied().unwrap_or(0);
    if n == 0 || q_heads == 0 || d != s.head_dim || !q.is_contiguous() || decode.block_size == 0 {
        candle_core::bail!(
            "{OP}: q {:?} must be contiguous with a head or more of the pool's size {}, with a decode row and blocks of a slot or more",
            q.dims(),
            s.head_dim
        );
    }
    check_index(decode.q_rows, &[n], q, OP, "q_rows")?;
    check_index(decode.tables, &[n, max_blocks], q, OP, "tables")?;
    check_index(decode.lens, &[n], q, OP, "lens")?;
    let g = decode.groups;
    if g.group == 0 || g.offset >= g.group || g.kv_head(q_heads - 1) >= s.kv_heads {
        candle_core::bail!(
            "{OP}: {q_heads} query heads in groups of {} from offset {} do not map onto {} KV heads",
            g.group,
            g.offset,
            s.kv_heads
        );
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        let out = crate::empty(&[n, q_heads, d], q.dtype(), q.device())?;
        cuda::paged_decode_attention(q, pool, decode, &out, (s, max_blocks), scale)?;
        return Ok(out);
    }
    let op = PagedAttention {
        sizes: s,
        rows,
        max_blocks,
        scale,
        decode,
    };
    let out = q.apply_op2_no_bwd(pool, &op)?;
    Ok(out)
}

struct PagedAttention<'a> {
    sizes: Sizes,
    /// Rows of q.
    rows: usize,
    max_blocks: usize,
    scale: f64,
    decode: DecodeRows<'a>,
}

impl candle_core::CustomOp2 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "paged_decode_attention"
    }

    fn cpu_fwd(&self, q: &CpuStorage, ql: &Layout, pool: &CpuStorage, pl: &Layout) -> Result<(CpuStorage, Shape)> {
        let s = &self.sizes;
        let d = self.decode;
        let (q_rows, lens): (Vec<u32>, Vec<u32>) = (d.q_rows.to_vec1()?, d.lens.to_vec1()?);
        let tables: Vec<u32> = d.tables.flatten_all()?.to_vec1()?;
        // Every slot a sequence reads must lie in its table and the pool.
        for (i, (&row, &len)) in q_rows.iter().zip(&lens).enumerate() {
            let table = &tables[i * self.max_blocks..(i + 1) * self.max_blocks];
            let blocks = (len as usize).div_ceil(d.block_size);
            if row as usize >= self.rows
                || blocks > self.max_blocks
                || table[..blocks]
                    .iter()
                    .any(|&b| (b as usize + 1) * d.block_size > s.slots)
            {
                candle_core::bail!(
                    "paged_decode_attention: sequence {i} (row {row}, {len} keys) reaches past q's {} rows, its table \
                     or the pool's {} slots",
                    self.rows,
                    s.slots
                );
            }
        }
        let out = crate::cpu::paged_decode_attention(
            (q, ql),
            (pool, pl),
            &crate::cpu::PagedDecode {
                sizes: *s,
                block_size: d.block_size,
                max_blocks: self.max_blocks,
                q_rows: &q_rows,
                tables: &tables,
                lens: &lens,
                groups: d.groups,
            },
            self.scale as f32,
        )?;
        Ok((out, Shape::from((q_rows.len(), s.q_heads, s.head_dim))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute as Attr;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Result, Tensor};

    use super::{DecodeRows, RowsAt, Sizes, PAGED_HEAD_DIMS};
    use crate::launch::{addresses, device_address, elementwise, suffix};

    /// Threads per CTA of the attention kernel (WARPS · 32 in cuda/paged.cu).
    const ATTENTION_THREADS: u32 = 128;
    /// The largest GQA group the attention kernel is instantiated for.
    const MAX_GROUP: usize = 8;
    /// The CTAs the attention aims for, and the most slices a sequence's keys split into.
    const TARGET_CTAS: usize = 2048;
    const MAX_SPLITS: usize = 64;
    /// The fewest sequences, the largest group and the longest head row (bytes) that take the
    /// streamed kernel.
    const STREAM_SEQUENCES: usize = 8;
    const STREAM_GROUP: usize = 4;
    const STREAM_ROW_BYTES: usize = 512;
    /// Head sizes the tensor-core kernel is instantiated for (16-bit K and V).
    const MMA_HEAD_DIMS: [usize; 2] = [64, 128];
    /// The streamed kernel's dynamic shared memory (cuda/paged.cu): three stages of 8 KiB of
    /// K and 8 KiB of V, and 256 block-table entries.
    const PAGED_STREAM_SMEM: u32 = 3 * 16 * 1024 + 256 * 4;

    pub(super) fn rotary_qkv_paged(
        pool: &Tensor,
        qkv: &Tensor,
        table: &Tensor,
        rows: RowsAt<'_>,
        queries: &Tensor,
        s: Sizes,
        table_positions: usize,
    ) -> Result<()> {
        let candle_core::Device::Cuda(dev) = qkv.device() else {
            candle_core::bail!("rotary_qkv_paged: not a CUDA tensor");
        };
        let n = qkv.dim(0)?;
        let func = crate::module::PAGED.kernel(dev, &format!("rotary_qkv_paged_{}", suffix(qkv.dtype())?))?;
        let addresses = addresses(&[qkv, table, queries, pool, rows.positions, rows.slots])?;
        let mut b = func.builder();
        for a in &addresses {
            b.arg(a);
        }
        let ints = [n, s.q_heads, s.kv_heads, s.head_dim, table_positions].map(|v| v as i32);
        for v in &ints {
            b.arg(v);
        }
        let slots = s.slots as i64;
        b.arg(&slots);
        // SAFETY: the arguments match the kernel's signature; rotary_qkv_paged checked that
        // qkv, the table, the pool, the positions and the slots are contiguous and shaped as
        // the kernel reads them, and `queries` holds rows · q_heads · d elements; the kernel
        // skips rows whose position or slot lies outside the table or the pool.
        unsafe { b.launch(elementwise(n * (s.q_heads + s.kv_heads) * s.head_dim / 2)) }.w()?;
        Ok(())
    }

    pub(super) fn paged_decode_attention(
        q: &Tensor,
        pool: &Tensor,
        decode: DecodeRows<'_>,
        out: &Tensor,
        (s, max_blocks): (Sizes, usize),
        scale: f64,
    ) -> Result<()> {
        const OP: &str = "paged_decode_attention";
        if !PAGED_HEAD_DIMS.contains(&s.head_dim) {
            candle_core::bail!(
                "{OP}: head size {} has no CUDA kernel (compiled for {PAGED_HEAD_DIMS:?})",
                s.head_dim
            );
        }
        if !decode.block_size.is_power_of_two() {
            candle_core::bail!(
                "{OP}: blocks of {} slots; the CUDA kernel takes a power of two",
                decode.block_size
            );
        }
        let groups = decode.groups;
        // The kernel instantiated for the smallest power of two that holds a group.
        let padded = groups.group.next_power_of_two();
        if padded > MAX_GROUP {
            candle_core::bail!(
                "{OP}: GQA groups of {} query heads; the CUDA kernel takes at most {MAX_GROUP}",
                groups.group
            );
        }
        // Each lane loads its columns of a head in one vector load: heads start aligned.
        if [q, pool].iter().any(|t| t.layout().start_offset() % s.head_dim != 0) {
            candle_core::bail!("{OP}: q and the pool must start on a head's boundary");
        }
        let candle_core::Device::Cuda(dev) = q.device() else {
            candle_core::bail!("{OP}: not a CUDA tensor");
        };
        let n = decode.q_rows.elem_count();
        // Up to TARGET_CTAS CTAs, some 8 per SM of an H100/H200 (fewer as sequences are too
        // short to fill their slices): each sequence's keys split into `splits` slices, so that
        // no CTA waits long on another's share. The grid does not depend on the lengths.
        let splits = TARGET_CTAS.div_ceil(n * s.kv_heads).clamp(1, MAX_SPLITS);
        let dtype = suffix(q.dtype())?;
        // On tensor cores in 16 bits (heads of 64 and 128); else the streamed kernel where it
        // is the faster: enough sequences that each CTA's slice fills its pipeline, and groups of
        // up to 4 (whose state leaves room for four CTAs an SM). benches/RESULTS.md has their
        // times.
        let tensor_cores = matches!(q.dtype(), DType::BF16 | DType::F16) && MMA_HEAD_DIMS.contains(&s.head_dim);
        let streamed = n >= STREAM_SEQUENCES
            && padded <= STREAM_GROUP
            && s.head_dim * q.dtype().size_in_bytes() <= STREAM_ROW_BYTES;
        let name = match (tensor_cores, streamed) {
            (true, _) => "paged_mma",
            (false, true) => "paged_stream",
            (false, false) => "paged_split",
        };
        let attention = crate::module::PAGED.kernel(dev, &format!("{name}_{dtype}_d{}_g{padded}", s.head_dim))?;
        let (stages, smem) = match (tensor_cores, streamed) {
            (true, _) => {
                let element_bytes = q.dtype().size_in_bytes();
                let (stages, bytes) = crate::cuda::decode_ring(
                    dev,
                    &attention,
                    (ATTENTION_THREADS as usize / 32, s.head_dim),
                    element_bytes,
                    2,
                )?;
                (Some(stages), bytes as u32)
            }
            (false, true) => {
                attention
                    .set_attribute(
                        Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        PAGED_STREAM_SMEM as i32,
                    )
                    .w()?;
                (None, PAGED_STREAM_SMEM)
            }
            (false, false) => (None, 0),
        };
        // Each split's output rows, then its max and sum; none when every sequence is one slice.
        let partials = match splits {
            1 => None,
            _ => {
                let heads = n * s.q_heads * splits;
                Some((
                    crate::empty(&[heads, s.head_dim], DType::F32, q.device())?,
                    crate::empty(&[heads, 2], DType::F32, q.device())?,
                ))
            }
        };
        let (part_o, part_ml) = match &partials {
            Some((o, ml)) => (device_address(o)?, device_address(ml)?),
            None => (0, 0),
        };
        let tensors = addresses(&[q, decode.q_rows, pool, decode.tables, decode.lens])?;
        let mut b = attention.builder();
        for a in &tensors {
            b.arg(a);
        }
        let out_address = device_address(out)?;
        b.arg(&part_o).arg(&part_ml).arg(&out_address);
        let ints = [
            s.q_heads,
            s.kv_heads,
            groups.group,
            groups.offset,
            max_blocks,
            decode.block_size.trailing_zeros() as usize,
        ]
        .map(|v| v as i32);
        for v in &ints {
            b.arg(v);
        }
        let slots = s.slots as i64;
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        b.arg(&slots).arg(&scale_log2);
        if let Some(stages) = &stages {
            b.arg(stages);
        }
        let cfg = LaunchConfig {
            grid_dim: (s.kv_heads as u32, n as u32, splits as u32),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: the arguments match the kernel's signature; paged_decode_attention checked
        // the shapes, dtypes and contiguity of q, the pool, the index tensors and the output
        // (n · q_heads · d elements, each written once), and that the groups map every query
        // head onto a KV head. The slots the kernel reads are the sequences' tables' (the
        // scheduler's blocks, inside the pool); the partials hold n · q_heads · splits rows;
        // the tensor-core kernel's dynamic shared memory holds `stages` tiles a warp.
        unsafe { b.launch(cfg) }.w()?;
        if partials.is_none() {
            return Ok(());
        }
        let merge = crate::module::PAGED.kernel(dev, &format!("merge_slices_{dtype}_d{}", s.head_dim))?;
        let lens = device_address(decode.lens)?;
        let (heads, splits) = (s.q_heads as i32, splits as i32);
        let mut b = merge.builder();
        b.arg(&part_o)
            .arg(&part_ml)
            .arg(&lens)
            .arg(&out_address)
            .arg(&heads)
            .arg(&splits);
        let cfg = LaunchConfig {
            grid_dim: (s.q_heads as u32, n as u32, 1),
            block_dim: (s.head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; the partials were written above
        // for every sequence with several slices (the same split of the same lengths).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}
