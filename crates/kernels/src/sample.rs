//! The next token of every row of a step's logits, chosen where the logits are
//! (cuda/sample.cu on CUDA, the same arithmetic here on the host): only the ids leave the
//! device. Greedy rows take the argmax. Sampled rows scale the logits by 1 / temperature,
//! keep the tokens that top-k and then top-p keep (every token tied with the last one kept
//! stays), and take the Gumbel-max draw over them: the argmax of `z + g`, `g` a standard
//! Gumbel variate per token. That is an exact draw from the softmax of the kept logits, needs
//! neither a normalization nor a sort, and its uniforms come from Philox4x32-10 keyed by the
//! request's seed at counter (token, draw): a request draws the same numbers alone as in any
//! batch, and on any device.

use std::collections::BTreeMap;

use candle_core::{DType, Result, Tensor};

/// How one row picks its token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling<'a> {
    /// 0 is greedy.
    pub temperature: f32,
    /// Keep the `k` most likely tokens (with their ties); `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the fewest most likely tokens whose probability reaches `p` (with their ties);
    /// `None` keeps all.
    pub top_p: Option<f32>,
    pub seed: u64,
    /// Which draw of the request this is (its tokens generated so far).
    pub draw: u64,
    /// Divides the positive logits (multiplies the negative ones) of `penalized`; 1 leaves
    /// them.
    pub repetition_penalty: f32,
    /// Tokens already seen, repeats allowed.
    pub penalized: &'a [u32],
    /// Taken off a token's logit once for each time it is in `generated` (OpenAI's
    /// `frequency_penalty`), after the repetition penalty; 0 leaves them.
    pub frequency_penalty: f32,
    /// Taken off the logit of every token in `generated` once (`presence_penalty`).
    pub presence_penalty: f32,
    /// The request's tokens generated so far, repeats counted: what the frequency and
    /// presence penalties look at (the prompt is not).
    pub generated: &'a [u32],
    /// Added to tokens' logits after the penalties (OpenAI's `logit_bias`), one entry a
    /// token.
    pub logit_bias: &'a [(u32, f32)],
}

impl RowSampling<'_> {
    /// Greedy, with nothing penalized.
    pub const GREEDY: RowSampling<'static> = RowSampling {
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        draw: 0,
        repetition_penalty: 1.0,
        penalized: &[],
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        generated: &[],
        logit_bias: &[],
    };

    /// The top-k and top-p that keep fewer than all of `vocab` tokens (a greedy row keeps no
    /// set: it takes the argmax).
    fn narrowing(&self, vocab: usize) -> (Option<usize>, Option<f32>) {
        if self.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return (None, None);
        }
        (
            self.top_k.filter(|&k| k > 0 && k < vocab),
            self.top_p.filter(|&p| p < 1.0),
        )
    }

    /// Each distinct token a penalty or bias changes, with what they do to the token's logit
    /// `x`: `penalize(x, factor) - offset` (none when every penalty is off and nothing is
    /// biased).
    fn penalized_set(&self) -> Vec<Penalty> {
        let mut set = BTreeMap::new();
        if self.repetition_penalty != 1.0 {
            for &token in self.penalized {
                entry(&mut set, token).factor = self.repetition_penalty;
            }
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
            for &token in self.generated {
                *counts.entry(token).or_default() += 1;
            }
            for (token, count) in counts {
                entry(&mut set, token).offset += self.frequency_penalty * count as f32 + self.presence_penalty;
            }
        }
        for &(token, bias) in self.logit_bias {
            entry(&mut set, token).offset -= bias;
        }
        set.into_values().collect()
    }
}

/// `token`'s entry in `set`, unchanged (factor 1, offset 0) until a penalty or bias sets it.
fn entry(set: &mut BTreeMap<u32, Penalty>, token: u32) -> &mut Penalty {
    set.entry(token).or_insert(Penalty {
        token,
        factor: 1.0,
        offset: 0.0,
    })
}

/// What the penalties do to one token's logit: `penalize(x, factor) - offset`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Penalty {
    token: u32,
    factor: f32,
    offset: f32,
}

