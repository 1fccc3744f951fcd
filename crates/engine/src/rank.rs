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

    /// Fails, naming the decode step, where the `logits` of the step just run are not
    /// finite: checked every [`FINITE_CHECK_STEPS`] steps, and at the `last`.
    fn check_finite(&self, logits: &Tensor, last: bool) -> Result<(), EngineError> {
        let step = self.context.len() - self.job.prompt.len();
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
        self.prefill.get_or_insert_with(|| self.start.elapsed());
        let generated = self.context.len() + 1 - self.job.prompt.len();
        let cancelled = self.job.events.send(RankEvent::Token(token, logprobs)).is_err();
        if self.job.eos.contains(&token) {
            Some(StopReason::Eos)
        } else if generated >= self.job.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if cached + 1 > capacity {
            Some(StopReason::ContextFull)
        } else if cancelled {
            Some(StopReason::Cancelled)
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

    /// Injects the configured fault before decode step `n` (the forward of the (n + 1)-th
    /// generated token).
    fn maybe_fault(&mut self, setup: &RankSetup<'_>) -> Result<(), EngineError> {
        let step = self.context.len() - self.job.prompt.len() - 1;
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
/// the host only reads the token (8 bytes with the stop flag) and never sends one back. Rank
/// 0's stop decision for a token rides on the next step's flag sum, so that every rank leaves
/// after the same step; that step's token is discarded. A step that would overflow the KV
/// cache is never run: every rank sees that alike.
fn run_greedy(
    model: &mut LlamaRank,
    comm: &dyn Communicator,
    setup: &RankSetup<'_>,
    mut run: JobRun,
    logits: Tensor,
) -> Result<usize, EngineError> {
    run.trace(&logits)?;
    let capacity = model.max_positions();
    let mut token = model.greedy_start(&logits).map_err(run.layer_err())?;
    loop {
        let reason = match run.rank {
            0 => run.accept(token, None, model.cached_positions(), capacity),
            _ => None,
        };
        run.context.push(token);
        if model.cached_positions() + 1 > capacity {
            run.finish(comm, reason.unwrap_or(StopReason::ContextFull));
            return Ok(model.cached_positions());
        }
        run.maybe_fault(setup)?;
        let step = model.greedy_step(encode(reason)).map_err(run.layer_err())?;
        run.check_finite(&step.logits, decode(step.flags).is_some())?;
        if let Some(reason) = decode(step.flags) {
            run.finish(comm, reason);
            return Ok(model.cached_positions());
        }
        run.trace(&step.logits)?;
        token = step.token;
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
            run.check_finite(&logits, true)?;
            run.finish(comm, reason);
            // The last token was sampled but never run through the model.
            return Ok(run.context.len() - 1);
        }
        run.maybe_fault(setup)?;
        logits = model.forward(&[token]).map_err(run.layer_err())?;
        run.check_finite(&logits, false)?;
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
