//! `decode-profile`: where a decode step's time goes on one rank holding the whole model: the
//! model's step (captured graph and eager), sampling, and the kernels alone (each timed inside
//! a captured graph of many calls, as the step runs them). At TP > 1: every rank's bare step
//! and the step's decode-size all-reduces alone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use tpinfer_kernels::RowWeight;
use tpinfer_llama::{LlamaCheckpoint, LlamaRank, LlamaShard};

use crate::WeightsArg;

#[derive(Args)]
pub(crate) struct DecodeProfileArgs {
    /// A Llama directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    cuda: bool,
    /// Timed decode steps per measurement.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Ranks (GPUs 0..tp on CUDA, NCCL between them; threads on CPU). Above 1, only the
    /// step and its all-reduces are timed.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// The form the model's linear weights are held in for its steps (`fp8`: quantized at
    /// load); the kernels alone are timed in both forms either way.
    #[arg(long, value_enum, default_value_t = WeightsArg::AsStored)]
    weights: WeightsArg,
}

/// One kernel call under test.
type Kernel<'a> = dyn Fn() -> candle_core::Result<Tensor> + 'a;

/// Milliseconds per call of `f` as a decode step's graph runs it: on CUDA, `calls` calls
/// captured in one graph and replayed; on CPU, back to back. After a warm-up call.
fn time_in_graph(device: &Device, calls: usize, f: impl Fn() -> candle_core::Result<Tensor>) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        {
            let _uploads = tpinfer_kernels::graph::upload_cache(device)?;
            f()?;
        }
        let graph = tpinfer_kernels::graph::Graph::capture(device, || {
            for _ in 0..calls {
                f()?;
            }
            Ok::<_, candle_core::Error>(())
        })?;
        graph.replay()?;
        device.synchronize()?;
        let replays = 10;
        let start = Instant::now();
        for _ in 0..replays {
            graph.replay()?;
        }
        device.synchronize()?;
        return Ok(start.elapsed().as_secs_f64() * 1e3 / (replays * calls) as f64);
    }
    f()?;
    let start = Instant::now();
    for _ in 0..calls {
        f()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / calls as f64)
}

/// Milliseconds per call of `f`, after two warm-up calls, each call ending in a device sync.
pub(crate) fn time_ms(device: &Device, calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..calls {
        f()?;
        device.synchronize()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / calls as f64)
}

