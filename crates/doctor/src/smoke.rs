//! The NCCL smoke test a doctor child process runs: join a communicator over some GPUs, check
//! the sums of all-reduces from decode-sized to bandwidth-sized messages and time them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::{CommOptions, Communicator, NcclComm, NcclGroup};

use crate::{AllReduceRow, SmokeOutcome, SMOKE_JOINED};

/// Runs the smoke test over `gpus`, one rank thread per GPU, with the peer paths `options`
/// allows. Progress goes to stderr.
pub fn run_smoke(gpus: &[usize], sizes: &[usize], timeout: Duration, options: CommOptions) -> SmokeOutcome {
    let failed = |error: String| SmokeOutcome::Failed {
        error,
        nccl_log: Vec::new(),
    };
    let devices = match gpus.iter().map(|&g| Device::new_cuda(g)).collect::<Result<Vec<_>, _>>() {
        Ok(d) => d,
        Err(e) => return failed(format!("cannot open the GPUs: {e}")),
    };
    let group = match NcclGroup::new(gpus.len(), timeout, options) {
        Ok(g) => g,
        Err(e) => return failed(e.to_string()),
    };
    let start = Instant::now();
    let world = gpus.len();
    let handles: Vec<_> = devices
        .into_iter()
        .enumerate()
        .map(|(rank, device)| {
            let group = group.clone();
            let sizes = sizes.to_vec();
            std::thread::spawn(move || rank_smoke(group, device, rank, world, &sizes, start))
        })
        .collect();
    let mut results = Vec::new();
    for h in handles {
        match h.join() {
            Ok(r) => results.push(r),
            Err(_) => return failed("a rank thread panicked".into()),
        }
    }
    let mut init_ms = 0.0;
    let mut sum_correct = true;
    let mut table = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                init_ms = f64::max(init_ms, r.init_ms);
                sum_correct &= r.sum_correct;
                if rank == 0 {
                    table = r.table;
                }
            }
            Err(e) => return failed(format!("rank {rank}: {e}")),
        }
    }
    SmokeOutcome::Passed {
        init_ms,
        sum_correct,
        table,
    }
}

struct RankResult {
    init_ms: f64,
    sum_correct: bool,
    table: Vec<AllReduceRow>,
}

fn rank_smoke(
    group: Arc<NcclGroup>,
    device: Device,
    rank: usize,
    world: usize,
    sizes: &[usize],
    start: Instant,
) -> Result<RankResult, String> {
    let comm = NcclComm::connect(group.clone(), &device, rank).map_err(|e| {
        group.fail(rank, &e.to_string());
        e.to_string()
    })?;
    let init_ms = start.elapsed().as_secs_f64() * 1e3;
    eprintln!("{SMOKE_JOINED} {rank} after {init_ms:.0} ms");
    let err = |e: candle_core::Error| e.to_string();
    let ones = Tensor::ones(1024, DType::F32, &device).map_err(err)?;
    let summed = comm.all_reduce_sum(&ones).map_err(|e| e.to_string())?;
    // Reading the sums back bounds this wait by the communicator's timeout.
    let gathered = comm.all_gather(&summed, 0).map_err(|e| e.to_string())?;
    let mut sum_correct = gathered
        .to_vec1::<f32>()
        .map_err(err)?
        .iter()
        .all(|&v| v == world as f32);
    let mut table = Vec::new();
    for &bytes in sizes {
        // Each rank adds its own value, so that a sum that read one rank's buffer twice shows
        // (NCCL's protocols and channels differ with the size).
        let x = Tensor::full((rank + 1) as f32, bytes / 4, &device).map_err(err)?;
        let mut last = None;
        // Few repeats for large messages: the timing is stable and the link is the bottleneck.
        let per_batch = if bytes >= 64 << 20 { 5 } else { 20 };
        let mut batches = Vec::new();
        for batch in 0..6 {
            device.synchronize().map_err(err)?;
            let t = Instant::now();
            for _ in 0..per_batch {
                last = Some(comm.all_reduce_sum(&x).map_err(|e| e.to_string())?);
            }
            device.synchronize().map_err(err)?;
            // The first batch warms up NCCL's buffers and channels for this size.
            if batch > 0 {
                batches.push(t.elapsed().as_secs_f64() / per_batch as f64);
            }
        }
        if let Some(sum) = last {
            let worst = (sum - (world * (world + 1) / 2) as f64)
                .and_then(|d| d.abs())
                .and_then(|d| d.max(0))
                .and_then(|d| d.to_scalar::<f32>())
                .map_err(err)?;
            sum_correct &= worst == 0.0;
        }
        batches.sort_by(f64::total_cmp);
        let seconds = batches[batches.len() / 2];
        let algbw = bytes as f64 / seconds / 1e9;
        table.push(AllReduceRow {
            bytes,
            micros: seconds * 1e6,
            algbw_gbs: algbw,
            busbw_gbs: algbw * 2.0 * (world as f64 - 1.0) / world as f64,
        });
    }
    comm.barrier().map_err(|e| e.to_string())?;
    Ok(RankResult {
        init_ms,
        sum_correct,
        table,
    })
}
