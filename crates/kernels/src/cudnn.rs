//! cuDNN's 2-D convolution, loaded when first asked for: the library (`libcudnn.so.9`) is
//! opened at run time, so a binary built with CUDA starts and runs every other model on a
//! machine without it. The legacy convolution API is enough here: a handful of descriptors,
//! the heuristic's algorithm list, one forward call, two layout transforms. Every convolution
//! runs as a 3-D one (a 2-D one is its case of one tap in time), so that cuDNN reads the
//! causal taps from the frames themselves instead of a copy with them stacked, on
//! channels-last copies of the frames-first input and output: the layout its Hopper
//! tensor-core kernels read. Given the frames-first layout through strides, cuDNN transposed
//! it with a generic kernel that took 90% of a decode's time; per-frame NCHW ↔ NHWC transforms
//! run at memory speed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::{CudaDevice, DType, Result};

use crate::conv::INDEX_TABLE_BYTES;

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
/// Algorithms the heuristic ranks (cudnnConvolutionFwdAlgo_t has 8).
const ALGORITHMS: usize = 8;

/// cuDNN's implicit GEMM with precomputed indices: the algorithm whose sm90 kernels run on
/// tensor cores. The heuristic ranks the plain implicit GEMM (a CUDA-core kernel that took
/// 72% of a VAE decode) first for many of the VAE's shapes.
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
    transform: unsafe extern "C" fn(
        Handle,
        *const c_void,
        Descriptor,
        *const c_void,
        *const c_void,
        Descriptor,
        *mut c_void,
    ) -> Status,
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
                "cuDNN not found ({why}): convolutions on CUDA run through candle's unfolding, about ten \
                 times slower. Install cuDNN 9 (e.g. `pip install nvidia-cudnn-cu13`) and put its lib \
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
            transform: sym!("cudnnTransformTensor"),
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

/// One convolution of a video held frames first (`[frames, c, h, w]`, as the VAE keeps its
/// activations): filter `[o, c, kt, kh, kw]` (stored channels last, `[o, kt, kh, kw, c]`),
/// zero padding of `pad` rows and columns on each side, stride 1; the output frames first
/// too. Packed input and output.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ConvShape {
    /// `[frames, c, h, w]`.
    pub input: [usize; 4],
    pub filter: [usize; 5],
    pub pad: [usize; 2],
    pub dtype: DType,
}

impl ConvShape {
    /// `[frames, o, h, w]`.
    pub fn output(&self) -> [usize; 4] {
        let [f, _, h, w] = self.input;
        let [o, _, kt, kh, kw] = self.filter;
        let [ph, pw] = self.pad;
        [f + 1 - kt, o, h + 2 * ph + 1 - kh, w + 2 * pw + 1 - kw]
    }

    fn input_elements(&self) -> usize {
        self.input.iter().product()
    }

    /// The most workspace its algorithm may take: the size of its input and output, and
    /// [`INDEX_TABLE_BYTES`] more.
    fn workspace_cap(&self) -> usize {
        (self.input_elements() + self.output_elements()) * self.dtype.size_in_bytes() + INDEX_TABLE_BYTES
    }

    fn output_elements(&self) -> usize {
        self.output().iter().product()
    }
}

/// A thread's handle for a stream, and the algorithm chosen for each shape it ran.
struct Context {
    stream: Arc<CudaStream>,
    handle: Handle,
    chosen: HashMap<ConvShape, (c_int, usize)>,
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

/// Descriptors destroyed when dropped.
struct Descriptors<'a> {
    api: &'a Api,
    /// The convolution's 5-D channels-last input and output.
    x: Descriptor,
    y: Descriptor,
    /// The 4-D frames-first input and output, and their channels-last copies.
    x_first: Descriptor,
    x_last: Descriptor,
    y_first: Descriptor,
    y_last: Descriptor,
    w: Descriptor,
    conv: Descriptor,
}

