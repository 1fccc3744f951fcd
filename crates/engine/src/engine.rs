use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{DType, Device};
use tpinfer_comm::{Communicator, ThreadGroup};
use tpinfer_llama::{LlamaCheckpoint, LlamaConfig, LlamaShard};
use tpinfer_tokenizer::Tokenizer;

use crate::builder::DEFAULT_MAX_CONTEXT;
use crate::memory::{measure, reset_peak, DeviceMemory};
use crate::rank::{rank_main, Connect, RankJob, RankResult, RankSetup, Startup};
use crate::stream::RankEvent;
use crate::{DeviceKind, EngineBuilder, EngineError, GenerateRequest, Prompt, TokenStream};

/// A loaded model on its ranks. Share it between threads (`Arc<Engine>`): requests from any
/// thread are queued and run one at a time on all ranks.
pub struct Engine {
    jobs: Option<Sender<Arc<RankJob>>>,
    scheduler: Option<JoinHandle<()>>,
    tokenizer: Arc<Tokenizer>,
    config: LlamaConfig,
    tp: usize,
    max_context: usize,
    dtype: DType,
    rank_weight_bytes: Vec<usize>,
    devices: Vec<Device>,
    plan: tpinfer_plan::Plan,
}

impl Engine {
    /// Starts configuring an engine for the model at `model`.
    pub fn builder(model: impl AsRef<std::path::Path>) -> EngineBuilder {
        EngineBuilder::new(model)
    }

