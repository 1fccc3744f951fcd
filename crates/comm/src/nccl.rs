//! GPU ranks joined by NCCL: one process, one thread and one CUDA device per rank.
//!
//! NCCL calls are asynchronous: a rank whose peer died would spin in its kernel forever, and
//! its host thread would block at the next stream sync. So the collectives whose results the
//! host reads ([`NcclComm::broadcast`] and [`NcclComm::all_gather`], once per decode step), and
//! [`Communicator::wait`] before the host reads a captured graph's output, end by polling the
//! stream with a deadline while watching the group's shared failure board; on a
//! peer's failure or a timeout the rank aborts its own communicator (`ncclCommAbort`), which
//! releases the kernel, and names the culprit. All-reduces stay asynchronous.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};
use candle_core::cuda::cudarc::nccl::{result::NcclError, sys, Comm, Id, NcclType, ReduceOp};
use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

use crate::peer::PeerReduce;
use crate::peer_rows::{Host, PeerRows};
use crate::{Collective, CommError, CommOptions, CommStats, Communicator};

/// All-reduces of 16-bit tensors up to this size over more than two ranks are summed in f32
/// (see `all_reduce_sum`).
const F32_SUM_MAX_BYTES: usize = 1 << 20;

fn sum<T: NcclType>(comm: &Comm, input: &CudaView<'_, T>, output: &mut CudaSlice<T>) -> Result<(), NcclError> {
    comm.all_reduce(input, output, &ReduceOp::Sum).map(|_| ())
}

/// A contiguous tensor's elements by device address, for NCCL's sum in place: it writes where
/// it reads, and nothing is allocated or copied (a decode step's kernels chain around it).
struct InPlace<T> {
    address: u64,
    len: usize,
    stream: Arc<CudaStream>,
    elem: PhantomData<T>,
}

impl<T> DeviceSlice<T> for InPlace<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtrMut<T> for InPlace<T> {
    fn device_ptr_mut<'a>(&'a mut self, _: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        // One stream per rank: nothing to order against.
        (self.address, SyncOnDrop::Sync(None))
    }
}

fn sum_in_place<T: NcclType>(
    comm: &Comm,
    (address, len): (u64, usize),
    stream: Arc<CudaStream>,
) -> Result<(), NcclError> {
    let mut buffer = InPlace::<T> {
        address,
        len,
        stream,
        elem: PhantomData,
    };
    comm.all_reduce_in_place(&mut buffer, &ReduceOp::Sum).map(|_| ())
}

fn scatter<T: NcclType>(comm: &Comm, input: &CudaView<'_, T>, output: &mut CudaSlice<T>) -> Result<(), NcclError> {
    comm.reduce_scatter(input, output, &ReduceOp::Sum).map(|_| ())
}

fn gather<T: NcclType>(comm: &Comm, input: &CudaView<'_, T>, output: &mut CudaSlice<T>) -> Result<(), NcclError> {
    comm.all_gather(input, output).map(|_| ())
}

/// What every rank of an in-process NCCL group shares: the unique id, and a board where a
/// failing rank posts its cause so that its peers stop waiting for it.
pub struct NcclGroup {
    id: Id,
    world_size: usize,
    timeout: Duration,
    options: CommOptions,
    board: Mutex<Board>,
}

struct Board {
    failure: Option<(usize, String)>,
    /// How many synchronizing collectives each rank has entered: on a timeout, the ranks
    /// behind are the ones that stopped calling.
    entered: Vec<u64>,
    /// The values ranks post at each of their set-up meetings, by meeting and rank.
    meetings: Vec<Vec<Option<u64>>>,
}

impl NcclGroup {
    /// A new group of `world_size` ranks; a rank waits at most `timeout` for its peers, and
    /// takes the peer paths `options` allows.
    pub fn new(world_size: usize, timeout: Duration, options: CommOptions) -> Result<Arc<Self>, CommError> {
        let id = Id::new().map_err(|e| nccl_error(0, "ncclGetUniqueId", e))?;
        Ok(Arc::new(Self {
            id,
            world_size,
            timeout,
            options,
            board: Mutex::new(Board {
                failure: None,
                entered: vec![0; world_size],
                meetings: Vec::new(),
            }),
        }))
    }

    fn board(&self) -> MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts `rank`'s failure unless an earlier one is the root cause.
    pub fn fail(&self, rank: usize, cause: &str) {
        self.board().failure.get_or_insert((rank, cause.to_string()));
    }