pub(crate) fn run(args: DecodeProfileArgs) -> Result<()> {
    if args.tp > 1 {
        return run_sharded(&args);
    }
    let device = match args.cuda {
        true => crate::gpu()?,
        false => Device::Cpu,
    };
    let dtype = if args.cuda { DType::BF16 } else { DType::F32 };
    let context = args.prompt_tokens + 4 * (args.steps + 2) + 8;
    let checkpoint = LlamaCheckpoint::open_with(&args.model, args.weights.format())?;
    let (mut model, c, prompt) = whole_model(&checkpoint, dtype, &device, args.prompt_tokens, context)?;
    println!(
        "| part (TP 1, {dtype:?}; steps synchronized, kernels timed in a graph) | ms | per token |\n|---|---|---|"
    );
    let step = |model: &mut LlamaRank, graphs: bool| -> Result<f64> {
        model.set_cuda_graphs(graphs)?;
        model.clear_cache();
        model.forward(&prompt)?;
        time_ms(&device, args.steps, || {
            model.forward(&[1])?;
            Ok(())
        })
    };
    let graph = step(&mut model, true)?;
    // A prompt once dropped the graph, and every later step ran eagerly unnoticed.
    if device.is_cuda() && model.decode_graph_replays() < args.steps {
        bail!(
            "only {} of {} decode steps replayed the captured graph",
            model.decode_graph_replays(),
            args.steps
        );
    }
    let mut tokens = Vec::new();
    let greedy = {
        model.clear_cache();
        let logits = model.forward(&prompt)?;
        model.greedy_start(&logits)?;
        time_ms(&device, args.steps, || {
            tokens.push(model.greedy_step(0)?.token);
            Ok(())
        })?
    };
    // As the engine runs greedy requests: each step queued before the host reads the one
    // before, so the device does not idle between them. Timed from an idle device to an idle
    // device, the first step queued on the clock.
    let ahead = {
        model.clear_cache();
        let logits = model.forward(&prompt)?;
        model.greedy_start(&logits)?;
        let mut ahead_tokens = vec![model.greedy_step(0)?.token];
        let start = Instant::now();
        model.greedy_queue(0)?;
        for _ in 0..args.steps {
            model.greedy_queue(0)?;
            ahead_tokens.push(model.greedy_take()?.token);
        }
        ahead_tokens.push(model.greedy_take()?.token);
        let ms = start.elapsed().as_secs_f64() * 1e3 / (args.steps + 1) as f64;
        if ahead_tokens != tokens {
            bail!("greedy steps queued ahead chose other tokens than steps one at a time: {ahead_tokens:?} against {tokens:?}");
        }
        ms
    };
    let eager = step(&mut model, false)?;
    println!(
        "| decode step, captured graph | {graph:.3} | {:.1} tok/s |",
        1e3 / graph
    );
    println!(
        "| decode step, captured graph, greedy token on the device | {greedy:.3} | {:.1} tok/s |",
        1e3 / greedy
    );
    println!(
        "| the same, the next step queued before the host reads a step | {ahead:.3} | {:.1} tok/s |",
        1e3 / ahead
    );
    println!("| decode step, eager | {eager:.3} | {:.1} tok/s |", 1e3 / eager);
    argmax(&device, c.vocab_size, args.steps)?;
    embedding(&device, dtype, &c, args.steps)?;
    gemvs(&device, dtype, &c, args.steps, false)?;
    let (n, k) = (c.hidden_size, c.intermediate_size);
    if tpinfer_kernels::fp8_path(&device, dtype, n, k) == tpinfer_kernels::Fp8Path::Fp8Kernels {
        gemvs(&device, dtype, &c, args.steps, true)?;
    }
    small_kernels(&device, dtype, &c, args.steps)?;
    decode_attention(&device, dtype, &c, args.steps)
}

/// The Llama at `dir` as one rank holding all of it, with a KV cache of `context` tokens, its
/// config, and a prompt of `prompt_tokens` made-up ids.
fn whole_model(
    checkpoint: &LlamaCheckpoint,
    dtype: DType,
    device: &Device,
    prompt_tokens: usize,
    context: usize,
) -> Result<(LlamaRank, tpinfer_llama::LlamaConfig, Vec<u32>)> {
    let c = checkpoint.config.clone();
    let shard = LlamaShard::new(&c, 1, 0)?;
    checkpoint.check(&shard)?;
    let comm = tpinfer_comm::ThreadGroup::ranks(1, std::time::Duration::from_secs(60))
        .pop()
        .context("no rank")?;
    let model = LlamaRank::load(checkpoint, shard, Arc::new(comm), dtype, device, context)?;
    let prompt = made_up_prompt(&c, prompt_tokens);
    Ok((model, c, prompt))
}

/// `tokens` prompt ids spread over the vocabulary, the same at every rank and run.
pub(crate) fn made_up_prompt(c: &tpinfer_llama::LlamaConfig, tokens: usize) -> Vec<u32> {
    (0..tokens)
        .map(|i| ((7919 * i + 13) % c.vocab_size.min(30000)) as u32)
        .collect()
}

