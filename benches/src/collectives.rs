//! `collectives`: what each collective of the tensor-parallel layers costs at the sizes the
//! models send, on ranks joined as the engine joins them (NCCL between GPUs, threads on CPU):
//! the all-reduce of a row-parallel output, and its two halves under sequence parallelism,
//! the reduce-scatter and the all-gather. Every sum is checked against its known value.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use clap::Args;

use crate::decode::{on_ranks, time_ms};

#[derive(Args)]
pub(crate) struct CollectivesArgs {
    /// Ranks (GPUs 0..tp on CUDA).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    #[arg(long)]
    cuda: bool,
    /// Row width of the activations (Wan-14B: 5120; Llama-3-8B: 4096).
    #[arg(long, default_value_t = 5120)]
    width: usize,
    /// Rows of each message (Wan-14B at 480p: 9,360 / 17,160 / 32,760 tokens for 21 / 41 / 81
    /// frames; a decode step: 1).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 9360, 17160, 32760])]
    rows: Vec<usize>,
    /// Timed calls per collective and size (after one warm-up).
    #[arg(long, default_value_t = 10)]
    calls: usize,
}

/// One rank's milliseconds per call for each size: all-reduce, reduce-scatter, all-gather.
type Times = Vec<[f64; 3]>;

pub(crate) fn run(args: CollectivesArgs) -> Result<()> {
    let dtype = if args.cuda { DType::BF16 } else { DType::F32 };
    let args = &args;
    let results: Vec<Times> = on_ranks(args.tp, args.cuda, |comm, device| -> Result<Times> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut times = Vec::new();
        for &rows in &args.rows {
            let sizes: Vec<usize> = tpinfer_layers::split_evenly(rows, world)
                .iter()
                .map(|r| r.len())
                .collect();
            // Rank r sends r + 1 everywhere: every sum is world (world + 1) / 2.
            let value = (rank + 1) as f64;
            let full = Tensor::full(value, (rows, args.width), &device)?.to_dtype(dtype)?;
            let own = Tensor::full(value, (sizes[rank], args.width), &device)?.to_dtype(dtype)?;
            let total = (world * (world + 1) / 2) as f32;
            let rows_of = |t: &Tensor| -> Result<Vec<Vec<f32>>> { Ok(t.to_dtype(DType::F32)?.to_vec2()?) };
            let all_are = |t: &Tensor, v: f32| -> Result<bool> { Ok(rows_of(t)?.iter().flatten().all(|&x| x == v)) };
            ensure!(
                all_are(&comm.all_reduce_sum(&full)?, total)?,
                "rank {rank}: wrong all-reduce"
            );
            ensure!(
                all_are(&comm.reduce_scatter_sum(&full, &sizes)?, total)?,
                "rank {rank}: wrong reduce-scatter"
            );
            let owner: Vec<f32> = sizes
                .iter()
                .enumerate()
                .flat_map(|(r, &n)| std::iter::repeat_n((r + 1) as f32, n))
                .collect();
            let gathered = rows_of(&comm.all_gather_sized(&own, 0, &sizes)?)?;
            ensure!(
                gathered.len() == rows && gathered.iter().zip(&owner).all(|(row, &v)| row.iter().all(|&x| x == v)),
                "rank {rank}: wrong all-gather"
            );
            let calls = args.calls;
            let reduce = time_ms(&device, calls, || {
                comm.all_reduce_sum(&full)?;
                Ok(())
            })?;
            let scatter = time_ms(&device, calls, || {
                comm.reduce_scatter_sum(&full, &sizes)?;
                Ok(())
            })?;
            let gather = time_ms(&device, calls, || {
                comm.all_gather_sized(&own, 0, &sizes)?;
                Ok(())
            })?;
            times.push([reduce, scatter, gather]);
        }
        Ok(times)
    })?;
    let world = args.tp as f64;
    println!(
        "| rows × {} ({dtype:?}, TP {}) | MiB | all-reduce ms (bus GB/s) | reduce-scatter ms (bus GB/s) | all-gather ms (bus GB/s) |\n|---|---|---|---|---|",
        args.width, args.tp
    );
    for (i, &rows) in args.rows.iter().enumerate() {
        let bytes = (rows * args.width * dtype.size_in_bytes()) as f64;
        // The slowest rank's time; bus bandwidth as nccl-tests reports it.
        let ms = |k: usize| results.iter().map(|t| t[i][k]).fold(0.0, f64::max);
        let bus = |k: usize, factor: f64| bytes * factor / (ms(k) * 1e-3) / 1e9;
        println!(
            "| {rows} | {:.1} | {:.4} ({:.0}) | {:.4} ({:.0}) | {:.4} ({:.0}) |",
            bytes / (1 << 20) as f64,
            ms(0),
            bus(0, 2.0 * (world - 1.0) / world),
            ms(1),
            bus(1, (world - 1.0) / world),
            ms(2),
            bus(2, (world - 1.0) / world),
        );
    }
    Ok(())
}
