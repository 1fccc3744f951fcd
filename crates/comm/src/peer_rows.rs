//! Sequence parallelism's exchanges of rows between GPUs with peer access, through the copy
//! engines, part by part: a rank's rows (all-gather) or its partial sums of a peer's rows
//! (reduce-scatter) are pushed into a slot of each peer's receive buffer while the rank's
//! kernels compute the next part. NCCL's kernels would take SMs from those products, so they
//! could not overlap; copy engines take none.
//!
//! Ordering without host meetings: every exchange has a number, the same on every rank. A
//! sender's copy stream waits until the receiver has released its slot from the previous
//! exchange (a flag in the sender's memory that the receiver's stream writes), copies, then
//! raises the receiver's "arrived" flag; the receiver's stream waits on that flag before its
//! kernels read the slot, and releases the slot once they are queued. Flags are 32-bit
//! counters compared with wrap-around, written and awaited by stream memory operations.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::Arc;

use candle_core::cuda::cudarc::driver::{sys, CudaContext, CudaStream, DriverError};
use candle_core::{CudaDevice, DType, Device, Tensor};
use tpinfer_kernels::device_address;

use crate::CommError;

/// The most ranks: flags per rank.
const MAX_RANKS: usize = 8;
/// Per rank: `arrived[sender]`, then `released[receiver]`, u32 each.
const FLAG_BYTES: usize = 2 * MAX_RANKS * 4;
/// Slots start on this many elements, so that parts are aligned as cuBLASLt wants them.
const SLOT_ALIGN: usize = 128;

/// What the exchanges need of their communicator's host side.
pub(crate) trait Host {
    /// Swaps `value` with every rank (a host meeting, in the same order on every rank).
    fn meet(&self, value: u64) -> Result<Vec<u64>, CommError>;
    /// Waits, boundedly and watching the peers, for the compute stream's queued work.
    fn wait(&self) -> Result<(), CommError>;
}

/// A rank's part of the exchanges.
pub(crate) struct PeerRows {
    rank: usize,
    world: usize,
    device: CudaDevice,
    compute: Arc<CudaStream>,
    /// The pushes' stream (created here, outside cudarc's stream bookkeeping, so that candle's
    /// tensors keep their single-stream fast path).
    copy: sys::CUstream,
    /// Releases stuck waits when a rank fails.
    rescue: sys::CUstream,
    /// This rank's flags (outside candle's pool) and every rank's, by device address.
    flags: sys::CUdeviceptr,
    all_flags: Vec<u64>,
    slots: RefCell<Option<Slots>>,
    /// The number of the last exchange.
    exchanges: Cell<u32>,
}

/// This rank's receive buffer: a slot of `elems` elements per peer, from candle's pool (which
/// the peers may write), and every rank's buffer address.
struct Slots {
    buffer: Tensor,
    elems: usize,
    bases: Vec<u64>,
}

fn driver(rank: usize, op: &str) -> impl Fn(DriverError) -> CommError + '_ {
    move |e| CommError::Nccl {
        rank,
        op: op.to_string(),
        detail: format!("{e:?}"),
    }
}

