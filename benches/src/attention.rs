//! `tpinfer-bench attention`: the fused flash-attention kernel against an f32 reference
//! computed from the same bf16 inputs (one head at a time, scores materialized), for numerics,
//! and its time per call in ms and TFLOP/s. A `cached` case runs the KV-cache entry point over
//! a cache whose slots past the filled keys hold NaN, which must not reach the output. A
//! `paged` case runs the continuous-batching decode kernel: many sequences of different
//! lengths, each over its own scattered blocks of a pool whose unused blocks hold NaN.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Args;

#[derive(Args)]
pub struct AttentionArgs {
    /// Cases `Q_LEN:KV_LEN:HEADS:KV_HEADS:HEAD_DIM[:causal|:cached|:paged|:paged-f32|:fp8|:fp8-spread]`;
    /// `cached`: causal, the last Q_LEN of KV_LEN keys through a KV cache with 77 unfilled (NaN)
    /// slots after them; `paged`: Q_LEN sequences of one query each, sequence i over KV_LEN ·
    /// (i + 1) / Q_LEN keys in blocks of 16 of a paged pool, in bf16 (`paged-f32`: in f32);
    /// `fp8`: the E4M3 kernels (Hopper's wgmma one where it runs, and the mma.sync one of
    /// compute capability 8.9) and the bf16 one on the same inputs; `fp8-spread` with query
    /// and key rows and value channels of magnitudes spread over 2⁴, so that a scale applied
    /// to the wrong block or channel shows.
    #[arg(long, value_delimiter = ',', required = true)]
    cases: Vec<String>,
    /// Timed calls per case, after one warm-up.
    #[arg(long, default_value_t = 10)]
    repeats: usize,
    /// Skip the f32 reference (it dominates the run at video lengths).
    #[arg(long)]
    no_reference: bool,
}

/// Unfilled slots after the keys in a `cached` case: not a multiple of the kernels' key tiles,
/// so that the last tile holds filled and unfilled rows.
const SPARE_SLOTS: usize = 77;

struct Case {
    q_len: usize,
    kv_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    cached: bool,
    paged: bool,
    /// An FP8 case, and whether its inputs are spread.
    fp8: Option<bool>,
    /// The paged case's dtype.
    dtype: DType,
}

fn parse(case: &str) -> Result<Case> {
    let parts: Vec<&str> = case.split(':').collect();
    let n = |i: usize| -> Result<usize> { parts.get(i).context("too few fields")?.parse().context("not a number") };
    let (causal, cached, paged) = match parts.get(5) {
        None | Some(&"fp8" | &"fp8-spread") => (false, false, false),
        Some(&"causal") => (true, false, false),
        Some(&"cached") => (true, true, false),
        Some(&"paged" | &"paged-f32") => (false, false, true),
        Some(other) => bail!("unknown flag {other} in {case}"),
    };
    Ok(Case {
        q_len: n(0)?,
        kv_len: n(1)?,
        heads: n(2)?,
        kv_heads: n(3)?,
        head_dim: n(4)?,
        causal,
        cached,
        paged,
        fp8: match parts.get(5) {
            Some(&"fp8") => Some(false),
            Some(&"fp8-spread") => Some(true),
            _ => None,
        },
        dtype: match parts.get(5) {
            Some(&"paged-f32") => DType::F32,
            _ => DType::BF16,
        },
    })
}

