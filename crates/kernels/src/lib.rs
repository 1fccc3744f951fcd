//! Fused CUDA kernels behind candle custom ops, for the hot paths candle's own kernels leave
//! unfused: flash attention (FlashAttention-2's scheme, and on Hopper the same on warpgroup
//! tensor-core instructions), which the video DiT needs at tens of thousands of tokens and
//! which never writes a score matrix to memory; a linear layer's bias and GELU in cuBLASLt's
//! GEMM epilogue; one-pass row-wise ops
//! (modulated LayerNorm, gated residual, the sums and scales of a sharded RMSNorm, a gated
//! MLP's SiLU product), which candle would run as chains of casts and broadcasts; rotary
//! embedding fused with the KV-cache write, which keeps a decode step's launches few; the
//! one-row weight product of a decode step, bound by reading the weight; and the step's
//! embedding lookup and greedy argmax, one kernel or two where candle runs ten or one CTA.
//!
//! Every op also runs on CPU tensors, in one pass that allocates only its output as the CUDA
//! kernel does, so that CPU ranks run (and the tests check) the same memory behaviour.

mod argmax;
mod attention_fp8;
mod chain;
mod channel_norm;
mod conv;
mod cpu;
#[cfg(feature = "cuda")]
mod cudnn;
mod fp8;
mod frames;
mod gemv;
mod ggml;
#[cfg(feature = "cuda")]
pub mod graph;
mod hold;
#[cfg(feature = "cuda")]
mod launch;
mod linear;
#[cfg(feature = "cuda")]
mod module;
mod paged;
#[cfg(feature = "cuda")]
pub mod peer_all_reduce;
mod pool;
mod position;
mod readback;
mod rotary;
mod rowwise;
mod sample;

pub use argmax::argmax;
pub use attention_fp8::{
    flash_attention_fp8, flash_attention_fp8_bytes, flash_attention_fp8_mma, flash_attention_fp8_supported,
    fp8_attention_kernel, Fp8AttentionKernel,
};
pub use chain::chained;
#[cfg(feature = "timeline")]
pub use chain::{trace_launches, trace_step, trace_to, TracedLaunch};
pub use channel_norm::channel_rms_norm;
pub use conv::{conv_filter, conv_frames_bias, conv_path, cudnn_version, cudnn_workspace_bound, ConvPath};
pub use fp8::{
    expand as expand_fp8, fp8_kernels_take, fp8_linear, fp8_linear_into, fp8_linear_of_silu_mul, fp8_path,
    fp8_tensor_cores, fp8_tensor_cores_on, Fp8Path,
};

pub use frames::{cat_frames, packed_frames, upsample_nearest2x, write_frames};
pub use gemv::{
    gemv, gemv_16_bit_on_cuda, gemv_gate_up_silu, gemv_gate_up_silu_into, gemv_gate_up_silu_on_cuda, gemv_into,
    gemv_on_cuda, gemv_residual_into, gemv_residual_squares, gemv_rotary_qkv_into, gemv_rotary_qkv_paged_into,
    gemv_tiled, GemvRow, ResidualNorm, RowWeight, GEMV_TILES,
};
pub use ggml::{mmvq_covers, mmvq_row_into, mmvq_takes, q8_1_row, q8_1_row_bytes, quantize_row_q8_1};
pub use hold::SmHold;
#[cfg(feature = "cuda")]
pub use launch::device_address;
pub use linear::{
    empty, fused_linear_covers, fused_linear_runs, fused_linear_workspace, linear_bias, linear_bias_into,
};
pub use paged::{paged_decode_attention, rotary_qkv_paged, DecodeRows, QueryGroups, RowsAt, PAGED_HEAD_DIMS};
pub use pool::PoolHold;
pub use position::write_u32s;
pub use readback::U32Readback;
pub use rotary::{rotary_qkv, rotary_qkv_into, HeadNorms};
pub use rowwise::{
    add_rms_norm, add_rms_norm_into, embed_owned_rows, gated_residual, gelu_tanh_mul, layer_norm, residual_sum,
    row_sum_squares, scale_rows_cols, silu_mul, silu_mul_into, softmax_relative_bias, sum_in_order, ColumnTable,
};
pub use sample::{sample_rows, RowSampling};

use candle_core::{DType, Device, Result, Tensor};

/// The oldest GPUs the CUDA kernels run on: their tensor-core products, `ldmatrix` and
/// `cp.async` need Ampere (compute capability 8.0) or newer.
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Whether the CUDA flash-attention kernel is compiled for `dtype` and `head_dim`: bf16 or
/// f16, head size 64 or 128. Device-free, so that memory plans can ask it too.
pub fn cuda_flash_attention_covers(dtype: DType, head_dim: usize) -> bool {
    matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128)
}

