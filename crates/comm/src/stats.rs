use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters a rank keeps of its collectives, so tests can assert the communication pattern
/// (e.g. two all-reduces per transformer layer) and benchmarks can report its time share.
#[derive(Debug, Default)]
pub struct CommStats {
    all_reduces: AtomicU64,
    all_reduce_bytes: AtomicU64,
    all_gathers: AtomicU64,
    broadcasts: AtomicU64,
    nanos: AtomicU64,
}

/// A copy of [`CommStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub all_reduces: u64,
    pub all_reduce_bytes: u64,
    pub all_gathers: u64,
    pub broadcasts: u64,
    pub time: Duration,
}

impl CommStats {
    pub fn record_all_reduce(&self, bytes: usize, took: Duration) {
        self.all_reduces.fetch_add(1, Ordering::Relaxed);
        self.all_reduce_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.add_time(took);
    }

    pub fn record_all_gather(&self, took: Duration) {
        self.all_gathers.fetch_add(1, Ordering::Relaxed);
        self.add_time(took);
    }

    pub fn record_broadcast(&self, took: Duration) {
        self.broadcasts.fetch_add(1, Ordering::Relaxed);
        self.add_time(took);
    }

    fn add_time(&self, took: Duration) {
        self.nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            all_reduces: self.all_reduces.load(Ordering::Relaxed),
            all_reduce_bytes: self.all_reduce_bytes.load(Ordering::Relaxed),
            all_gathers: self.all_gathers.load(Ordering::Relaxed),
            broadcasts: self.broadcasts.load(Ordering::Relaxed),
            time: Duration::from_nanos(self.nanos.load(Ordering::Relaxed)),
        }
    }
}

impl StatsSnapshot {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
        StatsSnapshot {
            all_reduces: self.all_reduces - earlier.all_reduces,
            all_reduce_bytes: self.all_reduce_bytes - earlier.all_reduce_bytes,
            all_gathers: self.all_gathers - earlier.all_gathers,
            broadcasts: self.broadcasts - earlier.broadcasts,
            time: self.time.saturating_sub(earlier.time),
        }
    }
}
