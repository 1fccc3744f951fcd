use serde::{Deserialize, Serialize};

/// What `tpinfer doctor` found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub inventory: Inventory,
    /// `nvidia-smi topo -m`'s link between each pair of GPUs, if it ran.
    pub links: Option<Vec<Vec<String>>>,
    pub smoke: Vec<SmokeRun>,
    pub plan_check: Vec<PlanCheck>,
    pub env: Vec<(String, String)>,
    pub findings: Vec<Finding>,
}

/// The machine's GPUs and CUDA/NCCL stack.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Inventory {
    /// The CUDA version this binary's kernels were built for (e.g. 13000), `None` for a CPU build.
    pub built_for_cuda: Option<u32>,
    /// The newest CUDA version the installed driver supports (cuDriverGetVersion).
    pub driver_cuda: Option<i32>,
    pub nccl_version: Option<i32>,
    /// cuDNN's version where it is installed: the video VAE's convolutions run on it.
    #[serde(default)]
    pub cudnn_version: Option<usize>,
    /// Why the CUDA driver could not be used, if it could not.
    pub driver_error: Option<String>,
    pub gpus: Vec<GpuInfo>,
    /// `can_access_peer[i][j]`: cuDeviceCanAccessPeer (true on the diagonal).
    pub can_access_peer: Vec<Vec<bool>>,
    /// (library, path) for each CUDA/NCCL library this process loaded.
    pub libraries: Vec<(String, String)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub pci_bus_id: String,
}

impl GpuInfo {
    /// What this binary runs on the GPU, by its compute capability: the kernels at all (8.0
    /// or newer), FP8 weights on tensor cores or expanded, and which FP8 attention kernel.
    pub fn runs(&self) -> String {
        let capability = self.compute_capability;
        if capability < tpinfer_kernels::MIN_COMPUTE_CAPABILITY {
            let (major, minor) = tpinfer_kernels::MIN_COMPUTE_CAPABILITY;
            return format!("nothing: the kernels need compute capability {major}.{minor} or newer");
        }
        let weights = match tpinfer_kernels::fp8_tensor_cores(capability) {
            true => "FP8 weights on FP8 tensor cores",
            false => "FP8 weights expanded to bf16 (not faster)",
        };
        let attention = match tpinfer_kernels::fp8_attention_kernel(capability) {
            Some(tpinfer_kernels::Fp8AttentionKernel::Hopper) => "FP8 attention (wgmma)",
            Some(tpinfer_kernels::Fp8AttentionKernel::MmaSync) => "FP8 attention (mma.sync)",
            None => "no FP8 attention",
        };
        format!("bf16 and f16; {weights}; {attention}")
    }
}

/// One bounded NCCL init + all-reduce run over a set of GPUs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SmokeRun {
    pub gpus: Vec<usize>,
    /// Run with `NCCL_P2P_DISABLE=1`.
    pub p2p_disabled: bool,
    pub outcome: SmokeOutcome,
}

/// The line a smoke-test rank writes to stderr once it has joined the communicator: the doctor
/// names the ranks without it when a child hangs.
pub const SMOKE_JOINED: &str = "tpinfer-smoke: joined rank";

/// All-reduce message sizes the smoke test times, in bytes: decode-sized to bandwidth-sized.
pub const SMOKE_SIZES: &[usize] = &[8 << 10, 256 << 10, 8 << 20, 128 << 20];

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SmokeOutcome {
    Passed {
        init_ms: f64,
        /// The f32 all-reduce of ones summed to the number of ranks on every rank.
        sum_correct: bool,
        table: Vec<AllReduceRow>,
    },
    Failed {
        error: String,
        nccl_log: Vec<String>,
    },
    /// Killed at the deadline; `missing` ranks had not finished joining the communicator.
    Hung {
        seconds: f64,
        missing: Vec<usize>,
        stage: String,
        nccl_log: Vec<String>,
    },
}

/// Time per f32 all-reduce of `bytes` (median over repeats, after a warm-up), with NCCL's
/// algorithm bandwidth (bytes / time) and bus bandwidth (× 2(n − 1)/n).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllReduceRow {
    pub bytes: usize,
    pub micros: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
}

/// A placement's plan against one GPU's free memory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanCheck {
    pub rank: usize,
    pub gpu: usize,
    pub needed: u64,
    /// Free memory plus the CUDA context the plan counts (this process created one already).
    pub available: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Ok,
    Warning,
    Error,
}

/// One conclusion, with what to do about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub severity: Severity,
    pub title: String,
    pub advice: Vec<String>,
}

impl Report {
    /// The worst severity found.
    pub fn severity(&self) -> Severity {
        self.findings.iter().map(|f| f.severity).max().unwrap_or(Severity::Ok)
    }
}
