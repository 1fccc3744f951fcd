//! Continuous batching: each step is one forward of every running sequence's new tokens over a
//! paged KV cache. Requests join between steps; prompts run in chunks under a per-step token
//! budget beside the others' decode tokens, so a long prompt does not stall them; a sequence
//! that finds no free KV block is preempted (its blocks freed, its tokens kept) and recomputed
//! when there is room again. Each sequence samples with its own parameters and seed, so a
//! seeded request gives the same tokens alone as in any batch.

use std::collections::VecDeque;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use tpinfer_layers::{BlockTable, RowSampling};
use tpinfer_llama::{LlamaRank, SequenceChunk};
use tpinfer_runtime::{ModelHandle, RankGroup, RuntimeError};

use crate::blocks::BlockPool;
use crate::rank::{inject, RankJob};
use crate::status::Status;
use crate::stream::RankEvent;
use crate::{EngineError, Fault, GenerationStats, Load, SamplingParams, StopReason};

/// What one step may hold, and the cache it draws from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchLimits {
    /// Sequences running at once.
    pub max_seqs: usize,
    /// New tokens (decode tokens and prompt chunks) in one forward.
    pub step_tokens: usize,
    /// The paged cache's blocks, and positions per block.
    pub blocks: usize,
    pub block_size: usize,
    /// The most positions a sequence may reach.
    pub max_positions: usize,
}

/// Runs a two-token prompt on every rank of a model just loaded, so that the driver compiles
/// the kernels before the first request. Its keys and values land in block 0, which every
/// sequence overwrites before it reads.
pub(crate) fn warm_up(group: &RankGroup, llama: ModelHandle<LlamaRank>) -> Result<(), EngineError> {
    group.run(move |rank| -> Result<(), EngineError> {
        let r = rank.env.rank;
        let table = BlockTable { blocks: vec![0] };
        let chunk = SequenceChunk {
            tokens: &[0, 0],
            start: 0,
            table: &table,
        };
        let model = rank.models.get_mut(&llama)?;
        model.forward_batch(&[chunk]).map_err(|e| RuntimeError::of_rank(r, e))?;
        Ok(())
    })?;
    Ok(())
}

/// Serves `jobs` until the sender is dropped and every sequence has ended. After a rank
/// failure every sequence in flight gets the error, and the group refuses later ones with it.
pub(crate) fn serve(
    jobs: Receiver<Arc<RankJob>>,
    group: RankGroup,
    llama: ModelHandle<LlamaRank>,
    limits: BatchLimits,
    fault: Option<Fault>,
    status: &Status,
) {
    let mut batch = Batch::new(limits);
    for step in 0.. {
        batch.report(status);
        let before = batch.waiting.len() + batch.running.len();
        if !batch.take_jobs(&jobs) {
            return;
        }
        status.taken(batch.waiting.len() + batch.running.len() - before);
        let plan = batch.plan_step();
        if plan.is_empty() {
            batch.refuse_unplaceable();
            continue;
        }
        let chunks: Arc<Vec<StepChunk>> = Arc::new(
            plan.iter()
                .map(|&(i, len)| {
                    let s = &batch.running[i];
                    StepChunk {
                        tokens: s.context[s.cached..s.cached + len].to_vec(),
                        start: s.cached,
                        table: s.table.clone(),
                        pick: s.pick(len),
                    }
                })
                .collect(),
        );
        let started = Instant::now();
        let outcome = group.run(move |rank| -> Result<StepRows, EngineError> {
            let r = rank.env.rank;
            let mut poisoned = false;
            if let Some(fault) = fault.filter(|f| f.at(r, step)) {
                poisoned = matches!(fault, Fault::NonFinite { .. });
                inject(fault, r, &rank.env.device)?;
            }
            let before = rank.env.comm.stats().snapshot();
            let model = rank.models.get_mut(&llama)?;
            let refs: Vec<SequenceChunk> = chunks
                .iter()
                .map(|c| SequenceChunk {
                    tokens: &c.tokens,
                    start: c.start,
                    table: &c.table,
                })
                .collect();
            let mut logits = model.forward_batch(&refs).map_err(|e| RuntimeError::of_rank(r, e))?;
            if r != 0 {
                return Ok(StepRows::default());
            }
            if poisoned {
                logits = (logits * f64::NAN).map_err(sample_err)?;
            }
            let picks: Vec<Option<&Pick>> = chunks.iter().map(|c| c.pick.as_ref()).collect();
            Ok(StepRows {
                rows: rows_out(&logits, &picks).map_err(sample_err)?,
                collectives: rank.env.comm.stats().snapshot().since(&before).time,
            })
        });
        let forward = started.elapsed();
        match outcome {
            Ok(mut ranks) if !ranks.is_empty() => {
                let tokens: usize = plan.iter().map(|&(_, len)| len).sum();
                batch.advance(&plan, ranks.swap_remove(0), Some(status));
                tracing::debug!(
                    sequences = plan.len(),
                    tokens,
                    forward_ms = forward.as_secs_f64() * 1e3,
                    step_ms = started.elapsed().as_secs_f64() * 1e3,
                    "a batched step"
                );
            }
            Ok(_) => batch.fail_all(RuntimeError::Stopped("the ranks returned nothing".into()).into()),
            Err(e) => {
                status.failed(&e.to_string());
                batch.fail_all(e);
            }
        }
    }
}