/// The greedy token's argmax over `vocab` f32 logits: candle's against `tpinfer_kernels`',
/// which must pick the same token as candle's CPU argmax (the first of tied maxima) on rows
/// rounded to bf16, where ties are common, and with a planted tie.
fn argmax(device: &Device, vocab: usize, calls: usize) -> Result<()> {
    for seed in 0..8u32 {
        let row = Tensor::randn(0f32, 3.0, (1, vocab), device)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?;
        let mut values = row.flatten_all()?.to_vec1::<f32>()?;
        let top = values.iter().cloned().fold(f32::MIN, f32::max);
        // A tie with the maximum, before or after it.
        values[(seed as usize * 7919 + 11) % vocab] = top;
        let row = Tensor::from_vec(values, (1, vocab), device)?;
        let want = row.to_device(&Device::Cpu)?.argmax_keepdim(candle_core::D::Minus1)?;
        let got = tpinfer_kernels::argmax(&row)?.to_device(&Device::Cpu)?;
        let (want, got) = (
            want.flatten_all()?.to_vec1::<u32>()?,
            got.flatten_all()?.to_vec1::<u32>()?,
        );
        if want != got {
            bail!("argmax: tpinfer_kernels picked {got:?}, the CPU argmax {want:?} (row {seed})");
        }
    }
    let logits = Tensor::randn(0f32, 3.0, (1, vocab), device)?;
    let kernels: [(&str, &Kernel); 2] = [
        ("candle", &|| logits.argmax_keepdim(candle_core::D::Minus1)),
        ("tpinfer_kernels", &|| tpinfer_kernels::argmax(&logits)),
    ];
    for (name, f) in kernels {
        let ms = time_in_graph(device, calls, f)?;
        println!("| greedy argmax of {vocab} logits ({name}; equal to the CPU's on 8 tied rows) | {ms:.4} | |");
    }
    Ok(())
}

/// The embedding lookup of a step as the second of two ranks runs it (its half of the
/// vocabulary; ids inside and outside it), which must give the CPU's rows.
fn embedding(device: &Device, dtype: DType, c: &tpinfer_llama::LlamaConfig, calls: usize) -> Result<()> {
    let (first, rows) = (c.vocab_size / 2, c.vocab_size - c.vocab_size / 2);
    let weight = Tensor::randn(0f32, 1.0, (rows, c.hidden_size), device)?.to_dtype(dtype)?;
    let ids = Tensor::new(
        &[[
            3u32,
            first as u32,
            (c.vocab_size - 1) as u32,
            (first - 1) as u32,
            77_777,
        ]],
        device,
    )?;
    let got = tpinfer_kernels::embed_owned_rows(&ids, &weight, first)?;
    let want =
        tpinfer_kernels::embed_owned_rows(&ids.to_device(&Device::Cpu)?, &weight.to_device(&Device::Cpu)?, first)?;
    let bits = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
    if bits(&got.to_device(&Device::Cpu)?)? != bits(&want)? {
        bail!("embed_owned_rows on the device does not give the CPU's rows");
    }
    let one = Tensor::new(&[[first as u32 + 5]], device)?;
    let ms = time_in_graph(device, calls, || {
        tpinfer_kernels::embed_owned_rows(&one, &weight, first)
    })?;
    println!("| embedding lookup of one token, rank 1 of 2 (equal to the CPU's) | {ms:.4} | |");
    Ok(())
}

/// Copies of a weight that together exceed the GPU's L2 cache (50 MiB on an H200), so that
/// each call of a timed loop reads its weight from HBM, as a decode step does.
fn cold_copies(bytes: usize) -> usize {
    (256usize << 20).div_ceil(bytes).max(2)
}

/// A cold copy of a weight as a step holds it: dense, or FP8 values with their row scales.
enum Held {
    Dense(Tensor),
    Fp8(Tensor, Tensor),
}

impl Held {
    fn weight(&self) -> RowWeight<'_> {
        match self {
            Held::Dense(w) => RowWeight::Dense(w),
            Held::Fp8(values, scales) => RowWeight::Fp8 { values, scales },
        }
    }

    /// The weight's values in f32, for the reference product.
    fn f32(&self) -> candle_core::Result<Tensor> {
        match self {
            Held::Dense(w) => w.to_dtype(DType::F32),
            Held::Fp8(values, scales) => tpinfer_kernels::expand_fp8(values, scales, DType::F32),
        }
    }
}