pub fn run(args: AttentionArgs) -> Result<()> {
    let device = crate::gpu().context("the attention benchmark needs a CUDA build and a GPU")?;
    println!("| q × kv tokens | heads (KV) | d | mask | ms | TFLOP/s | ‖out−ref‖/‖ref‖ | bf16(ref) error |");
    println!("|---|---|---|---|---|---|---|---|");
    for text in &args.cases {
        let c = parse(text).with_context(|| format!("case {text}"))?;
        if c.paged {
            paged(&c, &args, &device)?;
            continue;
        }
        let randn = |len: usize, heads: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1.0, (len, heads, c.head_dim), &device)?.to_dtype(DType::BF16)?)
        };
        let (mut q, mut k, mut v) = (
            randn(c.q_len, c.heads)?,
            randn(c.kv_len, c.kv_heads)?,
            randn(c.kv_len, c.kv_heads)?,
        );
        if c.fp8 == Some(true) {
            let spread = |x: &Tensor, n: usize, shape: &[usize]| -> Result<Tensor> {
                let f: Vec<f32> = (0..n).map(|i| (4.0 * (i as f32 * 0.618_034).fract()).exp2()).collect();
                let f = Tensor::from_vec(f, shape, &device)?.to_dtype(DType::BF16)?;
                Ok(x.broadcast_mul(&f)?)
            };
            q = spread(&q, c.q_len, &[c.q_len, 1, 1])?;
            k = spread(&k, c.kv_len, &[c.kv_len, 1, 1])?;
            v = spread(&v, c.head_dim, &[1, 1, c.head_dim])?;
        }
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let reference = match args.no_reference {
            true => None,
            false => Some(reference(&q, &k, &v, scale, c.causal)?),
        };
        let mut calls = vec![("", Call::new(&c, &k, &v, scale)?)];
        if c.fp8.is_some() {
            let fp8 = |kernel| -> Result<Call> {
                Ok(Call {
                    fp8: Some(kernel),
                    ..Call::new(&c, &k, &v, scale)?
                })
            };
            if tpinfer_kernels::flash_attention_fp8_supported(&device, DType::BF16, c.head_dim) {
                calls.push((", FP8", fp8(Fp8Kernel::AsRun)?));
            }
            calls.push((", FP8 mma.sync", fp8(Fp8Kernel::MmaSync)?));
        }
        for (label, call) in calls {
            let out = call.run(&q)?;
            device.synchronize()?;
            let start = std::time::Instant::now();
            for _ in 0..args.repeats {
                call.run(&q)?;
            }
            device.synchronize()?;
            let ms = start.elapsed().as_secs_f64() * 1e3 / args.repeats as f64;
            let mut flops = 4.0 * (c.q_len * c.kv_len * c.heads * c.head_dim) as f64;
            if c.causal {
                flops *= 1.0 - c.q_len as f64 / (2.0 * c.kv_len as f64);
            }
            let (err, rounding) = match &reference {
                None => ("—".to_string(), "—".to_string()),
                Some(reference) => {
                    let rounded = reference.to_dtype(DType::BF16)?;
                    let rel = |x: &Tensor| crate::relative_error(x, reference);
                    (format!("{:.2e}", rel(&out)?), format!("{:.2e}", rel(&rounded)?))
                }
            };
            let mask = if c.cached {
                "cached"
            } else if c.causal {
                "causal"
            } else {
                "none"
            };
            println!(
                "| {} × {} | {} ({}) | {} | {mask}{label} | {ms:.3} | {:.0} | {err} | {rounding} |",
                c.q_len,
                c.kv_len,
                c.heads,
                c.kv_heads,
                c.head_dim,
                flops / ms / 1e9
            );
        }
    }
    Ok(())
}

/// The call a case times: [`tpinfer_kernels::flash_attention`] over `k`, `v`, or for a
/// `cached` case [`tpinfer_kernels::flash_attention_cached`] over a cache holding them and
/// NaN in [`SPARE_SLOTS`] slots after them.
struct Call {
    k: Tensor,
    v: Tensor,
    scale: f64,
    causal: bool,
    /// A `cached` case's position of the first query.
    position: Option<Tensor>,
    /// The decode kernel's partials, for a cached call of one query.
    scratch: tpinfer_kernels::DecodeScratch,
    /// An FP8 kernel instead.
    fp8: Option<Fp8Kernel>,
}

