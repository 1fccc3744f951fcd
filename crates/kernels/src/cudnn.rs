//! cuDNN's convolution, loaded when first asked for: the library (`libcudnn.so.9`) is opened
//! at run time, so a binary built with CUDA starts and runs every other model on a machine
//! without it. The legacy convolution API is enough here: a handful of descriptors, the
//! heuristic's algorithm list, one fused call. Every convolution runs as a 3-D one (a 2-D one
//! is its case of one tap in time), so that cuDNN reads the causal taps from the frames
//! themselves instead of a copy with them stacked, on the channels-last layout (`[frames, h,
//! w, c]`, NDHWC) that its Hopper tensor-core kernels read and write; the bias and a residual
//! are added in the kernel's epilogue (`cudnnConvolutionBiasActivationForward` with the
//! identity activation).

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{CudaDevice, DType, Result};

use crate::conv::{cudnn_workspace_allocation, cudnn_workspace_bound};

type Status = c_int;
type Handle = *mut c_void;
type Descriptor = *mut c_void;

const SUCCESS: Status = 0;
// cudnnDataType_t
const DATA_FLOAT: c_int = 0;
const DATA_HALF: c_int = 2;
const DATA_BFLOAT16: c_int = 9;
// cudnnMathType_t: FMA keeps f32 exact (no TF32), tensor ops serve bf16 and f16.
const TENSOR_OP_MATH: c_int = 1;
const FMA_MATH: c_int = 3;
const CROSS_CORRELATION: c_int = 1;
const FORMAT_NHWC: c_int = 1;
const NOT_SUPPORTED: Status = 9;
// cudnnActivationMode_t, cudnnNanPropagation_t
const ACTIVATION_IDENTITY: c_int = 5;
const NOT_PROPAGATE_NAN: c_int = 0;
/// Algorithms the heuristic ranks (cudnnConvolutionFwdAlgo_t has 8).
const ALGORITHMS: usize = 8;

/// cuDNN's implicit GEMM with precomputed indices: the algorithm whose sm90 kernels run on
/// tensor cores, and the one that the fused bias and identity activation require. The
/// heuristic ranks the plain implicit GEMM (a CUDA-core kernel that took 72% of a VAE
/// decode) first for many of the VAE's shapes.
const IMPLICIT_PRECOMP_GEMM: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct AlgoPerf {
    algo: c_int,
    status: Status,
    time: f32,
    memory: usize,
    determinism: c_int,
    math_type: c_int,
    reserved: [c_int; 3],
}

