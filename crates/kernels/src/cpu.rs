//! The same ops on CPU tensors, each one pass that allocates only its output, like the CUDA
//! kernels: the DiT's memory model then holds on every device. f32 arithmetic throughout.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, WithDType};
use rayon::prelude::*;

/// The contiguous elements of a layout.
fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let all = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&all[start..end]),
        None => candle_core::bail!("fused CPU ops need contiguous inputs"),
    }
}

fn f(x: impl WithDType) -> f32 {
    x.to_f64() as f32
}

/// Below this many elements of work an op runs on the calling thread: a rank thread that hands
/// a one-row op (a decode step's) to a rayon pool busy with the other ranks' GEMMs waits
/// longer than the op takes.
const PARALLEL_MIN_WORK: usize = 1 << 16;

/// Runs `f(i, chunk)` on each `size`-element chunk of `out`, across the rayon pool when the op
/// reads at least [`PARALLEL_MIN_WORK`] elements (`work`), else on this thread.
fn for_each_chunk<T: Send>(out: &mut [T], size: usize, work: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if work >= PARALLEL_MIN_WORK {
        out.par_chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    } else {
        out.chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// Runs `$body` with `$t` bound to the element type of `dtype` (f32, bf16 or f16).
macro_rules! of_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("fused CPU ops: unsupported dtype {other:?}"),
        }
    };
}

/// Runs `$body` with `$t` bound to the element type of `$storage` (f32, bf16 or f16).
macro_rules! typed {
    ($storage:expr, $t:ident => $body:expr) => {
        match $storage {
            CpuStorage::F32(_) => {
                type $t = f32;
                $body
            }
            CpuStorage::BF16(_) => {
                type $t = half::bf16;
                $body
            }
            CpuStorage::F16(_) => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("fused CPU ops: unsupported dtype {:?}", other.dtype()),
        }
    };
}

