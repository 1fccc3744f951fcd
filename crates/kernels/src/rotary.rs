//! Rotary position embedding (the Hugging Face layout: each head's two halves rotate together)
//! fused with the split of a QKV projection and the KV-cache write: the queries come out
//! rotated and contiguous, the rotated keys and the values go straight into the cache. One
//! launch where candle needs seven (a copy of each head slice, two rotations, two writes).
//!
//! `qkv` is `[rows, (q_heads + 2 · kv_heads) · d]`, contiguous, row `r` at position
//! `position + r`; `table` is `[2, positions, d / 2]` (cos, then sin) in `qkv`'s dtype.
//! f32 arithmetic, one rounding. The position is a one-element u32 tensor that the kernels read
//! at run time (see [`crate::position`]); the caller checks that the rows fit the table and
//! the cache at that position (CPU twins check it again; CUDA kernels skip rows that do not).

use std::sync::Mutex;

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, Layout, Result, Storage, Tensor};

/// The shapes one rotary launch works on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub rows: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The positions the table covers.
    pub positions: usize,
}

impl Geometry {
    fn of(qkv: &Tensor, table: &Tensor, position: &Tensor, q_heads: usize, kv_heads: usize) -> Result<Self> {
        crate::position::check(position, qkv, "rotary")?;
        let (rows, width) = qkv.dims2()?;
        let (two, positions, half) = table.dims3()?;
        let head_dim = 2 * half;
        if two != 2 || width != (q_heads + 2 * kv_heads) * head_dim || rows > positions {
            candle_core::bail!(
                "rotary: qkv {:?} is not [rows, ({q_heads} + 2 · {kv_heads}) · d], or the table {:?} is not \
                 [2, positions ≥ {}, d / 2]",
                qkv.dims(),
                table.dims(),
                rows
            );
        }
        if qkv.dtype() != table.dtype() {
            candle_core::bail!("rotary: qkv is {:?} but the table {:?}", qkv.dtype(), table.dtype());
        }
        Ok(Self {
            rows,
            q_heads,
            kv_heads,
            head_dim,
            positions,
        })
    }