    /// The first failure posted, if any.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.board().failure.clone()
    }
}

/// A rank's NCCL communicator, on the CUDA stream of its candle device so that collectives
/// are ordered with the rank's kernels without host syncs.
pub struct NcclComm {
    rank: usize,
    device: CudaDevice,
    group: Arc<NcclGroup>,
    /// `None` once aborted.
    comm: RefCell<Option<Comm>>,
    /// Small all-reduces between GPUs with peer access, where every pair has it.
    peer_reduce: Option<PeerReduce>,
    /// Every rank's device where every pair has peer access.
    peer_devices: Option<Vec<candle_core::cuda::cudarc::driver::sys::CUdevice>>,
    /// Sequence parallelism's row exchanges by copy engines, where every pair has peer
    /// access: set up at the first exchange, so that ranks that never exchange rows (Llama's)
    /// neither open the memory pool to their peers nor hold the streams.
    peer_rows: std::cell::OnceCell<Option<PeerRows>>,
    /// The number of set-up meetings so far.
    meetings: std::cell::Cell<usize>,
    stats: CommStats,
}

/// An NCCL error with `ncclGetLastError`'s text, which says what actually went wrong.
fn nccl_error(rank: usize, op: &str, e: NcclError) -> CommError {
    // SAFETY: ncclGetLastError ignores its argument and returns a static, NUL-terminated
    // string (or null) that stays valid until the next NCCL call on this thread.
    let last = unsafe {
        let text = sys::ncclGetLastError(std::ptr::null_mut());
        match text.is_null() {
            true => String::new(),
            false => std::ffi::CStr::from_ptr(text).to_string_lossy().into_owned(),
        }
    };
    CommError::Nccl {
        rank,
        op: op.to_string(),
        detail: match last.is_empty() {
            true => format!("{e:?}"),
            false => format!("{e:?}: {last}"),
        },
    }
}

impl NcclComm {
    /// Joins `group` as `rank` on `device`. Blocks until every rank has joined (ncclCommInitRank);
    /// the caller bounds that wait.
    pub fn connect(group: Arc<NcclGroup>, device: &Device, rank: usize) -> Result<Self, CommError> {
        let Device::Cuda(cuda) = device else {
            return Err(CommError::Nccl {
                rank,
                op: "init".into(),
                detail: format!("rank {rank}'s device is {device:?}, not a CUDA device"),
            });
        };
        let stream = cuda.cuda_stream();
        // NCCL picks its GPU from the calling thread's current device.
        stream.context().bind_to_thread().map_err(|e| CommError::Nccl {
            rank,
            op: "bind the rank's CUDA device".into(),
            detail: format!("{e:?}"),
        })?;
        let context = stream.context().clone();
        let comm = Comm::from_rank(stream, rank, group.world_size, group.id)
            .map_err(|e| nccl_error(rank, "ncclCommInitRank", e))?;
        let mut this = Self {
            rank,
            device: cuda.clone(),
            group,
            comm: RefCell::new(Some(comm)),
            peer_reduce: None,
            peer_devices: None,
            peer_rows: std::cell::OnceCell::new(),
            meetings: std::cell::Cell::new(0),
            stats: CommStats::default(),
        };
        let options = this.group.options;
        if options.peer_access {
            this.peer_devices =
                crate::peer::peer_devices(&context, rank, this.group.world_size, |v| this.meet_next(v))?;
        }
        if let (Some(devices), true) = (&this.peer_devices, options.peer_all_reduce) {
            this.peer_reduce = PeerReduce::set_up(&context, rank, devices, |v| this.meet_next(v))?;
        }
        Ok(this)
    }

    /// The row exchanges, set up on first use (every rank exchanges rows at the same points).
    fn peer_rows(&self) -> Result<Option<&PeerRows>, CommError> {
        if let Some(rows) = self.peer_rows.get() {
            return Ok(rows.as_ref());
        }
        let rows = match (&self.peer_devices, self.group.options.peer_rows) {
            (Some(devices), true) => PeerRows::set_up(&self.device, self.rank, devices, self)?,
            _ => None,
        };
        Ok(self.peer_rows.get_or_init(|| rows).as_ref())
    }

    /// [`Self::meet`] at the next meeting: every rank meets in the same order.
    fn meet_next(&self, value: u64) -> Result<Vec<u64>, CommError> {
        let meeting = self.meetings.get();
        self.meetings.set(meeting + 1);
        self.meet(meeting, value)
    }

