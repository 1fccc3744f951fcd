//! A started rank group: one thread per rank, each holding its communicator and its loaded
//! models, running the tasks it is given in lockstep with its peers.

use std::any::Any;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use candle_core::Device;
use tpinfer_comm::Communicator;
use tpinfer_family::RankOptions;
use tpinfer_plan::{Plan, Residency};

use crate::connect::{Connect, Startup};
use crate::error::root_cause;
use crate::{memory, DeviceMemory, RankFailure, RuntimeError, Topology};

/// A loaded model's place on every rank of a group, typed by the rank model it holds.
pub struct ModelHandle<R> {
    index: usize,
    _rank: PhantomData<fn() -> R>,
}

impl<R> ModelHandle<R> {
    pub(crate) fn new(index: usize) -> Self {
        Self {
            index,
            _rank: PhantomData,
        }
    }

    /// The model's position among the group's models, in the order they were added.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl<R> Clone for ModelHandle<R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for ModelHandle<R> {}

/// What a rank is: its place in the group, its device and its communicator.
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub device: Device,
    pub comm: Arc<dyn Communicator>,
    /// This rank's plan of each model, in the order they were added.
    pub plans: Vec<tpinfer_plan::RankPlan>,
    /// The group's load progress, which its weight loaders count into.
    pub progress: tpinfer_weights::LoadProgress,
}

/// A model on a rank, through its turns (see [`Residency`]).
enum Held {
    Loaded(Box<dyn Any>),
    /// Its turn has not come: the loader that will load it.
    Pending(Loader),
    /// Its turn is over: freed for the models after it.
    Freed,
}

/// The models a rank holds, in the order they were added.
pub struct Models(Vec<Held>);

impl Models {
    /// The rank's model behind `handle`.
    pub fn get_mut<R: 'static>(&mut self, handle: &ModelHandle<R>) -> Result<&mut R, RuntimeError> {
        let index = handle.index;
        match self.0.get_mut(index) {
            Some(Held::Loaded(model)) => model.downcast_mut::<R>().ok_or(RuntimeError::WrongModel { index }),
            Some(Held::Pending(_)) => Err(RuntimeError::NotLoaded { index }),
            Some(Held::Freed) => Err(RuntimeError::Freed { index }),
            None => Err(RuntimeError::WrongModel { index }),
        }
    }
}

/// A rank as its tasks see it.
pub struct Rank {
    pub env: RankEnv,
    pub models: Models,
    options: RankOptions,
}

impl Rank {
    /// Frees the models of the first turn and loads the others: the weight bytes each one
    /// read (0 for the freed), then meets its peers.
    fn next_turn(&mut self, first: usize) -> Result<Vec<usize>, RuntimeError> {
        let rank = self.env.rank;
        let mut bytes = vec![0; self.models.0.len()];
        for held in &mut self.models.0[..first] {
            *held = Held::Freed;
        }
        // The freed blocks go back to the pool before the next turn's weights take them.
        memory::reset_peak(&self.env.device);
        for (index, held) in self.models.0.iter_mut().enumerate().skip(first) {
            let Held::Pending(load) = std::mem::replace(held, Held::Freed) else {
                continue;
            };
            let (model, read) = load(&self.env, self.options).map_err(|e| RuntimeError::of_rank(rank, e))?;
            *held = Held::Loaded(model);
            bytes[index] = read;
        }
        let at_load = self.env.plans[first..].iter().map(|p| p.weights + p.at_load).sum();
        memory::check_after_load(rank, &self.env.device, at_load);
        self.env.comm.barrier()?;
        Ok(bytes)
    }
}

/// Whether a rank goes on serving after a task.
#[derive(PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Exit,
}

pub(crate) type Job = Box<dyn FnOnce(&mut Rank) -> Flow + Send>;

/// Loads one model on a rank: the model and the weight bytes it read.
pub(crate) type Loader =
    Box<dyn FnOnce(&RankEnv, RankOptions) -> Result<(Box<dyn Any>, usize), tpinfer_layers::Error> + Send>;

/// Everything a rank thread starts with.
pub(crate) struct RankSetup {
    pub env: (usize, usize, Device),
    pub plans: Vec<tpinfer_plan::RankPlan>,
    pub connect: Connect,
    pub loaders: Vec<Loader>,
    /// How many of `loaders` load at the start; the others wait for [`RankGroup::next_turn`].
    pub load_first: usize,
    pub options: RankOptions,
    pub progress: tpinfer_weights::LoadProgress,
}

/// Ranks on their threads with their models loaded. Tasks run on every rank at once, one
/// task at a time; after a task fails, the ranks' collectives are aborted and every later
/// task is refused with the original cause.
pub struct RankGroup {
    jobs: Vec<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    topology: Topology,
    plans: Vec<Plan>,
    residency: Residency,
    /// Whether the models of the first turn have been freed and the others loaded.
    turned: Mutex<bool>,
    weight_bytes: Mutex<Vec<Vec<usize>>>,
    broken: Mutex<Option<String>>,
    /// The load progress the ranks count into: the second turn's weights are added to it.
    progress: tpinfer_weights::LoadProgress,
}

