//! The ranks of a group: how many, and the device of each.

use candle_core::Device;
use tpinfer_plan::DeviceProfile;

use crate::RuntimeError;

/// Where the ranks run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// Ranks are threads on the CPU, joined by in-process collectives.
    #[default]
    Cpu,
    /// One rank per GPU: the listed CUDA ordinals, or 0..tp.
    Cuda { gpus: Option<Vec<usize>> },
}

impl DeviceKind {
    /// The GPUs this process sees (as `CUDA_VISIBLE_DEVICES` maps them): 0 in a build without
    /// CUDA, or where the driver cannot be loaded.
    pub fn visible_gpus() -> usize {
        #[cfg(feature = "cuda")]
        {
            candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
        }
        #[cfg(not(feature = "cuda"))]
        {
            0
        }
    }
}

/// The TP width and each rank's device, validated once when made: at least one rank, one GPU
/// per rank, every GPU opened.
#[derive(Debug, Clone)]
pub struct Topology {
    devices: Vec<Device>,
}

impl Topology {
    /// `tp` ranks on `kind`.
    pub fn new(tp: usize, kind: &DeviceKind) -> Result<Self, RuntimeError> {
        if tp == 0 {
            return Err(RuntimeError::NoRanks);
        }
        let devices = match kind {
            DeviceKind::Cpu => vec![Device::Cpu; tp],
            DeviceKind::Cuda { gpus } => cuda_devices(gpus.as_deref(), tp)?,
        };
        Ok(Self { devices })
    }

    /// The TP width: the number of ranks.
    pub fn width(&self) -> usize {
        self.devices.len()
    }

    /// Each rank's device, in rank order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Whether every rank is a CPU thread.
    pub fn is_cpu(&self) -> bool {
        self.devices.iter().all(Device::is_cpu)
    }

    /// What the ranks' devices take beyond the models' tensors, for the plan.
    pub fn profile(&self) -> DeviceProfile {
        match self.is_cpu() {
            true => DeviceProfile::cpu(),
            false => DeviceProfile::cuda(),
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices(gpus: Option<&[usize]>, tp: usize) -> Result<Vec<Device>, RuntimeError> {
    let ordinals: Vec<usize> = gpus.map_or_else(|| (0..tp).collect(), <[usize]>::to_vec);
    if ordinals.len() != tp {
        return Err(RuntimeError::GpuCount {
            given: ordinals.len(),
            tp,
        });
    }
    ordinals
        .iter()
        .enumerate()
        .map(|(rank, &gpu)| {
            Device::new_cuda(gpu).map_err(|e| RuntimeError::Device {
                rank,
                detail: format!("cannot open CUDA device {gpu}: {e}"),
            })
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_gpus: Option<&[usize]>, _tp: usize) -> Result<Vec<Device>, RuntimeError> {
    Err(RuntimeError::CudaNotBuilt)
}