    /// Posts `value` as this rank's at set-up meeting `meeting` and returns every rank's, once
    /// all have posted; fails, naming them, when a peer fails or stays away past the timeout.
    fn meet(&self, meeting: usize, value: u64) -> Result<Vec<u64>, CommError> {
        let deadline = Instant::now() + self.group.timeout;
        let world = self.group.world_size;
        loop {
            {
                let mut board = self.group.board();
                if board.meetings.len() <= meeting {
                    board.meetings.resize(meeting + 1, vec![None; world]);
                }
                board.meetings[meeting][self.rank] = Some(value);
                if let Some(all) = board.meetings[meeting].iter().copied().collect::<Option<Vec<_>>>() {
                    return Ok(all);
                }
                if let Some((rank, cause)) = board.failure.clone().filter(|(r, _)| *r != self.rank) {
                    return Err(CommError::PeerFailed { rank, cause });
                }
                if Instant::now() >= deadline {
                    let missing = (0..world).filter(|&r| board.meetings[meeting][r].is_none()).collect();
                    return Err(CommError::Timeout {
                        rank: self.rank,
                        op: Collective::Barrier,
                        waited: self.group.timeout,
                        missing,
                    });
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn tensor_error(&self, op: Collective) -> impl Fn(candle_core::Error) -> CommError + '_ {
        move |source| CommError::Tensor {
            rank: self.rank,
            op,
            source,
        }
    }

    /// Runs `f` on the live communicator, or reports the failure that aborted it.
    fn with_comm<R>(&self, op: &str, f: impl FnOnce(&Comm) -> Result<R, NcclError>) -> Result<R, CommError> {
        let guard = self.comm.borrow();
        let Some(comm) = guard.as_ref() else {
            let (rank, cause) = self
                .group
                .failure()
                .unwrap_or((self.rank, "communicator aborted".into()));
            return Err(CommError::PeerFailed { rank, cause });
        };
        f(comm).map_err(|e| nccl_error(self.rank, op, e))
    }

    /// `f(input, output)` on the device slices of contiguous `x` (as `T`) and a new buffer of
    /// `out_len` elements, returned as a tensor of `shape`.
    fn run<T: CudaDType + DeviceRepr + NcclType>(
        &self,
        op: Collective,
        x: &Tensor,
        out_len: usize,
        shape: &[usize],
        f: impl FnOnce(&Comm, &CudaView<'_, T>, &mut CudaSlice<T>) -> Result<(), NcclError>,
    ) -> Result<Tensor, CommError> {
        let err = self.tensor_error(op);
        let x = x.contiguous().map_err(&err)?;
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(err(candle_core::Error::Msg(
                "NCCL collectives need CUDA tensors".into(),
            )));
        };
        let start = layout.start_offset();
        let input = storage.as_cuda_slice::<T>().map_err(&err)?;
        let input = input.slice(start..start + x.elem_count());
        // SAFETY: every element of `output` is written by the collective before it is read.
        let mut output = unsafe { self.device.alloc::<T>(out_len) }.map_err(&err)?;
        self.with_comm(&op.to_string(), |comm| f(comm, &input, &mut output))?;
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(output, self.device.clone()));
        Ok(Tensor::from_storage(storage, shape, BackpropOp::none(), false))
    }

    /// Waits for the stream to finish what was queued, with a deadline, watching for peers'
    /// failures. On either, aborts this rank's communicator so that no kernel spins forever.
    fn wait_for_stream(&self, op: Collective) -> Result<(), CommError> {
        let event = self
            .device
            .cuda_stream()
            .record_event(None)
            .map_err(|e| self.tensor_error(op)(candle_core::Error::Cuda(Box::new(e))))?;
        self.wait_for(op, &mut || {
            event
                .try_is_complete()
                .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
        })
    }

    /// Waits until `done` (a poll of work queued on the stream) says so, as
    /// [`Self::wait_for_stream`] does.
    fn wait_for(&self, op: Collective, done: &mut dyn FnMut() -> candle_core::Result<bool>) -> Result<(), CommError> {
        {
            let mut board = self.group.board();
            board.entered[self.rank] += 1;
        }
        let deadline = Instant::now() + self.group.timeout;
        loop {
            match done() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let cause = format!("CUDA error while waiting for {op}: {e:?}");
                    self.abort(&cause);
                    return Err(CommError::Nccl {
                        rank: self.rank,
                        op: op.to_string(),
                        detail: cause,
                    });
                }
            }
            if let Some((rank, cause)) = self.group.failure().filter(|(r, _)| *r != self.rank) {
                self.abort_local();
                return Err(CommError::PeerFailed { rank, cause });
            }
            if Instant::now() >= deadline {
                let missing = {
                    let board = self.group.board();
                    let mine = board.entered[self.rank];
                    (0..self.group.world_size)
                        .filter(|&r| board.entered[r] < mine)
                        .collect::<Vec<_>>()
                };
                let culprit = missing.first().copied().unwrap_or(self.rank);
                self.group
                    .fail(culprit, &format!("did not enter {op} within {:?}", self.group.timeout));
                self.abort_local();
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op,
                    waited: self.group.timeout,
                    missing,
                });
            }
            // Spin (yielding) through a decode step and well beyond: a sleep overshoots by tens
            // of µs, which a 3–5 ms step would pay every time. Back off only in long waits.
            match deadline.saturating_duration_since(Instant::now()) + Duration::from_millis(50) > self.group.timeout {
                true => std::thread::yield_now(),
                false => std::thread::sleep(Duration::from_micros(50)),
            }
        }
    }

    /// ncclCommAbort on this rank's communicator (dropping cudarc's `Comm` aborts it), and
    /// every wait on a peer's rows let through.
    fn abort_local(&self) {
        drop(self.comm.borrow_mut().take());
        if let Some(Some(rows)) = self.peer_rows.get() {
            rows.release_waits();
        }
    }
}