/// The entry points this module calls, from the opened library.
struct Api {
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy: unsafe extern "C" fn(Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    create_tensor: unsafe extern "C" fn(*mut Descriptor) -> Status,
    set_tensor: unsafe extern "C" fn(Descriptor, c_int, c_int, *const c_int, *const c_int) -> Status,
    destroy_tensor: unsafe extern "C" fn(Descriptor) -> Status,
    create_filter: unsafe extern "C" fn(*mut Descriptor) -> Status,
    set_filter: unsafe extern "C" fn(Descriptor, c_int, c_int, c_int, *const c_int) -> Status,
    destroy_filter: unsafe extern "C" fn(Descriptor) -> Status,
    create_conv: unsafe extern "C" fn(*mut Descriptor) -> Status,
    set_conv: unsafe extern "C" fn(Descriptor, c_int, *const c_int, *const c_int, *const c_int, c_int, c_int) -> Status,
    set_math: unsafe extern "C" fn(Descriptor, c_int) -> Status,
    destroy_conv: unsafe extern "C" fn(Descriptor) -> Status,
    #[allow(clippy::type_complexity)]
    algorithms: unsafe extern "C" fn(
        Handle,
        Descriptor,
        Descriptor,
        Descriptor,
        Descriptor,
        c_int,
        *mut c_int,
        *mut AlgoPerf,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    forward: unsafe extern "C" fn(
        Handle,
        *const c_void,
        Descriptor,
        *const c_void,
        Descriptor,
        *const c_void,
        Descriptor,
        c_int,
        *mut c_void,
        usize,
        *const c_void,
        Descriptor,
        *mut c_void,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    forward_bias: unsafe extern "C" fn(
        Handle,
        *const c_void,
        Descriptor,
        *const c_void,
        Descriptor,
        *const c_void,
        Descriptor,
        c_int,
        *mut c_void,
        usize,
        *const c_void,
        Descriptor,
        *const c_void,
        Descriptor,
        *const c_void,
        Descriptor,
        Descriptor,
        *mut c_void,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    add: unsafe extern "C" fn(
        Handle,
        *const c_void,
        Descriptor,
        *const c_void,
        *const c_void,
        Descriptor,
        *mut c_void,
    ) -> Status,
    create_activation: unsafe extern "C" fn(*mut Descriptor) -> Status,
    set_activation: unsafe extern "C" fn(Descriptor, c_int, c_int, f64) -> Status,
    destroy_activation: unsafe extern "C" fn(Descriptor) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    version: unsafe extern "C" fn() -> usize,
    /// Keeps the entry points valid.
    _library: libloading::Library,
}

/// The library, opened once per process; `None` where it is not installed.
fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(|| match open() {
        Ok(api) => Some(api),
        Err(why) => {
            tracing::warn!(
                "cuDNN not found ({why}): convolutions on CUDA run as one matrix product per tap, slower \
                 than cuDNN's. Install cuDNN 9 (e.g. `pip install nvidia-cudnn-cu13`) and put its lib \
                 directory on LD_LIBRARY_PATH"
            );
            None
        }
    })
    .as_ref()
}

fn open() -> std::result::Result<Api, libloading::Error> {
    // SAFETY: loading cuDNN runs its initialisers, which have no preconditions.
    let library = unsafe { libloading::Library::new("libcudnn.so.9") }
        .or_else(|_| unsafe { libloading::Library::new("libcudnn.so") })?;
    // SAFETY: each symbol is declared with its signature from cudnn_graph.h / cudnn_cnn.h
    // (cuDNN 9), and the library outlives the pointers (it is kept in `Api`).
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *library.get(concat!($name, "\0").as_bytes())?
            };
        }
        Ok(Api {
            create: sym!("cudnnCreate"),
            destroy: sym!("cudnnDestroy"),
            set_stream: sym!("cudnnSetStream"),
            create_tensor: sym!("cudnnCreateTensorDescriptor"),
            set_tensor: sym!("cudnnSetTensorNdDescriptor"),
            destroy_tensor: sym!("cudnnDestroyTensorDescriptor"),
            create_filter: sym!("cudnnCreateFilterDescriptor"),
            set_filter: sym!("cudnnSetFilterNdDescriptor"),
            destroy_filter: sym!("cudnnDestroyFilterDescriptor"),
            create_conv: sym!("cudnnCreateConvolutionDescriptor"),
            set_conv: sym!("cudnnSetConvolutionNdDescriptor"),
            set_math: sym!("cudnnSetConvolutionMathType"),
            destroy_conv: sym!("cudnnDestroyConvolutionDescriptor"),
            algorithms: sym!("cudnnGetConvolutionForwardAlgorithm_v7"),
            forward: sym!("cudnnConvolutionForward"),
            forward_bias: sym!("cudnnConvolutionBiasActivationForward"),
            add: sym!("cudnnAddTensor"),
            create_activation: sym!("cudnnCreateActivationDescriptor"),
            set_activation: sym!("cudnnSetActivationDescriptor"),
            destroy_activation: sym!("cudnnDestroyActivationDescriptor"),
            error_string: sym!("cudnnGetErrorString"),
            version: sym!("cudnnGetVersion"),
            _library: library,
        })
    }
}

/// Whether cuDNN is installed (opening it on the first call).
pub fn available() -> bool {
    api().is_some()
}

/// The installed cuDNN's version (e.g. 91900 for 9.19.0), `None` where it is not installed.
pub fn version() -> Option<usize> {
    // SAFETY: cudnnGetVersion has no preconditions.
    api().map(|api| unsafe { (api.version)() })
}

fn check(api: &Api, status: Status, what: &str) -> Result<()> {
    if status == SUCCESS {
        return Ok(());
    }
    // SAFETY: cudnnGetErrorString returns a static NUL-terminated string for any status.
    let message = unsafe { CStr::from_ptr((api.error_string)(status)) };
    candle_core::bail!("cuDNN {what}: {} ({status})", message.to_string_lossy())
}

/// One convolution of a video held channels last (`[frames, h, w, c]`, as the VAE keeps its
/// activations): filter `[o, kt, kh, kw, c]` (its dims in this order, stored so), zero padding
/// of `pad` rows and columns on each side, stride 1; the output channels last too. Packed
/// input and output.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ConvShape {
    /// `[frames, h, w, c]`.
    pub input: [usize; 4],
    /// `[o, kt, kh, kw, c]`.
    pub filter: [usize; 5],
    pub pad: [usize; 2],
    pub dtype: DType,
}

