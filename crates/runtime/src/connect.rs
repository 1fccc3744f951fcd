//! Building each rank's communicator on its own thread, and waiting for the ranks to start.

use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use tpinfer_comm::{CommOptions, Communicator, ThreadGroup};

use crate::error::root_cause;
use crate::RuntimeError;

/// Builds a rank's communicator on the rank's own thread.
pub(crate) type Connect = Box<dyn FnOnce() -> Result<Arc<dyn Communicator>, RuntimeError> + Send>;

/// What a starting rank reports.
pub(crate) enum Startup {
    /// The rank has joined its communicator.
    Connected(usize),
    /// The rank has loaded its models (their weight bytes, in the order they were added) and
    /// passed its health check.
    Loaded(usize, Vec<usize>),
    Failed(RuntimeError),
}

/// One communicator builder per rank: in-process collectives for CPU ranks, NCCL for GPUs.
pub(crate) fn connectors(
    devices: &[Device],
    timeout: Duration,
    options: CommOptions,
) -> Result<Vec<Connect>, RuntimeError> {
    let tp = devices.len();
    if devices.iter().all(Device::is_cpu) || tp == 1 {
        return Ok(ThreadGroup::ranks(tp, timeout)
            .into_iter()
            .map(|comm| Box::new(move || Ok(Arc::new(comm) as Arc<dyn Communicator>)) as Connect)
            .collect());
    }
    nccl_connectors(devices, timeout, options)
}

#[cfg(feature = "nccl")]
fn nccl_connectors(devices: &[Device], timeout: Duration, options: CommOptions) -> Result<Vec<Connect>, RuntimeError> {
    let group = tpinfer_comm::NcclGroup::new(devices.len(), timeout, options)?;
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
fn nccl_connectors(
    _devices: &[Device],
    _timeout: Duration,
    _options: CommOptions,
) -> Result<Vec<Connect>, RuntimeError> {
    Err(RuntimeError::CudaNotBuilt)
}

/// Waits for every rank to join its communicator (bounded by `init_timeout`) and then to load
/// and pass its health check. Returns each rank's weight bytes per model, or the root cause
/// among the ranks' failures.
pub(crate) fn await_startup(
    ready: &Receiver<Startup>,
    tp: usize,
    init_timeout: Duration,
) -> Result<Vec<Vec<usize>>, RuntimeError> {
    let deadline = Instant::now() + init_timeout;
    let mut connected = vec![false; tp];
    let mut loaded: Vec<Option<Vec<usize>>> = vec![None; tp];
    let mut failures = Vec::new();
    // Every rank reports once it has joined: a failure then waits for the others' reports
    // (their collectives are bounded), so that the root cause is told, not a peer's report.
    while loaded.iter().filter(|l| l.is_some()).count() + failures.len() < tp {
        let event = match connected.iter().all(|&c| c) {
            true => ready.recv().map_err(|_| ()),
            false => ready
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .map_err(|_| ()),
        };
        match event {
            Ok(Startup::Connected(rank)) => connected[rank] = true,
            Ok(Startup::Loaded(rank, bytes)) => loaded[rank] = Some(bytes),
            // Before every rank has joined, the others may be blocked in NCCL's init for this
            // one: its failure is the cause.
            Ok(Startup::Failed(e)) if !connected.iter().all(|&c| c) => return Err(e),
            Ok(Startup::Failed(e)) => failures.push(e),
            // Every rank's sender is gone: the ones that never reported ended silently.
            Err(()) if connected.iter().all(|&c| c) => break,
            Err(()) => {
                return Err(RuntimeError::InitTimeout {
                    missing: (0..tp).filter(|&r| !connected[r]).collect(),
                    waited: init_timeout,
                })
            }
        }
    }
    if let Some(cause) = root_cause(failures) {
        return Err(cause);
    }
    loaded
        .into_iter()
        .enumerate()
        .map(|(rank, bytes)| bytes.ok_or(RuntimeError::RankExited { rank }))
        .collect()
}