impl Drop for Descriptors<'_> {
    fn drop(&mut self) {
        // SAFETY: each was created by this struct's constructor (null ones are skipped).
        unsafe {
            for t in [self.x, self.y, self.x_first, self.x_last, self.y_first, self.y_last] {
                if !t.is_null() {
                    (self.api.destroy_tensor)(t);
                }
            }
            if !self.w.is_null() {
                (self.api.destroy_filter)(self.w);
            }
            if !self.conv.is_null() {
                (self.api.destroy_conv)(self.conv);
            }
        }
    }
}

/// The 5-D `[1, c, frames, h, w]` dims and the strides of a channels-last copy
/// (`[frames, h, w, c]`) of a frames-first `[frames, c, h, w]`: what the convolution reads.
fn channels_last(dims: [usize; 4]) -> ([c_int; 5], [c_int; 5]) {
    let [f, c, h, w] = dims;
    let d = [1, c, f, h, w].map(|d| d as c_int);
    let s = [f * h * w * c, 1, h * w * c, w * c, c].map(|s| s as c_int);
    (d, s)
}

/// The 4-D `[frames, c, h, w]` dims with the strides of its frames-first layout and of its
/// channels-last copy: the two ends of a transform.
fn per_frame(dims: [usize; 4]) -> ([c_int; 4], [c_int; 4], [c_int; 4]) {
    let [f, c, h, w] = dims;
    let d = [f, c, h, w].map(|d| d as c_int);
    let first = [c * h * w, h * w, w, 1].map(|s| s as c_int);
    let last = [h * w * c, 1, w * c, c].map(|s| s as c_int);
    (d, first, last)
}