/// `x + y · gate`, or `x + y` without a gate, in `x`'s type (`y` may be narrower): the gate
/// `[k, cols]` with the rows its first row serves (see [`crate::ColumnTable`]).
pub(crate) fn gated_residual(
    x: (&CpuStorage, &Layout),
    y: (&CpuStorage, &Layout),
    gate: Option<(&CpuStorage, &Layout, usize)>,
) -> Result<CpuStorage> {
    let (_, cols) = x.1.shape().dims2()?;
    let gate = gate
        .map(|(s, l, split)| Ok::<_, candle_core::Error>((contiguous::<f32>(s, l)?, split)))
        .transpose()?;
    typed!(x.0, T => typed!(y.0, P => {
        let (xs, ys) = (contiguous::<T>(x.0, x.1)?, contiguous::<P>(y.0, y.1)?);
        let mut out = vec![T::from_f64(0.0); xs.len()];
        for_each_chunk(&mut out, cols, xs.len(), |r, o| {
            let (a, b) = (&xs[r * cols..][..cols], &ys[r * cols..][..cols]);
            match &gate {
                Some((g, split)) => {
                    let g = table_row(g, r, *split, cols);
                    for j in 0..cols {
                        o[j] = T::from_f64((f(a[j]) + f(b[j]) * g[j]) as f64);
                    }
                }
                None => {
                    for j in 0..cols {
                        o[j] = T::from_f64((f(a[j]) + f(b[j])) as f64);
                    }
                }
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    }))
}

/// Row `r`'s values of a per-column table `[k, cols]` whose first row serves the rows before
/// `split`.
fn table_row(table: &[f32], r: usize, split: usize, cols: usize) -> &[f32] {
    let at = if r < split { 0 } else { cols };
    &table[at..][..cols]
}

/// Row `i` of a `[rows, cols]` layout with contiguous columns, rows any distance apart.
fn row<'a, T: WithDType>(all: &'a [T], l: &Layout, i: usize) -> &'a [T] {
    let (_, cols) = l.shape().dims2().unwrap_or((0, 0));
    let stride = crate::rowwise::row_stride(l).unwrap_or(cols);
    &all[l.start_offset() + i * stride..][..cols]
}

pub(crate) fn row_sum_squares(x: (&CpuStorage, &Layout)) -> Result<CpuStorage> {
    let (rows, cols) = x.1.shape().dims2()?;
    typed!(x.0, T => {
        let all = x.0.as_slice::<T>()?;
        let mut out = vec![0f32; rows];
        for_each_chunk(&mut out, 1, rows * cols, |r, o| {
            o[0] = row(all, x.1, r).iter().map(|&v| f(v) * f(v)).sum();
        });
        Ok(f32::to_cpu_storage_owned(out))
    })
}

/// See [`crate::scale_rows_cols`]; `rope` is the `[rows, 2, pairs]` table, contiguous.
pub(crate) fn scale_rows_cols(
    x: (&CpuStorage, &Layout),
    rows: (&CpuStorage, &Layout),
    cols: (&CpuStorage, &Layout),
    rope: Option<(&CpuStorage, &Layout)>,
) -> Result<CpuStorage> {
    let (r, c) = (contiguous::<f32>(rows.0, rows.1)?, contiguous::<f32>(cols.0, cols.1)?);
    let rope = match rope {
        Some((s, l)) => Some((contiguous::<f32>(s, l)?, l.dims()[2])),
        None => None,
    };
    let n = c.len();
    typed!(x.0, T => {
        let all = x.0.as_slice::<T>()?;
        let mut out = vec![T::from_f64(0.0); r.len() * n];
        for_each_chunk(&mut out, n, r.len() * n, |i, o| {
            let xr = row(all, x.1, i);
            let scaled = |j: usize| f(xr[j]) * r[i] * c[j];
            match rope {
                Some((table, pairs)) => {
                    let (cos, sin) = table[i * 2 * pairs..][..2 * pairs].split_at(pairs);
                    for p in 0..n / 2 {
                        let (a, b, k) = (scaled(2 * p), scaled(2 * p + 1), p % pairs);
                        o[2 * p] = T::from_f64((a * cos[k] - b * sin[k]) as f64);
                        o[2 * p + 1] = T::from_f64((a * sin[k] + b * cos[k]) as f64);
                    }
                }
                None => {
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = T::from_f64(scaled(j) as f64);
                    }
                }
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// See [`crate::layer_norm`]: written as `out`'s type.
pub(crate) fn layer_norm(
    x: (&CpuStorage, &Layout),
    weight: (&CpuStorage, &Layout),
    bias: (&CpuStorage, &Layout),
    split: usize,
    eps: f32,
    out: DType,
) -> Result<CpuStorage> {
    let (_, cols) = x.1.shape().dims2()?;
    let (w, b) = (
        contiguous::<f32>(weight.0, weight.1)?,
        contiguous::<f32>(bias.0, bias.1)?,
    );
    typed!(x.0, T => of_dtype!(out, O => {
        let xs = contiguous::<T>(x.0, x.1)?;
        let mut normed = vec![O::from_f64(0.0); xs.len()];
        for_each_chunk(&mut normed, cols, xs.len(), |r, o| {
            let row = &xs[r * cols..][..cols];
            let (w, b) = (table_row(w, r, split, cols), table_row(b, r, split, cols));
            let mean = row.iter().map(|&v| f(v)).sum::<f32>() / cols as f32;
            let var = row.iter().map(|&v| (f(v) - mean) * (f(v) - mean)).sum::<f32>() / cols as f32;
            let rstd = 1.0 / (var + eps).sqrt();
            for j in 0..cols {
                o[j] = O::from_f64(((f(row[j]) - mean) * rstd * w[j] + b[j]) as f64);
            }
        });
        Ok(O::to_cpu_storage_owned(normed))
    }))
}

/// Attention with an online softmax, one query row of every head per task: no score buffer,
/// as the CUDA kernel. `[len, heads, d]` views with any row/head strides.
pub(crate) fn flash_attention(
    q: (&CpuStorage, &Layout),
    k: (&CpuStorage, &Layout),
    v: (&CpuStorage, &Layout),
    scale: f32,
    causal: bool,
    keys: Option<usize>,
) -> Result<CpuStorage> {
    let (s, heads, d) = q.1.shape().dims3()?;
    let (slots, kv_heads, _) = k.1.shape().dims3()?;
    // With `keys`, K and V are a cache of which only the first `keys` slots count.
    let t = keys.unwrap_or(slots);
    let strides = |l: &Layout| -> Result<(usize, usize, usize)> {
        match l.stride() {
            [row, head, 1] => Ok((l.start_offset(), *row, *head)),
            other => candle_core::bail!("flash attention: the last dim must be contiguous, strides {other:?}"),
        }
    };
    let ((qo, qr, qh), (ko, kr, kh), (vo, vr, vh)) = (strides(q.1)?, strides(k.1)?, strides(v.1)?);
    let group = heads / kv_heads;
    typed!(q.0, T => {
        let (qs, ks, vs) = (q.0.as_slice::<T>()?, k.0.as_slice::<T>()?, v.0.as_slice::<T>()?);
        let mut out = vec![T::from_f64(0.0); s * heads * d];
        for_each_chunk(&mut out, heads * d, s * t * heads * d, |i, row| {
            let keys = if causal { t - s + i + 1 } else { t };
            let mut acc = vec![0f32; d];
            for h in 0..heads {
                let q_row: Vec<f32> = (0..d).map(|j| f(qs[qo + i * qr + h * qh + j]) * scale).collect();
                let (kb, vb) = (ko + (h / group) * kh, vo + (h / group) * vh);
                let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
                acc.iter_mut().for_each(|a| *a = 0.0);
                for key in 0..keys {
                    let kx = &ks[kb + key * kr..kb + key * kr + d];
                    let score: f32 = q_row.iter().zip(kx).map(|(&a, &b)| a * f(b)).sum();
                    let new_max = max.max(score);
                    let (alpha, p) = ((max - new_max).exp(), (score - new_max).exp());
                    sum = sum * alpha + p;
                    let vx = &vs[vb + key * vr..vb + key * vr + d];
                    acc.iter_mut().zip(vx).for_each(|(a, &b)| *a = *a * alpha + p * f(b));
                    max = new_max;
                }
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                for j in 0..d {
                    row[h * d + j] = T::from_f64((acc[j] * inv) as f64);
                }
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// act(gate) · up, act SiLU or (with `gelu`) GELU's tanh approximation.
pub(crate) fn gate_mul(x: (&CpuStorage, &Layout), half: usize, gelu: bool) -> Result<CpuStorage> {
    typed!(x.0, T => {
        let xs = contiguous::<T>(x.0, x.1)?;
        let mut out = vec![T::from_f64(0.0); xs.len() / 2];
        for_each_chunk(&mut out, half, xs.len(), |r, o| {
            let row = &xs[r * 2 * half..][..2 * half];
            for j in 0..half {
                let (g, u) = (f(row[j]), f(row[half + j]));
                let a = match gelu {
                    true => 0.5 * g * (1.0 + (0.797_884_6 * g * (1.0 + 0.044715 * g * g)).tanh()),
                    false => g / (1.0 + (-g).exp()),
                };
                o[j] = T::from_f64((a * u) as f64);
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// softmax(scores[h, q, :] + table[buckets[k − q + queries − 1], h]) in f32, rounded once.
pub(crate) fn softmax_relative_bias(
    scores: (&CpuStorage, &Layout),
    table: (&CpuStorage, &Layout),
    buckets: (&CpuStorage, &Layout),
    [heads, queries, keys]: [usize; 3],
) -> Result<CpuStorage> {
    let table = contiguous::<f32>(table.0, table.1)?;
    let buckets = contiguous::<u32>(buckets.0, buckets.1)?;
    typed!(scores.0, T => {
        let xs = contiguous::<T>(scores.0, scores.1)?;
        let mut out = vec![T::from_f64(0.0); xs.len()];
        for_each_chunk(&mut out, keys, xs.len(), |row, o| {
            let (h, q) = (row / queries, row % queries);
            let distance = &buckets[queries - 1 - q..][..keys];
            let v: Vec<f32> = xs[row * keys..][..keys]
                .iter()
                .zip(distance)
                .map(|(&s, &b)| f(s) + table[b as usize * heads + h])
                .collect();
            let top = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = v.iter().map(|x| (x - top).exp()).sum();
            for (o, x) in o.iter_mut().zip(&v) {
                *o = T::from_f64(((x - top).exp() / sum) as f64);
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

pub(crate) fn embed_owned_rows(
    ids: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    first: u32,
    end: u32,
) -> Result<CpuStorage> {
    let ids = contiguous::<u32>(ids.0, ids.1)?;
    let cols = w.1.shape().dims2()?.1;
    typed!(w.0, T => {
        let ws = contiguous::<T>(w.0, w.1)?;
        let mut out = vec![T::from_f64(0.0); ids.len() * cols];
        for (&id, o) in ids.iter().zip(out.chunks_mut(cols)) {
            if (first..end).contains(&id) {
                o.copy_from_slice(&ws[(id - first) as usize * cols..][..cols]);
            }
        }
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// `x1 · cos − x2 · sin`, `x2 · cos + x1 · sin` for a head's halves `x`, into `out`.
fn rotate<T: WithDType>(x: &[T], cos: &[T], sin: &[T], out: &mut [T]) {
    let half = cos.len();
    for j in 0..half {
        let (x1, x2, c, s) = (f(x[j]), f(x[j + half]), f(cos[j]), f(sin[j]));
        out[j] = T::from_f64((x1 * c - x2 * s) as f64);
        out[j + half] = T::from_f64((x2 * c + x1 * s) as f64);
    }
}

/// The cos and sin rows of `position` in a `[2, positions, half]` table.
fn rotation<T>(table: &[T], positions: usize, half: usize, position: usize) -> (&[T], &[T]) {
    let at = position * half;
    (&table[at..at + half], &table[(positions + position) * half..][..half])
}

/// `qkv` `[rows, width]` with each query and key head x RMS-normed, T(x · rsqrt(mean(x²) + ε)
/// · w) (w `[d]`: `q_norm` for the query heads, `k_norm` for the key heads); the value heads
/// as they are.
pub(crate) fn qk_normed(
    qkv: (&CpuStorage, &Layout),
    q_norm: &candle_core::Tensor,
    k_norm: &candle_core::Tensor,
    eps: f32,
    g: &crate::rotary::Geometry,
) -> Result<CpuStorage> {
    let d = g.head_dim;
    let weights = |w: &candle_core::Tensor| w.to_dtype(DType::F32)?.to_vec1::<f32>();
    let (qw, kw) = (weights(q_norm)?, weights(k_norm)?);
    typed!(qkv.0, T => {
        let xs = contiguous::<T>(qkv.0, qkv.1)?;
        let mut out = xs[..g.rows * g.width()].to_vec();
        for_each_chunk(&mut out, g.width(), g.rows * g.width(), |_, row| {
            for (h, head) in row.chunks_mut(d).take(g.q_heads + g.kv_heads).enumerate() {
                let w = if h < g.q_heads { &qw } else { &kw };
                let squares: f32 = head.iter().map(|&x| f(x) * f(x)).sum();
                let rstd = 1.0 / (squares / d as f32 + eps).sqrt();
                for (x, w) in head.iter_mut().zip(w) {
                    *x = T::from_f64((f(*x) * rstd * w) as f64);
                }
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

pub(crate) fn rotary_queries(
    qkv: (&CpuStorage, &Layout),
    table: (&CpuStorage, &Layout),
    g: &crate::rotary::Geometry,
    offset: usize,
) -> Result<CpuStorage> {
    let d = g.head_dim;
    if offset + g.rows > g.positions {
        candle_core::bail!(
            "rotary_queries: positions {offset}..{} exceed the table's {}",
            offset + g.rows,
            g.positions
        );
    }
    typed!(qkv.0, T => {
        let (xs, ts) = (contiguous::<T>(qkv.0, qkv.1)?, contiguous::<T>(table.0, table.1)?);
        let mut out = vec![T::from_f64(0.0); g.rows * g.q_heads * d];
        for_each_chunk(&mut out, g.q_heads * d, g.rows * g.q_heads * d, |r, o| {
            let (cos, sin) = rotation(ts, g.positions, d / 2, offset + r);
            let row = &xs[r * g.width()..];
            for h in 0..g.q_heads {
                rotate(&row[h * d..(h + 1) * d], cos, sin, &mut o[h * d..(h + 1) * d]);
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

pub(crate) fn append_rotated_kv(
    cache: (&mut CpuStorage, &Layout),
    qkv: (&CpuStorage, &Layout),
    table: (&CpuStorage, &Layout),
    g: &crate::rotary::Geometry,
    offset: usize,
    capacity: usize,
) -> Result<()> {
    let last = offset + g.rows;
    if last > capacity.min(g.positions) {
        candle_core::bail!(
            "append_rotated_kv: slots {offset}..{last} exceed the cache's {capacity} or the table's {}",
            g.positions
        );
    }
    fn append<T: WithDType>(
        cache: &mut [T],
        xs: &[T],
        ts: &[T],
        g: &crate::rotary::Geometry,
        offset: usize,
        capacity: usize,
    ) {
        let d = g.head_dim;
        let (keys, values) = cache.split_at_mut(g.kv_heads * capacity * d);
        for (h, (k_head, v_head)) in keys
            .chunks_mut(capacity * d)
            .zip(values.chunks_mut(capacity * d))
            .enumerate()
        {
            for r in 0..g.rows {
                let slot = (offset + r) * d;
                let row = &xs[r * g.width()..];
                let k = &row[(g.q_heads + h) * d..][..d];
                let v = &row[(g.q_heads + g.kv_heads + h) * d..][..d];
                let (cos, sin) = rotation(ts, g.positions, d / 2, offset + r);
                rotate(k, cos, sin, &mut k_head[slot..slot + d]);
                v_head[slot..slot + d].copy_from_slice(v);
            }
        }
    }
    let Some((start, end)) = cache.1.contiguous_offsets() else {
        candle_core::bail!("append_rotated_kv: the cache must be contiguous");
    };
    // The same call for each element type of the cache.
    macro_rules! append_to {
        ($c:expr) => {
            append(
                &mut $c[start..end],
                contiguous(qkv.0, qkv.1)?,
                contiguous(table.0, table.1)?,
                g,
                offset,
                capacity,
            )
        };
    }
    match cache.0 {
        CpuStorage::F32(c) => append_to!(c),
        CpuStorage::BF16(c) => append_to!(c),
        CpuStorage::F16(c) => append_to!(c),
        other => candle_core::bail!("append_rotated_kv: unsupported dtype {:?}", other.dtype()),
    }
    Ok(())
}

/// A batched step's rows over a paged pool `[2, slots, kv_heads, head_dim]`: row `r` at
/// position `positions[r]`, its key and value into slot `at[r]`.
pub(crate) struct PagedRows<'a> {
    pub sizes: crate::paged::Sizes,
    pub table_positions: usize,
    pub positions: &'a [u32],
    pub at: &'a [u32],
}

/// The rotated queries `[rows, q_heads, d]`, after writing each row's rotated keys and its
/// values into the pool at its slot.
pub(crate) fn rotary_qkv_paged(
    pool: (&mut CpuStorage, &Layout),
    qkv: (&CpuStorage, &Layout),
    table: (&CpuStorage, &Layout),
    g: &PagedRows<'_>,
) -> Result<CpuStorage> {
    if let Some(r) = (0..g.positions.len())
        .find(|&r| g.positions[r] as usize >= g.table_positions || g.at[r] as usize >= g.sizes.slots)
    {
        candle_core::bail!(
            "rotary_qkv_paged: row {r} at position {} into slot {} is outside the table's {} positions or the pool's \
             {} slots",
            g.positions[r],
            g.at[r],
            g.table_positions,
            g.sizes.slots
        );
    }
    fn write<T: WithDType>(pool: &mut [T], xs: &[T], ts: &[T], g: &PagedRows<'_>) -> Vec<T> {
        let (d, half) = (g.sizes.head_dim, g.sizes.head_dim / 2);
        let width = (g.sizes.q_heads + 2 * g.sizes.kv_heads) * d;
        let (keys, values) = pool.split_at_mut(g.sizes.slots * g.sizes.kv_heads * d);
        let mut queries = vec![T::from_f64(0.0); g.positions.len() * g.sizes.q_heads * d];
        for (r, (&position, &slot)) in g.positions.iter().zip(g.at).enumerate() {
            let (cos, sin) = rotation(ts, g.table_positions, half, position as usize);
            let row = &xs[r * width..][..width];
            for h in 0..g.sizes.q_heads {
                rotate(
                    &row[h * d..][..d],
                    cos,
                    sin,
                    &mut queries[(r * g.sizes.q_heads + h) * d..][..d],
                );
            }
            let at = slot as usize * g.sizes.kv_heads * d;
            for h in 0..g.sizes.kv_heads {
                let k = &row[(g.sizes.q_heads + h) * d..][..d];
                rotate(k, cos, sin, &mut keys[at + h * d..][..d]);
                let v = &row[(g.sizes.q_heads + g.sizes.kv_heads + h) * d..][..d];
                values[at + h * d..][..d].copy_from_slice(v);
            }
        }
        queries
    }
    let Some((start, end)) = pool.1.contiguous_offsets() else {
        candle_core::bail!("rotary_qkv_paged: the pool must be contiguous");
    };
    macro_rules! write_to {
        ($p:expr, $t:ty) => {
            <$t>::to_cpu_storage_owned(write(
                &mut $p[start..end],
                contiguous(qkv.0, qkv.1)?,
                contiguous(table.0, table.1)?,
                g,
            ))
        };
    }
    Ok(match pool.0 {
        CpuStorage::F32(p) => write_to!(p, f32),
        CpuStorage::BF16(p) => write_to!(p, half::bf16),
        CpuStorage::F16(p) => write_to!(p, half::f16),
        other => candle_core::bail!("rotary_qkv_paged: unsupported dtype {:?}", other.dtype()),
    })
}

/// The decode rows of a batched step over a paged pool (see `crate::DecodeRows`), on the
/// host; checked against the pool by the caller.
pub(crate) struct PagedDecode<'a> {
    pub sizes: crate::paged::Sizes,
    pub block_size: usize,
    pub max_blocks: usize,
    pub q_rows: &'a [u32],
    pub tables: &'a [u32],
    pub lens: &'a [u32],
    pub groups: crate::QueryGroups,
}

/// Each decode row's attention over its sequence's slots, `[n, q_heads, d]`, with an online
/// softmax as the CUDA kernel (no score buffer).
pub(crate) fn paged_decode_attention(
    q: (&CpuStorage, &Layout),
    pool: (&CpuStorage, &Layout),
    g: &PagedDecode<'_>,
    scale: f32,
) -> Result<CpuStorage> {
    let d = g.sizes.head_dim;
    let row = g.sizes.kv_heads * d;
    typed!(q.0, T => {
        let (qs, ps) = (contiguous::<T>(q.0, q.1)?, contiguous::<T>(pool.0, pool.1)?);
        let (keys, values) = ps.split_at(g.sizes.slots * row);
        let work: usize = g.lens.iter().map(|&l| l as usize).sum::<usize>() * g.sizes.q_heads * d;
        let mut out = vec![T::from_f64(0.0); g.q_rows.len() * g.sizes.q_heads * d];
        for_each_chunk(&mut out, g.sizes.q_heads * d, work, |i, o| {
            let table = &g.tables[i * g.max_blocks..][..g.max_blocks];
            let mut acc = vec![0f32; d];
            for h in 0..g.sizes.q_heads {
                let query: Vec<f32> =
                    qs[(g.q_rows[i] as usize * g.sizes.q_heads + h) * d..][..d].iter().map(|&x| f(x) * scale).collect();
                let head = g.groups.kv_head(h) * d;
                let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
                acc.iter_mut().for_each(|a| *a = 0.0);
                for p in 0..g.lens[i] as usize {
                    let slot = table[p / g.block_size] as usize * g.block_size + p % g.block_size;
                    let at = slot * row + head;
                    let score: f32 = query.iter().zip(&keys[at..at + d]).map(|(&a, &b)| a * f(b)).sum();
                    let new_max = max.max(score);
                    let (alpha, weight) = ((max - new_max).exp(), (score - new_max).exp());
                    sum = sum * alpha + weight;
                    acc.iter_mut()
                        .zip(&values[at..at + d])
                        .for_each(|(a, &v)| *a = *a * alpha + weight * f(v));
                    max = new_max;
                }
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                for (o, a) in o[h * d..][..d].iter_mut().zip(&acc) {
                    *o = T::from_f64((a * inv) as f64);
                }
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// `[2, rows, cols]`: the sum `x + y` (rounded), then its RMSNorm times `weight`.
pub(crate) fn add_rms_norm(
    x: (&CpuStorage, &Layout),
    y: (&CpuStorage, &Layout),
    weight: (&CpuStorage, &Layout),
    eps: f32,
) -> Result<CpuStorage> {
    typed!(x.0, T => {
        let (xs, ys, w) = (contiguous::<T>(x.0, x.1)?, contiguous::<T>(y.0, y.1)?, contiguous::<T>(weight.0, weight.1)?);
        let cols = w.len();
        let n = xs.len();
        let mut out = vec![T::from_f64(0.0); 2 * n];
        let (sums, normed) = out.split_at_mut(n);
        for_each_chunk(sums, cols, n, |r, sum| {
            let (a, b) = (&xs[r * cols..][..cols], &ys[r * cols..][..cols]);
            for j in 0..cols {
                sum[j] = T::from_f64((f(a[j]) + f(b[j])) as f64);
            }
        });
        let sums = &*sums;
        for_each_chunk(normed, cols, n, |r, norm| {
            let sum = &sums[r * cols..][..cols];
            let mean = sum.iter().map(|&v| f(v) * f(v)).sum::<f32>() / cols as f32;
            let rstd = 1.0 / (mean + eps).sqrt();
            for j in 0..cols {
                norm[j] = T::from_f64((f(sum[j]) * rstd * f(w[j])) as f64);
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// `x · wᵀ` for one row `x` of `k` and `w` `[n, k]`, f32 accumulation, rows across the pool.
/// `gate_up`: `w` is `[gate (n) | up (n)]`, `[2n, k]`, and output i is silu(gate_i) · up_i,
/// each product rounded to the dtype first and the SiLU product as `silu_mul` rounds it.
pub(crate) fn gemv(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    n: usize,
    k: usize,
    gate_up: bool,
) -> Result<CpuStorage> {
    typed!(x.0, T => {
        let (xs, ws) = (contiguous::<T>(x.0, x.1)?, contiguous::<T>(w.0, w.1)?);
        let xf: Vec<f32> = xs.iter().map(|&v| f(v)).collect();
        let product = |row: usize| {
            let row = &ws[row * k..][..k];
            T::from_f64(row.iter().zip(&xf).map(|(&a, &b)| f(a) * b).sum::<f32>() as f64)
        };
        let mut out = vec![T::from_f64(0.0); n];
        let work = if gate_up { 2 * n * k } else { n * k };
        for_each_chunk(&mut out, 64, work, |c, o| {
            for (i, y) in o.iter_mut().enumerate() {
                let row = c * 64 + i;
                *y = match gate_up {
                    false => product(row),
                    true => {
                        let (g, u) = (f(product(row)), f(product(n + row)));
                        T::from_f64((g / (1.0 + (-g).exp()) * u) as f64)
                    }
                };
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    })
}

/// `x · wᵀ + b` for `x` `[rows, k]`, `w` `[n, k]`, `b` `[n]` in f32, then GELU (tanh
/// approximation, candle's formula) when `gelu`: the output starts as the broadcast bias and
/// the GEMM (candle's own, the `gemm` crate) accumulates into it, so that, as with cuBLASLt's
/// epilogue on CUDA, the output is the only allocation.
pub(crate) fn linear_bias(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: (&CpuStorage, &Layout),
    dims: (usize, usize, usize),
    gelu: bool,
) -> Result<CpuStorage> {
    let mut out = vec![0f32; dims.0 * dims.1];
    linear_bias_into(&mut out, x, w, b, dims, gelu)?;
    Ok(CpuStorage::F32(out))
}

/// [`linear_bias`] written into `out` (`rows × n`).
pub(crate) fn linear_bias_into(
    out: &mut [f32],
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: (&CpuStorage, &Layout),
    (rows, n, k): (usize, usize, usize),
    gelu: bool,
) -> Result<()> {
    let (xs, ws, bs) = (
        contiguous::<f32>(x.0, x.1)?,
        contiguous::<f32>(w.0, w.1)?,
        contiguous::<f32>(b.0, b.1)?,
    );
    if out.len() != rows * n || bs.len() != n || xs.len() < rows * k || ws.len() < n * k {
        candle_core::bail!("linear_bias: {rows} × {n} × {k} does not fit its operands");
    }
    for row in out.chunks_exact_mut(n) {
        row.copy_from_slice(bs);
    }
    // As candle's matmul calls it.
    let parallelism = match rayon::current_num_threads() {
        1 => gemm::Parallelism::None,
        threads => gemm::Parallelism::Rayon(threads),
    };
    // SAFETY: out is rows × n (row stride n), x rows × k (row stride k), and wᵀ is read as
    // k × n with element (kk, j) at w[j · k + kk], all checked above; the gemm crate
    // computes out = 1 · out + 1 · x · wᵀ.
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            true,
            xs.as_ptr(),
            1,
            k as isize,
            ws.as_ptr(),
            k as isize,
            1,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        )
    };
    if gelu {
        const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
        for_each_chunk(out, 4096, rows * n, |_, chunk| {
            for v in chunk {
                *v = 0.5 * *v * (1.0 + (SQRT_TWO_OVER_PI * *v * (1.0 + 0.044715 * *v * *v)).tanh());
            }
        });
    }
    Ok(())
}
