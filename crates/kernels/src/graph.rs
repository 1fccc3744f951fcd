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

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, DriverError};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Device, Result};

/// A graph's nodes, kernel nodes, edges and programmatic edges (kernel chains' links).
fn shape(graph: sys::CUgraph) -> std::result::Result<(usize, usize, usize, usize), DriverError> {
    let check = |r: sys::CUresult| r.result();
    let (mut n, mut e) = (0usize, 0usize);
    // SAFETY: each call is first asked for the count, then given buffers of that count.
    unsafe {
        check(sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n))?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        check(sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n))?;
        let mut kernels = 0;
        for &node in &nodes {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            check(sys::cuGraphNodeGetType(node, &mut kind))?;
            kernels += (kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) as usize;
        }
        let null = std::ptr::null_mut();
        check(sys::cuGraphGetEdges_v2(graph, null, null, std::ptr::null_mut(), &mut e))?;
        let (mut from, mut to): (Vec<sys::CUgraphNode>, Vec<sys::CUgraphNode>) =
            (vec![std::ptr::null_mut(); e], vec![std::ptr::null_mut(); e]);
        let mut data = vec![std::mem::zeroed::<sys::CUgraphEdgeData>(); e];
        check(sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut e,
        ))?;
        let programmatic = data
            .iter()
            .filter(|d| d.type_ == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8)
            .count();
        Ok((n, kernels, e, programmatic))
    }
}

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
        if tracing::enabled!(tracing::Level::DEBUG) {
            let (nodes, kernels, edges, chained) = shape(graph.cu_graph()).w()?;
            tracing::debug!(
                nodes,
                kernels,
                edges,
                chained,
                "captured a CUDA graph (chained: programmatic edges)"
            );
        }
        Ok(Self { graph })
    }

    /// Enqueues the captured work on the stream it was captured on.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().w()
    }
}