impl<'a> Descriptors<'a> {
    fn new(api: &'a Api, shape: &ConvShape) -> Result<Self> {
        let (data, compute, math) = match shape.dtype {
            DType::BF16 => (DATA_BFLOAT16, DATA_FLOAT, TENSOR_OP_MATH),
            DType::F16 => (DATA_HALF, DATA_FLOAT, TENSOR_OP_MATH),
            DType::F32 => (DATA_FLOAT, DATA_FLOAT, FMA_MATH),
            other => candle_core::bail!("cuDNN convolution: unsupported dtype {other:?}"),
        };
        let mut d = Self {
            api,
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            x_first: std::ptr::null_mut(),
            x_last: std::ptr::null_mut(),
            y_first: std::ptr::null_mut(),
            y_last: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        let output = shape.output();
        // SAFETY: every pointer passed points at a live local array of the stated length.
        unsafe {
            for t in [
                &mut d.x,
                &mut d.y,
                &mut d.x_first,
                &mut d.x_last,
                &mut d.y_first,
                &mut d.y_last,
            ] {
                check(api, (api.create_tensor)(t), "create tensor")?;
            }
            check(api, (api.create_filter)(&mut d.w), "create filter")?;
            check(api, (api.create_conv)(&mut d.conv), "create convolution")?;
            let (x_dims, x_strides) = channels_last(shape.input);
            check(
                api,
                (api.set_tensor)(d.x, data, 5, x_dims.as_ptr(), x_strides.as_ptr()),
                "input",
            )?;
            let (y_dims, y_strides) = channels_last(output);
            check(
                api,
                (api.set_tensor)(d.y, data, 5, y_dims.as_ptr(), y_strides.as_ptr()),
                "output",
            )?;
            for (dims, first, last) in [(shape.input, d.x_first, d.x_last), (output, d.y_first, d.y_last)] {
                let (dims, first_strides, last_strides) = per_frame(dims);
                check(
                    api,
                    (api.set_tensor)(first, data, 4, dims.as_ptr(), first_strides.as_ptr()),
                    "frames",
                )?;
                check(
                    api,
                    (api.set_tensor)(last, data, 4, dims.as_ptr(), last_strides.as_ptr()),
                    "frames",
                )?;
            }
            let w_dims = shape.filter.map(|d| d as c_int);
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
        }
        Ok(d)
    }
}

/// `y = conv(x, w) + y`: the convolution accumulated into `y`, which holds the bias
/// broadcast. Addresses are of contiguous buffers on `dev`'s stream, shaped as `shape` says;
/// the filter channels last. Besides its workspace, it takes channels-last copies of the
/// input and the output.
///
/// # Safety
/// `x`, `w` and `y` must be device addresses of live buffers holding `shape`'s input, filter
/// and output in its dtype, and `y` must not alias the others.
pub unsafe fn convolve_into(dev: &CudaDevice, shape: &ConvShape, x: u64, w: u64, y: u64) -> Result<()> {
    let Some(api) = api() else {
        candle_core::bail!("cuDNN convolution: cuDNN is not installed");
    };
    let stream = dev.cuda_stream();
    let d = Descriptors::new(api, shape)?;
    let (handle, (algo, workspace_bytes)) = CONTEXTS.with(|contexts| -> Result<_> {
        let mut contexts = contexts.borrow_mut();
        let at = match contexts.iter().position(|c| Arc::ptr_eq(&c.stream, &stream)) {
            Some(at) => at,
            None => {
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
                    chosen: HashMap::new(),
                });
                contexts.len() - 1
            }
        };
        let context = &mut contexts[at];
        if let Some(&chosen) = context.chosen.get(shape) {
            return Ok((context.handle, chosen));
        }
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
                context.handle,
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
        let cap = shape.workspace_cap();
        let usable: Vec<&AlgoPerf> = perf[..found.max(0) as usize]
            .iter()
            .filter(|p| p.status == SUCCESS && p.memory <= cap)
            .collect();
        let chosen = usable
            .iter()
            .find(|p| p.algo == IMPLICIT_PRECOMP_GEMM)
            .or(usable.first())
            .map(|p| (p.algo, p.memory))
            .ok_or_else(|| {
                let ranked: Vec<(c_int, Status, usize)> = perf[..found.max(0) as usize]
                    .iter()
                    .map(|p| (p.algo, p.status, p.memory))
                    .collect();
                candle_core::Error::Msg(format!(
                    "cuDNN convolution: no algorithm for {shape:?} within {cap} bytes of workspace \
                     (algorithm, status, bytes: {ranked:?})"
                ))
            })?;
        tracing::debug!(?shape, algorithm = chosen.0, workspace = chosen.1, "cuDNN convolution");
        context.chosen.insert(*shape, chosen);
        Ok((context.handle, chosen))
    })?;
    let address = |buffer: &CudaSlice<u8>| {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        buffer.device_ptr(&stream).0 as *mut c_void
    };
    let size = shape.dtype.size_in_bytes();
    // SAFETY: every byte of these is written (by cuDNN) before it is read.
    let (workspace, x_last, y_last) = unsafe {
        (
            dev.alloc::<u8>(workspace_bytes.max(1))?,
            dev.alloc::<u8>(shape.input_elements() * size)?,
            dev.alloc::<u8>(shape.output_elements() * size)?,
        )
    };
    let (one_f32, zero_f32) = (1f32, 0f32);
    let (one, zero) = (
        &one_f32 as *const f32 as *const c_void,
        &zero_f32 as *const f32 as *const c_void,
    );
    // SAFETY: the caller vouches for x, w and y; the channels-last copies hold the input's
    // and the output's elements, the workspace `workspace_bytes`.
    unsafe {
        let to_last = (api.transform)(
            handle,
            one,
            d.x_first,
            x as *const c_void,
            zero,
            d.x_last,
            address(&x_last),
        );
        check(api, to_last, "input to channels last")?;
        let status = (api.forward)(
            handle,
            one,
            d.x,
            address(&x_last),
            d.w,
            w as *const c_void,
            d.conv,
            algo,
            address(&workspace),
            workspace_bytes,
            zero,
            d.y,
            address(&y_last),
        );
        check(api, status, "forward")?;
        // Added to the bias that `y` holds.
        let to_first = (api.transform)(
            handle,
            one,
            d.y_last,
            address(&y_last),
            one,
            d.y_first,
            y as *mut c_void,
        );
        check(api, to_first, "output to frames first")
    }
}