/// [`tpinfer_kernels::flash_attention_fp8`] (what `--attention fp8` runs on the GPU: the
/// wgmma kernel on Hopper, the mma.sync one on Ada) or
/// [`tpinfer_kernels::flash_attention_fp8_mma`].
#[derive(Clone, Copy)]
enum Fp8Kernel {
    AsRun,
    MmaSync,
}

impl Call {
    fn new(c: &Case, k: &Tensor, v: &Tensor, scale: f64) -> Result<Self> {
        let (k, v, causal) = (k.clone(), v.clone(), c.causal);
        if !c.cached {
            return Ok(Self {
                k,
                v,
                scale,
                causal,
                position: None,
                scratch: tpinfer_kernels::DecodeScratch::new(),
                fp8: None,
            });
        }
        let spare = Tensor::full(f32::NAN, (SPARE_SLOTS, c.kv_heads, c.head_dim), k.device())?.to_dtype(DType::BF16)?;
        let position = Tensor::zeros(1, DType::U32, k.device())?;
        tpinfer_kernels::write_u32s(&position, &[(c.kv_len - c.q_len) as u32])?;
        Ok(Self {
            k: Tensor::cat(&[&k, &spare], 0)?,
            v: Tensor::cat(&[&v, &spare], 0)?,
            scale,
            causal,
            position: Some(position),
            scratch: tpinfer_kernels::DecodeScratch::new(),
            fp8: None,
        })
    }

    fn run(&self, q: &Tensor) -> Result<Tensor> {
        Ok(match &self.position {
            Some(position) => {
                tpinfer_kernels::flash_attention_cached(q, &self.k, &self.v, position, self.scale, &self.scratch)?
            }
            None => match self.fp8 {
                Some(Fp8Kernel::AsRun) => tpinfer_kernels::flash_attention_fp8(q, &self.k, &self.v, self.scale)?,
                Some(Fp8Kernel::MmaSync) => tpinfer_kernels::flash_attention_fp8_mma(q, &self.k, &self.v, self.scale)?,
                None => tpinfer_kernels::flash_attention(q, &self.k, &self.v, self.scale, self.causal)?,
            },
        })
    }
}

/// Unfused attention in f32, one head at a time with its whole score matrix.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let (s, heads, _) = q.dims3()?;
    let (t, kv_heads, _) = k.dims3()?;
    let mask = match causal {
        true => Some(tpinfer_layers::causal_mask(s, t, q.device())?),
        false => None,
    };
    let head = |x: &Tensor, h: usize| -> Result<Tensor> {
        Ok(x.narrow(1, h, 1)?.squeeze(1)?.to_dtype(DType::F32)?.contiguous()?)
    };
    let mut out = Vec::with_capacity(heads);
    for h in 0..heads {
        let kv = h / (heads / kv_heads);
        let mut scores = ((head(q, h)? * scale)?.matmul(&head(k, kv)?.t()?))?;
        if let Some(mask) = &mask {
            scores = (scores + mask)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        out.push(probs.matmul(&head(v, kv)?)?);
    }
    Ok(Tensor::stack(&out, 1)?)
}

/// Positions per block of a `paged` case (the engine's KV_BLOCK_SIZE).
const PAGED_BLOCK: usize = 16;