/// Whether [`flash_attention`] runs for queries like `q` (`[len, heads, head_dim]`): any
/// float CPU tensor; on CUDA (a build with the `cuda` feature), bf16 or f16 with a head size
/// of 64 or 128.
pub fn flash_attention_supported(q: &Tensor) -> bool {
    let float = matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16);
    q.rank() == 3
        && match q.device() {
            Device::Cpu => float,
            Device::Cuda(_) => cfg!(feature = "cuda") && cuda_flash_attention_covers(q.dtype(), q.dims()[2]),
            _ => false,
        }
}

/// Softmax attention of `q` `[q_len, heads, d]` over `k`, `v` `[kv_len, kv_heads, d]`, with
/// scores scaled by `scale`; returns `[q_len, heads, d]` contiguous. Any strides with `d`
/// contiguous are accepted (`[heads, len, d]` tensors transposed work without a copy). Query
/// head `h` reads KV head `h / (heads / kv_heads)` (GQA). With `causal`, the queries are the
/// last `q_len` of `kv_len` positions and each sees the keys up to its own.
///
/// ```no_run
/// # use candle_core::{Device, DType, Tensor};
/// let dev = Device::new_cuda(0)?;
/// let q = Tensor::randn(0f32, 1., (4096, 12, 128), &dev)?.to_dtype(DType::BF16)?;
/// let out = tpinfer_kernels::flash_attention(&q, &q, &q, 128f64.powf(-0.5), false)?;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    attention(q, k, v, scale, causal, None)
}

/// The split-KV decode kernel's working memory: its softmax partials and a merge counter per
/// KV head. A rank owns one and passes it to each cached attention of its model: one set
/// serves every layer and every captured graph of the rank (its kernels run in stream order).
/// Allocated by the first decode that runs eagerly and grown by a larger one; a captured graph
/// keeps its addresses, so it lives as long as the rank's model. CPU ranks take one alike and
/// never allocate it.
#[derive(Default)]
pub struct DecodeScratch {
    #[cfg(feature = "cuda")]
    buffers: std::cell::RefCell<Vec<cuda::ScratchBuffers>>,
}

impl DecodeScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// The most KV heads a rank's decode attention takes: the merge counters of a device.
const MAX_KV_HEADS: usize = 1024;

/// Query heads per KV head the decode kernel handles (MAX_GROUP in cuda/decode_attention.cu).
const DECODE_MAX_GROUP: usize = 8;

/// How many slices the split-KV decode kernel launches for a cache of `capacity` rows over
/// `kv_heads` heads: about 64 CTAs in all, a cluster of 8 per KV head on a rank of 8 KV heads
/// (cuda/decode_attention.cu: a cluster's slices merge in shared memory; more clusters than
/// run at once, 15 at one CTA per SM of an H100, would take a second wave), more per head
/// for fewer heads; fewer for small caches. At most 128, and a whole number of clusters of 8.
fn decode_splits(kv_heads: usize, capacity: usize) -> usize {
    (64 / kv_heads.max(1))
        .min(capacity.div_ceil(128))
        .clamp(1, 128)
        .next_multiple_of(8)
}

/// The device bytes a [`DecodeScratch`] holds after one-row decodes of `q_heads` query heads
/// of `head_dim` over `kv_heads` KV heads in caches of `capacity` rows: each slice's partial
/// output, max and sum, and the merge counters. What a rank's memory plan counts for it.
pub fn decode_scratch_bytes(q_heads: usize, kv_heads: usize, capacity: usize, head_dim: usize) -> usize {
    let partials = q_heads * decode_splits(kv_heads, capacity);
    (partials * head_dim + partials * 2 + MAX_KV_HEADS) * 4
}

/// Causal [`flash_attention`] of the queries at positions `position..position + q_len` over
/// a KV cache's full capacity `k`, `v` `[capacity, kv_heads, d]`, of which the first
/// `position + q_len` slots count. The position (a one-element u32 tensor, see
/// [`write_u32s`]) is read when the kernel runs, so the call's shapes do not depend on it: a
/// decode step captured as a CUDA graph replays at every position. The caller checks that the
/// queries fit the cache; CPU tensors are checked again here. One query on CUDA runs the
/// split-KV decode kernel in `scratch`.
pub fn flash_attention_cached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    position: &Tensor,
    scale: f64,
    scratch: &DecodeScratch,
) -> Result<Tensor> {
    position::check(position, q, "flash attention")?;
    if q.device().is_cpu() {
        let (at, queries, slots) = (position::on_host(position)?, q.dim(0)?, k.dim(0)?);
        if at + queries > slots {
            candle_core::bail!("flash attention: {queries} queries at position {at} exceed the cache's {slots} slots");
        }
    }
    attention(q, k, v, scale, true, Some((position.clone(), scratch)))
}

