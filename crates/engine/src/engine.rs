use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{DType, Device};
use tpinfer_llama::{LlamaConfig, LlamaModel, LlamaRank};
use tpinfer_plan::Placement;
use tpinfer_runtime::{check_after_request, DeviceMemory, Launch, ModelHandle, RankGroup, RuntimeError, Topology};
use tpinfer_tokenizer::Tokenizer;

use crate::batching::{self, BatchLimits};
use crate::builder::DEFAULT_MAX_CONTEXT;
use crate::rank::{run_job, RankJob, RankSetup};
use crate::status::Status;
use crate::stream::{EventSink, RankEvent};
use crate::{EngineBuilder, EngineError, EventStream, Fault, GenerateRequest, Health, Load, Prompt, TokenStream};

/// A loaded model on its ranks. Share it between threads (`Arc<Engine>`): requests from any
/// thread are queued, and run one at a time on all ranks or, with
/// [`EngineBuilder::max_seqs`] above 1, batched continuously.
pub struct Engine {
    jobs: Option<Sender<Arc<RankJob>>>,
    scheduler: Option<JoinHandle<()>>,
    tokenizer: Arc<Tokenizer>,
    config: LlamaConfig,
    tp: usize,
    max_context: usize,
    step_tokens: usize,
    dtype: DType,
    rank_weight_bytes: Vec<usize>,
    devices: Vec<Device>,
    plan: tpinfer_plan::Plan,
    status: Arc<Status>,
}

impl Engine {
    /// Starts configuring an engine for the model at `model`.
    pub fn builder(model: impl AsRef<std::path::Path>) -> EngineBuilder {
        EngineBuilder::new(model)
    }

