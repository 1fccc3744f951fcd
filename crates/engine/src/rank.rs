//! A request as each rank runs it, in lockstep with its peers.

use std::sync::mpsc::Sender;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_llama::LlamaRank;
use tpinfer_runtime::RuntimeError;

use crate::stream::{EventSink, RankEvent};
use crate::{EngineError, Fault, GenerationStats, SamplingParams, StopReason};

/// A request as every rank sees it.
pub(crate) struct RankJob {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub eos: Vec<u32>,
    /// Rank 0 streams tokens here.
    pub events: EventSink,
    /// If set, rank 0 sends the logits of every step here, before sampling.
    pub logits: Option<Sender<Vec<f32>>>,
    /// Report the log-probabilities of each token and of this many alternatives.
    pub logprobs: Option<usize>,
}

impl RankJob {
    /// Whether the one-sequence step's own argmax can choose each token, which then never
    /// leaves the device between steps: greedy without a penalty, and no log-probabilities to
    /// report (a trace of the logits reads them either way).
    pub fn greedy_on_device(&self) -> bool {
        self.sampling.is_greedy() && self.logprobs.is_none()
    }

    /// `token`'s log-probabilities from the `logits` it was chosen from, if asked for.
    pub fn token_logprobs(&self, logits: &[f32], token: u32) -> Option<crate::TokenLogprobs> {
        self.logprobs.map(|top| crate::TokenLogprobs::of(logits, token, top))
    }
}

/// Decode steps from one check that the logits are finite to the next. A NaN reaches every
/// later step through the KV cache, so checks this far apart (and at a request's last step)
/// find it within a few tokens, at one device sync per this many steps.
const FINITE_CHECK_STEPS: usize = 32;

/// What a request's run needs of its rank besides the model and the communicator.
pub(crate) struct RankSetup<'a> {
    pub device: &'a Device,
    pub fault: Option<Fault>,
}

/// Stop reasons as they travel in the broadcast that ends each step.
fn encode(reason: Option<StopReason>) -> u32 {
    match reason {
        None => 0,
        Some(StopReason::Eos) => 1,
        Some(StopReason::MaxTokens) => 2,
        Some(StopReason::ContextFull) => 3,
        Some(StopReason::Cancelled) => 4,
    }
}

fn decode(code: u32) -> Option<StopReason> {
    match code {
        1 => Some(StopReason::Eos),
        2 => Some(StopReason::MaxTokens),
        3 => Some(StopReason::ContextFull),
        4 => Some(StopReason::Cancelled),
        _ => None,
    }
}

/// Prefill, then one token per step, every rank in lockstep. Greedy requests keep each token
/// on the device ([`run_greedy`]); the others sample on rank 0's host, which broadcasts the
/// token and whether to stop. Returns the number of positions the request reached.
pub(crate) fn run_job(
    model: &mut LlamaRank,
    comm: &dyn Communicator,
    setup: &RankSetup<'_>,
    job: &RankJob,
) -> Result<usize, EngineError> {
    model.clear_cache();
    let run = JobRun::start(comm, job);
    let logits = model.forward(&job.prompt).map_err(run.layer_err())?;
    // Every rank holds the gathered logits, so every rank stops alike. One check a request:
    // the decode steps' logits stay on the device.
    if !crate::error::finite(&logits).map_err(sample_err)? {
        return Err(EngineError::NonFinite {
            what: "logits",
            stage: "the prompt's forward".into(),
        });
    }
    match job.greedy_on_device() {
        true => run_greedy(model, comm, setup, run, logits),
        false => run_sampled(model, comm, setup, job, run, logits),
    }
}

/// A two-token prompt and two greedy decode steps on a model just loaded (the second step
/// captures the step's CUDA graph, which later requests replay), then an empty KV cache. The
/// tokens are id 0: only the kernels matter. A context too short for it is left cold.
pub(crate) fn warm_up(model: &mut LlamaRank) -> Result<(), tpinfer_layers::Error> {
    const PROMPT: [u32; 2] = [0, 0];
    const STEPS: usize = 2;
    if model.max_positions() < PROMPT.len() + STEPS {
        return Ok(());
    }
    let logits = model.forward(&PROMPT)?;
    model.greedy_start(&logits)?;
    for _ in 0..STEPS {
        model.greedy_step(0)?;
    }
    model.clear_cache();
    Ok(())
}

