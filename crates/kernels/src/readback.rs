//! A few u32 values read on the host behind the work queued before them, without waiting for
//! work queued after: a greedy decode step's token and flags, read while the next step runs.
//! A plain read (`to_vec1`) waits for the whole stream, so the GPU would idle from the end of
//! one step until the host has read it and queued the next.

use candle_core::{DType, Device, Result, Tensor};

/// A host buffer that a small u32 tensor is copied into, in stream order.
pub struct U32Readback {
    len: usize,
    inner: Inner,
}

enum Inner {
    /// CPU tensors are read at once.
    Host(Vec<u32>),
    /// Page-locked memory, which a copy fills without the host waiting, and the event that
    /// marks the copy's end.
    #[cfg(feature = "cuda")]
    Pinned {
        buffer: candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<u32>,
        done: candle_core::cuda_backend::cudarc::driver::CudaEvent,
        stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    },
}

impl U32Readback {
    /// A buffer of `len` values for tensors on `device`.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        let inner = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => {
                use candle_core::cuda_backend::WrapErr;
                let stream = cuda.cuda_stream();
                let context = stream.context();
                // SAFETY: the buffer is only read after a copy into it has completed.
                // Flags 0: cached page-locked memory (write-combined memory reads slowly on
                // the host).
                let buffer = unsafe { context.alloc_pinned_with_flags::<u32>(len, 0) }.w()?;
                let done = context.new_event(None).w()?;
                Inner::Pinned { buffer, done, stream }
            }
            _ => Inner::Host(vec![0; len]),
        };
        Ok(Self { len, inner })
    }

    /// Queues the copy of `src` (`len` contiguous u32 values) behind the work already queued
    /// on its device; a CPU tensor is copied at once.
    pub fn queue(&mut self, src: &Tensor) -> Result<()> {
        if src.dtype() != DType::U32 || src.elem_count() != self.len || !src.is_contiguous() {
            candle_core::bail!(
                "U32Readback: a {:?} {:?} tensor is not {} contiguous u32 values",
                src.dtype(),
                src.dims(),
                self.len
            );
        }
        match &mut self.inner {
            Inner::Host(values) => *values = src.flatten_all()?.to_vec1::<u32>()?,
            #[cfg(feature = "cuda")]
            Inner::Pinned { buffer, done, stream } => {
                use candle_core::cuda_backend::WrapErr;
                let len = self.len;
                crate::position::with_device_view(src, |view| {
                    stream.memcpy_dtoh(&view.slice(..len), buffer).w()?;
                    done.record(stream).w()
                })?;
            }
        }
        Ok(())
    }

    /// Whether the last queued copy has landed; never waits.
    pub fn is_done(&self) -> Result<bool> {
        match &self.inner {
            Inner::Host(_) => Ok(true),
            #[cfg(feature = "cuda")]
            Inner::Pinned { done, .. } => {
                use candle_core::cuda_backend::WrapErr;
                done.try_is_complete().w()
            }
        }
    }

    /// The values of the last queued copy, waiting for it if it has not landed.
    pub fn values(&self) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Host(values) => Ok(values.clone()),
            #[cfg(feature = "cuda")]
            Inner::Pinned { buffer, .. } => {
                use candle_core::cuda_backend::WrapErr;
                Ok(buffer.as_slice().w()?.to_vec())
            }
        }
    }
}