/// The token each row of `logits` `[rows, vocab]` (f32) picks as `rows` say, `[rows]` u32 on
/// the logits' device. Penalized tokens past the vocabulary are refused.
pub fn sample_rows(logits: &Tensor, rows: &[RowSampling<'_>]) -> Result<Tensor> {
    let (n, vocab) = logits.dims2()?;
    if logits.dtype() != DType::F32 || n != rows.len() || vocab == 0 {
        candle_core::bail!(
            "sample_rows: logits {:?} {:?} are not f32 [{} rows, vocab]",
            logits.dims(),
            logits.dtype(),
            rows.len()
        );
    }
    let penalized: Vec<Vec<Penalty>> = rows.iter().map(RowSampling::penalized_set).collect();
    if let Some(p) = penalized.iter().flatten().find(|p| p.token as usize >= vocab) {
        candle_core::bail!(
            "sample_rows: penalized token {} lies past the vocabulary of {vocab}",
            p.token
        );
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return cuda::sample_rows(&logits.contiguous()?, rows, &penalized);
    }
    let x = logits.to_vec2::<f32>()?;
    let ids: Vec<u32> = x
        .into_iter()
        .zip(rows)
        .zip(&penalized)
        .map(|((mut row, s), set)| {
            for p in set {
                let x = &mut row[p.token as usize];
                *x = penalize(*x, p.factor) - p.offset;
            }
            sample_row(&row, s)
        })
        .collect();
    Tensor::from_vec(ids, n, logits.device())
}

fn penalize(x: f32, penalty: f32) -> f32 {
    match x > 0.0 {
        true => x / penalty,
        false => x * penalty,
    }
}

/// The u32 whose unsigned order is the float order.
fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    match b & 0x8000_0000 {
        0 => b | 0x8000_0000,
        _ => !b,
    }
}

/// Philox4x32-10's first output word for counter (c0, c1, c2, 0) and key (k0, k1).
fn philox(mut c: [u32; 4], mut k: [u32; 2]) -> u32 {
    for _ in 0..10 {
        let p0 = 0xD251_1F53u64 * c[0] as u64;
        let p1 = 0xCD9E_8D57u64 * c[2] as u64;
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
        k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
    }
    c[0]
}

