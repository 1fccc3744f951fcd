//! What fits: the smallest TP width, the longest context or the most frames at a width.

use candle_core::DType;
use serde::Serialize;

use crate::{gib, DeviceProfile, Placement, Plan, ShardedModel};

/// How a model fits at one TP width.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WidthFit {
    pub tp: usize,
    /// The largest rank's bytes for the requested placement.
    pub peak: u64,
    pub fits: bool,
    /// LLM: the longest context that fits at this width.
    pub max_context: Option<usize>,
    /// DiT: the most frames (4k + 1) that fit at this width, at the requested size.
    pub max_frames: Option<usize>,
    /// LLM serving several sequences: how many at full context the paged KV cache the
    /// budget affords holds, beside the requested batch's temporaries.
    pub kv_sequences: Option<usize>,
}

/// How `model` fits `budget` at each width in `widths` (widths it cannot shard to are skipped),
/// a serving LLM's KV cache sized to the budget at each ([`with_kv_sequences`]).
pub fn fit_table(
    model: &dyn ShardedModel,
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
    budget: u64,
    widths: impl IntoIterator<Item = usize>,
) -> Vec<WidthFit> {
    widths
        .into_iter()
        .filter_map(|tp| {
            // Planned as the engine places it: a serving LLM's KV cache sized to the budget.
            let kv_sequences = kv_sequences_that_fit(model, tp, dtype, placement, device, budget);
            let placement = with_kv_sequences(placement, kv_sequences);
            let plan = Plan::new(model, tp, dtype, placement, device).ok()?;
            let peak = plan.peak().total();
            let (max_context, max_frames) = match placement {
                Placement::Llm { batch, .. } => (largest_context(model, tp, dtype, device, budget, batch), None),
                Placement::Dit { width, height, cfg, .. } => (
                    None,
                    most_frames(model, tp, dtype, device, budget, (width, height, cfg)),
                ),
            };
            Some(WidthFit {
                tp,
                peak,
                fits: peak <= budget,
                max_context,
                max_frames,
                kv_sequences,
            })
        })
        .collect()
}

/// The most sequences at full context whose paged KV cache fits `budget` at width `tp`,
/// beside the rest of `placement` (an LLM serving `batch` > 1 sequences, whose temporaries
/// count at the batch): what a budget-sized pool holds. `None` for other placements, or when
/// not even one fits.
pub fn kv_sequences_that_fit(
    model: &dyn ShardedModel,
    tp: usize,
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
    budget: u64,
) -> Option<usize> {
    let Placement::Llm { max_context, batch, .. } = placement else {
        return None;
    };
    if batch <= 1 {
        return None;
    }
    let fits = |sequences: usize| {
        let placement = Placement::Llm {
            max_context,
            batch,
            kv_sequences: Some(sequences),
        };
        Plan::new(model, tp, dtype, placement, device).is_ok_and(|p| p.fits(budget))
    };
    // A pool past a million full contexts is beyond any device.
    largest(1, 1 << 20, fits)
}

/// `placement` with its paged KV cache holding the `fit` full contexts a budget affords
/// ([`kv_sequences_that_fit`]): an LLM serving `batch` > 1 sequences keeps a pool of at most
/// `batch`, fewer where the budget holds fewer. Other placements, or no fit (not even one
/// sequence), come back as they are (and their plan refuses them).
pub fn with_kv_sequences(placement: Placement, fit: Option<usize>) -> Placement {
    match (placement, fit) {
        (Placement::Llm { max_context, batch, .. }, Some(fit)) if fit < batch => Placement::Llm {
            max_context,
            batch,
            kv_sequences: Some(fit),
        },
        _ => placement,
    }
}

/// The smallest width from `from` up that fits `placement` in `budget`.
pub fn smallest_width(
    model: &dyn ShardedModel,
    dtype: DType,
    placement: Placement,
    device: DeviceProfile,
    budget: u64,
    from: usize,
) -> Option<usize> {
    (from..=model.max_tp()).find(|&tp| {
        Plan::new(model, tp, dtype, placement, device)
            .map(|p| p.fits(budget))
            .unwrap_or(false)
    })
}