    pub fn width(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// The query heads of `qkv` rotated for positions `position..`, `[rows, q_heads, d]`, after
/// writing the rotated key heads and the value heads into `cache` `[2, kv_heads, capacity, d]`
/// (keys, then values; contiguous) at slots `position..position + rows`.
pub fn rotary_qkv(cache: &Tensor, qkv: &Tensor, table: &Tensor, position: &Tensor, q_heads: usize) -> Result<Tensor> {
    let op = RotaryQkv::checked(cache, qkv, table, position, q_heads)?;
    cache.inplace_op3(&qkv.contiguous()?, &table.contiguous()?, &op)?;
    let g = op.geometry;
    Ok(Tensor::from_storage(
        op.taken()?,
        (g.rows, g.q_heads, g.head_dim),
        BackpropOp::none(),
        false,
    ))
}

/// [`rotary_qkv`] with the queries written into `queries` (`rows · q_heads · d` elements,
/// contiguous), as a link of a kernel chain ([`crate::chained`]) on CUDA; elsewhere they are
/// copied in.
pub fn rotary_qkv_into(
    cache: &Tensor,
    qkv: &Tensor,
    norms: Option<HeadNorms>,
    table: &Tensor,
    position: &Tensor,
    q_heads: usize,
    queries: &Tensor,
) -> Result<()> {
    let mut op = RotaryQkv::checked(cache, qkv, table, position, q_heads)?;
    let g = op.geometry;
    if let Some(norms) = norms {
        for (name, w) in [("q_norm", norms.q), ("k_norm", norms.k)] {
            if w.dims() != [g.head_dim] || w.dtype() != qkv.dtype() || !w.is_contiguous() {
                candle_core::bail!(
                    "rotary_qkv: {name} {:?} {:?} is not a contiguous [{}] of the projection's {:?}",
                    w.dims(),
                    w.dtype(),
                    g.head_dim,
                    qkv.dtype()
                );
            }
        }
        op.norms = Some((norms.q.clone(), norms.k.clone(), norms.eps));
    }
    #[cfg(feature = "cuda")]
    if cache.device().is_cuda() {
        // With the norms, a CTA a head and a thread a pair.
        if norms.is_some() && g.head_dim > 2048 {
            candle_core::bail!("rotary_qkv: head size {} is over the 2,048 one CTA norms", g.head_dim);
        }
        crate::launch::check_output(queries, qkv.dtype(), g.rows * g.q_heads * g.head_dim, "rotary_qkv")?;
        op.into = Some(crate::launch::device_address(queries)?);
        return cache.inplace_op3(&qkv.contiguous()?, &table.contiguous()?, &op);
    }
    cache.inplace_op3(&qkv.contiguous()?, &table.contiguous()?, &op)?;
    let rotated = Tensor::from_storage(op.taken()?, queries.shape().clone(), BackpropOp::none(), false);
    queries.slice_set(&rotated, 0, 0)
}

/// Qwen3's RMSNorm of each query and key head, taken before the rotation and rounded as an
/// RMSNorm's output: the norms' weights `[d]`, in the projection's dtype, and ε. On CUDA in the
/// rotary kernel itself, where the unfused norms take a copy of each head slice, two norms and
/// a concatenation.
#[derive(Clone, Copy, Debug)]
pub struct HeadNorms<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub eps: f32,
}

/// Writes the cache in place (an in-place op on it) and the rotated queries to the address
/// `into`, or to a new buffer left in `queries` for [`rotary_qkv`] to wrap.
struct RotaryQkv {
    geometry: Geometry,
    capacity: usize,
    position: Tensor,
    /// The query and key heads' norm weights and ε ([`rotary_qkv_into`]'s `norms`).
    norms: Option<(Tensor, Tensor, f32)>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    into: Option<u64>,
    queries: Mutex<Option<Storage>>,
}

impl RotaryQkv {
    fn checked(cache: &Tensor, qkv: &Tensor, table: &Tensor, position: &Tensor, q_heads: usize) -> Result<Self> {
        let (two, kv_heads, capacity, d) = cache.dims4()?;
        let geometry = Geometry::of(qkv, table, position, q_heads, kv_heads)?;
        if two != 2 || d != geometry.head_dim || geometry.rows > capacity || !cache.is_contiguous() {
            candle_core::bail!(
                "rotary_qkv: the cache {:?} is not a contiguous [2, {kv_heads}, capacity ≥ {}, {}]",
                cache.dims(),
                geometry.rows,
                geometry.head_dim
            );
        }
        if cache.dtype() != qkv.dtype() {
            candle_core::bail!("rotary_qkv: the cache is {:?} but qkv {:?}", cache.dtype(), qkv.dtype());
        }
        Ok(Self {
            geometry,
            capacity,
            position: position.clone(),
            norms: None,
            into: None,
            queries: Mutex::new(None),
        })
    }
}

impl RotaryQkv {
    fn keep(&self, queries: Storage) -> Result<()> {
        *self
            .queries
            .lock()
            .map_err(|_| candle_core::Error::Msg("rotary_qkv: the queries' lock is poisoned".into()))? = Some(queries);
        Ok(())
    }