/// The step's weight products: cuBLAS against the GEMV kernel at each tile, each weight read
/// from HBM; and the MLP's gate/up product with its SiLU product in one kernel against the two.
/// With `fp8`, the weights of the layers in E4M3 with row scales, as `--weights fp8` holds
/// them (the LM head stays in `dtype`), and no cuBLAS row.
fn gemvs(device: &Device, dtype: DType, c: &tpinfer_llama::LlamaConfig, calls: usize, fp8: bool) -> Result<()> {
    let (h, ffn, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d;
    let mut totals = [0.0; 2];
    let format = if fp8 { "FP8" } else { "dense" };
    for (name, rows, cols, per_layer) in [
        ("qkv", qkv, h, true),
        ("o_proj", c.num_attention_heads * d, h, true),
        ("gate_up", 2 * ffn, h, true),
        ("down", h, ffn, true),
        ("lm_head", c.vocab_size, h, false),
    ] {
        if fp8 && !per_layer {
            continue;
        }
        let bytes = rows * cols * if fp8 { 1 } else { dtype.size_in_bytes() };
        let weights = (0..cold_copies(bytes))
            .map(|_| -> Result<Held> {
                let w = Tensor::randn(0f32, 0.02, (rows, cols), device)?;
                Ok(match fp8 {
                    false => Held::Dense(w.to_dtype(dtype)?),
                    true => {
                        let (values, scales) = tpinfer_weights::quantize_rows(&w.to_device(&Device::Cpu)?)?;
                        Held::Fp8(values.to_device(device)?, scales.to_device(device)?)
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let x = Tensor::randn(0f32, 1.0, (1, 1, cols), device)?.to_dtype(dtype)?;
        let exact = x.to_dtype(DType::F32)?.broadcast_matmul(&weights[0].f32()?.t()?)?;
        let next = std::cell::Cell::new(0);
        let weight = || {
            next.set((next.get() + 1) % weights.len());
            weights[next.get()].weight()
        };
        let layers = if per_layer { c.num_hidden_layers } else { 1 };
        let row = |kernel: String, ms: f64, y: Tensor| -> Result<()> {
            let err = crate::relative_error(&y, &exact)?;
            println!(
                "| GEMV {name} [{rows} x {cols}], {format} ({kernel}, rel. error vs f32 {err:.1e}) | {ms:.4} | {:.0} GB/s, x{layers} = {:.2} ms |",
                bytes as f64 / ms / 1e6,
                ms * layers as f64
            );
            Ok(())
        };
        let mut cublas = 0.0;
        if let Held::Dense(w0) = &weights[0] {
            let dense = |w: RowWeight| match w {
                RowWeight::Dense(w) => x.broadcast_matmul(&w.t()?),
                RowWeight::Fp8 { .. } => candle_core::bail!("a dense weight"),
            };
            cublas = time_in_graph(device, calls, || dense(weight()))?;
            row("candle/cuBLAS".into(), cublas, x.broadcast_matmul(&w0.t()?)?)?;
        }
        for tile in tpinfer_kernels::GEMV_TILES {
            let ms = time_in_graph(device, calls, || tpinfer_kernels::gemv_tiled(&x, weight(), tile))?;
            row(
                format!("tpinfer_kernels::gemv, {tile} rows per block"),
                ms,
                tpinfer_kernels::gemv_tiled(&x, weights[0].weight(), tile)?,
            )?;
        }
        let ms = time_in_graph(device, calls, || tpinfer_kernels::gemv(&x, weight()))?;
        row(
            "tpinfer_kernels::gemv as the step runs it".into(),
            ms,
            tpinfer_kernels::gemv(&x, weights[0].weight())?,
        )?;
        totals[0] += cublas * layers as f64;
        totals[1] += ms * layers as f64;
        if name == "gate_up" {
            let unfused = time_in_graph(device, calls, || {
                tpinfer_kernels::silu_mul(&tpinfer_kernels::gemv(&x, weight())?.reshape((1, rows))?)
            })?;
            let fused = time_in_graph(device, calls, || tpinfer_kernels::gemv_gate_up_silu(&x, weight()))?;
            let w0 = weights[0].weight();
            let want = tpinfer_kernels::silu_mul(&tpinfer_kernels::gemv(&x, w0)?.reshape((1, rows))?)?;
            let got = tpinfer_kernels::gemv_gate_up_silu(&x, w0)?;
            if bits(&got)? != bits(&want)? {
                bail!("gemv_gate_up_silu ({format}) does not give the bits of gemv + silu_mul");
            }
            println!(
                "| gate_up and SiLU product, {format}: gemv + silu_mul / gemv_gate_up_silu (same bits) | {unfused:.4} / {fused:.4} | x{layers} = {:.2} / {:.2} ms |",
                unfused * layers as f64,
                fused * layers as f64
            );
        }
        if name == "qkv" && tpinfer_kernels::gemv_on_cuda(&x, weights[0].weight()) {
            qkv_rotary(device, dtype, c, calls, &x, weights[0].weight(), &weight, None)?;
            // Qwen2's biased QKV.
            let bias = Tensor::randn(0f32, 1.0, rows, device)?.to_dtype(dtype)?;
            qkv_rotary(device, dtype, c, calls, &x, weights[0].weight(), &weight, Some(&bias))?;
        }
    }
    match fp8 {
        false => println!(
            "| all weight GEMVs of a step, cuBLAS / tpinfer_kernels::gemv | {:.3} / {:.3} | |",
            totals[0], totals[1]
        ),
        true => println!(
            "| all FP8 weight GEMVs of a step's layers, tpinfer_kernels::gemv | {:.3} | |",
            totals[1]
        ),
    }
    Ok(())
}

/// A tensor's values as f32, to compare bits.
fn bits(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// The QKV product, its `bias` added, followed by the rotation and the cache write (gemv,
/// an add, rotary_qkv_into) against the kernel that does all three (gemv_rotary_qkv_into):
/// the same bits in the queries and the whole cache, and the time of each. `weight` cycles
/// through cold copies of `first`.
#[allow(clippy::too_many_arguments)]
fn qkv_rotary<'w>(
    device: &Device,
    dtype: DType,
    c: &tpinfer_llama::LlamaConfig,
    calls: usize,
    x: &Tensor,
    first: RowWeight<'w>,
    weight: &dyn Fn() -> RowWeight<'w>,
    bias: Option<&Tensor>,
) -> Result<()> {
    let (heads, kv_heads, d, capacity) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, 4096);
    let table = Tensor::randn(0f32, 1.0, (2, capacity, d / 2), device)?.to_dtype(dtype)?;
    let position = Tensor::new(&[100u32], device)?;
    let outputs = || -> candle_core::Result<(Tensor, Tensor)> {
        Ok((
            Tensor::zeros((2, kv_heads, capacity, d), dtype, device)?,
            Tensor::zeros((1, heads, d), dtype, device)?,
        ))
    };
    let unfused = |w: RowWeight, (cache, queries): &(Tensor, Tensor)| -> candle_core::Result<Tensor> {
        let mut product = tpinfer_kernels::gemv(x, w)?.reshape((1, ()))?;
        if let Some(b) = bias {
            product = product.broadcast_add(b)?;
        }
        tpinfer_kernels::rotary_qkv_into(cache, &product, None, &table, &position, heads, queries)?;
        Ok(queries.clone())
    };
    let fused = |w: RowWeight, (cache, queries): &(Tensor, Tensor)| -> candle_core::Result<Tensor> {
        tpinfer_kernels::gemv_rotary_qkv_into(cache, x, w, bias, &table, &position, heads, queries)?;
        Ok(queries.clone())
    };
    let (want, got) = (outputs()?, outputs()?);
    unfused(first, &want)?;
    fused(first, &got)?;
    let format = match (first, bias) {
        (RowWeight::Dense(_), None) => "dense",
        (RowWeight::Dense(_), Some(_)) => "dense with a bias",
        (RowWeight::Fp8 { .. }, None) => "FP8",
        (RowWeight::Fp8 { .. }, Some(_)) => "FP8 with a bias",
    };
    if bits(&got.0)? != bits(&want.0)? || bits(&got.1)? != bits(&want.1)? {
        bail!("gemv_rotary_qkv_into ({format}) does not give the bits of gemv + rotary_qkv_into");
    }
    let buffers = outputs()?;
    let t_unfused = time_in_graph(device, calls, || unfused(weight(), &buffers))?;
    let t_fused = time_in_graph(device, calls, || fused(weight(), &buffers))?;
    let layers = c.num_hidden_layers as f64;
    println!(
        "| QKV and rotation, {format}: gemv + rotary_qkv_into / gemv_rotary_qkv_into (same bits) | {t_unfused:.4} / {t_fused:.4} | x{layers} = {:.2} / {:.2} ms |",
        t_unfused * layers,
        t_fused * layers
    );
    Ok(())
}

/// The step at TP > 1, every rank on its own thread: the greedy step on the device (synchronized
/// each step), and the step's all-reduces of one hidden row timed alone in a captured graph.
fn run_sharded(args: &DecodeProfileArgs) -> Result<()> {
    let checkpoint = Arc::new(LlamaCheckpoint::open(&args.model)?);
    let c = checkpoint.config.clone();
    let dtype = if args.cuda { DType::BF16 } else { DType::F32 };
    let prompt = made_up_prompt(&c, args.prompt_tokens);
    let context = args.prompt_tokens + args.steps + 8;
    // Per step: the embedding's, two per layer, and the greedy step's flag sum.
    let sums = 2 * c.num_hidden_layers + 2;
    let results = on_ranks(args.tp, args.cuda, |comm, device| -> Result<(f64, f64)> {
        let rank = comm.rank();
        let shard = LlamaShard::new(&checkpoint.config, args.tp, rank)?;
        checkpoint.check(&shard)?;
        let mut model = LlamaRank::load(&checkpoint, shard, comm.clone(), dtype, &device, context)?;
        let logits = model.forward(&prompt)?;
        model.greedy_start(&logits)?;
        let step = time_ms(&device, args.steps, || {
            model.greedy_step(0)?;
            Ok(())
        })?;
        if device.is_cuda() && model.decode_graph_replays() < args.steps {
            bail!("rank {rank}: the decode steps did not replay the captured graph");
        }
        let row = Tensor::randn(0f32, 1.0, (1, c.hidden_size), &device)?.to_dtype(dtype)?;
        let sum = time_in_graph(&device, args.steps, || {
            comm.all_reduce_sum(&row)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        })?;
        Ok((step, sum))
    })?;
    println!(
        "| part (TP {}, {dtype:?}; steps synchronized, collectives timed in a graph) | ms per rank | per token |\n|---|---|---|",
        args.tp
    );
    let steps: Vec<String> = results.iter().map(|(step, _)| format!("{step:.3}")).collect();
    let slowest = results.iter().map(|(step, _)| *step).fold(0.0, f64::max);
    println!(
        "| decode step, captured graph, greedy token on the device | {} | {:.1} tok/s |",
        steps.join(" / "),
        1e3 / slowest
    );
    let sum = results.iter().map(|(_, sum)| *sum).fold(0.0, f64::max);
    println!(
        "| all-reduce of one {}-wide row | {sum:.4} | x{sums} = {:.2} ms |",
        c.hidden_size,
        sum * sums as f64
    );
    Ok(())
}

/// Runs `f` on `tp` ranks, each on its own thread with its communicator and device (NCCL on
/// CUDA devices 0..tp, or CPU thread ranks). The ranks' results, in rank order.
pub(crate) fn on_ranks<T: Send>(
    tp: usize,
    cuda: bool,
    f: impl Fn(Arc<dyn tpinfer_comm::Communicator>, Device) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let connects = ranks(tp, cuda)?;
    std::thread::scope(|s| {
        let handles: Vec<_> = connects
            .into_iter()
            .map(|connect| {
                let f = &f;
                s.spawn(move || {
                    let (comm, device) = connect()?;
                    f(comm, device)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?)
            .collect()
    })
}

/// Connects rank r of `tp` on its own thread: NCCL on CUDA device r, or a CPU thread rank.
type Connect = Box<dyn FnOnce() -> Result<(Arc<dyn tpinfer_comm::Communicator>, Device)> + Send>;

fn ranks(tp: usize, cuda: bool) -> Result<Vec<Connect>> {
    let timeout = std::time::Duration::from_secs(120);
    if !cuda {
        return Ok(tpinfer_comm::ThreadGroup::ranks(tp, timeout)
            .into_iter()
            .map(|comm| -> Connect { Box::new(move || Ok((Arc::new(comm) as _, Device::Cpu))) })
            .collect());
    }
    #[cfg(feature = "nccl")]
    {
        // Opened first: a missing GPU fails here, not as the others' NCCL init timeout.
        let devices = (0..tp)
            .map(|rank| Device::new_cuda(rank).with_context(|| format!("--tp {tp}: cannot open CUDA device {rank}")))
            .collect::<Result<Vec<_>>>()?;
        let group = tpinfer_comm::NcclGroup::new(tp, timeout, crate::comm_options())?;
        Ok(devices
            .into_iter()
            .enumerate()
            .map(|(rank, device)| -> Connect {
                let group = group.clone();
                Box::new(move || {
                    let comm = tpinfer_comm::NcclComm::connect(group, &device, rank)?;
                    // Stays on this rank's thread, which built it (NCCL communicators must).
                    #[allow(clippy::arc_with_non_send_sync)]
                    let comm = Arc::new(comm) as Arc<dyn tpinfer_comm::Communicator>;
                    Ok((comm, device))
                })
            })
            .collect())
    }
    #[cfg(not(feature = "nccl"))]
    anyhow::bail!("decode-profile --cuda --tp {tp} needs a build with the nccl feature")
}

/// The fused one-row kernels of a decode step's layer.
fn small_kernels(device: &Device, dtype: DType, c: &tpinfer_llama::LlamaConfig, calls: usize) -> Result<()> {
    let (h, ffn, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
    let row = |n: usize| -> Result<Tensor> { Ok(Tensor::randn(0f32, 1.0, (1, n), device)?.to_dtype(dtype)?) };
    let (x, y, w, gate_up) = (row(h)?, row(h)?, row(h)?.squeeze(0)?, row(2 * ffn)?);
    let qkv = row((heads + 2 * kv_heads) * d)?;
    let table = Tensor::randn(0f32, 1.0, (2, 4096, d / 2), device)?.to_dtype(dtype)?;
    let position = Tensor::new(&[100u32], device)?;
    let cache = Tensor::zeros((2, kv_heads, 4096, d), dtype, device)?;
    let kernels: [(&str, usize, &Kernel); 3] = [
        ("add_rms_norm", 2, &|| {
            Ok(tpinfer_kernels::add_rms_norm(&x, &y, &w, 1e-5)?.0)
        }),
        ("silu_mul", 1, &|| tpinfer_kernels::silu_mul(&gate_up)),
        ("rotary_qkv (queries out, keys and values into the cache)", 1, &|| {
            tpinfer_kernels::rotary_qkv(&cache, &qkv, &table, &position, heads)
        }),
    ];
    for (name, per_layer, f) in kernels {
        let ms = time_in_graph(device, calls, f)?;
        let n = per_layer * c.num_hidden_layers;
        println!("| {name} (one row) | {ms:.4} | x{n} = {:.2} ms |", ms * n as f64);
    }
    Ok(())
}

/// One layer's decode attention over a cache at many lengths: the flash kernel over the filled
/// rows against the cache kernels (split-KV on CUDA), each against an f32 reference.
fn decode_attention(device: &Device, dtype: DType, c: &tpinfer_llama::LlamaConfig, calls: usize) -> Result<()> {
    let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
    // Lengths either side of one tile of 16 keys, of a CTA's four warps' tiles and of one
    // cluster's most keys (8 × 256): each path of the split kernel, with the flash kernel
    // beside it. A TP 2 rank's half of the KV heads takes two clusters a head past 2,048 keys,
    // whose partials meet in global memory.
    let lengths = [1, 16, 17, 64, 65, 256, 512, 513, 1024, 2048, 2049, 4096];
    decode_attention_rows(device, dtype, c, calls, (heads, kv_heads), &lengths, "")?;
    if kv_heads % 2 == 0 && kv_heads >= 2 {
        let rank = format!(", a TP 2 rank's {} heads", heads / 2);
        decode_attention_rows(
            device,
            dtype,
            c,
            calls,
            (heads / 2, kv_heads / 2),
            &[2048, 2049, 4096],
            &rank,
        )?;
    }
    Ok(())
}

/// The rows of [`decode_attention`] for `heads` query heads over `kv_heads`, at each filled
/// length of a 4,096-row cache: the flash kernel over the filled rows (only for a whole rank,
/// `label` empty) and the cache kernel, each against an f32 reference.
fn decode_attention_rows(
    device: &Device,
    dtype: DType,
    c: &tpinfer_llama::LlamaConfig,
    calls: usize,
    (heads, kv_heads): (usize, usize),
    lengths: &[usize],
    label: &str,
) -> Result<()> {
    let (d, capacity) = (c.head_dim, 4096);
    let scale = 1.0 / (d as f64).sqrt();
    let q = Tensor::randn(0f32, 1.0, (1, heads, d), device)?.to_dtype(dtype)?;
    let k = Tensor::randn(0f32, 1.0, (capacity, kv_heads, d), device)?.to_dtype(dtype)?;
    let v = Tensor::randn(0f32, 1.0, (capacity, kv_heads, d), device)?.to_dtype(dtype)?;
    // One scratch for every length, as a rank's model holds one for all its layers.
    let scratch = tpinfer_kernels::DecodeScratch::new();
    for &filled in lengths {
        let keys = |t: &Tensor| t.narrow(0, 0, filled);
        let exact = reference_attention(&q, &keys(&k)?, &keys(&v)?, scale)?;
        let position = Tensor::new(&[filled as u32 - 1], device)?;
        let flash: (&str, &Kernel) = ("flash kernel over the filled rows", &|| {
            tpinfer_kernels::flash_attention(&q, &keys(&k)?, &keys(&v)?, scale, true)
        });
        let cache: (&str, &Kernel) = ("cache kernel (split-KV on CUDA)", &|| {
            tpinfer_kernels::flash_attention_cached(&q, &k, &v, &position, scale, &scratch)
        });
        let kernels = if label.is_empty() {
            vec![flash, cache]
        } else {
            vec![cache]
        };
        for (kernel, f) in kernels {
            let ms = time_in_graph(device, calls, f)?;
            let err = crate::relative_error(&f()?, &exact)?;
            // bf16 inputs and output against f32 land near 4e-3; a wrong split or merge, near 1.
            if err > 2e-2 {
                bail!("decode attention, {filled} keys{label}, {kernel}: relative error {err:.1e} against f32");
            }
            println!(
                "| decode attention, {filled} keys{label}, {kernel} (rel. error vs f32 {err:.1e}) | {ms:.4} | x{} = {:.2} ms |",
                c.num_hidden_layers,
                ms * c.num_hidden_layers as f64
            );
        }
    }
    Ok(())
}

/// Softmax attention of `q` `[1, heads, d]` over `k`, `v` `[t, kv_heads, d]` in f32.
fn reference_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, heads, d) = q.dims3()?;
    let kv_heads = k.dim(1)?;
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let q = f(q)?.reshape((kv_heads, heads / kv_heads, d))?;
    let (k, v) = (
        f(k)?.transpose(0, 1)?.contiguous()?,
        f(v)?.transpose(0, 1)?.contiguous()?,
    );
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    Ok(probs.matmul(&v)?.reshape((1, heads, d))?)
}
