//! Starting a rank group: every model split once and planned, the budget checked before any
//! rank allocates or joins NCCL, then the ranks spawned, connected, loaded and checked.

use std::any::Any;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;
use tpinfer_comm::CommOptions;
use tpinfer_family::{Family, LoadContext, RankOptions};
use tpinfer_plan::{gib, over_budget_message, Placement, Plan, PlanError, RankShard, Residency, ShardedModel};
use tpinfer_weights::LoadProgress;

use crate::connect::{await_startup, connectors};
use crate::group::{rank_main, Loader, RankSetup};
use crate::{memory, ModelHandle, RankGroup, RuntimeError, Topology};

/// The part of the host's available memory that CPU ranks size a memory pool to (an LLM's
/// paged KV cache) when no budget is given. They share the host with everything else on it, so
/// a server of many sequences takes half of what is free rather than all of it, as a GPU's
/// pool may.
pub const CPU_POOL_SHARE: f64 = 0.5;

/// How a group starts and how its ranks run.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// How long a rank waits for its peers in a collective before it reports them.
    pub comm_timeout: Duration,
    /// How long the ranks may take to form their communicator (NCCL init).
    pub init_timeout: Duration,
    /// The device memory each rank may use; on GPUs also at most each device's free memory
    /// less a 2% margin.
    pub gpu_mem: Option<u64>,
    /// The share of each GPU's total memory each rank may use (vLLM's
    /// `gpu_memory_utilization`); also at most `gpu_mem` and the free memory.
    pub gpu_share: Option<f64>,
    pub comm: CommOptions,
    pub rank: RankOptions,
    /// Counts the weight bytes the ranks place, out of the bytes they will: for a progress
    /// bar, which the caller draws from its clone.
    pub progress: LoadProgress,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            comm_timeout: tpinfer_comm::DEFAULT_TIMEOUT,
            init_timeout: tpinfer_comm::DEFAULT_TIMEOUT,
            gpu_mem: None,
            gpu_share: None,
            comm: CommOptions::default(),
            rank: RankOptions::default(),
            progress: LoadProgress::new(),
        }
    }
}

/// One model on its way onto the ranks.
struct Slot {
    model: Arc<dyn ShardedModel>,
    dtype: DType,
    plan: Plan,
    /// One loader per rank, each holding that rank's shard.
    loaders: Vec<Loader>,
}

/// The models a group will hold, split and planned, before any rank exists.
///
/// ```no_run
/// use std::sync::Arc;
/// use tpinfer_family::Family;
/// use tpinfer_runtime::{DeviceKind, GroupOptions, Launch, RuntimeError, Topology};
///
/// /// Loads `model` on two CPU ranks and asks each rank for its index.
/// fn ranks_of<F: Family>(model: Arc<F>) -> Result<Vec<usize>, RuntimeError> {
///     let mut launch = Launch::new(Topology::new(2, &DeviceKind::Cpu)?, GroupOptions::default());
///     let placement = model.default_placement();
///     let handle = launch.add(model, candle_core::DType::F32, placement)?;
///     let group = launch.start()?;
///     group.run(move |rank| -> Result<usize, RuntimeError> {
///         let _model: &mut F::Rank = rank.models.get_mut(&handle)?;
///         Ok(rank.env.rank)
///     })
/// }
/// ```
pub struct Launch {
    topology: Topology,
    options: GroupOptions,
    slots: Vec<Slot>,
    /// How many models may be freed before the others load (see [`Self::may_free_here`]).
    first_turn: Option<usize>,
}

impl Launch {
    pub fn new(topology: Topology, options: GroupOptions) -> Self {
        Self {
            topology,
            options,
            slots: Vec::new(),
            first_turn: None,
        }
    }

    /// Lets the models added so far run in a first turn and be freed before the ones added
    /// next load ([`RankGroup::next_turn`]), if holding all of them at once would not fit the
    /// budget. Where they fit together, every model loads at the start and stays.
    pub fn may_free_here(&mut self) {
        self.first_turn = Some(self.slots.len());
    }

    /// Adds `model` in `dtype` for `placement`: splits it over the ranks once (checked against
    /// its checkpoint's headers) and plans every rank.
    pub fn add<F: Family>(
        &mut self,
        model: Arc<F>,
        dtype: DType,
        placement: Placement,
    ) -> Result<ModelHandle<F::Rank>, RuntimeError> {
        let tp = self.topology.width();
        let shards = model.shards(tp).map_err(plan_error)?;
        for shard in &shards {
            model.check(shard.weight_decls()).map_err(plan_error)?;
        }
        let refs: Vec<&dyn RankShard> = shards.iter().map(|s| s as &dyn RankShard).collect();
        let plan = Plan::for_shards(&*model, &refs, dtype, placement, self.topology.profile()).map_err(plan_error)?;
        let loaders = shards
            .into_iter()
            .map(|shard| {
                let model = model.clone();
                Box::new(move |env: &crate::RankEnv, options: RankOptions| {
                    let ctx = LoadContext {
                        comm: &env.comm,
                        device: &env.device,
                        dtype,
                        options,
                        progress: &env.progress,
                    };
                    let rank = model.load(&shard, placement, &ctx)?;
                    let bytes = F::bytes_loaded(&rank);
                    Ok((Box::new(rank) as Box<dyn Any>, bytes))
                }) as Loader
            })
            .collect();
        self.slots.push(Slot {
            model,
            dtype,
            plan,
            loaders,
        });
        Ok(ModelHandle::new(self.slots.len() - 1))
    }

