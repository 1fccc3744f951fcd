//! What the engine is doing, as a server reports it: requests running and queued, KV blocks
//! in use, and whether the ranks still serve.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Whether the engine can take requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Serving,
    /// A rank failed: every later request is refused with this cause.
    Failed(String),
}

/// The engine's load at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Requests generating now.
    pub running: usize,
    /// Requests accepted and not yet running (queued, or preempted for KV blocks).
    pub queued: usize,
    /// KV cache blocks held by sequences, of `kv_blocks` (0 of 0 for an engine that serves
    /// one request at a time with a cache of its own).
    pub kv_blocks_used: usize,
    pub kv_blocks: usize,
    /// Sequences preempted for KV blocks since the start (each recomputed when it resumes).
    pub preemptions: usize,
    /// Prompt positions found in the KV cache since the start (a prefix another sequence
    /// computed), instead of computed again.
    pub prefix_hit_tokens: usize,
}

/// Written by the scheduler, read by the engine's handle.
#[derive(Debug, Default)]
pub(crate) struct Status {
    /// Requests handed to the scheduler, and those it has taken off its channel.
    submitted: AtomicUsize,
    taken: AtomicUsize,
    running: AtomicUsize,
    /// Taken but not running (the batching scheduler's queue).
    waiting: AtomicUsize,
    kv_blocks_used: AtomicUsize,
    kv_blocks: AtomicUsize,
    preemptions: AtomicUsize,
    prefix_hit_tokens: AtomicUsize,
    failure: Mutex<Option<String>>,
}

impl Status {
    pub fn submitted(&self) {
        self.submitted.fetch_add(1, Ordering::Relaxed);
    }

    pub fn taken(&self, jobs: usize) {
        self.taken.fetch_add(jobs, Ordering::Relaxed);
    }

    /// The batching scheduler's state after a step (see [`Load`]).
    pub fn set(&self, load: Load) {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.queued, Ordering::Relaxed);
        self.kv_blocks_used.store(load.kv_blocks_used, Ordering::Relaxed);
        self.kv_blocks.store(load.kv_blocks, Ordering::Relaxed);
        self.preemptions.store(load.preemptions, Ordering::Relaxed);
        self.prefix_hit_tokens.store(load.prefix_hit_tokens, Ordering::Relaxed);
    }

    pub fn failed(&self, cause: &str) {
        let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        failure.get_or_insert_with(|| cause.to_string());
    }

    pub fn health(&self) -> Health {
        match self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(cause) => Health::Failed(cause),
            None => Health::Serving,
        }
    }

    pub fn load(&self) -> Load {
        let in_channel = self
            .submitted
            .load(Ordering::Relaxed)
            .saturating_sub(self.taken.load(Ordering::Relaxed));
        Load {
            running: self.running.load(Ordering::Relaxed),
            queued: self.waiting.load(Ordering::Relaxed) + in_channel,
            kv_blocks_used: self.kv_blocks_used.load(Ordering::Relaxed),
            kv_blocks: self.kv_blocks.load(Ordering::Relaxed),
            preemptions: self.preemptions.load(Ordering::Relaxed),
            prefix_hit_tokens: self.prefix_hit_tokens.load(Ordering::Relaxed),
        }
    }
}
