//! Ranks on threads of one process, joined through shared memory.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::{Collective, CommError, CommStats, Communicator};

/// How long a rank waits for its peers before it names the missing ones.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Builds the communicators of a group of ranks that run as threads of this process.
pub struct ThreadGroup;

impl ThreadGroup {
    /// One communicator per rank, `0..world_size`, to be moved into the rank threads.
    /// A collective that waits longer than `timeout` for a peer fails and names it.
    pub fn ranks(world_size: usize, timeout: Duration) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                op: None,
                inputs: vec![None; world_size],
                arrived: 0,
                generation: 0,
                result: None,
                present: vec![false; world_size],
                failure: None,
                exited: vec![false; world_size],
            }),
            wake: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
                stats: CommStats::default(),
            })
            .collect()
    }
}

/// A rank's handle on an in-process group. The reduction is computed once, by the last rank
/// to arrive, summing in rank order in f32, so every rank gets bit-identical results and a run
/// is deterministic whatever the thread timing.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    stats: CommStats,
}

struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

struct State {
    /// The collective in progress, set by its first rank to arrive.
    op: Option<Collective>,
    inputs: Vec<Option<Tensor>>,
    arrived: usize,
    /// Counts completed collectives; a waiter is done when it moves past its own.
    generation: u64,
    /// The outcome of collective number `generation - 1`. It stays valid until every rank
    /// has entered the next collective, which the slowest reader must do after reading it.
    result: Option<Result<Tensor, String>>,
    /// Which ranks have entered the collective in progress.
    present: Vec<bool>,
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held, but a poisoned lock must not hide
        // the real failure behind a second panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ThreadComm {
    fn collective(&self, op: Collective, x: Option<&Tensor>) -> Result<Tensor, CommError> {
        let rank = self.rank;
        let shared = &*self.shared;
        let mut st = shared.lock();
        if let Some((rank, cause)) = &st.failure {
            return Err(peer_failed(*rank, cause));
        }
        match st.op {
            Some(expected) if expected != op => {
                let cause = format!("entered {op} while the others entered {expected}");
                st.failure = Some((rank, cause));
                shared.wake.notify_all();
                return Err(CommError::Mismatch {
                    rank,
                    expected,
                    got: op,
                });
            }
            _ => st.op = Some(op),
        }
        st.inputs[rank] = x.cloned();
        st.present[rank] = true;
        st.arrived += 1;
        let my_generation = st.generation;
        if st.arrived == shared.world_size {
            let inputs: Vec<Option<Tensor>> = st.inputs.iter_mut().map(Option::take).collect();
            let outcome = combine(op, &inputs);
            st.present.iter_mut().for_each(|p| *p = false);
            st.result = Some(outcome.clone());
            st.arrived = 0;
            st.op = None;
            st.generation += 1;
            shared.wake.notify_all();
            return outcome.map_err(|detail| CommError::Shape { rank, op, detail });
        }
        let deadline = Instant::now() + shared.timeout;
        loop {
            if st.generation != my_generation {
                return match &st.result {
                    Some(Ok(t)) => Ok(t.clone()),
                    Some(Err(detail)) => Err(CommError::Shape {
                        rank,
                        op,
                        detail: detail.clone(),
                    }),
                    None => Err(peer_failed(rank, "collective finished without a result")),
                };
            }
            if let Some((rank, cause)) = &st.failure {
                return Err(peer_failed(*rank, cause));
            }
            let absent = |st: &State| (0..shared.world_size).filter(|&r| !st.present[r]).collect::<Vec<_>>();
            if let Some(gone) = absent(&st).into_iter().find(|&r| st.exited[r]) {
                st.failure = Some((gone, format!("exited before entering {op}")));
                shared.wake.notify_all();
                return Err(CommError::PeerExited { rank: gone, op });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = absent(&st);
                let culprit = missing.first().copied().unwrap_or(rank);
                let cause = format!("did not enter {op} within {:?}", shared.timeout);
                st.failure.get_or_insert((culprit, cause));
                shared.wake.notify_all();
                return Err(CommError::Timeout {
                    rank,
                    op,
                    waited: shared.timeout,
                    missing,
                });
            }
            let (guard, _) = shared
                .wake
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            st = guard;
        }
    }
}

fn peer_failed(rank: usize, cause: &str) -> CommError {
    CommError::PeerFailed {
        rank,
        cause: cause.to_string(),
    }
}

/// Computes a collective's result from every rank's input, in rank order.
fn combine(op: Collective, inputs: &[Option<Tensor>]) -> Result<Tensor, String> {
    let tensors: Vec<&Tensor> = inputs.iter().flatten().collect();
    let result = match op {
        Collective::Barrier => Tensor::zeros((), DType::U8, &Device::Cpu),
        Collective::AllReduceSum | Collective::ReduceScatterSum => {
            let first = tensors.first().ok_or("no inputs")?;
            if let Some(other) = tensors.iter().find(|t| t.shape() != first.shape()) {
                return Err(format!("shapes differ: {:?} vs {:?}", first.shape(), other.shape()));
            }
            sum_in_rank_order(&tensors)
        }
        Collective::AllGather { dim } => Tensor::cat(&tensors, dim),
        Collective::Wait => return Err("a wait is not a collective".into()),
        Collective::Broadcast { root } => {
            return inputs[root]
                .clone()
                .ok_or_else(|| format!("root rank {root} gave no tensor"))
        }
    };
    result.map_err(|e| e.to_string())
}