/// One sequence's chunk of a step, as the ranks take it.
struct StepChunk {
    tokens: Vec<u32>,
    start: usize,
    table: BlockTable,
    /// How its next token is chosen, when the chunk reaches the end of its sequence's tokens.
    pick: Option<Pick>,
}

/// How a sequence chooses its next token on the device.
struct Pick {
    sampling: SamplingParams,
    /// Its tokens generated so far.
    draw: usize,
    /// The context's last tokens, which the penalties look at (empty without one).
    recent: Vec<u32>,
    /// Whether the logits also come to the host: for log-probabilities, or a trace.
    row: bool,
}

impl Pick {
    fn row_sampling(&self) -> RowSampling<'_> {
        self.sampling.row(self.draw, &self.recent)
    }
}

/// What rank 0 reads of one chunk's logits.
#[derive(Debug, Clone, PartialEq)]
enum RowOut {
    Nothing,
    /// The token chosen, and the logits when they were asked for.
    Token(u32, Option<Vec<f32>>),
    /// The row holds NaN or infinite values.
    NonFinite,
}

/// Rank 0's part of a step: what each chunk's logits at its last token give, and its host
/// time in collectives.
#[derive(Default)]
struct StepRows {
    rows: Vec<RowOut>,
    collectives: Duration,
}

/// Reads `logits` `[chunks, vocab]` as `picks` say: every row's token chosen on the device and
/// each row's sum (a NaN or an infinity makes it not finite) in two small copies, and only the
/// rows asked for in full. Rows without a pick take the argmax, and are not read.
fn rows_out(logits: &Tensor, picks: &[Option<&Pick>]) -> candle_core::Result<Vec<RowOut>> {
    if picks.iter().all(Option::is_none) {
        return Ok(vec![RowOut::Nothing; picks.len()]);
    }
    let rows: Vec<RowSampling> = picks
        .iter()
        .map(|p| p.map_or(RowSampling::GREEDY, Pick::row_sampling))
        .collect();
    // Both queued before either is read: one wait for the device, not two.
    let (ids, sums) = (
        tpinfer_layers::sample_rows(logits, &rows)?,
        logits.sum_keepdim(1)?.flatten_all()?,
    );
    let (ids, sums) = (ids.to_vec1::<u32>()?, sums.to_vec1::<f32>()?);
    let full: Vec<u32> = (0..picks.len() as u32)
        .filter(|&i| picks[i as usize].is_some_and(|p| p.row))
        .collect();
    let mut full_rows = match full.is_empty() {
        true => Vec::new(),
        false => {
            let index = Tensor::new(full.as_slice(), logits.device())?;
            logits.index_select(&index, 0)?.to_vec2::<f32>()?
        }
    }
    .into_iter();
    Ok(picks
        .iter()
        .zip(ids.into_iter().zip(sums))
        .map(|(pick, (id, sum))| match (pick, sum.is_finite()) {
            (None, _) => RowOut::Nothing,
            (_, false) => RowOut::NonFinite,
            (Some(p), true) => RowOut::Token(id, p.row.then(|| full_rows.next()).flatten()),
        })
        .collect())
}

