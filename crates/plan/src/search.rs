//! What fits: the smallest TP width, the longest context or the most frames at a width.

use candle_core::DType;
use serde::Serialize;

use crate::{gib, DeviceProfile, Placement, Plan, ShardedModel, Split};

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
            let split = Split::new(model, tp, dtype).ok()?;
            // Planned as the engine places it: a serving LLM's KV cache sized to the budget.
            let kv_sequences = pool_that_fits(&split, placement, device, budget);
            let placement = with_kv_sequences(placement, kv_sequences);
            let peak = split.peak(placement, device).ok()?.total();
            let (max_context, max_frames) = match placement {
                Placement::Llm { batch, .. } => (largest_context(&split, device, budget, batch), None),
                Placement::Dit { width, height, cfg, .. } => {
                    (None, most_frames(&split, device, budget, (width, height, cfg)))
                }
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
    let split = Split::new(model, tp, dtype).ok()?;
    pool_that_fits(&split, placement, device, budget)
}

/// [`kv_sequences_that_fit`] of a width already split.
fn pool_that_fits(split: &Split, placement: Placement, device: DeviceProfile, budget: u64) -> Option<usize> {
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
        split.fits(placement, device, budget)
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

/// The widest TP a search plans (a refusal's `--tp` suggestion, `tpinfer plan`'s table):
/// well past a box's 8 to 16 GPUs. A width's plan costs a footprint per rank, so a search to
/// width W costs W²/2 of them: to the VAE's 2,048 bands (or its replicated encoder's any
/// width) that took minutes, during which a refused start seemed to hang.
pub const WIDEST_SEARCHED: usize = 64;

/// The widths a search plans for `model`, from `from`: up to its widest, at most
/// [`WIDEST_SEARCHED`].
pub fn searched_widths(model: &dyn ShardedModel, from: usize) -> std::ops::RangeInclusive<usize> {
    from..=model.max_tp().min(WIDEST_SEARCHED)
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
    searched_widths(model, from)
        .find(|&tp| Split::new(model, tp, dtype).is_ok_and(|s| s.fits(placement, device, budget)))
}

/// The longest context that fits `budget` at a width, serving `batch` sequences.
fn largest_context(split: &Split, device: DeviceProfile, budget: u64, batch: usize) -> Option<usize> {
    let limit = split.model().max_context()?;
    // Serving several sequences, a context fits when the budget's KV cache holds one at full
    // length (the others share it).
    let fits = |context: usize| {
        let placement = Placement::Llm {
            max_context: context,
            batch,
            kv_sequences: (batch > 1).then_some(1),
        };
        split.fits(placement, device, budget)
    };
    largest(1, limit, fits)
}

/// The most frames (4k + 1) of `width` × `height` that fit `budget` at a width.
fn most_frames(
    split: &Split,
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
        split.fits(placement, device, budget)
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
         + allocator slack {:.2}, buffers {:.2}, libraries {:.2}, NCCL {:.2}, CUDA context {:.2} GiB)",
        r.rank,
        gib(r.total()),
        gib(budget),
        gib(r.weights),
        gib(r.cache),
        gib(r.activations),
        gib(r.allocator_slack),
        gib(r.buffers),
        gib(r.libraries),
        gib(r.comm),
        gib(r.context),
    );
    let mut options = Vec::new();
    if let Some(tp) = smallest_width(model, dtype, plan.placement, plan.device, budget, plan.tp + 1) {
        options.push(format!("--tp {tp}"));
    }
    // The plan's own width, split again: a plan keeps no shards.
    let split = Split::new(model, plan.tp, dtype).ok();
    match (plan.placement, &split) {
        (_, None) => {}
        (Placement::Llm { batch, .. }, Some(split)) => {
            if let Some(context) = largest_context(split, plan.device, budget, batch) {
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
                    split.fits(placement, plan.device, budget)
                };
                if let Some(fewer) = largest(1, batch - 1, fits) {
                    options.push(format!("--max-seqs {fewer}"));
                }
            }
        }
        (Placement::Dit { width, height, cfg, .. }, Some(split)) => {
            if let Some(frames) = most_frames(split, plan.device, budget, (width, height, cfg)) {
                options.push(format!("--frames {frames}"));
            }
        }
    }
    match options.is_empty() {
        true => {
            let widths = match model.max_tp() > WIDEST_SEARCHED {
                true => format!("any TP width up to {WIDEST_SEARCHED}"),
                false => "any TP width".to_string(),
            };
            message.push_str(&format!("; it does not fit at {widths}: {remedy}"))
        }
        false => message.push_str(&format!("; fits with {}", options.join(", or with "))),
    }
    message
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use tpinfer_weights::{ShardSpec, WeightDecl};

    use super::*;
    use crate::{boxed_shards, Accelerator, Footprint, PlanError, RankShard};

    /// A model every rank holds whole at any width, as the VAE's encoder: a wider TP never
    /// fits better. It counts the footprints planned and the declaration lists checked.
    struct Replicated {
        decls: Arc<[WeightDecl]>,
        footprints: Arc<AtomicUsize>,
        checks: AtomicUsize,
    }

    struct Whole {
        decls: Arc<[WeightDecl]>,
        footprints: Arc<AtomicUsize>,
    }

    impl Replicated {
        fn one_tensor() -> Self {
            Self {
                decls: vec![WeightDecl::new("w", &[4, 4], ShardSpec::Replicated)].into(),
                footprints: Arc::default(),
                checks: AtomicUsize::new(0),
            }
        }
    }

    impl ShardedModel for Replicated {
        fn name(&self) -> &str {
            "replicated"
        }
        fn max_tp(&self) -> usize {
            1 << 16
        }
        fn default_dtype(&self) -> DType {
            DType::F32
        }
        fn default_placement(&self) -> Placement {
            VIDEO
        }
        fn rank_shards(&self, tp: usize) -> Result<Vec<Box<dyn RankShard>>, PlanError> {
            let whole = || Whole {
                decls: self.decls.clone(),
                footprints: self.footprints.clone(),
            };
            Ok(boxed_shards((0..tp).map(|_| whole()).collect()))
        }
        fn check(&self, _decls: &[WeightDecl]) -> Result<(), PlanError> {
            self.checks.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn fsdp_unit(&self, _tensor: &str) -> Option<String> {
            None
        }
    }

    impl RankShard for Whole {
        fn weight_decls(&self) -> &[WeightDecl] {
            &self.decls
        }
        fn footprint(&self, _: DType, _: Placement, _: Accelerator) -> Result<Footprint, PlanError> {
            self.footprints.fetch_add(1, Ordering::Relaxed);
            Ok(Footprint {
                activations: 1 << 30,
                ..Footprint::default()
            })
        }
    }

    const VIDEO: Placement = Placement::Dit {
        frames: 1,
        width: 8,
        height: 8,
        cfg: false,
    };

    /// A fit table splits and checks the model once a width, however many placements its
    /// searches plan there (the most frames: a bisection over 251 counts): replanned whole for
    /// each, `tpinfer plan --model llama-3-70b` without `--tp` took 27 s.
    #[test]
    fn a_fit_table_splits_each_width_once() {
        let model = Replicated::one_tensor();
        let table = fit_table(&model, DType::F32, VIDEO, DeviceProfile::cpu(), 1 << 40, 1..=8);
        assert_eq!(
            table.iter().map(|w| w.tp).collect::<Vec<_>>(),
            (1..=8).collect::<Vec<_>>()
        );
        assert!(table.iter().all(|w| w.fits && w.max_frames == Some(1001)), "{table:?}");
        assert_eq!(model.checks.load(Ordering::Relaxed), 8, "one check a width");
    }

    /// A refusal of a model that shards to 65,536 ranks plans widths up to WIDEST_SEARCHED
    /// (a search to every width planned 2³¹ footprints: a refused start hung), and checks the
    /// ranks' one shared declaration list once a width.
    #[test]
    fn a_refusal_searches_widths_up_to_the_widest_searched() {
        let model = Replicated::one_tensor();
        let device = DeviceProfile::cpu();
        let Ok(plan) = Plan::new(&model, 1, DType::F32, VIDEO, device) else {
            panic!("width 1 plans");
        };
        assert_eq!(model.checks.load(Ordering::Relaxed), 1);
        let message = over_budget_message(&model, &plan, DType::F32, 1 << 20);
        assert!(
            message.contains(&format!("does not fit at any TP width up to {WIDEST_SEARCHED}")),
            "{message}"
        );
        let plans = model.checks.load(Ordering::Relaxed);
        assert!(plans <= WIDEST_SEARCHED + 2, "{plans} plans: one check a width");
        let footprints = model.footprints.load(Ordering::Relaxed);
        assert!(
            footprints <= WIDEST_SEARCHED * WIDEST_SEARCHED,
            "{footprints} footprints"
        );
        assert_eq!(searched_widths(&model, 3), 3..=WIDEST_SEARCHED);
    }
}