impl PeerRows {
    /// Sets the rank's part up on `devices` (every rank's, in rank order, all pairs with peer
    /// access enabled), or `None` past [`MAX_RANKS`].
    pub(crate) fn set_up(
        device: &CudaDevice,
        rank: usize,
        devices: &[sys::CUdevice],
        host: &dyn Host,
    ) -> Result<Option<Self>, CommError> {
        let world = devices.len();
        if world > MAX_RANKS {
            return Ok(None);
        }
        let compute = device.cuda_stream();
        let context = compute.context().clone();
        let err = driver(rank, "peer row exchange set-up");
        grant_pool_access(&context, devices).map_err(&err)?;
        let (mut flags, mut copy, mut rescue) = (0, std::ptr::null_mut(), std::ptr::null_mut());
        let non_blocking = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: plain allocations and stream creations in the bound context; the flags are
        // zeroed before any stream reads them.
        unsafe {
            sys::cuMemAlloc_v2(&mut flags, FLAG_BYTES).result().map_err(&err)?;
            sys::cuMemsetD8_v2(flags, 0, FLAG_BYTES).result().map_err(&err)?;
            sys::cuStreamCreate(&mut copy, non_blocking).result().map_err(&err)?;
            sys::cuStreamCreate(&mut rescue, non_blocking).result().map_err(&err)?;
        }
        // Owned from here, so that an error frees them.
        let mut this = Self {
            rank,
            world,
            device: device.clone(),
            compute,
            copy,
            rescue,
            flags,
            all_flags: Vec::new(),
            slots: RefCell::new(None),
            exchanges: Cell::new(0),
        };
        this.all_flags = host.meet(flags)?;
        Ok(Some(this))
    }

    /// This rank's own flag: `arrived[sender]` or `released[receiver]`.
    fn own(&self, arrived: bool, peer: usize) -> u64 {
        self.flags + flag_offset(arrived, peer)
    }

    /// `rank`'s flag about this rank.
    fn theirs(&self, rank: usize, arrived: bool) -> u64 {
        self.all_flags[rank] + flag_offset(arrived, self.rank)
    }