fn sample_err(e: candle_core::Error) -> EngineError {
    EngineError::Sampling(e.to_string())
}

/// One request as the scheduler holds it.
struct Sequence {
    job: Arc<RankJob>,
    /// The prompt, then every generated token; once generation started, the last one is not
    /// cached yet.
    context: Vec<u32>,
    /// Positions in the KV cache: the first `cached` of `context`.
    cached: usize,
    table: BlockTable,
    submitted: Instant,
    first_token: Option<Duration>,
    /// Rank 0's collective time over the steps it was in.
    collectives: Duration,
}

impl Sequence {
    fn new(job: Arc<RankJob>) -> Self {
        Self {
            context: job.prompt.clone(),
            job,
            cached: 0,
            table: BlockTable::default(),
            submitted: Instant::now(),
            first_token: None,
            collectives: Duration::ZERO,
        }
    }

    /// The positions of its next chunk: from the first uncached one on, at most `budget`.
    fn next_chunk(&self, budget: usize) -> usize {
        (self.context.len() - self.cached).min(budget)
    }

    fn generated(&self) -> usize {
        self.context.len() - self.job.prompt.len()
    }

    /// How its next chunk of `len` positions chooses a token: not at all before the end of
    /// its tokens.
    fn pick(&self, len: usize) -> Option<Pick> {
        if self.cached + len < self.context.len() {
            return None;
        }
        let sampling = &self.job.sampling;
        let draw = self.generated();
        let tail = sampling.penalized_tail(draw);
        Some(Pick {
            sampling: sampling.clone(),
            draw,
            recent: self.context[self.context.len().saturating_sub(tail)..].to_vec(),
            row: self.job.logprobs.is_some() || self.job.logits.is_some(),
        })
    }

    /// Takes the next token from a step's `row` (chosen on the device, or sampled here from
    /// the logits) and streams it; says why the sequence stops, if it does (the token is kept
    /// either way).
    fn take(&mut self, row: RowOut, max_positions: usize) -> Result<Option<StopReason>, EngineError> {
        let (token, logprobs) = match row {
            RowOut::Token(token, logits) => {
                let logprobs = logits.as_deref().and_then(|l| self.job.token_logprobs(l, token));
                if let (Some(trace), Some(logits)) = (&self.job.logits, logits) {
                    let _ = trace.send(logits);
                }
                (token, logprobs)
            }
            RowOut::Nothing | RowOut::NonFinite => {
                return Err(EngineError::NonFinite {
                    what: "logits",
                    stage: format!("decode step {}", self.generated()),
                })
            }
        };
        self.first_token.get_or_insert_with(|| self.submitted.elapsed());
        self.context.push(token);
        let cancelled = self.job.events.send(RankEvent::Token(token, logprobs)).is_err();
        Ok(if self.job.eos.contains(&token) {
            Some(StopReason::Eos)
        } else if self.generated() >= self.job.max_new_tokens {
            Some(StopReason::MaxTokens)
        } else if self.cached + 1 > max_positions {
            Some(StopReason::ContextFull)
        } else if cancelled {
            Some(StopReason::Cancelled)
        } else {
            None
        })
    }

    fn finish(self, outcome: Result<StopReason, EngineError>) {
        let event = match outcome {
            Ok(stop_reason) => {
                let total = self.submitted.elapsed();
                let prefill = self.first_token.unwrap_or(total);
                RankEvent::Done(GenerationStats {
                    prompt_tokens: self.job.prompt.len(),
                    generated_tokens: self.generated(),
                    prefill,
                    decode: total - prefill,
                    collectives: self.collectives,
                    stop_reason,
                })
            }
            Err(e) => RankEvent::Error(e),
        };
        let _ = self.job.events.send(event);
    }
}