/// Sums in f32 so that bf16/f16 reductions are as exact as the f32 path.
fn sum_in_rank_order(tensors: &[&Tensor]) -> candle_core::Result<Tensor> {
    let dtype = tensors[0].dtype();
    let mut acc = tensors[0].to_dtype(DType::F32)?;
    for t in &tensors[1..] {
        acc = (acc + t.to_dtype(DType::F32)?)?;
    }
    acc.to_dtype(dtype)
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor, CommError> {
        let start = Instant::now();
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        let out = match self.shared.world_size {
            1 => x.clone(),
            _ => self.collective(Collective::AllReduceSum, Some(x))?,
        };
        self.stats.record_all_reduce(bytes, start.elapsed());
        Ok(out)
    }

    /// The full sum, as an all-reduce computes it, cut to this rank's rows.
    fn reduce_scatter_sum(&self, x: &Tensor, sizes: &[usize]) -> Result<Tensor, CommError> {
        let start = Instant::now();
        let first = crate::check_scatter_sizes(self.rank, self.shared.world_size, x, sizes)?;
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        let total = match self.shared.world_size {
            1 => x.clone(),
            _ => self.collective(Collective::ReduceScatterSum, Some(x))?,
        };
        let out = total
            .narrow(0, first, sizes[self.rank])
            .and_then(|t| t.contiguous())
            .map_err(|source| CommError::Tensor {
                rank: self.rank,
                op: Collective::ReduceScatterSum,
                source,
            })?;
        self.stats.record_all_reduce(bytes, start.elapsed());
        Ok(out)
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor, CommError> {
        let start = Instant::now();
        let out = match self.shared.world_size {
            1 => x.clone(),
            _ => self.collective(Collective::AllGather { dim }, Some(x))?,
        };
        self.stats.record_all_gather(start.elapsed());
        Ok(out)
    }

    fn all_gather_sized(&self, x: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor, CommError> {
        crate::check_gather_sizes(self.rank, self.shared.world_size, x, dim, sizes)?;
        self.all_gather(x, dim)
    }

    /// Part by part, this rank's first, as GPUs with peer access hand them out: the CPU ranks
    /// run the callers' per-part code that those GPUs run.
    fn all_gather_rows(
        &self,
        x: &Tensor,
        sizes: &[usize],
        each: &mut dyn FnMut(&Tensor, usize) -> candle_core::Result<()>,
    ) -> Result<(), CommError> {
        let all = self.all_gather_sized(x, 0, sizes)?;
        let ranges = crate::row_ranges(sizes);
        let world = self.shared.world_size;
        for r in (0..world).map(|i| (self.rank + i) % world) {
            let rows = &ranges[r];
            all.narrow(0, rows.start, rows.len())
                .and_then(|part| each(&part, rows.start))
                .map_err(crate::rows_error(self.rank, Collective::AllGather { dim: 0 }))?;
        }
        Ok(())
    }

    /// Every rank's rows apart, this rank's last, as GPUs with peer access ask for them.
    fn reduce_scatter_rows(
        &self,
        sizes: &[usize],
        partial: &mut dyn FnMut(std::ops::Range<usize>) -> candle_core::Result<Tensor>,
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor, CommError> {
        let ranges = crate::row_ranges(sizes);
        let world = self.shared.world_size;
        let mut parts = vec![None; world];
        for r in (1..=world).map(|i| (self.rank + i) % world) {
            let part =
                partial(ranges[r].clone()).map_err(crate::rows_error(self.rank, Collective::ReduceScatterSum))?;
            parts[r] = Some(part);
        }
        let parts: Vec<Tensor> = parts.into_iter().flatten().collect();
        let whole = Tensor::cat(&parts, 0).map_err(crate::rows_error(self.rank, Collective::ReduceScatterSum))?;
        let sum = self.reduce_scatter_sum(&whole, sizes)?;
        finish(&[sum]).map_err(crate::rows_error(self.rank, Collective::ReduceScatterSum))
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor, CommError> {
        let world = self.shared.world_size;
        if root >= world {
            return Err(CommError::BadRoot { root, world });
        }
        let start = Instant::now();
        let out = match world {
            1 => x.clone(),
            _ => self.collective(Collective::Broadcast { root }, Some(x))?,
        };
        self.stats.record_broadcast(start.elapsed());
        Ok(out)
    }

    fn barrier(&self) -> Result<(), CommError> {
        if self.shared.world_size > 1 {
            self.collective(Collective::Barrier, None)?;
        }
        Ok(())
    }

    fn wait(&self) -> Result<(), CommError> {
        Ok(())
    }

    fn abort(&self, cause: &str) {
        let mut st = self.shared.lock();
        st.failure.get_or_insert((self.rank, cause.to_string()));
        self.shared.wake.notify_all();
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }
}

impl Drop for ThreadComm {
    /// A rank that unwinds or returns early must not leave its peers waiting.
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.exited[self.rank] = true;
        if std::thread::panicking() {
            st.failure.get_or_insert((self.rank, "panicked".to_string()));
        }
        self.shared.wake.notify_all();
    }
}
