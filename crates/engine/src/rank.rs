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

    /// Fails, naming decode `step`, where its `logits` are not finite: checked every
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

    /// The number of tokens generated so far.
    fn generated(&self) -> usize {
        self.context.len() - self.job.prompt.len()
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
        let listening = self.stream(token, logprobs);
        self.ending(token, cached, capacity)
            .or((!listening).then_some(StopReason::Cancelled))
    }

    /// Rank 0 streams a new `token`; false once the request's receiver is gone.
    fn stream(&mut self, token: u32, logprobs: Option<crate::TokenLogprobs>) -> bool {
        self.prefill.get_or_insert_with(|| self.start.elapsed());
        self.job.events.send(RankEvent::Token(token, logprobs)).is_ok()
    }

    /// Whether the request ends at a new `token` (kept either way), as every rank decides alike
    /// from the token: at an end of sequence, at its token limit, or where the KV cache (of
    /// `cached` positions, `capacity` at most) has no room to run it.
    fn ending(&self, token: u32, cached: usize, capacity: usize) -> Option<StopReason> {
        if self.job.eos.contains(&token) {
            Some(StopReason::Eos)
        } else if self.generated() + 1 >= self.job.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if cached + 1 > capacity {
            Some(StopReason::ContextFull)
        } else {
            None
        }
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

    /// Injects the configured fault before decode step `step` (the forward of the
    /// (`step` + 1)-th generated token).
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
/// the host only reads the token (8 bytes with the stop flag) and never sends one back.
///
/// The device runs a step ahead of the host: while the host streams a token and decides on
/// it, the next step is already queued, so no step waits on the host. Every rank reads the
/// same tokens, so every rank ends alike at an end of sequence, the token limit or a full KV
/// cache (a step that would overflow it is never queued), and the steps still queued then are
/// read and their tokens discarded. Only a cancellation is rank 0's alone: it rides on the
/// flag sum of the next step queued. No step is queued past one whose logits are read: the
/// finiteness checks' and, for a traced request, every step.
fn run_greedy(
    model: &mut LlamaRank,
    comm: &dyn Communicator,
    setup: &RankSetup<'_>,
    mut run: JobRun,
    logits: Tensor,
) -> Result<usize, EngineError> {
    run.trace(&logits)?;
    let traced = run.job.logits.is_some();
    let capacity = model.max_positions();
    let mut token = model.greedy_start(&logits).map_err(run.layer_err())?;
    // Rank 0's: the request's receiver is gone.
    let mut cancelled = false;
    // Steps queued so far, and of them not yet read.
    let (mut queued, mut unread) = (0, 0);
    // The logits of the step read last, where no later one has overwritten them.
    let mut newest = None;
    loop {
        // `token` has just been read; `unread` steps are queued after it.
        let cached = run.context.len();
        let end = run.ending(token, cached, capacity);
        if run.rank == 0 && !cancelled {
            cancelled = !run.stream(token, None);
        }
        run.context.push(token);
        if let Some(reason) = end {
            return finish_greedy(model, comm, run, reason, (queued, unread), newest);
        }
        let depth = match traced {
            true => 1,
            false => 2,
        };
        while unread < depth && model.cached_positions() < capacity {
            if unread > 0 && queued % FINITE_CHECK_STEPS == 0 {
                break;
            }
            let flag = encode(cancelled.then_some(StopReason::Cancelled));
            model.greedy_queue(flag).map_err(run.layer_err())?;
            (queued, unread) = (queued + 1, unread + 1);
        }
        // A fault strikes as the step's result is awaited, as a failure on the device would.
        run.maybe_fault(setup, queued - unread)?;
        let step = model.greedy_take().map_err(run.layer_err())?;
        unread -= 1;
        if let Some(reason) = decode(step.flags) {
            return finish_greedy(model, comm, run, reason, (queued, unread), step.logits);
        }
        if let Some(logits) = &step.logits {
            run.check_finite(logits, queued, false)?;
            run.trace(logits)?;
        }
        (token, newest) = (step.token, step.logits);
    }
}

/// Ends a greedy request for `reason`: reads the `unread` steps still queued (of `queued` in
/// all), discarding their tokens, and checks the logits of the last step run (`newest`, the
/// step read last, where none is left to read).
fn finish_greedy(
    model: &mut LlamaRank,
    comm: &dyn Communicator,
    run: JobRun,
    reason: StopReason,
    (queued, unread): (usize, usize),
    mut newest: Option<Tensor>,
) -> Result<usize, EngineError> {
    for _ in 0..unread {
        newest = model.greedy_take().map_err(run.layer_err())?.logits;
    }
    if let Some(logits) = &newest {
        run.check_finite(logits, queued, true)?;
    }
    run.finish(comm, reason);
    Ok(model.cached_positions())
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
            run.check_finite(&logits, run.generated(), true)?;
            run.finish(comm, reason);
            // The last token was sampled but never run through the model.
            return Ok(run.context.len() - 1);
        }
        run.maybe_fault(setup, run.generated() - 1)?;
        logits = model.forward(&[token]).map_err(run.layer_err())?;
        run.check_finite(&logits, run.generated(), false)?;
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