    /// The queries a launch without `into` made.
    fn taken(self) -> Result<Storage> {
        self.queries
            .into_inner()
            .map_err(|_| candle_core::Error::Msg("rotary_qkv: the queries' lock is poisoned".into()))?
            .ok_or_else(|| candle_core::Error::Msg("rotary_qkv: no queries came out".into()))
    }
}

impl candle_core::InplaceOp3 for RotaryQkv {
    fn name(&self) -> &'static str {
        "rotary_qkv"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        qkv: &CpuStorage,
        ql: &Layout,
        table: &CpuStorage,
        tl: &Layout,
    ) -> Result<()> {
        let g = &self.geometry;
        let offset = crate::position::on_host(&self.position)?;
        let (normed, normed_layout);
        let (qkv, ql) = match &self.norms {
            Some((q_norm, k_norm, eps)) => {
                normed = crate::cpu::qk_normed((qkv, ql), q_norm, k_norm, *eps, g)?;
                normed_layout = Layout::contiguous((g.rows, g.width()));
                (&normed, &normed_layout)
            }
            None => (qkv, ql),
        };
        crate::cpu::append_rotated_kv((cache, cl), (qkv, ql), (table, tl), g, offset, self.capacity)?;
        self.keep(Storage::Cpu(crate::cpu::rotary_queries(
            (qkv, ql),
            (table, tl),
            g,
            offset,
        )?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cl: &Layout,
        qkv: &candle_core::CudaStorage,
        ql: &Layout,
        table: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<()> {
        let queries = crate::position::with_device_view(&self.position, |position| {
            cuda::rotary_qkv(
                &self.geometry,
                self.capacity,
                position,
                (cache, cl),
                (qkv, ql),
                (table, tl),
                self.norms.as_ref(),
                self.into,
            )
        })?;
        match queries {
            Some(queries) => self.keep(Storage::Cuda(queries)),
            None => Ok(()),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, DType, Layout, Result, Tensor};
    use half::{bf16, f16};

    use super::Geometry;
    use crate::chain::Launch;
    use crate::launch::{elementwise, suffix};

    type Input<'a> = (&'a CudaStorage, &'a Layout);
    type Position<'a, 'b> = &'a CudaView<'b, u32>;

    type Norms = (Tensor, Tensor, f32);

    /// Writes the queries at `into`, or returns them in a new buffer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rotary_qkv(
        g: &Geometry,
        capacity: usize,
        position: Position,
        (cache, cl): (&mut CudaStorage, &Layout),
        qkv: Input,
        table: Input,
        norms: Option<&Norms>,
        into: Option<u64>,
    ) -> Result<Option<CudaStorage>> {
        match qkv.0.dtype() {
            DType::F32 => typed::<f32>(g, capacity, position, (cache, cl), qkv, table, norms, into),
            DType::BF16 => typed::<bf16>(g, capacity, position, (cache, cl), qkv, table, norms, into),
            DType::F16 => typed::<f16>(g, capacity, position, (cache, cl), qkv, table, norms, into),
            other => candle_core::bail!("rotary_qkv: unsupported dtype {other:?}"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn typed<T: CudaDType + DeviceRepr>(
        g: &Geometry,
        capacity: usize,
        position: Position,
        (cache, cl): (&mut CudaStorage, &Layout),
        (qkv, ql): Input,
        (table, tl): Input,
        norms: Option<&Norms>,
        into: Option<u64>,
    ) -> Result<Option<CudaStorage>> {
        let dev = qkv.device().clone();
        let stream = dev.cuda_stream();
        let name = if norms.is_some() {
            "rotary_qkv_normed"
        } else {
            "rotary_qkv"
        };
        let func = crate::module::ROTARY.kernel(&dev, &format!("{name}_{}", suffix(qkv.dtype())?))?;
        let xs = qkv.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let ts = table.as_cuda_slice::<T>()?.slice(tl.start_offset()..);
        let cs = cache.as_cuda_slice::<T>()?.slice(cl.start_offset()..);
        let (out, out_address) = match into {
            Some(address) => (None, address),
            None => {
                // SAFETY: every element is written by the kernel (each row, head and half-dim pair).
                let out = unsafe { dev.alloc::<T>(g.rows * g.q_heads * g.head_dim)? };
                let address = out.device_ptr(&stream).0;
                (Some(out), address)
            }
        };
        let mut launch = Launch::default();
        launch.arg(xs.device_ptr(&stream).0);
        if let Some((q_norm, k_norm, eps)) = norms {
            launch
                .arg(crate::launch::device_address(q_norm)?)
                .arg(crate::launch::device_address(k_norm)?)
                .arg(*eps);
        }
        launch
            .arg(ts.device_ptr(&stream).0)
            .arg(out_address)
            .arg(cs.device_ptr(&stream).0);
        if norms.is_none() {
            launch.arg(g.rows as i32);
        }
        for v in [g.q_heads, g.kv_heads, g.head_dim] {
            launch.arg(v as i32);
        }
        launch
            .arg(position.device_ptr(&stream).0)
            .arg(g.positions as i32)
            .arg(capacity as i32);
        // One thread per (row, head, j < d/2) of the query heads, then of the KV heads; with
        // the norms, a CTA of d/2 of them per (row, head).
        let heads = g.rows * (g.q_heads + g.kv_heads);
        let cfg = match norms {
            Some(_) => LaunchConfig {
                grid_dim: (heads as u32, 1, 1),
                block_dim: ((g.head_dim / 2).next_multiple_of(32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            None => elementwise(heads * g.head_dim / 2),
        };
        // SAFETY: the arguments match the kernel's signature; `Geometry::of` checked that qkv
        // covers every row, the cache is a contiguous [2, kv_heads, capacity, d], the output
        // holds rows · q_heads · d values, the norms d each (checked by the caller), and the
        // kernel skips positions past the table and slots past the cache.
        unsafe { launch.launch(&dev, &func, cfg) }?;
        Ok(out.map(|out| CudaStorage::wrap_cuda_slice(out, dev)))
    }
}