/// [`flash_attention_cached`] of one query row written into `out` (`heads · d` elements,
/// contiguous), as a link of a kernel chain ([`crate::chained`]) where the CUDA decode kernel
/// takes it; elsewhere the output is copied in.
pub fn flash_attention_cached_into(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    position: &Tensor,
    scale: f64,
    scratch: &DecodeScratch,
    out: &Tensor,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        position::check(position, q, "flash attention")?;
        let op = FlashAttention {
            scale,
            causal: true,
            position: Some(position.clone()),
            scratch: Some(scratch),
        };
        if decode_into(&op, (q, k, v), None, out, "flash attention")? {
            return Ok(());
        }
    }
    let y = flash_attention_cached(q, k, v, position, scale, scratch)?;
    out.slice_set(&y.reshape(out.shape())?, 0, 0)
}

/// The split-KV decode kernel of `op` (its position and scratch given) for one query row `q`
/// over `k`, `v`, written into `out`, each key j in row j or, with `blocks` (a block table's
/// address and log2 of its block size), in the row the table gives. False, and nothing run,
/// where the kernel does not take these inputs (`cuda::decode_covers`).
#[cfg(feature = "cuda")]
fn decode_into(
    op: &FlashAttention<'_>,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    blocks: Option<(u64, u32)>,
    out: &Tensor,
    what: &str,
) -> Result<bool> {
    let position = op
        .position
        .as_ref()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: the decode kernel needs a position")))?;
    let (rows, heads, d) = q.dims3()?;
    launch::check_output(out, q.dtype(), heads * d, what)?;
    let into = launch::device_address(out)?;
    let ((qs, ql), (ks, kl), (vs, vl)) = (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout());
    if let (candle_core::Storage::Cuda(qs), candle_core::Storage::Cuda(ks), candle_core::Storage::Cuda(vs)) =
        (&*qs, &*ks, &*vs)
    {
        if rows == 1 && cuda::decode_covers(ql, kl) {
            position::with_device_view(position, |p| {
                cuda::decode(op, p, blocks, (qs, ql), (ks, kl), (vs, vl), Some(into))
            })?;
            return Ok(true);
        }
    }
    Ok(false)
}

/// A lone sequence's paged KV cache, as [`paged_decode_attention_into`] reads it: its key at
/// position `p` in slot `blocks[p / block_size] · block_size + p % block_size` of the pool.
#[derive(Debug, Clone, Copy)]
pub struct PagedSequence<'a> {
    /// The newest position, a one-element u32 tensor (as [`flash_attention_cached`]'s).
    pub position: &'a Tensor,
    /// The sequence's block table, `[blocks]` u32, covering the position.
    pub blocks: &'a Tensor,
    /// A power of two.
    pub block_size: usize,
}

/// Whether [`paged_decode_attention_into`] runs for `q_heads` query heads over `kv_heads` of
/// `head_dim` in `dtype` on CUDA: the split-KV decode kernel's groups (at most 8 query heads
/// a KV head) and head sizes (64, 128). Device-free, so that a model can choose its path.
pub fn paged_decode_attention_into_covers(dtype: DType, q_heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    cuda_flash_attention_covers(dtype, head_dim)
        && kv_heads > 0
        && q_heads.is_multiple_of(kv_heads)
        && q_heads / kv_heads <= DECODE_MAX_GROUP
}

/// [`flash_attention_cached_into`] of a lone sequence's query row `q` `[1, heads, d]` over its
/// keys in a paged pool `[2, slots, kv_heads, d]` ([`rotary_qkv_paged`]'s), written into `out`:
/// the split-KV decode kernel reading each key through the block table, a chain link, its
/// splits in `scratch`. Positions `0..=position` count; the caller has checked that the table
/// covers them. CUDA only, where [`paged_decode_attention_into_covers`] holds; the batched
/// path ([`paged_decode_attention`]) serves everywhere.
pub fn paged_decode_attention_into(
    q: &Tensor,
    pool: &Tensor,
    sequence: PagedSequence<'_>,
    scale: f64,
    scratch: &DecodeScratch,
    out: &Tensor,
) -> Result<()> {
    const OP: &str = "paged decode attention";
    position::check(sequence.position, q, OP)?;
    let (two, _, kv_heads, d) = pool.dims4()?;
    let (rows, heads, q_d) = q.dims3()?;
    let blocks = sequence.blocks;
    if two != 2
        || rows != 1
        || q_d != d
        || !pool.is_contiguous()
        || !sequence.block_size.is_power_of_two()
        || blocks.dtype() != DType::U32
        || blocks.rank() != 1
        || !blocks.is_contiguous()
        || !paged_decode_attention_into_covers(q.dtype(), heads, kv_heads, d)
    {
        candle_core::bail!(
            "{OP}: q {:?} {:?} over the pool {:?} in blocks of {} (table {:?} {:?}) is not one query row of a \
             covered shape over a contiguous [2, slots, kv_heads, d] with a u32 table",
            q.dims(),
            q.dtype(),
            pool.dims(),
            sequence.block_size,
            blocks.dims(),
            blocks.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        let table = (launch::device_address(blocks)?, sequence.block_size.trailing_zeros());
        let op = FlashAttention {
            scale,
            causal: true,
            position: Some(sequence.position.clone()),
            scratch: Some(scratch),
        };
        let (k, v) = (pool.get(0)?, pool.get(1)?);
        if decode_into(&op, (&q.contiguous()?, &k, &v), Some(table), out, OP)? {
            return Ok(());
        }
    }
    let _ = (scale, scratch, out);
    candle_core::bail!("{OP}: runs on CUDA alone, for q on a 16-byte boundary")
}

/// `cached`: the position of the first query in a cache of the keys' full capacity, and the
/// decode kernel's scratch.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    cached: Option<(Tensor, &DecodeScratch)>,
) -> Result<Tensor> {
    let (q_len, heads, d) = q.dims3()?;
    let (kv_len, kv_heads, kd) = k.dims3()?;
    if v.dims() != k.dims() || kd != d || kv_heads == 0 || heads % kv_heads != 0 || kv_len < q_len && causal {
        candle_core::bail!(
            "flash attention: q {:?}, k {:?}, v {:?} do not fit (same head size, heads a multiple of KV heads{})",
            q.dims(),
            k.dims(),
            v.dims(),
            if causal { ", no more queries than keys" } else { "" }
        );
    }
    if !flash_attention_supported(q) {
        candle_core::bail!(
            "flash attention runs on CPU, or on CUDA in bf16/f16 with head size 64 or 128; got {:?} {:?} d={d} on {:?}",
            q.dtype(),
            q.dims(),
            q.device().location()
        );
    }
    if q_len == 0 {
        return q.contiguous();
    }
    let (position, scratch) = cached.unzip();
    q.apply_op3_no_bwd(
        k,
        v,
        &FlashAttention {
            scale,
            causal,
            position,
            scratch,
        },
    )
}

