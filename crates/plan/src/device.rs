use serde::Serialize;

/// What a device takes beyond the model's own tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeviceProfile {
    pub name: &'static str,
    /// The CUDA context: code modules, stacks, driver structures. What a forward's libraries
    /// and kernels add at its first request is the family's ([`crate::Footprint::libraries`]).
    pub context_reserve: u64,
    /// NCCL's buffers for one communicator (TP > 1 only).
    pub comm_buffers: u64,
    /// Whether tensors live in a stream-ordered pool (CUDA's), which holds freed blocks that
    /// later allocations split: the plan then counts the model's pool slack.
    pub pooled: bool,
}

const MIB: u64 = 1 << 20;

impl DeviceProfile {
    /// A CUDA GPU, with the figures measured on the H200 test host (driver 580, CUDA 13.0,
    /// NCCL over NVLink between two GPUs; benches/RESULTS.md): device memory in use outside
    /// the tensor pool after creating the context (565 MiB) and NCCL's buffers for a 2-rank
    /// communicator (774 MiB, half of it allocated at the first collectives). Other GPUs and
    /// drivers differ by tens of MiB; NCCL over PCIe without P2P uses less.
    pub fn cuda() -> Self {
        Self {
            name: "cuda",
            context_reserve: 565 * MIB,
            comm_buffers: 774 * MIB,
            pooled: true,
        }
    }

    /// CPU ranks: host memory, no context or library reserves.
    pub fn cpu() -> Self {
        Self {
            name: "cpu",
            context_reserve: 0,
            comm_buffers: 0,
            pooled: false,
        }
    }

    /// Whether ranks run on CUDA GPUs (which decides the kernels a forward uses).
    pub fn is_cuda(&self) -> bool {
        self.name == "cuda"
    }

    /// The kind of device, as the families' footprints take it.
    pub fn accelerator(&self) -> crate::Accelerator {
        match self.is_cuda() {
            true => crate::Accelerator::Cuda,
            false => crate::Accelerator::Cpu,
        }
    }

    /// NCCL's buffers for a rank of a `tp`-wide group.
    pub fn comm(&self, tp: usize) -> u64 {
        if tp > 1 {
            self.comm_buffers
        } else {
            0
        }
    }
}