/// A request as one rank runs it: the tokens so far and the clocks of its statistics.
struct JobRun<'a> {
    rank: usize,
    job: &'a RankJob,
    /// The prompt, then every generated token.
    context: Vec<u32>,
    start: Instant,
    prefill: Option<std::time::Duration>,
    collectives_before: tpinfer_comm::StatsSnapshot,
    /// An injected `Fault::NonFinite` has struck: the logits read as NaN from then on.
    poisoned: bool,
}

impl<'a> JobRun<'a> {
    fn start(comm: &dyn Communicator, job: &'a RankJob) -> Self {
        Self {
            rank: comm.rank(),
            job,
            context: job.prompt.clone(),
            start: Instant::now(),
            prefill: None,
            collectives_before: comm.stats().snapshot(),
            poisoned: false,
        }
    }

    /// Fails, naming decode step `step`, where its `logits` are not finite: checked every
    /// [`FINITE_CHECK_STEPS`] steps, and at the `last`.
    fn check_finite(&self, logits: &Tensor, step: usize, last: bool) -> Result<(), EngineError> {
        if !last && !step.is_multiple_of(FINITE_CHECK_STEPS) {
            return Ok(());
        }
        let finite = match self.poisoned {
            true => crate::error::finite(&(logits * f64::NAN).map_err(sample_err)?),
            false => crate::error::finite(logits),
        };
        match finite.map_err(sample_err)? {
            true => Ok(()),
            false => Err(EngineError::NonFinite {
                what: "logits",
                stage: format!("decode step {step}"),
            }),
        }
    }

    fn layer_err(&self) -> impl Fn(tpinfer_layers::Error) -> EngineError {
        let rank = self.rank;
        move |source| rank_error(rank, source)
    }

    /// Rank 0's part of a new `token`: streams it and says whether the request stops here
    /// (the token itself is kept either way). `cached` is the number of positions in the
    /// KV cache, `capacity` the most it holds.
    fn accept(
        &mut self,
        token: u32,
        logprobs: Option<crate::TokenLogprobs>,
        cached: usize,
        capacity: usize,
    ) -> Option<StopReason> {
        let cancelled = self.stream(token, logprobs);
        self.stop_at(token, self.context.len() + 1, cached, capacity)
            .or(cancelled.then_some(StopReason::Cancelled))
    }

    /// Rank 0 streams a new `token`; returns whether the stream's reader has gone.
    fn stream(&mut self, token: u32, logprobs: Option<crate::TokenLogprobs>) -> bool {
        self.prefill.get_or_insert_with(|| self.start.elapsed());
        self.job.events.send(RankEvent::Token(token, logprobs)).is_err()
    }

