//! CUDA graphs: the kernels of a decode step captured once and replayed with one launch. A
//! step of a 32-layer model is some 300 launches and 64 all-reduces; issued one by one from
//! the host they take longer than the GPU needs to run them.
//!
//! What a captured step may do: read and write tensors that outlive the graph (weights, the KV
//! cache, input and output buffers), allocate and free temporaries (captured as graph memory
//! nodes, at the same addresses on every replay), and run collectives. What it may not do:
//! copy to or from the host, or let a temporary it allocated outlive the capture. Inputs that
//! change between replays (token, position) live in device buffers that the host rewrites
//! with [`crate::write_u32s`] before each replay.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Device, Result};

/// A captured CUDA graph, replayed on the stream it was captured on.
pub struct Graph {
    graph: CudaGraph,
}

fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(cuda) => Ok(cuda),
        other => candle_core::bail!("CUDA graphs need a CUDA device, not {:?}", other.location()),
    }
}

/// Keeps the small host-to-device uploads candle makes for a non-contiguous op's shape and
/// strides cached on the device while it lives: run a step once eagerly under it, and a
/// capture of the same step (which cannot upload) finds them there.
#[must_use = "the cache is on only while the guard lives"]
pub fn upload_cache(device: &Device) -> Result<impl Sized> {
    Ok(cuda(device)?.enable_cuda_graph_htod_cache())
}

impl Graph {
    /// Captures what `record` enqueues on `device`'s stream into a graph; nothing of it runs
    /// until [`Graph::replay`]. Every rank of a group must capture its collectives in the same
    /// order, and a failed capture leaves the collectives' sequence out of step between ranks:
    /// the caller treats it as fatal. Run `record` once eagerly under [`upload_cache`] first.
    pub fn capture<E: From<candle_core::Error>>(
        device: &Device,
        record: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let cuda = cuda(device)?;
        let stream = cuda.cuda_stream();
        let _uploads = cuda.enable_cuda_graph_htod_cache();
        // Thread-local: another rank's thread may allocate while this one captures.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let recorded = record();
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded?;
        let Some(graph) = ended.w()? else {
            return Err(candle_core::Error::Msg("the CUDA graph capture recorded no work".into()).into());
        };
        graph.upload().w()?;
        Ok(Self { graph })
    }

    /// Enqueues the captured work on the stream it was captured on.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().w()
    }
}