    /// Refuses a placement over budget, then spawns one thread per rank, builds the
    /// communicators, loads every model on every rank (those of the first turn, where they
    /// are held in turns) and checks the ranks' health. Fails with the root cause among the
    /// ranks' errors.
    pub fn start(self) -> Result<RankGroup, RuntimeError> {
        // A zero wait would report every healthy peer as stalled.
        for (name, wait) in [
            ("the collectives' timeout (--comm-timeout)", self.options.comm_timeout),
            ("the communicator's init timeout", self.options.init_timeout),
        ] {
            if wait.is_zero() {
                return Err(RuntimeError::Option(format!(
                    "{name} is 0: give the ranks at least a second"
                )));
            }
        }
        let start = std::time::Instant::now();
        let residency = self.check_budget()?;
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            ?residency,
            "planned: every rank fits its budget"
        );
        let Self {
            topology,
            options,
            slots,
            ..
        } = self;
        let load_first = residency.loaded_first(slots.len());
        let tp = topology.width();
        topology.devices().iter().for_each(memory::reset_peak);
        let connectors = connectors(topology.devices(), options.comm_timeout, options.comm)?;
        let mut per_rank: Vec<(Vec<Loader>, Vec<tpinfer_plan::RankPlan>)> =
            (0..tp).map(|_| (Vec::new(), Vec::new())).collect();
        let mut plans = Vec::with_capacity(slots.len());
        let loaded_at_start: u64 = slots[..load_first]
            .iter()
            .flat_map(|slot| slot.plan.ranks.iter().map(|r| r.weights))
            .sum();
        options.progress.add_total(loaded_at_start);
        for slot in slots {
            for (rank, loader) in slot.loaders.into_iter().enumerate() {
                per_rank[rank].0.push(loader);
                per_rank[rank].1.push(slot.plan.ranks[rank]);
            }
            plans.push(slot.plan);
        }
        let (ready_tx, ready_rx) = mpsc::channel();
        let (mut jobs, mut threads) = (Vec::with_capacity(tp), Vec::with_capacity(tp));
        for (rank, (connect, (loaders, rank_plans))) in connectors.into_iter().zip(per_rank).enumerate() {
            let (job_tx, job_rx) = mpsc::channel();
            let setup = RankSetup {
                env: (rank, tp, topology.devices()[rank].clone()),
                plans: rank_plans,
                connect,
                loaders,
                load_first,
                options: options.rank,
                progress: options.progress.clone(),
            };
            let ready = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("tpinfer-rank-{rank}"))
                .spawn(move || rank_main(setup, ready, job_rx))
                .map_err(|e| RuntimeError::Device {
                    rank,
                    detail: format!("cannot start the rank's thread: {e}"),
                })?;
            jobs.push(job_tx);
            threads.push(thread);
        }
        drop(ready_tx);
        // Ranks still blocked in communicator init cannot be joined; on a failure the others
        // exit once their job channels close, and nothing waits for them.
        let weight_bytes = await_startup(&ready_rx, tp, options.init_timeout)?;
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            ranks = tp,
            "started: connected, loaded and checked"
        );
        Ok(RankGroup::new(
            jobs,
            threads,
            topology,
            plans,
            residency,
            weight_bytes,
            options.progress,
        ))
    }

    /// Plans every rank's device bytes and refuses a placement over budget, before any rank
    /// allocates or joins NCCL. The budget is `gpu_mem`, and on GPUs at most each device's
    /// free memory (which already excludes the CUDA context this process created) less a 2%
    /// margin. Models held together keep their weights, buffers and caches resident and run
    /// one at a time: their temporaries do not add up. Where together they do not fit and
    /// [`Self::may_free_here`] allows it, they are held in two turns. Returns how they are held.
    fn check_budget(&self) -> Result<Residency, RuntimeError> {
        let turns = self
            .first_turn
            .filter(|&first| first > 0 && first < self.slots.len())
            .map(|first| Residency::InTurns { first });
        let refusal = match self.over_budget(Residency::Together) {
            None => return Ok(Residency::Together),
            Some(refusal) => refusal,
        };
        let Some(turns) = turns else {
            return Err(RuntimeError::OverBudget(refusal));
        };
        match self.over_budget(turns) {
            None => {
                tracing::info!("{refusal}: the first models are freed after their turn, before the others load");
                Ok(turns)
            }
            Some(still) => Err(RuntimeError::OverBudget(format!("{refusal}; {still}"))),
        }
    }

    /// The smallest of the ranks' budgets (see [`Self::start`]), if any rank has one: what a
    /// model may size a memory pool to before it is added, such as an LLM's paged KV cache.
    /// CPU ranks without a given budget take an equal part of [`CPU_POOL_SHARE`] of the host's
    /// available memory.
    pub fn budget(&self) -> Option<u64> {
        let given = (0..self.topology.width())
            .filter_map(|rank| self.rank_budget(rank).map(|(budget, _)| budget))
            .min();
        given.or_else(|| {
            let available = self.topology.is_cpu().then(memory::host_available)??;
            Some((available as f64 * CPU_POOL_SHARE) as u64 / self.topology.width() as u64)
        })
    }

    /// The device profile the ranks are planned with.
    pub fn profile(&self) -> tpinfer_plan::DeviceProfile {
        self.topology.profile()
    }

    /// Rank `rank`'s budget, and its device's free memory less the margin where measured:
    /// `gpu_mem` and the share of `gpu_memory_utilization`, and on GPUs at most the free
    /// memory.
    fn rank_budget(&self, rank: usize) -> Option<(u64, Option<u64>)> {
        let profile = self.topology.profile();
        let measured = memory::measure(&self.topology.devices()[rank]);
        let free = measured.map(|m| (m.free() + profile.context_reserve).saturating_sub(m.total / 50));
        let share = self
            .options
            .gpu_share
            .zip(measured)
            .map(|(share, m)| (share * m.total as f64) as u64);
        let given = match (self.options.gpu_mem, share) {
            (Some(bytes), Some(share)) => Some(bytes.min(share)),
            (bytes, share) => bytes.or(share),
        };
        let budget = match (given, free) {
            (Some(given), Some(free)) => given.min(free),
            (Some(given), None) => given,
            (None, Some(free)) => free,
            (None, None) => return None,
        };
        Some((budget, free))
    }

    /// Why the models held as `residency` do not fit, if they do not.
    fn over_budget(&self, residency: Residency) -> Option<String> {
        if let Some(refusal) = self.over_host_memory(residency) {
            return Some(refusal);
        }
        let profile = self.topology.profile();
        for rank in 0..self.topology.width() {
            let Some((budget, free)) = self.rank_budget(rank) else {
                continue;
            };
            let needed = self.rank_total(rank, residency);
            if needed <= budget {
                continue;
            }
            let mut message = match (self.slots.as_slice(), residency) {
                ([one], _) => over_budget_message(&*one.model, &one.plan, one.dtype, budget),
                (all, Residency::Together) => format!(
                    "rank {rank} needs {:.2} GiB for {} held together but {:.2} GiB is available {}",
                    gib(needed),
                    names(all),
                    gib(budget),
                    if profile.is_cuda() { "per GPU" } else { "per CPU rank" }
                ),
                (all, Residency::InTurns { first }) => format!(
                    "with {} freed before {} load, it still needs {:.2} GiB",
                    names(&all[..first]),
                    names(&all[first..]),
                    gib(needed)
                ),
            };
            if free == Some(budget) {
                message.push_str(&format!(
                    " (the budget is rank {rank}'s free device memory less a 2% margin; other processes on the GPU \
                     show in `nvidia-smi`)"
                ));
            }
            return Some(message);
        }
        None
    }

    /// CPU ranks are threads of this process: together they must fit the host's available
    /// memory, which a start that swaps or is killed for memory would learn too late.
    fn over_host_memory(&self, residency: Residency) -> Option<String> {
        if !self.topology.is_cpu() {
            return None;
        }
        let available = memory::host_available()?;
        let needed: u64 = (0..self.topology.width())
            .map(|rank| self.rank_total(rank, residency))
            .sum();
        (needed > available).then(|| {
            format!(
                "the {} CPU ranks need {:.2} GiB together, but the host has {:.2} GiB available (MemAvailable); \
                 the ranks share it, so a wider --tp does not help: use a smaller dtype, context or model",
                self.topology.width(),
                gib(needed),
                gib(available)
            )
        })
    }

    /// A rank's bytes for every model, held as `residency` says.
    fn rank_total(&self, rank: usize, residency: Residency) -> u64 {
        let ranks: Vec<_> = self.slots.iter().map(|s| &s.plan.ranks[rank]).collect();
        residency.rank_bytes(&ranks)
    }
}

/// The models' names, joined by " + ".
fn names(slots: &[Slot]) -> String {
    slots.iter().map(|s| s.model.name()).collect::<Vec<_>>().join(" + ")
}

fn plan_error(e: PlanError) -> RuntimeError {
    match e {
        PlanError::Sharding { tp, detail } => RuntimeError::Sharding { tp, detail },
        PlanError::Model(detail) => RuntimeError::Model(detail),
        PlanError::Placement(detail) => RuntimeError::Plan(detail),
    }
}
