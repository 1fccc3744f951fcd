use serde::Serialize;

/// What a device takes beyond the model's own tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeviceProfile {
    pub name: &'static str,
    /// The CUDA context: code modules, stacks, driver structures.
    pub context_reserve: u64,
    /// cuBLAS's workspace for its handle on the rank's stream.
    pub blas_workspace: u64,
    /// NCCL's buffers for one communicator (TP > 1 only).
    pub comm_buffers: u64,
}

const MIB: u64 = 1 << 20;

impl DeviceProfile {
    /// A CUDA GPU. The context, cuBLAS and NCCL figures were measured on the H200 test host
    /// (CUDA 13.0 driver API, NCCL 2.27, two GPUs over NVLink; see benches/RESULTS.md); other
    /// GPUs and drivers differ by tens of MiB, which the engine's after-load check reports.
    pub fn cuda() -> Self {
        Self {
            name: "cuda",
            context_reserve: 512 * MIB,
            blas_workspace: 32 * MIB,
            comm_buffers: 256 * MIB,
        }
    }

    /// CPU ranks: host memory, no context or library reserves.
    pub fn cpu() -> Self {
        Self {
            name: "cpu",
            context_reserve: 0,
            blas_workspace: 0,
            comm_buffers: 0,
        }
    }

    /// The library workspace of a rank in a `tp`-wide group.
    pub fn workspace(&self, tp: usize) -> u64 {
        self.blas_workspace + if tp > 1 { self.comm_buffers } else { 0 }
    }
}
