//! This crate's CUDA modules as build.rs compiled them: fatbins with machine code for the
//! GPUs the build targets, which load without compiling (a first run as fast as the next),
//! and PTX that the driver compiles at first use on any other GPU. candle loads modules from
//! PTX text only, so these are loaded here, each once per thread and CUDA context.

use std::cell::RefCell;
use std::ops::Deref;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchArgs};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

/// What the build compiled the kernels for, in words (build.rs).
const TARGETS: &str = env!("TPINFER_CUDA_TARGETS");

/// One compiled source (cuda/{name}.cu): its name and its fatbin.
pub(crate) struct Module {
    name: &'static str,
    image: &'static [u8],
}

macro_rules! fatbin {
    ($name:literal) => {
        Module {
            name: $name,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin")),
        }
    };
}

pub(crate) const ARGMAX: Module = fatbin!("argmax");
pub(crate) const ATTENTION_FP8: Module = fatbin!("attention_fp8");
pub(crate) const FLASH_ATTENTION: Module = fatbin!("flash_attention");
#[cfg(tpinfer_sm90)]
pub(crate) const FLASH_ATTENTION_SM90: Module = fatbin!("flash_attention_sm90");
pub(crate) const FP8: Module = fatbin!("fp8");
pub(crate) const GEMV: Module = fatbin!("gemv");
pub(crate) const HOLD: Module = fatbin!("hold");
pub(crate) const PAGED: Module = fatbin!("paged");
pub(crate) const PEER_ALL_REDUCE: Module = fatbin!("peer_all_reduce");
pub(crate) const ROTARY: Module = fatbin!("rotary");
pub(crate) const ROWWISE: Module = fatbin!("rowwise");
pub(crate) const SAMPLE: Module = fatbin!("sample");
/// The decode attention modules by GQA group size (cuda/decode_attention.cu's DECODE_GROUP).
pub(crate) const DECODE_ATTENTION: [(usize, Module); 4] = [
    (1, fatbin!("decode_attention_g1")),
    (2, fatbin!("decode_attention_g2")),
    (4, fatbin!("decode_attention_g4")),
    (8, fatbin!("decode_attention_g8")),
];

/// A kernel and the stream it launches on.
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.builder_on(&self.stream)
    }

    /// A launch on `stream` instead of the device's own.
    pub(crate) fn builder_on<'a>(&'a self, stream: &'a Arc<CudaStream>) -> LaunchArgs<'a> {
        stream.launch_builder(&self.func)
    }
}

impl Deref for Kernel {
    type Target = CudaFunction;

    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

/// A module loaded into a context.
struct Loaded {
    context: Arc<CudaContext>,
    name: &'static str,
    module: Arc<CudaModule>,
}

thread_local! {
    /// A rank's thread drives one context: its modules, loaded at first use. A kernel holds
    /// its module, so none is unloaded while a kernel of it is held.
    static LOADED: RefCell<Vec<Loaded>> = const { RefCell::new(Vec::new()) };
}

impl Module {
    /// The kernel `name` of this module on `dev`'s context, the module loaded on first use.
    pub(crate) fn kernel(&self, dev: &CudaDevice, name: &str) -> Result<Kernel> {
        let stream = dev.cuda_stream();
        let context = stream.context();
        let module = LOADED.with_borrow_mut(|loaded| {
            if let Some(l) = loaded
                .iter()
                .find(|l| l.name == self.name && Arc::ptr_eq(&l.context, context))
            {
                return Ok(l.module.clone());
            }
            let module = context
                .load_module(Ptx::from_binary(self.image.to_vec()))
                .map_err(|e| {
                    let capability = context.compute_capability().ok();
                    let gpu = match capability {
                        Some((major, minor)) => format!("compute capability {major}.{minor}"),
                        None => "this GPU".into(),
                    };
                    let fix = match capability {
                        Some(c) if c < crate::MIN_COMPUTE_CAPABILITY => {
                            let (major, minor) = crate::MIN_COMPUTE_CAPABILITY;
                            format!(
                                "tpinfer's kernels need compute capability {major}.{minor} or newer (Ampere, Ada, \
                                 Hopper); run on CPU ranks (--device cpu) or on a newer GPU"
                            )
                        }
                        _ => "Rebuild with CUDA_COMPUTE_CAP set to this GPU's compute capability".into(),
                    };
                    candle_core::Error::Msg(format!(
                        "loading tpinfer's {} kernels for {gpu}: {e}; this build holds {TARGETS}. {fix}",
                        self.name
                    ))
                })?;
            loaded.push(Loaded {
                context: context.clone(),
                name: self.name,
                module: module.clone(),
            });
            Ok::<_, candle_core::Error>(module)
        })?;
        let func = module.load_function(name).w()?;
        Ok(Kernel { func, stream })
    }
}
