//! The machine's GPUs and CUDA stack, through the driver API.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext};

use crate::{GpuInfo, Inventory};

/// Every visible GPU, the driver's CUDA version, NCCL's version, peer access between each
/// pair, and the libraries loaded to find them. Creates a context on each GPU.
pub fn inventory() -> Inventory {
    let mut inv = Inventory {
        built_for_cuda: Some(sys::CUDA_VERSION),
        ..Inventory::default()
    };
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => {
            inv.driver_error = Some(format!("{e:?}"));
            inv.libraries = loaded_libraries();
            return inv;
        }
    };
    let mut version = 0;
    // SAFETY: a valid out-pointer; the driver was initialized by `device_count`.
    if unsafe { sys::cuDriverGetVersion(&mut version) }.result().is_ok() {
        inv.driver_cuda = Some(version);
    }
    #[cfg(feature = "nccl")]
    {
        inv.nccl_version = candle_core::cuda_backend::cudarc::nccl::result::get_nccl_version().ok();
    }
    inv.cudnn_version = tpinfer_kernels::cudnn_version();
    let mut devices = Vec::new();
    for ordinal in 0..count {
        match gpu(ordinal) {
            Ok((info, device)) => {
                inv.gpus.push(info);
                devices.push(device);
            }
            Err(e) => {
                inv.driver_error = Some(format!("GPU {ordinal}: {e}"));
                break;
            }
        }
    }
    inv.can_access_peer = devices
        .iter()
        .map(|&a| {
            devices
                .iter()
                .map(|&b| {
                    if a == b {
                        return true;
                    }
                    let mut can = 0;
                    // SAFETY: valid device handles from live contexts and a valid out-pointer.
                    let ok = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }.result().is_ok();
                    ok && can == 1
                })
                .collect()
        })
        .collect();
    inv.libraries = loaded_libraries();
    inv
}

fn gpu(ordinal: usize) -> Result<(GpuInfo, sys::CUdevice), String> {
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("{e:?}"))?;
    let attr = |a| ctx.attribute(a).map_err(|e| format!("{e:?}"));
    use sys::CUdevice_attribute::*;
    let cc = (
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let (free, total) = ctx.mem_get_info().map_err(|e| format!("{e:?}"))?;
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer holds `len` bytes; the driver writes a NUL-terminated id into it.
    let pci_bus_id =
        match unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ctx.cu_device()) }.result() {
            // SAFETY: on success the buffer holds a NUL-terminated string.
            Ok(()) => unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
            Err(_) => String::new(),
        };
    let info = GpuInfo {
        ordinal,
        name: ctx.name().map_err(|e| format!("{e:?}"))?,
        compute_capability: cc,
        total_bytes: total as u64,
        free_bytes: free as u64,
        pci_bus_id,
    };
    let device = ctx.cu_device();
    // The context stays alive for the process: its device handle is used for the peer matrix.
    std::mem::forget(ctx);
    Ok((info, device))
}

/// The CUDA and NCCL libraries this process has loaded, with their paths: which copy of
/// libcuda, libnccl or libcublas was picked up is the first question when versions disagree.
pub fn loaded_libraries() -> Vec<(String, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let wanted = [
        "libcuda.so",
        "libnccl",
        "libcublasLt",
        "libcublas.so",
        "libnvrtc",
        "libcurand",
        "libcudart",
        "libcudnn.so",
    ];
    let mut found: Vec<(String, String)> = Vec::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let file = path.rsplit('/').next().unwrap_or(path);
        if let Some(lib) = wanted.iter().find(|w| file.starts_with(*w)) {
            let lib = lib.trim_end_matches(".so").to_string();
            if !found.iter().any(|(_, p)| p == path) {
                found.push((lib, path.to_string()));
            }
        }
    }
    found
}