fn largest_context(
    model: &dyn ShardedModel,
    tp: usize,
    dtype: DType,
    device: DeviceProfile,
    budget: u64,
    batch: usize,
) -> Option<usize> {
    let limit = model.max_context()?;
    // Serving several sequences, a context fits when the budget's KV cache holds one at full
    // length (the others share it).
    let fits = |context: usize| {
        let placement = Placement::Llm {
            max_context: context,
            batch,
            kv_sequences: (batch > 1).then_some(1),
        };
        Plan::new(model, tp, dtype, placement, device)
            .map(|p| p.fits(budget))
            .unwrap_or(false)
    };
    largest(1, limit, fits)
}

fn most_frames(
    model: &dyn ShardedModel,
    tp: usize,
    dtype: DType,
    device: DeviceProfile,
    budget: u64,
    (width, height, cfg): (usize, usize, bool),
) -> Option<usize> {
    let fits = |k: usize| {
        let placement = Placement::Dit {
            frames: 4 * k + 1,
            width,
            height,
            cfg,
        };
        Plan::new(model, tp, dtype, placement, device)
            .map(|p| p.fits(budget))
            .unwrap_or(false)
    };
    // Up to 1,001 frames: a minute of 16 fps video in one window.
    largest(0, 250, fits).map(|k| 4 * k + 1)
}

/// The largest `n` in `lo..=hi` with `fits(n)`, for a `fits` that holds up to some point.
fn largest(lo: usize, hi: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if !fits(lo) {
        return None;
    }
    let (mut good, mut bad) = (lo, hi + 1);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        match fits(mid) {
            true => good = mid,
            false => bad = mid,
        }
    }
    Some(good)
}

/// The refusal for a plan over `budget`: which rank, its bytes against the budget, and what
/// would fit (a wider TP, a shorter context, fewer frames).
pub fn over_budget_message(model: &dyn ShardedModel, plan: &Plan, dtype: DType, budget: u64) -> String {
    let r = plan.peak();
    let cache = match plan.placement {
        Placement::Llm { .. } => "KV cache",
        Placement::Dit { .. } => "latents",
    };
    // CPU ranks are threads sharing the host's memory: there are no GPUs to add.
    let (unit, remedy) = match plan.device.is_cuda() {
        true => ("per GPU", "add GPUs or use a smaller dtype"),
        false => (
            "per CPU rank",
            "the CPU ranks share the host's memory: use a smaller dtype or model",
        ),
    };
    let mut message = format!(
        "rank {} needs {:.2} GiB but {:.2} GiB is available {unit} (weights {:.2}, {cache} {:.2}, activations {:.2} \
         + allocator slack {:.2}, buffers {:.2}, workspace {:.2}, CUDA context {:.2} GiB)",
        r.rank,
        gib(r.total()),
        gib(budget),
        gib(r.weights),
        gib(r.cache),
        gib(r.activations),
        gib(r.allocator_slack),
        gib(r.buffers),
        gib(r.workspace),
        gib(r.context),
    );
    let mut options = Vec::new();
    if let Some(tp) = smallest_width(model, dtype, plan.placement, plan.device, budget, plan.tp + 1) {
        options.push(format!("--tp {tp}"));
    }
    match plan.placement {
        Placement::Llm { batch, .. } => {
            if let Some(context) = largest_context(model, plan.tp, dtype, plan.device, budget, batch) {
                options.push(format!("--max-context {context}"));
            }
            if batch > 1 {
                let max_context = match plan.placement {
                    Placement::Llm { max_context, .. } => max_context,
                    Placement::Dit { .. } => 0,
                };
                // Bisection: fewer sequences never need more bytes (their KV cache sized to
                // the budget, so at least one full context).
                let fits = |b: usize| {
                    let placement = Placement::Llm {
                        max_context,
                        batch: b,
                        kv_sequences: (b > 1).then_some(1),
                    };
                    Plan::new(model, plan.tp, dtype, placement, plan.device).is_ok_and(|p| p.fits(budget))
                };
                if let Some(fewer) = largest(1, batch - 1, fits) {
                    options.push(format!("--max-seqs {fewer}"));
                }
            }
        }
        Placement::Dit { width, height, cfg, .. } => {
            if let Some(frames) = most_frames(model, plan.tp, dtype, plan.device, budget, (width, height, cfg)) {
                options.push(format!("--frames {frames}"));
            }
        }
    }
    match options.is_empty() {
        true => message.push_str(&format!("; it does not fit at any TP width: {remedy}")),
        false => message.push_str(&format!("; fits with {}", options.join(", or with "))),
    }
    message
}