impl Host for NcclComm {
    fn meet(&self, value: u64) -> Result<Vec<u64>, CommError> {
        self.meet_next(value)
    }

    fn wait(&self) -> Result<(), CommError> {
        self.wait_for_stream(Collective::Wait)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world_size
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor, CommError> {
        let start = Instant::now();
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        let peer_sum = self
            .peer_reduce
            .as_ref()
            .and_then(|p| p.all_reduce(x, self.rank, self.group.world_size));
        let out = match (self.group.world_size, peer_sum) {
            (1, _) => x.clone(),
            (_, Some(sum)) => sum.map_err(self.tensor_error(Collective::AllReduceSum))?,
            _ => {
                let op = Collective::AllReduceSum;
                let n = x.elem_count();
                // Large messages (prompts, video activations) are bandwidth-bound: summing in
                // f32 would double the bytes on the link. Between two ranks each element is a
                // single addition, rounded once either way, so f32 would only add two casts.
                let native = bytes > F32_SUM_MAX_BYTES || self.group.world_size == 2;
                match x.dtype() {
                    DType::F32 => self.run::<f32>(op, x, n, x.dims(), sum::<f32>)?,
                    DType::BF16 if native => self.run::<half::bf16>(op, x, n, x.dims(), sum::<half::bf16>)?,
                    DType::F16 if native => self.run::<half::f16>(op, x, n, x.dims(), sum::<half::f16>)?,
                    // Small ones (decode) over more ranks are latency-bound: summing in f32
                    // costs nothing and keeps a 16-bit reduction as exact as the f32 path.
                    _ => {
                        let x32 = x.to_dtype(DType::F32).map_err(self.tensor_error(op))?;
                        let total = self.run::<f32>(op, &x32, n, x.dims(), sum::<f32>)?;
                        total.to_dtype(x.dtype()).map_err(self.tensor_error(op))?
                    }
                }
            }
        };
        self.stats.record_all_reduce(bytes, start.elapsed());
        Ok(out)
    }

    fn all_reduce_sum_in_place(&self, x: &Tensor) -> Result<(), CommError> {
        let start = Instant::now();
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        let in_place = self
            .peer_reduce
            .as_ref()
            .filter(|_| self.group.world_size > 1)
            .and_then(|p| p.all_reduce_in_place(x, self.rank, self.group.world_size));
        match in_place {
            Some(done) => {
                done.map_err(self.tensor_error(Collective::AllReduceSum))?;
                self.stats.record_all_reduce(bytes, start.elapsed());
                Ok(())
            }
            // 16-bit decode sums over more than two ranks go through f32 (see `all_reduce_sum`)
            // and are copied back.
            None if self.group.world_size > 2 && x.dtype() != DType::F32 && bytes <= F32_SUM_MAX_BYTES => {
                let sum = self.all_reduce_sum(x)?;
                x.slice_set(&sum, 0, 0)
                    .map_err(self.tensor_error(Collective::AllReduceSum))
            }
            None if self.group.world_size > 1 => {
                let op = Collective::AllReduceSum;
                if !x.is_contiguous() || !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                    return Err(self.tensor_error(op)(candle_core::Error::Msg(format!(
                        "an all-reduce in place needs a contiguous f32, bf16 or f16 tensor, not {:?}",
                        x.dtype()
                    ))));
                }
                let buffer = (
                    tpinfer_kernels::device_address(x).map_err(self.tensor_error(op))?,
                    x.elem_count(),
                );
                let stream = self.device.cuda_stream();
                self.with_comm(&op.to_string(), |comm| match x.dtype() {
                    DType::BF16 => sum_in_place::<half::bf16>(comm, buffer, stream),
                    DType::F16 => sum_in_place::<half::f16>(comm, buffer, stream),
                    _ => sum_in_place::<f32>(comm, buffer, stream),
                })?;
                self.stats.record_all_reduce(bytes, start.elapsed());
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor, CommError> {
        let op = Collective::AllGather { dim };
        let err = self.tensor_error(op);
        if self.group.world_size == 1 {
            return Ok(x.clone());
        }
        // NCCL gathers equal parts: share each rank's size along `dim` first.
        let size =
            Tensor::new(&[x.dim(dim).map_err(&err)? as u32], &Device::Cuda(self.device.clone())).map_err(&err)?;
        let world = self.group.world_size;
        let sizes = self.run::<u32>(op, &size, world, &[world], |c, i, o| c.all_gather(i, o).map(|_| ()))?;
        // Reading device memory blocks the host until the stream gets there: wait boundedly
        // first, or a dead peer would hang this rank in the copy.
        self.wait_for_stream(op)?;
        let sizes: Vec<usize> = sizes
            .to_vec1::<u32>()
            .map_err(&err)?
            .into_iter()
            .map(|n| n as usize)
            .collect();
        let out = self.all_gather_sized(x, dim, &sizes)?;
        // Callers read gathered logits on the host; make that read safe in the same way.
        self.wait_for_stream(op)?;
        Ok(out)
    }

    fn reduce_scatter_sum(&self, x: &Tensor, sizes: &[usize]) -> Result<Tensor, CommError> {
        let start = Instant::now();
        let op = Collective::ReduceScatterSum;
        let err = self.tensor_error(op);
        let world = self.group.world_size;
        crate::check_scatter_sizes(self.rank, world, x, sizes)?;
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        if world == 1 {
            self.stats.record_all_reduce(bytes, start.elapsed());
            return Ok(x.clone());
        }
        // NCCL scatters equal parts: each rank's rows padded to the largest part.
        let max = sizes.iter().copied().max().unwrap_or(0);
        let input = crate::parts::pad_parts(x, sizes).map_err(&err)?;
        let mut shape = x.dims().to_vec();
        shape[0] = max;
        let n = shape.iter().product::<usize>();
        let out = match x.dtype() {
            DType::F32 => self.run::<f32>(op, &input, n, &shape, scatter::<f32>)?,
            DType::BF16 => self.run::<half::bf16>(op, &input, n, &shape, scatter::<half::bf16>)?,
            DType::F16 => self.run::<half::f16>(op, &input, n, &shape, scatter::<half::f16>)?,
            other => return Err(err(candle_core::Error::Msg(format!("reduce-scatter of {other:?}")))),
        };
        let out = match max == sizes[self.rank] {
            true => out,
            false => out
                .narrow(0, 0, sizes[self.rank])
                .and_then(|t| t.contiguous())
                .map_err(&err)?,
        };
        self.stats.record_all_reduce(bytes, start.elapsed());
        Ok(out)
    }

    fn all_gather_sized(&self, x: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor, CommError> {
        let start = Instant::now();
        let op = Collective::AllGather { dim };
        let err = self.tensor_error(op);
        let world = self.group.world_size;
        crate::check_gather_sizes(self.rank, world, x, dim, sizes)?;
        if world == 1 {
            return Ok(x.clone());
        }
        // Pad to the largest part, gather with `dim` moved to the front, cut the padding away.
        let max = sizes.iter().copied().max().unwrap_or(0);
        let front = x.transpose(0, dim).map_err(&err)?.contiguous().map_err(&err)?;
        let pad = max - front.dim(0).map_err(&err)?;
        let front = match pad {
            0 => front,
            _ => front.pad_with_zeros(0, 0, pad).map_err(&err)?,
        };
        let mut shape = front.dims().to_vec();
        shape[0] = max * world;
        let n = front.elem_count() * world;
        // Activations (sequence parallelism) gather in their own type; anything else in f32.
        let all = match front.dtype() {
            DType::F32 => self.run::<f32>(op, &front, n, &shape, gather::<f32>)?,
            DType::BF16 => self.run::<half::bf16>(op, &front, n, &shape, gather::<half::bf16>)?,
            DType::F16 => self.run::<half::f16>(op, &front, n, &shape, gather::<half::f16>)?,
            _ => {
                let front = front.to_dtype(DType::F32).map_err(&err)?;
                self.run::<f32>(op, &front, n, &shape, gather::<f32>)?
                    .to_dtype(x.dtype())
                    .map_err(&err)?
            }
        };
        let all = crate::parts::unpad_parts(&all, sizes).map_err(&err)?;
        let out = match dim {
            0 => all,
            _ => all.transpose(0, dim).and_then(|t| t.contiguous()).map_err(&err)?,
        };
        self.stats.record_all_gather(start.elapsed());
        Ok(out)
    }

    fn all_gather_rows(
        &self,
        x: &Tensor,
        sizes: &[usize],
        each: &mut dyn FnMut(&Tensor, usize) -> candle_core::Result<()>,
    ) -> Result<(), CommError> {
        let op = Collective::AllGather { dim: 0 };
        crate::check_gather_sizes(self.rank, self.group.world_size, x, 0, sizes)?;
        let Some(rows) = self.peer_rows()? else {
            return crate::gather_rows_whole(self, x, sizes, each);
        };
        let start = Instant::now();
        rows.all_gather_rows(x, sizes, each, self)
            .map_err(self.tensor_error(op))?;
        self.stats.record_all_gather(start.elapsed());
        Ok(())
    }

    fn reduce_scatter_rows(
        &self,
        sizes: &[usize],
        partial: &mut dyn FnMut(std::ops::Range<usize>) -> candle_core::Result<Tensor>,
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor, CommError> {
        let op = Collective::ReduceScatterSum;
        let Some(rows) = self.peer_rows()? else {
            return crate::reduce_scatter_rows_whole(self, sizes, partial, finish);
        };
        if sizes.len() != self.group.world_size {
            return Err(CommError::Shape {
                rank: self.rank,
                op,
                detail: format!("{} sizes for {} ranks", sizes.len(), self.group.world_size),
            });
        }
        let start = Instant::now();
        let mut width = 0;
        let out = rows
            .reduce_scatter_rows(
                sizes,
                &mut |range| {
                    let part = partial(range)?;
                    width = part.dims().get(1).copied().unwrap_or(1);
                    Ok(part)
                },
                finish,
                self,
            )
            .map_err(self.tensor_error(op))?;
        let bytes = sizes.iter().sum::<usize>() * width * out.dtype().size_in_bytes();
        self.stats.record_all_reduce(bytes, start.elapsed());
        Ok(out)
    }

    /// Also the host's bounded sync point: it returns once the broadcast has completed.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor, CommError> {
        let world = self.group.world_size;
        if root >= world {
            return Err(CommError::BadRoot { root, world });
        }
        let start = Instant::now();
        let op = Collective::Broadcast { root };
        let out = match (world, x.dtype()) {
            (1, _) => x.clone(),
            (_, DType::U32) => self.run::<u32>(op, x, x.elem_count(), x.dims(), |c, i, o| {
                c.broadcast(Some(i), o, root as i32).map(|_| ())
            })?,
            _ => {
                let x32 = x.to_dtype(DType::F32).map_err(self.tensor_error(op))?;
                self.run::<f32>(op, &x32, x.elem_count(), x.dims(), |c, i, o| {
                    c.broadcast(Some(i), o, root as i32).map(|_| ())
                })?
                .to_dtype(x.dtype())
                .map_err(self.tensor_error(op))?
            }
        };
        self.wait_for_stream(op)?;
        self.stats.record_broadcast(start.elapsed());
        Ok(out)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let one =
            Tensor::new(&[1f32], &Device::Cuda(self.device.clone())).map_err(self.tensor_error(Collective::Barrier))?;
        self.all_reduce_sum(&one)?;
        self.wait_for_stream(Collective::Barrier)
    }

    fn wait(&self) -> Result<(), CommError> {
        self.wait_for_stream(Collective::Wait)
    }

    fn wait_until(&self, done: &mut dyn FnMut() -> candle_core::Result<bool>) -> Result<(), CommError> {
        self.wait_for(Collective::Wait, done)
    }

    fn abort(&self, cause: &str) {
        self.group.fail(self.rank, cause);
        self.abort_local();
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }
}