    pub(crate) fn start(b: EngineBuilder) -> Result<Self, EngineError> {
        if b.lora.is_some() {
            return Err(EngineError::InvalidRequest(format!(
                "{}: LoRA adapters are merged into Wan video models so far, not language models",
                b.model.display()
            )));
        }
        if b.self_attention != tpinfer_wan::SelfAttention::ComputeDtype {
            return Err(EngineError::InvalidRequest(format!(
                "{}: FP8 self-attention is for Wan video models, not language models",
                b.model.display()
            )));
        }
        let model = LlamaModel::open_checkpoint_with(&b.model, b.weight_format)?;
        let config = model.config().clone();
        // A GGUF file without a tokenizer (one tpinfer wrote, say) takes the tokenizer.json
        // beside it.
        let tokenizer = match model.checkpoint().and_then(|c| c.gguf_metadata()) {
            Some(metadata) if metadata.contains_key("tokenizer.ggml.tokens") => Tokenizer::from_gguf(metadata)?,
            Some(_) => Tokenizer::from_hf_dir(b.model.parent().unwrap_or(std::path::Path::new(".")))?,
            None => Tokenizer::from_hf_dir(&b.model)?,
        };
        let tokenizer = Arc::new(match &b.chat_template {
            Some(source) => tokenizer.with_chat_template(source.as_str()).map_err(|e| {
                EngineError::InvalidRequest(format!("the chat template given for {}: {e}", b.model.display()))
            })?,
            None => tokenizer,
        });
        let topology = Topology::new(b.tp, &b.device)?;
        if let Some(note) = crate::fp8_expanded_note(&topology).filter(|_| model.holds_fp8()) {
            tracing::warn!("{note}");
        }
        // A fault that can never strike would let a failure test pass without a failure.
        if let Some((rank, _)) = b.fault.map(|f| f.place()).filter(|&(rank, _)| rank >= b.tp) {
            return Err(EngineError::InvalidRequest(format!(
                "the injected fault's rank {rank} is not one of the {} ranks",
                b.tp
            )));
        }
        let dtype = b.dtype.unwrap_or(match topology.is_cpu() {
            true => DType::F32,
            false => config.dtype.unwrap_or(DType::BF16),
        });
        // An explicit length goes to the plan as it is: it refuses one the model cannot hold.
        let max_context = b
            .max_context
            .unwrap_or(DEFAULT_MAX_CONTEXT.min(config.max_position_embeddings));
        if b.max_seqs == 0 || b.step_tokens == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "max_seqs ({}) and step_tokens ({}) must be at least 1",
                b.max_seqs, b.step_tokens
            )));
        }
        let batch = b.max_seqs;
        let mut launch = Launch::new(topology, b.group.clone());
        // Serving several sequences, the paged KV cache holds as many full contexts as the
        // budget affords, up to all of them; shorter sequences share it finer, and when its
        // blocks run out the newest is preempted.
        let full = Placement::llm(max_context, batch);
        let fit = launch.budget().and_then(|budget| {
            tpinfer_plan::kv_sequences_that_fit(&model, b.tp, dtype, full, launch.profile(), budget)
        });
        let placement = tpinfer_plan::with_kv_sequences(full, fit);
        let llama = launch.add(Arc::new(model), dtype, placement)?;
        let group = launch.start()?;
        match batch {
            1 => warm_up(&group, llama)?,
            _ => batching::warm_up(&group, llama)?,
        }
        let plan = group.plans()[llama.index()].clone();
        let step_tokens = batched_step_tokens(b.step_tokens, &plan, max_context, batch);
        let devices = group.topology().devices().to_vec();
        let rank_weight_bytes = group.weight_bytes(llama.index());
        let (jobs_tx, jobs_rx) = mpsc::channel();
        let fault = b.fault;
        let limits = BatchLimits {
            max_seqs: batch,
            step_tokens,
            // The pool the ranks allocated (none for one sequence at a time, whose scheduler
            // hands out no blocks).
            blocks: tpinfer_llama::memory::paged_blocks(placement).unwrap_or(0),
            block_size: tpinfer_llama::memory::KV_BLOCK_SIZE,
            max_positions: max_context,
        };
        let status = Arc::new(Status::default());
        // The paged cache's size is known before the scheduler's first report.
        if batch > 1 {
            status.set(Load {
                kv_blocks: limits.blocks,
                ..Load::default()
            });
        }
        let shared = status.clone();
        let scheduler = std::thread::Builder::new()
            .name("tpinfer-scheduler".into())
            .spawn(move || match batch {
                1 => schedule(jobs_rx, group, llama, fault, &shared),
                _ => batching::serve(jobs_rx, group, llama, limits, fault, &shared),
            })
            .map_err(|e| RuntimeError::Stopped(format!("cannot start the scheduler thread: {e}")))?;
        Ok(Self {
            jobs: Some(jobs_tx),
            scheduler: Some(scheduler),
            tokenizer,
            config,
            tp: b.tp,
            max_context,
            step_tokens,
            dtype,
            rank_weight_bytes,
            devices,
            plan,
            status,
        })
    }

    /// Queues a request and returns its token stream. Prompt errors are reported here, before
    /// anything runs.
    pub fn generate(&self, request: GenerateRequest) -> Result<TokenStream, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.submit(request, EventSink::Blocking(tx), None)?;
        Ok(TokenStream::new(rx, self.tokenizer.clone()))
    }

    /// [`Self::generate`] as an async stream, for services on an async runtime: polling it
    /// never blocks a thread, and dropping it cancels the request.
    pub fn generate_stream(&self, request: GenerateRequest) -> Result<EventStream, EngineError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let prompt_tokens = self.submit(request, EventSink::Async(tx), None)?;
        Ok(EventStream::new(rx, self.tokenizer.clone(), prompt_tokens))
    }

    /// Like [`Self::generate`], and also returns the f32 logits over the vocabulary of every
    /// step (prefill first), as sampled from: for checking numerics against a reference.
    pub fn generate_traced(&self, request: GenerateRequest) -> Result<(TokenStream, Receiver<Vec<f32>>), EngineError> {
        let (tx, rx) = mpsc::channel();
        let (events, stream) = mpsc::channel();
        self.submit(request, EventSink::Blocking(events), Some(tx))?;
        Ok((TokenStream::new(stream, self.tokenizer.clone()), rx))
    }

    fn submit(
        &self,
        request: GenerateRequest,
        events: EventSink,
        logits: Option<Sender<Vec<f32>>>,
    ) -> Result<usize, EngineError> {
        request.sampling.check()?;
        if let Some(n) = request.logprobs.filter(|&n| n > crate::MAX_TOP_LOGPROBS) {
            return Err(EngineError::InvalidRequest(format!(
                "logprobs asks for the {n} most likely tokens; at most {} are reported",
                crate::MAX_TOP_LOGPROBS
            )));
        }
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
        if let Some(&(id, _)) = request
            .sampling
            .logit_bias
            .iter()
            .find(|&&(id, _)| id as usize >= vocab)
        {
            return Err(EngineError::InvalidRequest(format!(
                "logit_bias names token {id}, outside the model's vocabulary of {vocab}"
            )));
        }
        let prompt_tokens = prompt.len();
        let job = Arc::new(RankJob {
            prompt,
            max_new_tokens: request.max_new_tokens,
            sampling: request.sampling,
            eos: match request.ignore_eos {
                true => Vec::new(),
                false => self.config.eos_token_ids.clone(),
            },
            events,
            logits,
            logprobs: request.logprobs,
        });
        self.jobs
            .as_ref()
            .ok_or_else(|| RuntimeError::Stopped("shutting down".into()))?
            .send(job)
            .map_err(|_| RuntimeError::Stopped("the scheduler has exited".into()))?;
        self.status.submitted();
        Ok(prompt_tokens)
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

    /// The positions the paged KV cache holds over all its blocks: 0 for an engine that serves
    /// one request at a time with a cache of its own.
    pub fn kv_cache_positions(&self) -> usize {
        self.load().kv_blocks * tpinfer_llama::memory::KV_BLOCK_SIZE
    }

    /// The most new tokens a batched step runs: the builder's
    /// [`EngineBuilder::step_tokens`], within the rows the plan counted for one forward.
    pub fn step_tokens(&self) -> usize {
        self.step_tokens
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Each rank's device memory now, with its peak since the start; `None` for CPU ranks.
    pub fn device_memory(&self) -> Vec<Option<DeviceMemory>> {
        self.devices.iter().map(tpinfer_runtime::measure).collect()
    }

    /// Whether the ranks still serve, or the cause of the failure that stopped them.
    pub fn health(&self) -> Health {
        self.status.health()
    }

    /// Requests running and queued, and KV blocks in use, now.
    pub fn load(&self) -> Load {
        self.status.load()
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

/// The new tokens per batched step: `asked`, at most the rows whose temporaries `plan` counted
/// for one forward (a prompt chunk of up to `max_context` positions, or a decode row for each
/// of `max_seqs` sequences), so that a step of several sequences' prompt chunks stays within
/// the memory the plan checked. Told when it is fewer.
fn batched_step_tokens(asked: usize, plan: &tpinfer_plan::Plan, max_context: usize, max_seqs: usize) -> usize {
    let planned = plan.tokens_per_forward.min(max_context).max(max_seqs);
    if max_seqs > 1 && asked > planned {
        tracing::info!(
            "{asked} new tokens a step asked; {planned} run, the rows the memory plan counts for one forward \
             (a longer --max-context plans more)"
        );
    }
    asked.min(planned)
}

/// Runs a short request's kernels once on every rank before the first request: the driver
/// compiles candle's PTX kernels and the decode step's CUDA graph is captured at start-up, as
/// vLLM warms up before serving, instead of inside the first request's prefill.
fn warm_up(group: &RankGroup, llama: ModelHandle<LlamaRank>) -> Result<(), EngineError> {
    let start = std::time::Instant::now();
    group.run(move |rank| -> Result<(), EngineError> {
        let r = rank.env.rank;
        crate::rank::warm_up(rank.models.get_mut(&llama)?).map_err(|e| RuntimeError::of_rank(r, e).into())
    })?;
    tracing::info!(
        seconds = start.elapsed().as_secs_f64(),
        "warmed up: kernels loaded, decode step captured"
    );
    Ok(())
}

/// Runs jobs one at a time on all ranks. After a failure the ranks' collectives are aborted,
/// and the group refuses later requests with the original cause.
fn schedule(
    jobs: Receiver<Arc<RankJob>>,
    group: RankGroup,
    llama: ModelHandle<LlamaRank>,
    fault: Option<Fault>,
    status: &Status,
) {
    let mut first = true;
    for job in jobs.iter() {
        status.taken(1);
        status.set(Load {
            running: 1,
            ..Load::default()
        });
        // The first request is held to the plan: its peak against the planned one for it.
        let check_memory = std::mem::take(&mut first);
        let task_job = job.clone();
        let outcome = group.run(move |rank| -> Result<(), EngineError> {
            let model = rank.models.get_mut(&llama)?;
            let setup = RankSetup {
                device: &rank.env.device,
                fault,
            };
            let positions = run_job(model, &*rank.env.comm, &setup, &task_job)?;
            if check_memory {
                let request = model.planned_activations(task_job.prompt.len(), positions);
                let (peak, slack) = (request.peak as u64, request.pool_slack() as u64);
                check_after_request(rank.env.rank, &rank.env.device, &rank.env.plans[0], peak, slack);
            }
            Ok(())
        });
        status.set(Load::default());
        if let Err(e) = outcome {
            status.failed(&e.to_string());
            let _ = job.events.send(RankEvent::Error(e));
        }
    }
}