/// A `paged` case: `q_len` sequences, sequence i over `kv_len · (i + 1) / q_len` keys, their
/// blocks dealt out of the pool in a scrambled order; the pool's unused block holds NaN.
fn paged(c: &Case, args: &AttentionArgs, device: &candle_core::Device) -> Result<()> {
    let n = c.q_len;
    let lens: Vec<usize> = (0..n).map(|i| (c.kv_len * (i + 1) / n).max(1)).collect();
    let counts: Vec<usize> = lens.iter().map(|l| l.div_ceil(PAGED_BLOCK)).collect();
    let used: usize = counts.iter().sum();
    // Block `used` (the last) is never dealt: NaN there must not reach any output.
    let blocks = used + 1;
    let mut order: Vec<u32> = (0..used as u32).collect();
    order.sort_by_key(|&b| (b as u64 * 2_654_435_761) % used as u64);
    let most = *counts.iter().max().context("no sequences")?;
    let mut tables = vec![0u32; n * most];
    let mut next = order.iter();
    for (i, &count) in counts.iter().enumerate() {
        for t in &mut tables[i * most..i * most + count] {
            *t = *next.next().context("blocks")?;
        }
    }
    let slots = blocks * PAGED_BLOCK;
    let pool = Tensor::randn(0f32, 1.0, (2, slots, c.kv_heads, c.head_dim), device)?.to_dtype(c.dtype)?;
    let nan = Tensor::full(f32::NAN, (2, PAGED_BLOCK, c.kv_heads, c.head_dim), device)?.to_dtype(c.dtype)?;
    pool.slice_set(&nan, 1, used * PAGED_BLOCK)?;
    let q = Tensor::randn(0f32, 1.0, (n, c.heads, c.head_dim), device)?.to_dtype(c.dtype)?;
    let u32s = |v: &[u32], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape, device);
    let q_rows: Vec<u32> = (0..n as u32).rev().collect();
    let lens_u32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let (q_rows_t, tables_t) = (u32s(&q_rows, &[n])?, u32s(&tables, &[n, most])?);
    let lens_t = u32s(&lens_u32, &[n])?;
    let decode = tpinfer_kernels::DecodeRows {
        q_rows: &q_rows_t,
        tables: &tables_t,
        lens: &lens_t,
        block_size: PAGED_BLOCK,
        groups: tpinfer_kernels::QueryGroups {
            group: c.heads / c.kv_heads,
            offset: 0,
        },
    };
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let out = tpinfer_kernels::paged_decode_attention(&q, &pool, decode, scale)?;
    device.synchronize()?;
    let start = std::time::Instant::now();
    for _ in 0..args.repeats {
        tpinfer_kernels::paged_decode_attention(&q, &pool, decode, scale)?;
    }
    device.synchronize()?;
    let ms = start.elapsed().as_secs_f64() * 1e3 / args.repeats as f64;
    let keys: usize = lens.iter().sum();
    let flops = 4.0 * (keys * c.heads * c.head_dim) as f64;
    let bytes = (2 * keys * c.kv_heads * c.head_dim * c.dtype.size_in_bytes()) as f64;
    let (err, rounding) = match args.no_reference {
        true => ("—".to_string(), "—".to_string()),
        false => {
            let mut refs = Vec::with_capacity(n);
            for i in 0..n {
                let table = &tables[i * most..];
                let at: Vec<u32> = (0..lens[i])
                    .map(|p| table[p / PAGED_BLOCK] * PAGED_BLOCK as u32 + (p % PAGED_BLOCK) as u32)
                    .collect();
                let at = u32s(&at, &[lens[i]])?;
                let (k, v) = (pool.get(0)?.index_select(&at, 0)?, pool.get(1)?.index_select(&at, 0)?);
                let query = q.narrow(0, q_rows[i] as usize, 1)?;
                refs.push(reference(&query, &k, &v, scale, false)?);
            }
            let reference = Tensor::cat(&refs, 0)?;
            let rounded = reference.to_dtype(c.dtype)?;
            let rel = |x: &Tensor| crate::relative_error(x, &reference);
            (format!("{:.2e}", rel(&out)?), format!("{:.2e}", rel(&rounded)?))
        }
    };
    println!(
        "| {n} seqs × ≤ {} ({keys} keys) | {} ({}) | {} | paged | {ms:.3} | {:.1} ({:.0} GB/s) | {err} | {rounding} |",
        c.kv_len,
        c.heads,
        c.kv_heads,
        c.head_dim,
        flops / ms / 1e9,
        bytes / ms / 1e6
    );
    Ok(())
}
