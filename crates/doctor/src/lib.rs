//! `tpinfer doctor`: what the GPUs, drivers, libraries and links of this machine are, whether
//! NCCL really initializes and all-reduces over them (in child processes, so that a hang is
//! killed at a deadline and reported), and what to change when something is wrong.
//!
//! The probes that need CUDA or NCCL are behind the `cuda` / `nccl` features; the report, its
//! verdict, the topology parser and the bounded child runs are plain Rust and tested on CPU.

mod bounded;
mod diagnose;
#[cfg(feature = "cuda")]
mod probe;
mod report;
#[cfg(feature = "nccl")]
mod smoke;
mod topology;
mod verdict;

pub use bounded::{run_bounded, ChildOutcome};
pub use diagnose::{diagnose, smoke_outcome, DoctorOptions, SmokeChild};
#[cfg(feature = "cuda")]
pub use probe::{inventory, loaded_libraries};
pub use report::{
    AllReduceRow, Finding, GpuInfo, Inventory, PlanCheck, Report, Severity, SmokeOutcome, SmokeRun, SMOKE_JOINED,
    SMOKE_SIZES,
};
#[cfg(feature = "nccl")]
pub use smoke::run_smoke;
pub use topology::{parse_topology, Link};
pub use verdict::{nccl_debug_lines, verdict};

/// Environment variables that change how NCCL and CUDA behave, as set now.
pub fn relevant_env() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NCCL_") || k == "CUDA_VISIBLE_DEVICES" || k == "CUDA_DEVICE_ORDER")
        .collect();
    vars.sort();
    vars
}