    /// The peers in the order this rank serves them: the next rank first.
    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (1..self.world).map(|i| (self.rank + i) % self.world)
    }

    /// Receive slots of at least `elems` elements of `dtype`. Grows them (every rank at the
    /// same exchange, as sizes and types are the same everywhere) once the exchanges before
    /// are over, and swaps the new addresses.
    fn reserve(&self, elems: usize, dtype: DType, host: &dyn Host) -> candle_core::Result<()> {
        let elems = elems.next_multiple_of(SLOT_ALIGN);
        if matches!(&*self.slots.borrow(), Some(s) if s.elems >= elems && s.buffer.dtype() == dtype) {
            return Ok(());
        }
        let host_error = |e: CommError| candle_core::Error::Msg(e.to_string());
        // Reads of the old slots are queued on the compute stream, pushes on the copy stream:
        // both done before the old slots go.
        // SAFETY: both streams are this rank's.
        unsafe { after(self.compute.cu_stream(), self.copy) }?;
        host.wait().map_err(host_error)?;
        *self.slots.borrow_mut() = None;
        let buffer = Tensor::zeros((self.world - 1, elems), dtype, &Device::Cuda(self.device.clone()))?;
        // The zeros are written before any peer can push (it pushes after the meeting).
        host.wait().map_err(host_error)?;
        let bases = host.meet(device_address(&buffer)?).map_err(host_error)?;
        *self.slots.borrow_mut() = Some(Slots { buffer, elems, bases });
        Ok(())
    }

    /// The device address of `receiver`'s slot for this rank's pushes.
    fn slot_address(&self, receiver: usize) -> candle_core::Result<u64> {
        let slots = self.slots.borrow();
        let slots = slots.as_ref().ok_or_else(unreserved)?;
        let index = slot_index(receiver, self.rank);
        Ok(slots.bases[receiver] + (index * slots.elems * slots.buffer.dtype().size_in_bytes()) as u64)
    }

    /// `rows` × `d` of this rank's slot for `sender`'s pushes, as a tensor.
    fn slot(&self, sender: usize, rows: usize, d: usize) -> candle_core::Result<Tensor> {
        let slots = self.slots.borrow();
        let slots = slots.as_ref().ok_or_else(unreserved)?;
        slots
            .buffer
            .get(slot_index(self.rank, sender))?
            .narrow(0, 0, rows * d)?
            .reshape((rows, d))
    }

    /// Starts exchange number `n`'s push of `x` (contiguous) into `receiver`'s slot, after
    /// the work queued so far on the compute stream.
    fn push(&self, x: &Tensor, receiver: usize, n: u32) -> candle_core::Result<()> {
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        let (src, dst) = (device_address(x)?, self.slot_address(receiver)?);
        // SAFETY: both streams are this rank's; `x` stays alive until the compute stream has
        // waited for the copy stream (`finish`); the slot holds at least `bytes` (reserved
        // for the largest part), released by the receiver for exchange `n`.
        unsafe {
            after(self.copy, self.compute.cu_stream())?;
            wait_flag(self.copy, self.own(false, receiver), n.wrapping_sub(1))?;
            if bytes > 0 {
                sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.copy)
                    .result()
                    .map_err(cuda)?;
            }
            sys::cuStreamWriteValue32_v2(
                self.copy,
                self.theirs(receiver, true),
                n,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
            .result()
            .map_err(cuda)
        }
    }

    /// Makes the compute stream wait for `sender`'s push of exchange `n`.
    fn arrival(&self, sender: usize, n: u32) -> candle_core::Result<()> {
        // SAFETY: the compute stream and this rank's flags are live.
        unsafe { wait_flag(self.compute.cu_stream(), self.own(true, sender), n) }
    }

    /// Releases this rank's slots of exchange `n` once the reads queued so far are done, and
    /// keeps the compute stream (which frees the pushed tensors) behind the pushes.
    fn finish(&self, n: u32) -> candle_core::Result<()> {
        let compute = self.compute.cu_stream();
        for sender in self.peers() {
            // SAFETY: a 32-bit write to the sender's flag, mapped by peer access.
            unsafe {
                sys::cuStreamWriteValue32_v2(
                    compute,
                    self.theirs(sender, false),
                    n,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
                .result()
                .map_err(cuda)?;
            }
        }
        // SAFETY: both streams are this rank's.
        unsafe { after(compute, self.copy) }
    }

    fn next_exchange(&self) -> u32 {
        let n = self.exchanges.get().wrapping_add(1);
        self.exchanges.set(n);
        n
    }

    /// [`crate::Communicator::all_gather_rows`]: this rank's rows to `each` at once, each
    /// peer's as it lands.
    pub(crate) fn all_gather_rows(
        &self,
        x: &Tensor,
        sizes: &[usize],
        each: &mut dyn FnMut(&Tensor, usize) -> candle_core::Result<()>,
        host: &dyn Host,
    ) -> candle_core::Result<()> {
        let x = x.contiguous()?;
        let d = x.dims2()?.1;
        let ranges = crate::row_ranges(sizes);
        self.reserve(sizes.iter().max().copied().unwrap_or(0) * d, x.dtype(), host)?;
        let n = self.next_exchange();
        for receiver in self.peers() {
            self.push(&x, receiver, n)?;
        }
        each(&x, ranges[self.rank].start)?;
        for sender in self.peers() {
            self.arrival(sender, n)?;
            each(&self.slot(sender, sizes[sender], d)?, ranges[sender].start)?;
        }
        self.finish(n)
    }

    /// [`crate::Communicator::reduce_scatter_rows`]: each peer's part computed and pushed in
    /// turn, this rank's last, then every rank's part of this rank's rows, in rank order, to
    /// `finish`.
    pub(crate) fn reduce_scatter_rows(
        &self,
        sizes: &[usize],
        partial: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
        finish: &mut dyn FnMut(&[Tensor]) -> candle_core::Result<Tensor>,
        host: &dyn Host,
    ) -> candle_core::Result<Tensor> {
        let ranges = crate::row_ranges(sizes);
        let n = self.next_exchange();
        let mut pushed = Vec::with_capacity(self.world - 1);
        for receiver in self.peers() {
            let part = partial(ranges[receiver].clone())?.contiguous()?;
            if pushed.is_empty() {
                let d = part.dims2()?.1;
                self.reserve(sizes.iter().max().copied().unwrap_or(0) * d, part.dtype(), host)?;
            }
            self.push(&part, receiver, n)?;
            pushed.push(part);
        }
        let own = partial(ranges[self.rank].clone())?;
        let d = own.dims2()?.1;
        let parts = (0..self.world)
            .map(|r| match r == self.rank {
                true => Ok(own.clone()),
                false => {
                    self.arrival(r, n)?;
                    self.slot(r, sizes[self.rank], d)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let out = finish(&parts)?;
        drop(parts);
        self.finish(n)?;
        drop(pushed);
        Ok(out)
    }

    /// Lets every wait of this rank's streams through, so that no stream stays blocked on a
    /// failed peer (the results are garbage, and the caller reports the failure).
    pub(crate) fn release_waits(&self) {
        let past = self.exchanges.get().wrapping_add(1 << 30);
        for peer in 0..self.world {
            for arrived in [true, false] {
                // SAFETY: a write to this rank's own flags on its own stream.
                let _ = unsafe {
                    sys::cuStreamWriteValue32_v2(
                        self.rescue,
                        self.own(arrived, peer),
                        past,
                        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                    )
                };
            }
        }
    }
}

impl Drop for PeerRows {
    fn drop(&mut self) {
        if self.compute.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: this rank's streams and flags; the streams are drained first.
        unsafe {
            let _ = sys::cuStreamSynchronize(self.copy);
            let _ = sys::cuStreamDestroy_v2(self.copy);
            let _ = sys::cuStreamDestroy_v2(self.rescue);
            let _ = sys::cuMemFree_v2(self.flags);
        }
    }
}

fn unreserved() -> candle_core::Error {
    candle_core::Error::Msg("peer row exchange: no receive slots reserved".into())
}

fn flag_offset(arrived: bool, peer: usize) -> u64 {
    ((if arrived { 0 } else { MAX_RANKS } + peer) * 4) as u64
}

/// The index of `sender`'s slot in `receiver`'s buffer (no slot for itself).
fn slot_index(receiver: usize, sender: usize) -> usize {
    match sender < receiver {
        true => sender,
        false => sender - 1,
    }
}

fn cuda(e: DriverError) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// Makes `stream` wait for the work queued so far on `other`.
unsafe fn after(stream: sys::CUstream, other: sys::CUstream) -> candle_core::Result<()> {
    unsafe {
        let mut event = std::ptr::null_mut();
        sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            .result()
            .map_err(cuda)?;
        let waited = sys::cuEventRecord(event, other)
            .result()
            .and_then(|()| sys::cuStreamWaitEvent(stream, event, 0).result());
        // Destroying a recorded event is safe: its resources go once it completes.
        sys::cuEventDestroy_v2(event).result().map_err(cuda)?;
        waited.map_err(cuda)
    }
}

/// Makes `stream` wait until the 32-bit flag at `address` has reached `value` (with
/// wrap-around).
unsafe fn wait_flag(stream: sys::CUstream, address: u64, value: u32) -> candle_core::Result<()> {
    unsafe {
        sys::cuStreamWaitValue32_v2(
            stream,
            address,
            value,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
        .result()
        .map_err(cuda)
    }
}

/// Lets every peer device read and write this device's stream-ordered pool, where candle
/// allocates (the receive slots, and the pushed tensors).
fn grant_pool_access(context: &Arc<CudaContext>, devices: &[sys::CUdevice]) -> Result<(), DriverError> {
    context.bind_to_thread()?;
    let own = context.cu_device();
    // SAFETY: queries and sets the access of this device's current pool for devices this
    // process has opened.
    unsafe {
        let mut pool = std::ptr::null_mut();
        sys::cuDeviceGetMemPool(&mut pool, own).result()?;
        for &peer in devices.iter().filter(|&&d| d != own) {
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: peer,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            sys::cuMemPoolSetAccess(pool, &desc, 1).result()?;
        }
    }
    Ok(())
}