struct FlashAttention<'a> {
    scale: f64,
    causal: bool,
    /// With a cache's full capacity as K and V: the position of the first query.
    position: Option<Tensor>,
    /// Where the decode kernel keeps its partials (cached attention only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scratch: Option<&'a DecodeScratch>,
}

impl candle_core::CustomOp3 for FlashAttention<'_> {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        q: &candle_core::CpuStorage,
        ql: &candle_core::Layout,
        k: &candle_core::CpuStorage,
        kl: &candle_core::Layout,
        v: &candle_core::CpuStorage,
        vl: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let keys = self
            .position
            .as_ref()
            .map(position::on_host)
            .transpose()?
            .map(|p| p + ql.dims()[0]);
        let out = cpu::flash_attention((q, ql), (k, kl), (v, vl), self.scale as f32, self.causal, keys)?;
        Ok((out, ql.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &candle_core::Layout,
        k: &candle_core::CudaStorage,
        kl: &candle_core::Layout,
        v: &candle_core::CudaStorage,
        vl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        match &self.position {
            // One query over a cache: the split-KV decode kernel.
            Some(position) if cuda::decode_covers(ql, kl) => {
                let out = position::with_device_view(position, |p| {
                    cuda::decode(self, p, None, (q, ql), (k, kl), (v, vl), None)
                })?;
                let out = out.ok_or_else(|| candle_core::Error::Msg("decode attention: no output came out".into()))?;
                Ok((out, ql.shape().clone()))
            }
            Some(position) => {
                position::with_device_view(position, |p| cuda::launch(self, Some(p), (q, ql), (k, kl), (v, vl)))
            }
            None => cuda::launch(self, None, (q, ql), (k, kl), (v, vl)),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};
    use half::{bf16, f16};

    use super::FlashAttention;
    use crate::chain::Launch;
    use crate::module::{DECODE_ATTENTION, FLASH_ATTENTION};

    /// Query rows per CTA, 16 per warp (cuda/flash_attention.cu).
    const QUERY_ROWS: usize = 64;

    type Input<'a> = (&'a CudaStorage, &'a Layout);
    type Position<'a, 'b> = Option<&'a CudaView<'b, u32>>;

    pub(crate) fn launch(
        op: &FlashAttention,
        position: Position,
        q: Input,
        k: Input,
        v: Input,
    ) -> Result<(CudaStorage, Shape)> {
        match q.0.dtype() {
            DType::BF16 => launch_typed::<bf16>("bf16", op, position, q, k, v),
            DType::F16 => launch_typed::<f16>("f16", op, position, q, k, v),
            other => candle_core::bail!("flash attention: unsupported dtype {other:?}"),
        }
    }

    /// (row stride, head stride) of a `[len, heads, d]` layout whose last dim is contiguous;
    /// rows are copied in 16-byte pieces, so offsets and strides must be multiples of 8.
    pub(crate) fn strides(layout: &Layout, what: &str) -> Result<(i64, i64)> {
        match layout.stride() {
            [row, head, 1] if (row | head | layout.start_offset()).is_multiple_of(8) => Ok((*row as i64, *head as i64)),
            other => candle_core::bail!(
                "flash attention: {what} needs a contiguous last dim and strides and offset that are multiples of 8, \
                 got strides {other:?} at offset {}",
                layout.start_offset()
            ),
        }
    }

    /// The arguments every attention kernel takes after its tensors: the lengths, the query
    /// heads, the GQA group, the scale in base 2 and the causal flag.
    struct Scalars {
        q_len: i32,
        kv_len: i32,
        heads: i32,
        group: i32,
        scale_log2: f32,
        causal: i32,
    }

    impl Scalars {
        fn new(op: &FlashAttention, q: &Layout, k: &Layout) -> Result<Self> {
            let ((q_len, heads, _), (kv_len, kv_heads, _)) = (q.shape().dims3()?, k.shape().dims3()?);
            Ok(Self {
                q_len: q_len as i32,
                kv_len: kv_len as i32,
                heads: heads as i32,
                group: (heads / kv_heads) as i32,
                scale_log2: (op.scale * std::f64::consts::LOG2_E) as f32,
                causal: op.causal as i32,
            })
        }
    }

    /// Whether the split-KV decode kernel takes `q` over `k`: one query row, a GQA group of at
    /// most [`super::DECODE_MAX_GROUP`], and `q` contiguous on a 16-byte boundary.
    pub(crate) fn decode_covers(ql: &Layout, kl: &Layout) -> bool {
        let (q_len, heads, d) = ql.shape().dims3().unwrap_or((0, 0, 0));
        let kv_heads = kl.shape().dims().get(1).copied().unwrap_or(0);
        q_len == 1
            && kv_heads > 0
            && heads / kv_heads <= super::DECODE_MAX_GROUP
            && ql.is_contiguous()
            && ql.start_offset().is_multiple_of(8)
            && d.is_multiple_of(8)
    }

    /// The split-KV decode kernel, its output written at `into` or into a new buffer. With
    /// `blocks` (a block table's address and log2 of its block size), key j lies in the row
    /// its table gives (decode_split_paged), else in row j.
    pub(crate) fn decode(
        op: &FlashAttention<'_>,
        position: &CudaView<'_, u32>,
        blocks: Option<(u64, u32)>,
        q: Input,
        k: Input,
        v: Input,
        into: Option<u64>,
    ) -> Result<Option<CudaStorage>> {
        match q.0.dtype() {
            DType::BF16 => decode_typed::<bf16>("bf16", op, (position, blocks), q, k, v, into),
            DType::F16 => decode_typed::<f16>("f16", op, (position, blocks), q, k, v, into),
            other => candle_core::bail!("flash attention: unsupported dtype {other:?}"),
        }
    }

    fn decode_typed<T: CudaDType + DeviceRepr>(
        suffix: &str,
        op: &FlashAttention<'_>,
        (position, blocks): (&CudaView<'_, u32>, Option<(u64, u32)>),
        (q, ql): Input,
        (k, kl): Input,
        (v, vl): Input,
        into: Option<u64>,
    ) -> Result<Option<CudaStorage>> {
        let (_, heads, d) = ql.shape().dims3()?;
        let (capacity, kv_heads, _) = kl.shape().dims3()?;
        let ((k_row, k_head), (v_row, v_head)) = (strides(kl, "k")?, strides(vl, "v")?);
        let dev = q.device();
        let stream = dev.cuda_stream();
        let (out, out_address) = match into {
            Some(address) => (None, address),
            None => {
                // SAFETY: the merging CTA of each KV head writes its query heads' rows.
                let out = unsafe { dev.alloc::<T>(heads * d)? };
                let address = out.device_ptr(&stream).0;
                (Some(out), address)
            }
        };
        let group = heads / kv_heads;
        // The kernel instantiated for the smallest power of two that holds the group.
        let padded = group.next_power_of_two();
        let module = DECODE_ATTENTION
            .iter()
            .find(|(g, _)| *g == padded)
            .map(|(_, module)| module);
        let module = module.ok_or_else(|| {
            candle_core::Error::Msg(format!("decode attention: no kernel for a GQA group of {group}"))
        })?;
        let name = match blocks {
            Some(_) => "decode_split_paged",
            None => "decode_split",
        };
        let split = module.kernel(dev, &format!("{name}_{suffix}_d{d}_g{padded}"))?;
        let splits = super::decode_splits(kv_heads, capacity);
        let (stages, ring_bytes) = decode_ring(dev, &split, (d / 32, d), std::mem::size_of::<T>(), 4)?;
        let address = |s: &CudaStorage, l: &Layout| -> Result<u64> {
            Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..).device_ptr(&stream).0)
        };
        let (qs, ks, vs) = (address(q, ql)?, address(k, kl)?, address(v, vl)?);
        let group = group as i32;
        let scale_log2 = (op.scale * std::f64::consts::LOG2_E) as f32;
        let scratch = op
            .scratch
            .ok_or_else(|| candle_core::Error::Msg("decode attention: no scratch was given".into()))?;
        with_decode_scratch(scratch, dev, kv_heads, (heads * splits, d), |scratch| {
            let mut launch = Launch::default();
            launch
                .arg(qs)
                .arg(ks)
                .arg(vs)
                .arg(position.device_ptr(&stream).0)
                .arg(blocks.map_or(0, |(table, _)| table))
                .arg(blocks.map_or(0, |(_, shift)| shift as i32))
                .arg(scratch.part_o.device_ptr(&stream).0)
                .arg(scratch.part_ml.device_ptr(&stream).0)
                .arg(scratch.counters.device_ptr(&stream).0)
                .arg(out_address)
                .arg(group);
            launch
                .arg(k_row)
                .arg(k_head)
                .arg(v_row)
                .arg(v_head)
                .arg(scale_log2)
                .arg(stages);
            // SAFETY: the arguments match the kernel's signature; k and v cover `capacity` rows
            // and the kernel reads at most *position + 1 ≤ capacity of them, or with a block
            // table the rows of its first blocks, which cover them (checked by the caller);
            // the partials hold `heads · splits` rows, the output `heads · d`;
            // a counter per KV head, zero between launches; the dynamic shared memory holds
            // `stages` tiles a warp.
            unsafe {
                launch.launch(
                    dev,
                    &split,
                    LaunchConfig {
                        grid_dim: (splits as u32, kv_heads as u32, 1),
                        block_dim: (d as u32, 1, 1),
                        shared_mem_bytes: ring_bytes as u32,
                    },
                )
            }
        })?;
        Ok(out.map(|out| CudaStorage::wrap_cuda_slice(out, dev.clone())))
    }

    /// The depth of each warp's ring of key tiles in a decode kernel of `warps` warps on tensor
    /// cores (cuda/decode_tile.cuh), at most `deepest` (4 or 2), and the dynamic shared memory
    /// it takes, allowed on `split`: 4 tiles where the device's shared memory per CTA holds them
    /// beside the kernel's own (Hopper, A100), else 2 (Ada's 99 KiB). At 16,384 keys four took
    /// 28.5 µs a launch and two 46.9, Llama-3-8B's shape with one cluster per KV head on one
    /// H100 (benches/archive, 2026-12-05).
    pub(crate) fn decode_ring(
        dev: &candle_core::CudaDevice,
        split: &candle_core::cuda_backend::cudarc::driver::CudaFunction,
        (warps, d): (usize, usize),
        element_bytes: usize,
        deepest: usize,
    ) -> Result<(i32, usize)> {
        use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
        let ring = |stages: usize| warps * stages * 2 * 16 * (d + 8) * element_bytes;
        let own = split
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .w()? as usize;
        let limit = dev
            .cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .w()? as usize;
        let stages = if deepest >= 4 && own + ring(4) <= limit { 4 } else { 2 };
        if own + ring(stages) > limit {
            candle_core::bail!(
                "decode attention: head size {d} takes {} bytes of shared memory a CTA, the device allows {limit}",
                own + ring(stages)
            );
        }
        split
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                ring(stages) as i32,
            )
            .w()?;
        Ok((stages as i32, ring(stages)))
    }

    /// A device's buffers for the decode kernel's splits: the softmax partials and a merge
    /// counter per KV head.
    pub(crate) struct ScratchBuffers {
        device: candle_core::cuda_backend::DeviceId,
        /// Each split's output rows, `heads · splits · d`.
        part_o: CudaSlice<f32>,
        /// Each split's running max and sum, `heads · splits · 2`.
        part_ml: CudaSlice<f32>,
        /// Zero between launches, as every split kernel's last CTA leaves them.
        counters: CudaSlice<u32>,
    }

    /// Runs `launch` with `scratch`'s buffers on `dev`, which hold at least `rows` partials
    /// of `d`, so that a decode step allocates nothing for its splits and its kernels chain.
    /// Allocated, or grown, by a decode that runs eagerly (a capture cannot allocate memory
    /// that outlives it: the first decode step of a model runs before its capture); a grown
    /// set is added beside the old one, whose addresses captured graphs keep.
    fn with_decode_scratch(
        scratch: &super::DecodeScratch,
        dev: &candle_core::CudaDevice,
        kv_heads: usize,
        (rows, d): (usize, usize),
        launch: impl FnOnce(&ScratchBuffers) -> Result<()>,
    ) -> Result<()> {
        if kv_heads > super::MAX_KV_HEADS {
            candle_core::bail!(
                "decode attention: {kv_heads} KV heads on one rank, at most {}",
                super::MAX_KV_HEADS
            );
        }
        let mut all = scratch
            .buffers
            .try_borrow_mut()
            .map_err(|_| candle_core::Error::Msg("decode attention: the scratch is in use by another launch".into()))?;
        // The newest of the device's (a grown one is pushed after the one it replaces).
        if let Some(buffers) = all
            .iter()
            .rev()
            .find(|s| s.device == dev.id() && s.part_o.len() >= rows * d && s.part_ml.len() >= rows * 2)
        {
            return launch(buffers);
        }
        let capturing = dev.cuda_stream().capture_status().w()?;
        if capturing
            != candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        {
            candle_core::bail!("decode attention: a decode step of this shape must run once before a graph capture");
        }
        // SAFETY: the partials are written by each split before its merge reads them.
        let buffers = ScratchBuffers {
            device: dev.id(),
            part_o: unsafe { dev.alloc::<f32>(rows * d)? },
            part_ml: unsafe { dev.alloc::<f32>(rows * 2)? },
            counters: dev.alloc_zeros::<u32>(super::MAX_KV_HEADS)?,
        };
        launch(&buffers)?;
        all.push(buffers);
        Ok(())
    }

    fn launch_typed<T: CudaDType + DeviceRepr>(
        suffix: &str,
        op: &FlashAttention<'_>,
        position: Position,
        (q, ql): Input,
        (k, kl): Input,
        (v, vl): Input,
    ) -> Result<(CudaStorage, Shape)> {
        let (q_len, heads, d) = ql.shape().dims3()?;
        let ((q_row, q_head), (k_row, k_head), (v_row, v_head)) =
            (strides(ql, "q")?, strides(kl, "k")?, strides(vl, "v")?);
        let dev = q.device();
        #[cfg(tpinfer_sm90)]
        if hopper::covers(dev, suffix, d, q_len)? {
            if let Some(done) = hopper::launch(op, position, (q, ql), (k, kl), (v, vl))? {
                return Ok(done);
            }
        }
        let func = FLASH_ATTENTION.kernel(dev, &format!("flash_attention_{suffix}_d{d}"))?;
        let qs = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        // SAFETY: every element is written by the kernel (rows < q_len of every head).
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(q_len * heads * d)? };
        let cfg = LaunchConfig {
            grid_dim: (q_len.div_ceil(QUERY_ROWS) as u32, heads as u32, 1),
            block_dim: (QUERY_ROWS as u32 / 16 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = Scalars::new(op, ql, kl)?;
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&qs).arg(&ks).arg(&vs).arg(&out);
        match position {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(&n.q_len).arg(&n.kv_len).arg(&n.heads).arg(&n.group);
        b.arg(&q_row)
            .arg(&q_head)
            .arg(&k_row)
            .arg(&k_head)
            .arg(&v_row)
            .arg(&v_head);
        b.arg(&n.scale_log2).arg(&n.causal);
        // SAFETY: the argument list matches the kernel's signature; all pointers cover the
        // rows and heads the strides address.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((q_len, heads, d)),
        ))
    }

    /// The Hopper kernel (cuda/flash_attention_sm90.cu), built for compute capability 9.0 only.
    #[cfg(tpinfer_sm90)]
    pub(crate) mod hopper {
        use std::ffi::c_void;
        use std::mem::MaybeUninit;

        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::sys::{self, CUfunction_attribute_enum as Attr};
        use candle_core::cuda_backend::cudarc::driver::{
            CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
        };
        use candle_core::cuda_backend::WrapErr;
        use candle_core::{CudaStorage, Result, Shape};
        use half::bf16;

        use super::{strides, FlashAttention, Input, Position, Scalars};

        /// Query rows per CTA: two consumer warpgroups of 64.
        const QUERY_ROWS: usize = 128;
        /// A producer warpgroup and the two consumers.
        const THREADS: u32 = 3 * 128;
        /// Dynamic shared memory: 1 KiB to align the swizzle atoms, four stages of a K and a V
        /// tile (64 keys × 128 values of 2 bytes), the consumers' query staging (64 rows of
        /// 136 values each), eight mbarriers.
        const SMEM_BYTES: u32 = 1024 + 4 * 2 * 64 * 128 * 2 + 2 * 64 * 136 * 2 + 8 * 8;

        /// Whether the Hopper kernel runs this launch: an sm_90 GPU, bf16, head size 128 and at
        /// least one warpgroup's worth of queries (a decode step's single row stays on the
        /// mma.sync kernel, whose CTAs are a quarter as tall).
        pub(super) fn covers(dev: &candle_core::CudaDevice, suffix: &str, d: usize, q_len: usize) -> Result<bool> {
            Ok(suffix == "bf16"
                && d == 128
                && q_len >= 64
                && dev.cuda_stream().context().compute_capability().w()? == (9, 0))
        }

        /// A TMA operand of the Hopper kernels: a 3-D tensor map the driver encoded
        /// ([`TensorMap::kv`] for bf16 K or V, [`TensorMap::tiled`] in general).
        #[repr(transparent)]
        pub(crate) struct TensorMap(sys::CUtensorMap);

        // SAFETY: the kernel takes the map by value (__grid_constant__); it is plain bytes with
        // the alignment CUDA's own CUtensorMap declares.
        unsafe impl DeviceRepr for TensorMap {}

        impl TensorMap {
            /// K or V over (d, rows, KV heads), innermost first, copied in boxes of 64 × 64 × 1
            /// into 128-byte-swizzled shared memory; rows past `rows` arrive as zeros. `None`
            /// for a layout the driver will not map (no rows, or strides it rejects, such as a
            /// broadcast's zero); the launcher's stride check makes them multiples of 16 bytes.
            fn kv(base: sys::CUdeviceptr, rows: usize, kv_heads: usize, (row, head): (i64, i64)) -> Option<Self> {
                Self::tiled(
                    base,
                    sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                    [128, rows as u64, kv_heads as u64],
                    [row as u64 * 2, head as u64 * 2],
                    [64, 64, 1],
                    sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                )
            }

            /// A 3-D map (dims innermost first, the outer two strides in bytes) copied in
            /// `boxes` into shared memory swizzled by `swizzle`; out-of-range elements arrive as
            /// zeros. The caller makes `base` and the strides multiples of 16 bytes, as TMA needs.
            pub(crate) fn tiled(
                base: sys::CUdeviceptr,
                data_type: sys::CUtensorMapDataType,
                dims: [u64; 3],
                byte_strides: [u64; 2],
                boxes: [u32; 3],
                swizzle: sys::CUtensorMapSwizzle,
            ) -> Option<Self> {
                let element_strides = [1u32; 3];
                let mut map = MaybeUninit::<sys::CUtensorMap>::uninit();
                // SAFETY: every array holds `rank` (or rank − 1 strides) entries; the map is
                // read only if the driver filled it.
                unsafe {
                    sys::cuTensorMapEncodeTiled(
                        map.as_mut_ptr(),
                        data_type,
                        3,
                        base as *mut c_void,
                        dims.as_ptr(),
                        byte_strides.as_ptr(),
                        boxes.as_ptr(),
                        element_strides.as_ptr(),
                        sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzle,
                        sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                    )
                    .result()
                    .ok()?;
                    Some(Self(map.assume_init()))
                }
            }
        }

        /// The launch, or `None` when K or V cannot be mapped (the mma.sync kernel takes it).
        pub(super) fn launch(
            op: &FlashAttention,
            position: Position,
            (q, ql): Input,
            (k, kl): Input,
            (v, vl): Input,
        ) -> Result<Option<(CudaStorage, Shape)>> {
            let (q_len, heads, d) = ql.shape().dims3()?;
            let (kv_len, kv_heads, _) = kl.shape().dims3()?;
            let (q_row, q_head) = strides(ql, "q")?;
            let dev = q.device();
            let func = crate::module::FLASH_ATTENTION_SM90.kernel(dev, "flash_attention_sm90_bf16_d128")?;
            func.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM_BYTES as i32)
                .w()?;
            let stream = dev.cuda_stream();
            let qs = q.as_cuda_slice::<bf16>()?.slice(ql.start_offset()..);
            let ks = k.as_cuda_slice::<bf16>()?.slice(kl.start_offset()..);
            let vs = v.as_cuda_slice::<bf16>()?.slice(vl.start_offset()..);
            // The guards order K's and V's reads after their writers and before later writers,
            // as passing the slices themselves would.
            let ((k_ptr, _k_guard), (v_ptr, _v_guard)) = (ks.device_ptr(&stream), vs.device_ptr(&stream));
            let maps = match kv_len {
                0 => None,
                _ => TensorMap::kv(k_ptr, kv_len, kv_heads, strides(kl, "k")?).zip(TensorMap::kv(
                    v_ptr,
                    kv_len,
                    kv_heads,
                    strides(vl, "v")?,
                )),
            };
            let Some((k_map, v_map)) = maps else {
                return Ok(None);
            };
            // SAFETY: every element is written by the kernel (rows < q_len of every head).
            let out: CudaSlice<bf16> = unsafe { dev.alloc::<bf16>(q_len * heads * d)? };
            let n = Scalars::new(op, ql, kl)?;
            let null = 0u64;
            let mut b = func.builder();
            b.arg(&k_map).arg(&v_map).arg(&qs).arg(&out);
            match position {
                Some(p) => b.arg(p),
                None => b.arg(&null),
            };
            b.arg(&n.q_len).arg(&n.kv_len).arg(&n.heads).arg(&n.group);
            b.arg(&q_row).arg(&q_head).arg(&n.scale_log2).arg(&n.causal);
            let cfg = LaunchConfig {
                grid_dim: (q_len.div_ceil(QUERY_ROWS) as u32, heads as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: SMEM_BYTES,
            };
            // SAFETY: the argument list matches the kernel's signature; the maps span the
            // `kv_len` rows of every KV head that the strides address.
            unsafe { b.launch(cfg) }.w()?;
            Ok(Some((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from((q_len, heads, d)),
            )))
        }
    }
}