/// The scheduler's state: sequences running (oldest first) and waiting (next first).
struct Batch {
    running: Vec<Sequence>,
    waiting: VecDeque<Sequence>,
    blocks: BlockPool,
    limits: BatchLimits,
    /// Sequences preempted so far.
    preemptions: usize,
    /// Positions that sequences found computed (shared prefixes) instead of computing.
    prefix_hits: usize,
}

impl Batch {
    fn new(limits: BatchLimits) -> Self {
        Self {
            running: Vec::new(),
            waiting: VecDeque::new(),
            blocks: BlockPool::new(limits.blocks, limits.block_size),
            limits,
            preemptions: 0,
            prefix_hits: 0,
        }
    }

    /// Queues the jobs sent since the last step, waiting for one when there is nothing to do.
    /// False once the sender is gone and nothing is left.
    fn take_jobs(&mut self, jobs: &Receiver<Arc<RankJob>>) -> bool {
        if self.running.is_empty() && self.waiting.is_empty() {
            match jobs.recv() {
                Ok(job) => self.waiting.push_back(Sequence::new(job)),
                Err(_) => return false,
            }
        }
        self.waiting.extend(jobs.try_iter().map(Sequence::new));
        true
    }

    /// The next step: (index in `running`, positions) per chunk. Running sequences come first,
    /// oldest first; then waiting ones join while the budget, `max_seqs` and the free blocks
    /// allow. A running sequence that needs a block when none is free takes the newest
    /// sequence's blocks, preempting it.
    fn plan_step(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.limits.step_tokens;
        let mut plan = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &mut self.running[i];
            let len = s.next_chunk(budget);
            if self.blocks.cover(&mut s.table, s.cached + len) {
                plan.push((i, len));
                budget -= len;
                i += 1;
                continue;
            }
            let newest = self.running.len() - 1;
            self.preempt(newest);
            if newest == i {
                break;
            }
        }
        while budget > 0 && self.running.len() < self.limits.max_seqs {
            let Some(next) = self.waiting.front_mut() else {
                break;
            };
            // Its first blocks, where another sequence computed the same tokens.
            let shared = self.blocks.share_prefix(&mut next.table, &next.context);
            next.cached = shared;
            let len = next.next_chunk(budget);
            if !self.blocks.cover(&mut next.table, shared + len) {
                self.blocks.release(&mut next.table);
                next.cached = 0;
                break;
            }
            self.prefix_hits += shared;
            if let Some(s) = self.waiting.pop_front() {
                self.running.push(s);
                plan.push((self.running.len() - 1, len));
                budget -= len;
            }
        }
        plan
    }

    fn report(&self, status: &Status) {
        let blocks = self.limits.blocks;
        status.set(Load {
            running: self.running.len(),
            queued: self.waiting.len(),
            kv_blocks_used: self.blocks.used(),
            kv_blocks: blocks,
            preemptions: self.preemptions,
            prefix_hit_tokens: self.prefix_hits,
        });
    }

    /// Frees sequence `i`'s blocks and queues it first, to recompute what it had cached.
    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        self.blocks.release(&mut s.table);
        s.cached = 0;
        self.preemptions += 1;
        tracing::debug!(tokens = s.context.len(), "preempted a sequence for its KV blocks");
        self.waiting.push_front(s);
    }

    /// With nothing running, the next sequence's first chunk must fit the free blocks; one
    /// that does not can never run.
    fn refuse_unplaceable(&mut self) {
        if !self.running.is_empty() {
            return;
        }
        if let Some(s) = self.waiting.pop_front() {
            let blocks = self.limits.blocks;
            s.finish(Err(EngineError::InvalidRequest(format!(
                "the request needs more KV blocks than the cache's {blocks}"
            ))));
        }
    }

    /// Takes a step's logits: each chunk that reached the end of its sequence's tokens samples
    /// the next one; sequences that stop leave with their blocks freed.
    /// The load goes to `status` before any sequence that ended is told: whoever sees a
    /// request end sees its blocks free.
    fn advance(&mut self, plan: &[(usize, usize)], step: StepRows, status: Option<&Status>) {
        let max_positions = self.limits.max_positions;
        let mut ended = Vec::new();
        for (&(i, len), row) in plan.iter().zip(step.rows) {
            let s = &mut self.running[i];
            self.blocks.computed(&s.table, &s.context, s.cached, s.cached + len);
            s.cached += len;
            s.collectives += step.collectives;
            if s.cached < s.context.len() {
                continue;
            }
            match s.take(row, max_positions) {
                Ok(None) => {}
                Ok(Some(reason)) => ended.push((i, Ok(reason))),
                Err(e) => ended.push((i, Err(e))),
            }
        }
        // From the back, so that the indices still hold.
        ended.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        let ended: Vec<_> = ended
            .into_iter()
            .map(|(i, outcome)| {
                let mut s = self.running.remove(i);
                self.blocks.release(&mut s.table);
                (s, outcome)
            })
            .collect();
        if let Some(status) = status {
            self.report(status);
        }
        for (s, outcome) in ended {
            s.finish(outcome);
        }
    }

    /// Ends every sequence with `error`: the oldest gets it as it is, the others its words.
    fn fail_all(&mut self, error: EngineError) {
        let cause = error.to_string();
        let mut error = Some(error);
        for mut s in self.running.drain(..).chain(self.waiting.drain(..)) {
            self.blocks.release(&mut s.table);
            let e = error
                .take()
                .unwrap_or_else(|| RuntimeError::Stopped(cause.clone()).into());
            s.finish(Err(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::SamplingParams;

    /// A sequence of `prompt` tokens that no other test's shares: no prefix is found cached
    /// unless a test makes one.
    fn sequence(prompt: usize, max_new_tokens: usize) -> (Sequence, mpsc::Receiver<RankEvent>) {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let first = NEXT.fetch_add(prompt as u32, std::sync::atomic::Ordering::Relaxed);
        sequence_of((first..first + prompt as u32).collect(), max_new_tokens)
    }

    fn sequence_of(prompt: Vec<u32>, max_new_tokens: usize) -> (Sequence, mpsc::Receiver<RankEvent>) {
        let (events, received) = mpsc::channel();
        let job = Arc::new(RankJob {
            prompt,
            max_new_tokens,
            sampling: SamplingParams::default(),
            eos: vec![],
            events: crate::stream::EventSink::Blocking(events),
            logits: None,
            logprobs: None,
        });
        (Sequence::new(job), received)
    }

    fn batch(max_seqs: usize, step_tokens: usize, blocks: usize) -> Batch {
        Batch::new(BatchLimits {
            max_seqs,
            step_tokens,
            blocks,
            block_size: 4,
            max_positions: 64,
        })
    }

    /// Token 1 for every chunk of `plan`, as greedy rows read on the device give it.
    fn rows(plan: &[(usize, usize)]) -> StepRows {
        StepRows {
            rows: plan.iter().map(|_| RowOut::Token(1, None)).collect(),
            collectives: Duration::ZERO,
        }
    }

    #[test]
    fn prompts_join_in_chunks_under_the_step_budget() {
        let mut b = batch(3, 8, 16);
        let receivers: Vec<_> = (0..3)
            .map(|_| {
                let (s, r) = sequence(5, 4);
                b.waiting.push_back(s);
                r
            })
            .collect();
        // The first prompt whole, the second's first 3 positions; the third waits.
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 5), (1, 3)]);
        assert_eq!((b.running.len(), b.waiting.len()), (2, 1));
        assert_eq!(b.running[0].table.blocks.len(), 2);
        b.advance(&plan, rows(&plan), None);
        // Sequence 0 sampled its first token; sequence 1 did not (its prompt is not done).
        assert_eq!(receivers[0].try_iter().count(), 1);
        assert_eq!(receivers[1].try_iter().count(), 0);
        // Decode of 0, the rest of 1's prompt, then 3 joins with what is left of the budget.
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 1), (1, 2), (2, 5)]);
    }

    #[test]
    fn a_sequence_without_a_free_block_preempts_the_newest_which_recomputes_later() {
        // Four blocks of 4: prompts of 8 and 6 positions fill all four.
        let mut b = batch(4, 64, 4);
        let (first, r0) = sequence(8, 6);
        let (second, r1) = sequence(6, 20);
        b.waiting.extend([first, second]);
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 8), (1, 6)]);
        assert_eq!(b.blocks.used(), 4);
        b.advance(&plan, rows(&plan), None);
        // Position 8 of the first needs a third block: the second is preempted for it.
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 1)]);
        assert_eq!((b.running.len(), b.waiting.len()), (1, 1));
        let preempted = &b.waiting[0];
        assert_eq!((preempted.cached, preempted.table.blocks.len()), (0, 0));
        assert_eq!(preempted.context.len(), 7, "its prompt and its sampled token are kept");
        assert_eq!(b.running[0].table.blocks.len(), 3);
        assert_eq!(b.blocks.used(), 3);
        b.advance(&plan, rows(&plan), None);
        assert_eq!(r0.try_iter().count(), 2);
        assert_eq!(r1.try_iter().count(), 1);
        // The first finishes, its blocks come back, and the second resumes from position 0:
        // the first's last block was the one that held the second's first positions.
        while b.running.first().is_some_and(|s| s.job.prompt.len() == 8) {
            let plan = b.plan_step();
            b.advance(&plan, rows(&plan), None);
        }
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 7)], "the whole context, recomputed");
        assert_eq!(b.prefix_hits, 0);
        assert_eq!(
            r0.try_iter().last().map(|e| matches!(e, RankEvent::Done(_))),
            Some(true)
        );
    }

    #[test]
    fn a_prompt_that_begins_as_a_computed_one_shares_its_blocks() {
        // Blocks of 4. A system prompt of 9 tokens, then two questions.
        let mut b = batch(4, 64, 16);
        let system: Vec<u32> = (500..509).collect();
        let ask = |question: &[u32]| sequence_of([system.as_slice(), question].concat(), 2);
        let (first, _r0) = ask(&[1, 2, 3]);
        b.waiting.push_back(first);
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 12)]);
        b.advance(&plan, rows(&plan), None);
        // The second shares the first's two whole blocks of system prompt (positions 0..8);
        // position 8 (the system prompt's last token) sits in a block with the first's own
        // question, so it is computed again, with the rest.
        let (second, _r1) = ask(&[7, 7]);
        b.waiting.push_back(second);
        let plan = b.plan_step();
        assert_eq!(plan, [(0, 1), (1, 3)]);
        assert_eq!(b.running[1].cached, 8);
        assert_eq!(b.running[1].table.blocks[..2], b.running[0].table.blocks[..2]);
        assert_eq!(b.prefix_hits, 8);
        // Shared blocks count once: 3 + 1 of the first's, 1 of the second's own.
        assert_eq!(b.blocks.used(), 5);
        // A different system prompt shares nothing.
        let (third, _r2) = sequence(12, 2);
        b.waiting.push_back(third);
        b.advance(&plan, rows(&plan), None);
        let plan = b.plan_step();
        assert_eq!(plan.last().map(|&(_, len)| len), Some(12));
        assert_eq!(b.prefix_hits, 8);
    }

    #[test]
    fn a_finished_sequence_returns_its_blocks() {
        let mut b = batch(2, 64, 8);
        let (s, r) = sequence(3, 1);
        b.waiting.push_back(s);
        let plan = b.plan_step();
        b.advance(&plan, rows(&plan), None);
        assert!(b.running.is_empty());
        assert_eq!(b.blocks.used(), 0);
        let events: Vec<_> = r.try_iter().collect();
        assert!(matches!(
            events.as_slice(),
            [RankEvent::Token(1, None), RankEvent::Done(_)]
        ));
    }
}