/// A standard Gumbel variate from 23 random bits: `u` in (0, 1), exact in f32.
fn gumbel(bits: u32) -> f32 {
    let u = ((bits >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0);
    -(-u.ln()).ln()
}

/// `exp(z - top)` in 2⁻³² fixed point, as the kernel weighs tokens for top-p.
fn fixed_weight(z: f32, top: f32) -> u64 {
    (((z - top) * std::f32::consts::LOG2_E).exp2() * 4_294_967_296.0) as u64
}

/// The lowest index of the largest value; NaN never wins (a row of NaN gives 0).
fn first_max(values: impl Iterator<Item = (usize, f32)>) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, v) in values {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v)).filter(|_| !v.is_nan());
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// One row on the host, as cuda/sample.cu's threshold stages, sample_part and sample_join.
fn sample_row(x: &[f32], s: &RowSampling<'_>) -> u32 {
    // NaN or not above 0: greedy, as the kernel reads it.
    if s.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return first_max(x.iter().copied().enumerate());
    }
    let inv = 1.0 / s.temperature;
    let z: Vec<f32> = x.iter().map(|&v| v * inv).collect();
    let (top_k, top_p) = s.narrowing(x.len());
    let mut floor = match top_k {
        Some(k) => {
            let mut keys: Vec<u32> = z.iter().map(|&v| order_key(v)).collect();
            *keys.select_nth_unstable_by_key(k - 1, |&key| std::cmp::Reverse(key)).1
        }
        None => 0,
    };
    if let Some(p) = top_p {
        let top = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // The weights in descending key order: the threshold is the key at which they reach
        // the target.
        let mut by_key: Vec<(u32, u64)> = z
            .iter()
            .map(|&v| (order_key(v), fixed_weight(v, top)))
            .filter(|&(key, _)| key >= floor)
            .collect();
        by_key.sort_unstable_by_key(|&(key, _)| std::cmp::Reverse(key));
        let kept: u64 = by_key.iter().map(|&(_, w)| w).sum();
        let target = ((p as f64 * kept as f64) as u64).max(1);
        let mut sum = 0u64;
        for &(key, w) in &by_key {
            sum += w;
            if sum >= target {
                floor = floor.max(key);
                break;
            }
        }
    }
    let (draw, key) = (
        [s.draw as u32, (s.draw >> 32) as u32],
        [s.seed as u32, (s.seed >> 32) as u32],
    );
    first_max(
        z.iter()
            .enumerate()
            .filter(|&(_, &v)| order_key(v) >= floor)
            .map(|(i, &v)| (i, v + gumbel(philox([i as u32, draw[0], draw[1], 0], key)))),
    )
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Result, Tensor};

    use super::{Penalty, RowSampling};
    use crate::launch::{addresses, device_address, elementwise};

    /// Threads per CTA of the thresholds (THREADS in cuda/sample.cu), and of the draw's parts
    /// (at most THREADS), each over CHUNK tokens: some 63 CTAs a row for a 128K vocabulary.
    const FLOOR_THREADS: u32 = 512;
    const PART_THREADS: u32 = 256;
    const CHUNK: usize = 8 * PART_THREADS as usize;
    /// The thresholds' CTAs take at least this many tokens each (8 a thread), and a step's
    /// rows share about this many CTAs (a few waves of the largest GPUs' SMs; a row has one
    /// at least): each CTA of a stage sums the partials of all of its row's.
    const THRESHOLD_CHUNK: usize = 8 * FLOOR_THREADS as usize;
    const THRESHOLD_CTAS: usize = 256;
    /// The stages of cuda/sample.cu's `Stage`, in launch order.
    const TOP_K_STAGES: [i32; 4] = [0, 1, 2, 3];
    const TOP_P_STAGES: [i32; 6] = [4, 5, 6, 7, 8, 9];
    const DONE: i32 = 10;
    /// cuda/sample.cu's `Select`: a u64 and four u32.
    const SELECT_BYTES: usize = 24;

    /// Each row's lowest kept key into `floors` `[n]` u32, through the stages that some row
    /// needs (`narrowing`: any top-k, any top-p).
    fn thresholds(
        dev: &candle_core::CudaDevice,
        logits: &Tensor,
        params: &Tensor,
        floors: &Tensor,
        narrowing: (bool, bool),
    ) -> Result<()> {
        let (n, vocab) = logits.dims2()?;
        let parts = vocab.div_ceil(THRESHOLD_CHUNK).min((THRESHOLD_CTAS / n).max(1));
        let chunk = vocab.div_ceil(parts);
        let device = logits.device();
        // Two of each, one a stage reads and one it writes; u64 partials as pairs of u32 (a
        // fresh allocation is aligned for them).
        let partial = || crate::empty(&[n * parts * 256 * 2], DType::U32, device);
        let select = || crate::empty(&[n * SELECT_BYTES / 4], DType::U32, device);
        let (partials, selects) = ([partial()?, partial()?], [select()?, select()?]);
        let (x, p, f) = (
            device_address(logits)?,
            device_address(params)?,
            device_address(floors)?,
        );
        let partials = [device_address(&partials[0])?, device_address(&partials[1])?];
        let selects = [device_address(&selects[0])?, device_address(&selects[1])?];
        let mut stages = Vec::new();
        if narrowing.0 {
            stages.extend(TOP_K_STAGES);
        }
        if narrowing.1 {
            stages.extend(TOP_P_STAGES);
        }
        stages.push(DONE);
        let func = crate::module::SAMPLE.kernel(dev, "sample_threshold_stage")?;
        let (vocab_i, chunk_i) = (vocab as i32, chunk as i32);
        let mut prev = -1i32;
        for (i, &stage) in stages.iter().enumerate() {
            let (read, write) = ((i + 1) % 2, i % 2);
            let mut launch = func.builder();
            launch
                .arg(&x)
                .arg(&p)
                .arg(&vocab_i)
                .arg(&chunk_i)
                .arg(&stage)
                .arg(&prev)
                .arg(&partials[read])
                .arg(&partials[write])
                .arg(&selects[read])
                .arg(&selects[write])
                .arg(&f);
            let cfg = LaunchConfig {
                grid_dim: (parts as u32, n as u32, 1),
                block_dim: (FLOOR_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature; the logits are a contiguous
            // f32 [n, vocab], the parameters [n, 8] u32, the partials [n, parts, 256] u64 and
            // the selects n of cuda/sample.cu's Select each, the floors n u32. Each stage reads
            // what the stage before wrote (none for the first: prev is -1).
            unsafe { launch.launch(cfg) }.w()?;
            prev = stage;
        }
        Ok(())
    }

    /// A row's parameters as the kernel reads them (cuda/sample.cu).
    fn params(s: &RowSampling<'_>, vocab: usize) -> [u32; 8] {
        let (top_k, top_p) = s.narrowing(vocab);
        [
            s.temperature.max(0.0).to_bits(),
            top_k.unwrap_or(0).min(u32::MAX as usize) as u32,
            top_p.unwrap_or(1.0).to_bits(),
            s.seed as u32,
            (s.seed >> 32) as u32,
            s.draw as u32,
            (s.draw >> 32) as u32,
            0,
        ]
    }

    pub(super) fn sample_rows(logits: &Tensor, rows: &[RowSampling<'_>], penalized: &[Vec<Penalty>]) -> Result<Tensor> {
        let candle_core::Device::Cuda(dev) = logits.device() else {
            candle_core::bail!("sample_rows: not a CUDA tensor");
        };
        let device = logits.device();
        let (n, vocab) = logits.dims2()?;
        let count: usize = penalized.iter().map(Vec::len).sum();
        // Penalties change a copy: the caller's logits stay as the model gave them.
        let logits = match count {
            0 => logits.clone(),
            _ => {
                let copy = logits.copy()?;
                let all = || penalized.iter().flatten();
                let tokens: Vec<u32> = all().map(|p| p.token).collect();
                let of_row: Vec<u32> = penalized
                    .iter()
                    .enumerate()
                    .flat_map(|(r, set)| std::iter::repeat_n(r as u32, set.len()))
                    .collect();
                let factors: Vec<f32> = all().map(|p| p.factor).collect();
                let offsets: Vec<f32> = all().map(|p| p.offset).collect();
                let tokens = Tensor::new(tokens.as_slice(), device)?;
                let of_row = Tensor::new(of_row.as_slice(), device)?;
                let factors = Tensor::new(factors.as_slice(), device)?;
                let offsets = Tensor::new(offsets.as_slice(), device)?;
                let func = crate::module::SAMPLE.kernel(dev, "penalize")?;
                let (count_i, vocab_i) = (count as i32, vocab as i32);
                let pointers = addresses(&[&copy, &tokens, &of_row, &factors, &offsets])?;
                let mut launch = func.builder();
                for a in &pointers {
                    launch.arg(a);
                }
                launch.arg(&count_i).arg(&vocab_i);
                // SAFETY: the arguments match the kernel's signature; every token lies inside
                // the vocabulary (checked by sample_rows) and each (row, token) is listed once.
                unsafe { launch.launch(elementwise(count)) }.w()?;
                copy
            }
        };
        let params: Vec<u32> = rows.iter().flat_map(|s| params(s, vocab)).collect();
        let params = Tensor::from_vec(params, (n, 8), device)?;
        let (x, p) = (device_address(&logits)?, device_address(&params)?);
        let vocab_i = vocab as i32;
        // Each row's lowest kept key: 0 (all) unless some row keeps fewer.
        let floors = Tensor::zeros(n, DType::U32, device)?;
        let f = device_address(&floors)?;
        let (top_k, top_p) = rows.iter().fold((false, false), |(k, p), s| {
            let (top_k, top_p) = s.narrowing(vocab);
            (k || top_k.is_some(), p || top_p.is_some())
        });
        if top_k || top_p {
            thresholds(dev, &logits, &params, &floors, (top_k, top_p))?;
        }
        let parts = vocab.div_ceil(CHUNK);
        let values = crate::empty(&[n, parts], DType::F32, device)?;
        let indices = crate::empty(&[n, parts], DType::U32, device)?;
        let (v, i) = (device_address(&values)?, device_address(&indices)?);
        let chunk_i = CHUNK as i32;
        let func = crate::module::SAMPLE.kernel(dev, "sample_parts")?;
        let mut launch = func.builder();
        launch
            .arg(&x)
            .arg(&p)
            .arg(&f)
            .arg(&vocab_i)
            .arg(&chunk_i)
            .arg(&v)
            .arg(&i);
        let cfg = LaunchConfig {
            grid_dim: (parts as u32, n as u32, 1),
            block_dim: (PART_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; the winners hold n · parts entries, one per CTA.
        unsafe { launch.launch(cfg) }.w()?;
        let out = crate::empty(&[n], DType::U32, device)?;
        let o = device_address(&out)?;
        let parts_i = parts as i32;
        let func = crate::module::SAMPLE.kernel(dev, "sample_join")?;
        let mut launch = func.builder();
        launch.arg(&v).arg(&i).arg(&parts_i).arg(&o);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (PART_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the winners were written above for every (row, part); the output holds n.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(out)
    }
}