impl ConvShape {
    /// `[frames, h, w, o]`.
    pub fn output(&self) -> [usize; 4] {
        let [f, h, w, _] = self.input;
        let [o, kt, kh, kw, _] = self.filter;
        let [ph, pw] = self.pad;
        [f + 1 - kt, h + 2 * ph + 1 - kh, w + 2 * pw + 1 - kw, o]
    }

    fn input_elements(&self) -> usize {
        self.input.iter().product()
    }

    /// The most workspace its algorithm may take, as the memory plan counts it.
    fn workspace_cap(&self) -> usize {
        cudnn_workspace_bound(self.input_elements(), self.output_elements(), self.dtype)
    }

    fn output_elements(&self) -> usize {
        self.output().iter().product()
    }
}

/// How a shape runs: its algorithm and workspace, and whether its bias and residual are added
/// in the convolution's epilogue (else by separate additions, where cuDNN does not fuse them
/// for this shape, dtype or algorithm).
#[derive(Clone, Copy, Debug)]
struct Chosen {
    algo: c_int,
    workspace: usize,
    fused: bool,
}

/// A shape's descriptors and how it runs, made on its first call.
struct Prepared {
    d: Descriptors<'static>,
    chosen: Chosen,
}

/// A thread's handle for a stream, and each shape it ran: a VAE decode runs a few dozen
/// shapes a thousand times, and making descriptors took as long as launching.
struct Context {
    stream: Arc<CudaStream>,
    handle: Handle,
    prepared: HashMap<ConvShape, Prepared>,
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Some(api) = api() {
            // SAFETY: the handle was created by cudnnCreate and is used by nothing else.
            unsafe { (api.destroy)(self.handle) };
        }
    }
}

thread_local! {
    /// A rank's thread launches on one stream: one handle each, as cuBLASLt's.
    static CONTEXTS: RefCell<Vec<Context>> = const { RefCell::new(Vec::new()) };
}

/// A shape's descriptors: the 5-D channels-last input and output, the bias `[1, o, 1, 1,
/// 1]`, the filter, the convolution and the identity activation.
#[derive(Clone, Copy)]
struct Raw {
    x: Descriptor,
    y: Descriptor,
    bias: Descriptor,
    w: Descriptor,
    conv: Descriptor,
    identity: Descriptor,
}

/// Descriptors destroyed when dropped.
struct Descriptors<'a> {
    api: &'a Api,
    raw: Raw,
}

impl Drop for Descriptors<'_> {
    fn drop(&mut self) {
        let r = self.raw;
        // SAFETY: each was created by this struct's constructor (null ones are skipped).
        unsafe {
            for t in [r.x, r.y, r.bias] {
                if !t.is_null() {
                    (self.api.destroy_tensor)(t);
                }
            }
            if !r.w.is_null() {
                (self.api.destroy_filter)(r.w);
            }
            if !r.conv.is_null() {
                (self.api.destroy_conv)(r.conv);
            }
            if !r.identity.is_null() {
                (self.api.destroy_activation)(r.identity);
            }
        }
    }
}

/// The 5-D `[1, c, frames, h, w]` dims and the strides of a packed channels-last `[frames,
/// h, w, c]`: how cuDNN describes NDHWC.
fn channels_last(dims: [usize; 4]) -> ([c_int; 5], [c_int; 5]) {
    let [f, h, w, c] = dims;
    let d = [1, c, f, h, w].map(|d| d as c_int);
    let s = [f * h * w * c, 1, h * w * c, w * c, c].map(|s| s as c_int);
    (d, s)
}