impl RankGroup {
    pub(crate) fn new(
        jobs: Vec<Sender<Job>>,
        threads: Vec<JoinHandle<()>>,
        topology: Topology,
        plans: Vec<Plan>,
        residency: Residency,
        weight_bytes: Vec<Vec<usize>>,
        progress: tpinfer_weights::LoadProgress,
    ) -> Self {
        Self {
            jobs,
            threads,
            topology,
            plans,
            residency,
            turned: Mutex::new(false),
            weight_bytes: Mutex::new(weight_bytes),
            broken: Mutex::new(None),
            progress,
        }
    }

    /// How the ranks hold their models: all together, or in turns because together they
    /// would not fit the budget.
    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// Whether the model at `index` was freed at the end of its turn.
    pub fn is_freed(&self, index: usize) -> bool {
        match self.residency {
            Residency::InTurns { first } => index < first && *lock(&self.turned),
            Residency::Together => false,
        }
    }

    /// Ends the first turn of models held in turns: frees them on every rank and loads the
    /// others. Returns whether it did; models held together, or a turn already ended, need
    /// nothing.
    pub fn next_turn(&self) -> Result<bool, RuntimeError> {
        let Residency::InTurns { first } = self.residency else {
            return Ok(false);
        };
        let mut turned = lock(&self.turned);
        if *turned {
            return Ok(false);
        }
        let second: u64 = self.plans[first..]
            .iter()
            .flat_map(|plan| plan.ranks.iter().map(|r| r.weights))
            .sum();
        self.progress.add_total(second);
        let bytes = self.run(move |rank| rank.next_turn(first))?;
        *turned = true;
        for (held, read) in lock(&self.weight_bytes).iter_mut().zip(bytes) {
            for (held, read) in held.iter_mut().zip(read).skip(first) {
                *held = read;
            }
        }
        Ok(true)
    }

    /// Runs `task` on every rank and returns each rank's value in rank order, or the root
    /// cause among the ranks' errors (a rank that reports only a peer's failure is not one).
    pub fn run<T, E, F>(&self, task: F) -> Result<Vec<T>, E>
    where
        T: Send + 'static,
        E: RankFailure,
        F: Fn(&mut Rank) -> Result<T, E> + Send + Sync + 'static,
    {
        self.submit(task).wait()
    }