    pub(crate) fn start(b: EngineBuilder) -> Result<Self, EngineError> {
        let checkpoint = Arc::new(LlamaCheckpoint::open(&b.model)?);
        let config = checkpoint.config.clone();
        // A GGUF file carries its tokenizer in the metadata already read for the config.
        let tokenizer = Arc::new(match checkpoint.gguf_metadata() {
            Some(metadata) => Tokenizer::from_gguf(metadata)?,
            None => Tokenizer::from_hf_dir(&b.model)?,
        });
        let tp = b.tp;
        let sharding = |detail: String| EngineError::Sharding { tp, detail };
        let shards = (0..tp)
            .map(|rank| {
                let shard = LlamaShard::new(&config, tp, rank).map_err(|e| sharding(e.to_string()))?;
                checkpoint.check(&shard).map_err(tpinfer_llama::CheckpointError::from)?;
                Ok(shard)
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let devices = rank_devices(&b.device, tp)?;
        let dtype = b.dtype.unwrap_or(match b.device {
            DeviceKind::Cpu => DType::F32,
            DeviceKind::Cuda { .. } => config.dtype.unwrap_or(DType::BF16),
        });
        // An explicit length goes to the plan as it is: it refuses one the model cannot hold.
        let max_context = b
            .max_context
            .unwrap_or(DEFAULT_MAX_CONTEXT.min(config.max_position_embeddings));

        let model = tpinfer_plan::ModelSpec::from_checkpoint(b.model.display().to_string(), checkpoint.clone());
        let plan = check_plan(
            &model,
            tpinfer_plan::Placement::Llm { max_context, batch: 1 },
            &devices,
            dtype,
            b.gpu_mem,
        )?;
        devices.iter().for_each(reset_peak);
        let connectors = connectors(&b, &devices)?;
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut rank_done = Vec::with_capacity(tp);
        let mut rank_jobs = Vec::with_capacity(tp);
        let mut threads = Vec::with_capacity(tp);
        for (rank, ((connect, shard), device)) in connectors.into_iter().zip(shards).zip(devices.clone()).enumerate() {
            let (job_tx, job_rx) = mpsc::channel();
            let setup = RankSetup {
                rank,
                world: tp,
                device,
                checkpoint: checkpoint.clone(),
                shard,
                dtype,
                max_context,
                fault: b.fault,
                enforce_eager: b.enforce_eager,
                plan: plan.ranks[rank],
            };
            let ready = ready_tx.clone();
            // One channel per rank: a rank whose thread ends closes it, which the scheduler sees.
            let (done, done_rx) = mpsc::channel();
            rank_done.push(done_rx);
            let thread = std::thread::Builder::new()
                .name(format!("tpinfer-rank-{rank}"))
                .spawn(move || rank_main(setup, connect, ready, job_rx, done))
                .map_err(|e| EngineError::Device {
                    rank,
                    detail: format!("cannot start the rank's thread: {e}"),
                })?;
            rank_jobs.push(job_tx);
            threads.push(thread);
        }
        drop(ready_tx);

        let rank_weight_bytes = match await_startup(&ready_rx, tp, b.init_timeout) {
            Ok(bytes) => bytes,
            Err(e) => {
                // Ranks still blocked in communicator init cannot be joined; the others exit
                // once their job channels close.
                drop(rank_jobs);
                return Err(e);
            }
        };

        let (jobs_tx, jobs_rx) = mpsc::channel();
        let scheduler = std::thread::Builder::new()
            .name("tpinfer-scheduler".into())
            .spawn(move || schedule(jobs_rx, rank_jobs, rank_done, threads))
            .map_err(|e| EngineError::Stopped(format!("cannot start the scheduler thread: {e}")))?;
        Ok(Self {
            jobs: Some(jobs_tx),
            scheduler: Some(scheduler),
            tokenizer,
            config,
            tp,
            max_context,
            dtype,
            rank_weight_bytes,
            devices,
            plan,
        })
    }

    /// Queues a request and returns its token stream. Prompt errors are reported here, before
    /// anything runs.
    pub fn generate(&self, request: GenerateRequest) -> Result<TokenStream, EngineError> {
        self.submit(request, None)
    }

    /// Like [`Self::generate`], and also returns the f32 logits over the vocabulary of every
    /// step (prefill first), as sampled from: for checking numerics against a reference.
    pub fn generate_traced(&self, request: GenerateRequest) -> Result<(TokenStream, Receiver<Vec<f32>>), EngineError> {
        let (tx, rx) = mpsc::channel();
        Ok((self.submit(request, Some(tx))?, rx))
    }

    fn submit(&self, request: GenerateRequest, logits: Option<Sender<Vec<f32>>>) -> Result<TokenStream, EngineError> {
        request.sampling.check()?;
        let prompt = match &request.prompt {
            Prompt::Text(text) => self.tokenizer.encode(text, true)?,
            Prompt::Chat(messages) => self.tokenizer.encode_chat(messages)?,
            Prompt::Tokens(ids) => ids.clone(),
        };
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() > self.max_context {
            return Err(EngineError::PromptTooLong {
                tokens: prompt.len(),
                context: self.max_context,
                model_max: self.config.max_position_embeddings,
            });
        }
        if request.max_new_tokens == 0 {
            return Err(EngineError::InvalidRequest("max_new_tokens must be at least 1".into()));
        }
        let vocab = self.config.vocab_size;
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {id} is outside the model's vocabulary of {vocab}"
            )));
        }
        let (events_tx, events_rx) = mpsc::channel();
        let job = Arc::new(RankJob {
            prompt,
            max_new_tokens: request.max_new_tokens,
            sampling: request.sampling,
            eos: self.config.eos_token_ids.clone(),
            events: events_tx,
            logits,
        });
        self.jobs
            .as_ref()
            .ok_or_else(|| EngineError::Stopped("shutting down".into()))?
            .send(job)
            .map_err(|_| EngineError::Stopped("the scheduler has exited".into()))?;
        Ok(TokenStream::new(events_rx, self.tokenizer.clone()))
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The tensor-parallel width.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// The longest sequence a request may reach.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Each rank's device memory now, with its peak since the start; `None` for CPU ranks.
    pub fn device_memory(&self) -> Vec<Option<DeviceMemory>> {
        self.devices.iter().map(measure).collect()
    }

    /// The memory plan the engine was started with.
    pub fn plan(&self) -> &tpinfer_plan::Plan {
        &self.plan
    }

    /// The weight bytes each rank read from the checkpoint.
    pub fn rank_weight_bytes(&self) -> &[usize] {
        &self.rank_weight_bytes
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(scheduler) = self.scheduler.take() {
            let _ = scheduler.join();
        }
    }
}