impl<'a> Descriptors<'a> {
    fn new(api: &'a Api, shape: &ConvShape) -> Result<Self> {
        let (data, compute, math) = match shape.dtype {
            DType::BF16 => (DATA_BFLOAT16, DATA_FLOAT, TENSOR_OP_MATH),
            DType::F16 => (DATA_HALF, DATA_FLOAT, TENSOR_OP_MATH),
            DType::F32 => (DATA_FLOAT, DATA_FLOAT, FMA_MATH),
            other => candle_core::bail!("cuDNN convolution: unsupported dtype {other:?}"),
        };
        let null = std::ptr::null_mut();
        let mut owned = Self {
            api,
            raw: Raw {
                x: null,
                y: null,
                bias: null,
                w: null,
                conv: null,
                identity: null,
            },
        };
        let d = &mut owned.raw;
        let o = shape.filter[0];
        // SAFETY: every pointer passed points at a live local array of the stated length.
        unsafe {
            for t in [&mut d.x, &mut d.y, &mut d.bias] {
                check(api, (api.create_tensor)(t), "create tensor")?;
            }
            check(api, (api.create_filter)(&mut d.w), "create filter")?;
            check(api, (api.create_conv)(&mut d.conv), "create convolution")?;
            check(api, (api.create_activation)(&mut d.identity), "create activation")?;
            for (t, dims, what) in [(d.x, shape.input, "input"), (d.y, shape.output(), "output")] {
                let (dims, strides) = channels_last(dims);
                check(api, (api.set_tensor)(t, data, 5, dims.as_ptr(), strides.as_ptr()), what)?;
            }
            let (bias_dims, bias_strides) = channels_last([1, 1, 1, o]);
            check(
                api,
                (api.set_tensor)(d.bias, data, 5, bias_dims.as_ptr(), bias_strides.as_ptr()),
                "bias",
            )?;
            // cuDNN's filter dims are [o, c, kt, kh, kw] whatever the format; NHWC stores
            // them [o, kt, kh, kw, c].
            let [fo, kt, kh, kw, c] = shape.filter;
            let w_dims = [fo, c, kt, kh, kw].map(|d| d as c_int);
            check(
                api,
                (api.set_filter)(d.w, data, FORMAT_NHWC, 5, w_dims.as_ptr()),
                "filter",
            )?;
            let pad = [0, shape.pad[0] as c_int, shape.pad[1] as c_int];
            let (stride, dilation) = ([1 as c_int; 3], [1 as c_int; 3]);
            let conv = (api.set_conv)(
                d.conv,
                3,
                pad.as_ptr(),
                stride.as_ptr(),
                dilation.as_ptr(),
                CROSS_CORRELATION,
                compute,
            );
            check(api, conv, "convolution")?;
            check(api, (api.set_math)(d.conv, math), "math type")?;
            check(
                api,
                (api.set_activation)(d.identity, ACTIVATION_IDENTITY, NOT_PROPAGATE_NAN, 0.0),
                "activation",
            )?;
        }
        Ok(owned)
    }
}

/// The handle for `stream` on this thread (made on its first use) and the context's index.
fn context(api: &Api, contexts: &mut Vec<Context>, stream: &Arc<CudaStream>) -> Result<usize> {
    if let Some(at) = contexts.iter().position(|c| Arc::ptr_eq(&c.stream, stream)) {
        return Ok(at);
    }
    let mut handle: Handle = std::ptr::null_mut();
    // SAFETY: the handle is written by cudnnCreate and bound to this stream.
    unsafe {
        check(api, (api.create)(&mut handle), "create handle")?;
        check(
            api,
            (api.set_stream)(handle, stream.cu_stream() as *mut c_void),
            "set stream",
        )?;
    }
    contexts.push(Context {
        stream: stream.clone(),
        handle,
        prepared: HashMap::new(),
    });
    Ok(contexts.len() - 1)
}

/// The heuristic's choice for `shape`: the implicit precomputed GEMM where it is usable
/// within the workspace cap, else the best ranked that is.
fn choose(api: &Api, handle: Handle, d: &Raw, shape: &ConvShape) -> Result<Chosen> {
    let mut perf = [AlgoPerf {
        algo: 0,
        status: 0,
        time: 0.0,
        memory: 0,
        determinism: 0,
        math_type: 0,
        reserved: [0; 3],
    }; ALGORITHMS];
    let mut found: c_int = 0;
    // SAFETY: `perf` holds ALGORITHMS entries, as requested.
    let status = unsafe {
        (api.algorithms)(
            handle,
            d.x,
            d.w,
            d.conv,
            d.y,
            ALGORITHMS as c_int,
            &mut found,
            perf.as_mut_ptr(),
        )
    };
    check(api, status, "algorithm heuristic")?;
    let ranked = &perf[..found.clamp(0, ALGORITHMS as c_int) as usize];
    let cap = shape.workspace_cap();
    let usable: Vec<&AlgoPerf> = ranked
        .iter()
        .filter(|p| p.status == SUCCESS && p.memory <= cap)
        .collect();
    let (algo, workspace) = usable
        .iter()
        .find(|p| p.algo == IMPLICIT_PRECOMP_GEMM)
        .or(usable.first())
        .map(|p| (p.algo, p.memory))
        .ok_or_else(|| {
            let ranked: Vec<(c_int, Status, usize)> = ranked.iter().map(|p| (p.algo, p.status, p.memory)).collect();
            candle_core::Error::Msg(format!(
                "cuDNN convolution: no algorithm for {shape:?} within {cap} bytes of workspace \
                 (algorithm, status, bytes: {ranked:?})"
            ))
        })?;
    Ok(Chosen {
        algo,
        workspace,
        fused: algo == IMPLICIT_PRECOMP_GEMM,
    })
}