    /// Starts `task` on every rank and returns at once: the caller may serve what the task
    /// sends it meanwhile, then [`Pending::wait`]s for the ranks.
    pub fn submit<T, E, F>(&self, task: F) -> Pending<'_, T, E>
    where
        T: Send + 'static,
        E: RankFailure,
        F: Fn(&mut Rank) -> Result<T, E> + Send + Sync + 'static,
    {
        let (results_tx, results) = mpsc::channel();
        if let Some(cause) = lock(&self.broken).clone() {
            return Pending {
                group: self,
                results,
                refused: Some(RuntimeError::Stopped(cause).into()),
            };
        }
        let task = Arc::new(task);
        for jobs in &self.jobs {
            let (task, results) = (task.clone(), results_tx.clone());
            let job: Job = Box::new(move |rank: &mut Rank| {
                let r = rank.env.rank;
                let comm = rank.env.comm.clone();
                let outcome = guarded(r, &*comm, || task(rank));
                let flow = match outcome.as_ref().err().and_then(RankFailure::as_runtime) {
                    // A silent death, as a killed process: no report.
                    Some(RuntimeError::RankExited { .. }) => return Flow::Exit,
                    // The rank's state is unknown after a panic: it is finished.
                    Some(RuntimeError::RankPanicked { .. }) => Flow::Exit,
                    _ => Flow::Continue,
                };
                let _ = results.send((r, outcome));
                flow
            });
            // A rank whose thread has ended drops the job, and its sender with it.
            let _ = jobs.send(job);
        }
        Pending {
            group: self,
            results,
            refused: None,
        }
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The plan of each model, in the order they were added.
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// Each rank's planned bytes for all its models, held as [`Self::residency`] says.
    pub fn planned_totals(&self) -> Vec<u64> {
        (0..self.jobs.len())
            .map(|rank| {
                let ranks: Vec<_> = self.plans.iter().map(|p| &p.ranks[rank]).collect();
                self.residency.rank_bytes(&ranks)
            })
            .collect()
    }

    /// Each rank's planned bytes for the models it holds now: all of them, or those of the
    /// current turn.
    pub fn held_now(&self) -> Vec<u64> {
        let first = self.residency.loaded_first(self.plans.len());
        let held = match *lock(&self.turned) {
            false => 0..first,
            true => first..self.plans.len(),
        };
        (0..self.jobs.len())
            .map(|rank| tpinfer_plan::held_together(self.plans[held.clone()].iter().map(|p| &p.ranks[rank])))
            .collect()
    }

    /// The weight bytes each rank read for the model at `index` (0 before its turn).
    pub fn weight_bytes(&self, index: usize) -> Vec<usize> {
        lock(&self.weight_bytes)
            .iter()
            .map(|r| r.get(index).copied().unwrap_or(0))
            .collect()
    }

    /// Each rank's device memory now, with its peak since the start; `None` for CPU ranks.
    pub fn device_memory(&self) -> Vec<Option<DeviceMemory>> {
        self.topology.devices().iter().map(memory::measure).collect()
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A task running on the ranks of a group.
pub struct Pending<'a, T, E> {
    group: &'a RankGroup,
    results: Receiver<(usize, Result<T, E>)>,
    /// The group had stopped: the task was not started.
    refused: Option<E>,
}

impl<T, E: RankFailure> Pending<'_, T, E> {
    /// Every rank's value, or the root cause among the ranks' errors, which stops the group.
    pub fn wait(self) -> Result<Vec<T>, E> {
        if let Some(refused) = self.refused {
            return Err(refused);
        }
        collect(self.group.jobs.len(), &self.results).inspect_err(|root| {
            *lock(&self.group.broken) = Some(root.to_string());
        })
    }
}

/// Every rank's value of one task, or the root cause; a rank that sent nothing has exited.
fn collect<T, E: RankFailure>(world: usize, results: &Receiver<(usize, Result<T, E>)>) -> Result<Vec<T>, E> {
    let mut values: Vec<Option<T>> = (0..world).map(|_| None).collect();
    let mut errors = Vec::new();
    let mut reported = vec![false; world];
    for (rank, outcome) in results.iter() {
        reported[rank] = true;
        match outcome {
            Ok(value) => values[rank] = Some(value),
            Err(e) => errors.push(e),
        }
    }
    errors.extend(
        (0..world)
            .filter(|&r| !reported[r])
            .map(|rank| RuntimeError::RankExited { rank }.into()),
    );
    if let Some(root) = root_cause(errors) {
        return Err(root);
    }
    Ok(values.into_iter().flatten().collect())
}

/// The body of a rank thread: joins the communicator, loads every model, checks its memory
/// against the plan and meets its peers (the health check), then runs jobs until the group
/// is dropped.
pub(crate) fn rank_main(setup: RankSetup, ready: Sender<Startup>, jobs: Receiver<Job>) {
    let RankSetup {
        env: (rank, world, device),
        plans,
        connect,
        loaders,
        load_first,
        options,
        progress,
    } = setup;
    let _span = tracing::info_span!("rank", rank, world).entered();
    let start = std::time::Instant::now();
    let comm = match connect() {
        Ok(comm) => {
            tracing::info!(seconds = start.elapsed().as_secs_f64(), "joined the communicator");
            comm
        }
        Err(e) => {
            let _ = ready.send(Startup::Failed(e));
            return;
        }
    };
    let _ = ready.send(Startup::Connected(rank));
    let env = RankEnv {
        rank,
        world,
        device,
        comm,
        plans,
        progress,
    };
    let start = std::time::Instant::now();
    let loaded = guarded(rank, &*env.comm.clone(), || -> Result<_, RuntimeError> {
        let mut models = Vec::with_capacity(loaders.len());
        let mut bytes = Vec::with_capacity(loaders.len());
        for (index, load) in loaders.into_iter().enumerate() {
            if index >= load_first {
                models.push(Held::Pending(load));
                bytes.push(0);
                continue;
            }
            let (model, read) = load(&env, options).map_err(|e| RuntimeError::of_rank(rank, e))?;
            models.push(Held::Loaded(model));
            bytes.push(read);
        }
        tracing::info!(
            bytes = bytes.iter().sum::<usize>(),
            seconds = start.elapsed().as_secs_f64(),
            "loaded"
        );
        let at_load = env.plans[..load_first].iter().map(|p| p.weights + p.at_load).sum();
        memory::check_after_load(rank, &env.device, at_load);
        env.comm.barrier()?;
        tracing::info!(seconds = start.elapsed().as_secs_f64(), "loaded and met its peers");
        Ok((models, bytes))
    });
    let models = match loaded {
        Ok((models, bytes)) => {
            let _ = ready.send(Startup::Loaded(rank, bytes));
            models
        }
        Err(e) => {
            let _ = ready.send(Startup::Failed(e));
            return;
        }
    };
    drop(ready);
    let mut rank = Rank {
        env,
        models: Models(models),
        options,
    };
    while let Ok(job) = jobs.recv() {
        if job(&mut rank) == Flow::Exit {
            return;
        }
    }
}

/// Runs `f`, turning a panic into an error, and on any failure tells the peers, so that none
/// of them waits for this rank.
pub(crate) fn guarded<T, E: RankFailure>(
    rank: usize,
    comm: &dyn Communicator,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let outcome = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        Err(RuntimeError::RankPanicked { rank, message }.into())
    });
    if let Err(e) = &outcome {
        let quiet = e
            .as_runtime()
            .is_some_and(|r| r.is_peer_report() || matches!(r, RuntimeError::RankExited { .. }));
        if !quiet {
            comm.abort(&e.to_string());
        }
    }
    outcome
}

/// A lock whose holder never leaves its data half-changed: a poisoned one is taken as is.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