pub(crate) fn rank_devices(kind: &DeviceKind, tp: usize) -> Result<Vec<Device>, EngineError> {
    match kind {
        DeviceKind::Cpu => Ok(vec![Device::Cpu; tp]),
        DeviceKind::Cuda { gpus } => cuda_devices(gpus.as_deref(), tp),
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices(gpus: Option<&[usize]>, tp: usize) -> Result<Vec<Device>, EngineError> {
    let ordinals: Vec<usize> = gpus.map_or_else(|| (0..tp).collect(), <[usize]>::to_vec);
    if ordinals.len() != tp {
        return Err(EngineError::GpuCount {
            given: ordinals.len(),
            tp,
        });
    }
    ordinals
        .iter()
        .enumerate()
        .map(|(rank, &gpu)| {
            Device::new_cuda(gpu).map_err(|e| EngineError::Device {
                rank,
                detail: format!("cannot open CUDA device {gpu}: {e}"),
            })
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_gpus: Option<&[usize]>, _tp: usize) -> Result<Vec<Device>, EngineError> {
    Err(EngineError::CudaNotBuilt)
}

/// Plans every rank's device bytes and refuses a placement over budget, before any rank
/// allocates or joins NCCL. The budget is `--gpu-mem`, and on GPUs at most each device's free
/// memory (which already excludes the CUDA context this process created) less a 2% margin.
pub(crate) fn check_plan(
    model: &tpinfer_plan::ModelSpec,
    placement: tpinfer_plan::Placement,
    devices: &[Device],
    dtype: DType,
    gpu_mem: Option<u64>,
) -> Result<tpinfer_plan::Plan, EngineError> {
    use tpinfer_plan::{over_budget_message, DeviceProfile, Plan};
    let profile = match devices.iter().all(Device::is_cpu) {
        true => DeviceProfile::cpu(),
        false => DeviceProfile::cuda(),
    };
    let plan =
        Plan::new(model, devices.len(), dtype, placement, profile).map_err(|e| EngineError::Plan(e.to_string()))?;
    for (rank, device) in devices.iter().enumerate() {
        // What the device can give now: its free memory (this process's context is already
        // counted as used; the plan counts it too) less a 2% margin.
        let free = measure(device).map(|m| (m.free() + profile.context_reserve).saturating_sub(m.total / 50));
        let budget = match (gpu_mem, free) {
            (Some(given), Some(free)) => given.min(free),
            (Some(given), None) => given,
            (None, Some(free)) => free,
            (None, None) => continue,
        };
        let needed = plan.ranks[rank].total();
        if needed > budget {
            let mut message = over_budget_message(model, &plan, dtype, budget);
            if free == Some(budget) {
                message.push_str(&format!(
                    " (the budget is rank {rank}'s free device memory less a 2% margin; other processes on the GPU \
                     show in `nvidia-smi`)"
                ));
            }
            return Err(EngineError::OverBudget(message));
        }
    }
    Ok(plan)
}

/// One communicator builder per rank: in-process collectives for CPU ranks, NCCL for GPUs.
pub(crate) fn connectors(b: &EngineBuilder, devices: &[Device]) -> Result<Vec<Connect>, EngineError> {
    let tp = devices.len();
    if devices.iter().all(Device::is_cpu) || tp == 1 {
        return Ok(ThreadGroup::ranks(tp, b.comm_timeout)
            .into_iter()
            .map(|comm| Box::new(move || Ok(Arc::new(comm) as Arc<dyn Communicator>)) as Connect)
            .collect());
    }
    nccl_connectors(b, devices)
}

#[cfg(feature = "nccl")]
fn nccl_connectors(b: &EngineBuilder, devices: &[Device]) -> Result<Vec<Connect>, EngineError> {
    let group = tpinfer_comm::NcclGroup::new(devices.len(), b.comm_timeout)?;
    Ok(devices
        .iter()
        .enumerate()
        .map(|(rank, device)| {
            let (group, device) = (group.clone(), device.clone());
            Box::new(move || {
                let comm = tpinfer_comm::NcclComm::connect(group, &device, rank)?;
                // Shared only among the layers of this rank's thread, which built it: an NCCL
                // communicator must stay on one thread, so it is deliberately neither Send nor Sync.
                #[allow(clippy::arc_with_non_send_sync)]
                let comm = Arc::new(comm) as Arc<dyn Communicator>;
                Ok(comm)
            }) as Connect
        })
        .collect())
}

#[cfg(not(feature = "nccl"))]
fn nccl_connectors(_b: &EngineBuilder, _devices: &[Device]) -> Result<Vec<Connect>, EngineError> {
    Err(EngineError::CudaNotBuilt)
}

/// Waits for every rank to join its communicator (bounded by `init_timeout`) and then to load
/// its shard. Returns each rank's weight bytes, or the first rank's error.
pub(crate) fn await_startup(
    ready: &Receiver<Startup>,
    tp: usize,
    init_timeout: std::time::Duration,
) -> Result<Vec<usize>, EngineError> {
    let deadline = std::time::Instant::now() + init_timeout;
    let mut connected = vec![false; tp];
    let mut loaded: Vec<Option<usize>> = vec![None; tp];
    while loaded.iter().any(Option::is_none) {
        let event = match connected.iter().all(|&c| c) {
            true => ready.recv().map_err(|_| ()),
            false => ready
                .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
                .map_err(|_| ()),
        };
        match event {
            Ok(Startup::Connected(rank)) => connected[rank] = true,
            Ok(Startup::Loaded(rank, bytes)) => loaded[rank] = Some(bytes),
            Ok(Startup::Failed(e)) => return Err(e),
            Err(()) => {
                return Err(EngineError::InitTimeout {
                    missing: (0..tp).filter(|&r| !connected[r]).collect(),
                    waited: init_timeout,
                })
            }
        }
    }
    Ok(loaded.into_iter().flatten().collect())
}

/// Of the ranks' errors, the one that is not merely a report of a failed peer.
pub(crate) fn root_cause(mut errors: Vec<EngineError>) -> Option<EngineError> {
    match errors.iter().position(|e| !e.is_peer_report()) {
        Some(i) => Some(errors.swap_remove(i)),
        None => errors.into_iter().next(),
    }
}

/// Runs jobs one at a time on all ranks. After a failure the ranks' collectives are aborted,
/// so later requests are refused with the original cause.
fn schedule(
    jobs: Receiver<Arc<RankJob>>,
    ranks: Vec<Sender<Arc<RankJob>>>,
    done: Vec<Receiver<RankResult>>,
    threads: Vec<JoinHandle<()>>,
) {
    let mut broken: Option<String> = None;
    for job in jobs.iter() {
        if let Some(cause) = &broken {
            let _ = job.events.send(RankEvent::Error(EngineError::Stopped(cause.clone())));
            continue;
        }
        let mut errors = Vec::new();
        let sent: Vec<bool> = ranks.iter().map(|tx| tx.send(job.clone()).is_ok()).collect();
        for (rank, (done, sent)) in done.iter().zip(sent).enumerate() {
            match sent.then(|| done.recv()) {
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => errors.push(e),
                Some(Err(_)) | None => errors.push(EngineError::RankExited { rank }),
            }
        }
        if let Some(root) = root_cause(errors) {
            broken = Some(root.to_string());
            let _ = job.events.send(RankEvent::Error(root));
        }
    }
    drop(ranks);
    for t in threads {
        let _ = t.join();
    }
}