/// `y = conv(x, w) + b (+ r)`. Addresses are of contiguous buffers on `dev`'s stream, shaped
/// as `shape` says (the bias `[o]`, `r` as the output). Besides `y`, it takes its algorithm's
/// workspace.
///
/// # Safety
/// `x`, `w`, `b`, `r` and `y` must be device addresses of live buffers holding `shape`'s
/// input, filter, bias, output and output in its dtype, and `y` must alias none of them.
pub unsafe fn convolve_into(
    dev: &CudaDevice,
    shape: &ConvShape,
    x: u64,
    w: u64,
    b: u64,
    r: Option<u64>,
    y: u64,
) -> Result<()> {
    let Some(api) = api() else {
        candle_core::bail!("cuDNN convolution: cuDNN is not installed");
    };
    let stream = dev.cuda_stream();
    CONTEXTS.with(|contexts| -> Result<()> {
        let mut contexts = contexts.borrow_mut();
        let at = context(api, &mut contexts, &stream)?;
        let context = &mut contexts[at];
        let handle = context.handle;
        let prepared = match context.prepared.entry(*shape) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let d = Descriptors::new(api, shape)?;
                let chosen = choose(api, handle, &d.raw, shape)?;
                tracing::debug!(?shape, ?chosen, "cuDNN convolution");
                entry.insert(Prepared { d, chosen })
            }
        };
        let chosen = prepared.chosen;
        let d = prepared.d.raw;
        let bytes = cudnn_workspace_allocation(
            chosen.workspace,
            shape.input_elements(),
            shape.output_elements(),
            shape.dtype,
        );
        // SAFETY: every byte of it is written (by cuDNN) before it is read.
        let workspace = unsafe { dev.alloc::<u8>(bytes.max(1))? };
        let workspace = {
            use candle_core::cuda_backend::cudarc::driver::DevicePtr;
            workspace.device_ptr(&stream).0 as *mut c_void
        };
        let (one_f32, zero_f32) = (1f32, 0f32);
        let (one, zero) = (
            &one_f32 as *const f32 as *const c_void,
            &zero_f32 as *const f32 as *const c_void,
        );
        let (x, w, b, y) = (
            x as *const c_void,
            w as *const c_void,
            b as *const c_void,
            y as *mut c_void,
        );
        if chosen.fused {
            // y = identity(conv(x) + α₂·z + b), with z the residual (α₂ = 1), or y itself
            // unread (α₂ = 0).
            let (alpha2, z) = match r {
                Some(r) => (one, r as *const c_void),
                None => (zero, y as *const c_void),
            };
            // SAFETY: the caller vouches for the buffers; the workspace holds
            // `chosen.workspace` bytes.
            let status = unsafe {
                (api.forward_bias)(
                    handle,
                    one,
                    d.x,
                    x,
                    d.w,
                    w,
                    d.conv,
                    chosen.algo,
                    workspace,
                    chosen.workspace,
                    alpha2,
                    d.y,
                    z,
                    d.bias,
                    b,
                    d.identity,
                    d.y,
                    y,
                )
            };
            if status != NOT_SUPPORTED {
                return check(api, status, "forward with bias");
            }
            tracing::debug!(?shape, "cuDNN does not fuse the bias here: added separately");
            prepared.chosen.fused = false;
        }
        // SAFETY: as above; `y` takes the residual first, so that the convolution adds to it.
        unsafe {
            let beta = match r {
                Some(r) => {
                    check(
                        api,
                        (api.add)(handle, one, d.y, r as *const c_void, zero, d.y, y),
                        "residual",
                    )?;
                    one
                }
                None => zero,
            };
            let status = (api.forward)(
                handle,
                one,
                d.x,
                x,
                d.w,
                w,
                d.conv,
                chosen.algo,
                workspace,
                chosen.workspace,
                beta,
                d.y,
                y,
            );
            check(api, status, "forward")?;
            check(api, (api.add)(handle, one, d.bias, b, one, d.y, y), "bias")
        }
    })
}