    /// Whether the request stops at `token`, with `context` tokens in all once it is kept,
    /// `cached` positions in the KV cache and room for `capacity`: what every rank decides
    /// alike from the tokens alone.
    fn stop_at(&self, token: u32, context: usize, cached: usize, capacity: usize) -> Option<StopReason> {
        let generated = context - self.job.prompt.len();
        if self.job.eos.contains(&token) {
            Some(StopReason::Eos)
        } else if generated >= self.job.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if cached + 1 > capacity {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }

    /// Whether this request reads the logits of every step (rank 0 sends them on).
    fn traces(&self) -> bool {
        self.job.logits.is_some()
    }

    /// Rank 0 sends the logits a token is chosen from, when the request asked for them.
    fn trace(&self, logits: &Tensor) -> Result<(), EngineError> {
        if let (0, Some(trace)) = (self.rank, &self.job.logits) {
            let _ = trace.send(logits.squeeze(0).and_then(|l| l.to_vec1::<f32>()).map_err(sample_err)?);
        }
        Ok(())
    }

    /// Ends the request: rank 0 reports its statistics.
    fn finish(&self, comm: &dyn Communicator, reason: StopReason) {
        if self.rank != 0 {
            return;
        }
        let prefill = self.prefill.unwrap_or_default();
        let stats = GenerationStats {
            prompt_tokens: self.job.prompt.len(),
            generated_tokens: self.context.len() - self.job.prompt.len(),
            prefill,
            decode: self.start.elapsed() - prefill,
            collectives: comm.stats().snapshot().since(&self.collectives_before).time,
            stop_reason: reason,
        };
        let _ = self.job.events.send(RankEvent::Done(stats));
    }

    /// Injects the configured fault before decode step `step` (from 0: the forward of the
    /// (step + 1)-th generated token).
    fn maybe_fault(&mut self, setup: &RankSetup<'_>, step: usize) -> Result<(), EngineError> {
        match setup.fault.filter(|f| f.at(self.rank, step)) {
            Some(Fault::NonFinite { .. }) => {
                self.poisoned = true;
                Ok(())
            }
            Some(fault) => inject(fault, self.rank, setup.device),
            None => Ok(()),
        }
    }
}

fn sample_err(e: candle_core::Error) -> EngineError {
    EngineError::Sampling(e.to_string())
}

/// Greedy decoding on the device: each step's argmax stays there as the next step's input, so
/// the host only reads the token (8 bytes with the flag sum) and never sends one back. The
/// host queues the next step before it reads a step's token, so that the device does not
/// idle while the host reads it. So that ranks stay in lockstep, every rank queues the same
/// steps: each decides alike from the tokens (which all hold) whether an end-of-sequence
/// token, the requested length or the cache's room stops the request, and never queues a
/// step past that length or room. Only rank 0 sees the stream's reader leave: that rides on
/// the flag sum of the next step it queues, and the steps before it run out. The steps whose
/// logits are checked, and every step of a request whose logits are traced, run with none
/// queued after them: the logits of a captured step are the buffer the next one overwrites.
fn run_greedy(
    model: &mut LlamaRank,
    comm: &dyn Communicator,
    setup: &RankSetup<'_>,
    mut run: JobRun,
    logits: Tensor,
) -> Result<usize, EngineError> {
    run.trace(&logits)?;
    let capacity = model.max_positions();
    let prompt = run.job.prompt.len();
    // Step k (from 1) runs the k-th token generated (counting from 1): the request needs it
    // unless that token is the last asked for or fills the cache.
    let max_new_tokens = run.job.max_new_tokens;
    let needed = |step: usize| step < max_new_tokens && prompt + step <= capacity;
    // Whether step k may run with step k + 1 queued behind it.
    let traces = run.traces();
    let overlaps = |step: usize| !traces && !step.is_multiple_of(FINITE_CHECK_STEPS);
    let mut token = model.greedy_start(&logits).map_err(run.layer_err())?;
    let (mut queued, mut taken, mut flags) = (0, 0, 0);
    let mut last_logits = logits;
    let mut cancelled = false;
    loop {
        if run.rank == 0 {
            cancelled |= run.stream(token, None);
        }
        run.context.push(token);
        let at = run.stop_at(token, run.context.len(), prompt + taken, capacity);
        if let Some(reason) = at.or(decode(flags)) {
            while taken < queued {
                last_logits = model.greedy_take().map_err(run.layer_err())?.logits;
                taken += 1;
            }
            if taken > 0 {
                run.check_finite(&last_logits, taken, true)?;
            }
            run.finish(comm, reason);
            return Ok(model.cached_positions());
        }
        while needed(queued + 1) && (queued == taken || (queued == taken + 1 && overlaps(queued))) {
            let flag = encode(cancelled.then_some(StopReason::Cancelled));
            let queue = run
                .maybe_fault(setup, queued)
                .and_then(|()| model.greedy_queue(flag).map_err(run.layer_err()));
            if let Err(error) = queue {
                // The step in flight ran before the failing one: its token is delivered, as a
                // loop of one step at a time would have.
                if run.rank == 0 && taken < queued {
                    if let Ok(step) = model.greedy_take() {
                        run.stream(step.token, None);
                    }
                }
                return Err(error);
            }
            queued += 1;
        }
        let step = model.greedy_take().map_err(run.layer_err())?;
        taken += 1;
        run.check_finite(&step.logits, taken, false)?;
        run.trace(&step.logits)?;
        (token, flags, last_logits) = (step.token, step.flags, step.logits);
    }
}

/// Sampling (or a penalty, or log-probabilities) on rank 0: it chooses each token on the
/// device and broadcasts it with whether to stop. The logits come to the host only for
/// log-probabilities or a trace.
fn run_sampled(
    model: &mut LlamaRank,
    comm: &dyn Communicator,
    setup: &RankSetup<'_>,
    job: &RankJob,
    mut run: JobRun,
    mut logits: Tensor,
) -> Result<usize, EngineError> {
    loop {
        let mut step = [0u32, 0u32];
        if run.rank == 0 {
            let draw = run.context.len() - job.prompt.len();
            let pick = job.sampling.row(draw, &run.context);
            let token = tpinfer_layers::sample_rows(&logits, &[pick])
                .and_then(|ids| ids.to_vec1::<u32>())
                .map_err(sample_err)?[0];
            run.trace(&logits)?;
            let logprobs = match job.logprobs {
                Some(_) => {
                    let row = logits.squeeze(0).and_then(|l| l.to_vec1::<f32>()).map_err(sample_err)?;
                    job.token_logprobs(&row, token)
                }
                None => None,
            };
            let reason = run.accept(token, logprobs, model.cached_positions(), model.max_positions());
            step = [token, encode(reason)];
        }
        // A lone rank has its step already: no trip to the device and back.
        let [token, code] = match comm.world_size() {
            1 => step,
            _ => {
                let step_tensor = Tensor::new(&step, setup.device).map_err(sample_err)?;
                comm.broadcast(&step_tensor, 0)?
                    .to_vec1::<u32>()
                    .map_err(sample_err)?
                    .try_into()
                    .map_err(|_| EngineError::Sampling("malformed step broadcast".into()))?
            }
        };
        run.context.push(token);
        if let Some(reason) = decode(code) {
            run.check_finite(&logits, run.context.len() - job.prompt.len(), true)?;
            run.finish(comm, reason);
            // The last token was sampled but never run through the model.
            return Ok(run.context.len() - 1);
        }
        let step = run.context.len() - job.prompt.len() - 1;
        run.maybe_fault(setup, step)?;
        logits = model.forward(&[token]).map_err(run.layer_err())?;
        run.check_finite(&logits, step + 1, false)?;
    }
}

fn rank_error(rank: usize, source: tpinfer_layers::Error) -> EngineError {
    RuntimeError::of_rank(rank, source).into()
}

/// Carries out an injected fault (see [`Fault`]).
pub(crate) fn inject(fault: Fault, rank: usize, device: &Device) -> Result<(), EngineError> {
    match fault {
        Fault::Error { .. } => Err(EngineError::Injected {
            rank,
            fault: "error".into(),
        }),
        Fault::Panic { .. } => panic!("injected panic on rank {rank}"),
        Fault::Exit { .. } => Err(RuntimeError::RankExited { rank }.into()),
        Fault::NonFinite { .. } => Ok(()),
        Fault::Oom { .. } => {
            if device.is_cpu() {
                // On the CPU a failed allocation aborts the process: nothing to report.
                return Err(EngineError::Injected {
                    rank,
                    fault: "out-of-memory cannot be injected into CPU ranks".into(),
                });
            }
            // 4 TiB: more than any GPU has, so the driver refuses it.
            let bytes = 4usize << 40;
            Tensor::zeros(bytes / 4, DType::F32, device).map(|_| ()).map_err(|e| {
                RuntimeError::OutOfMemory {
                    rank,
                    detail: format!("allocating {bytes} bytes: {e}"),
                }
                .into()
            })
        }
    }
}
