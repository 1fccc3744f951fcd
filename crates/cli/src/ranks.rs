//! Where the ranks run: the options every command that starts them shares.

use std::path::Path;

use anyhow::{bail, Result};
use clap::ValueEnum;
use tpinfer_engine::{DeviceKind, Engine, EngineBuilder};

/// Where the ranks run.
#[derive(Clone, Copy, ValueEnum)]
pub enum DeviceArg {
    /// One rank per GPU where this build has CUDA and NCCL and a GPU is visible; else CPU
    /// threads.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

impl DtypeArg {
    pub fn dtype(self) -> tpinfer_engine::DType {
        match self {
            Self::F32 => tpinfer_engine::DType::F32,
            Self::F16 => tpinfer_engine::DType::F16,
            Self::Bf16 => tpinfer_engine::DType::BF16,
        }
    }
}

/// The ranks' width, devices, dtype and memory budget.
#[derive(clap::Args)]
pub struct RankArgs {
    /// Tensor-parallel width: the number of ranks (vLLM's --tensor-parallel-size).
    #[arg(long, alias = "tensor-parallel-size", default_value_t = 1)]
    pub tp: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// GPUs to use with --device cuda, e.g. 0,2 (default: 0..tp, as CUDA_VISIBLE_DEVICES maps them).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Option<Vec<usize>>,
    /// Compute dtype (default: f32 on CPU, the checkpoint's dtype on GPUs).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Device memory each rank may use, e.g. 24GiB (default on GPUs: the free memory less 2%).
    /// The placement is planned first and refused, with what would fit, if over it.
    #[arg(long, value_parser = tpinfer_plan::parse_bytes)]
    pub gpu_mem: Option<u64>,
    /// The share of each GPU's memory the ranks may use, above 0 and at most 1, as vLLM's
    /// flag (default: the free memory less 2%); also at most --gpu-mem where both are given.
    #[arg(long, value_parser = parse_fraction)]
    pub gpu_memory_utilization: Option<f64>,
}

/// A share of memory: a number above 0 and at most 1.
fn parse_fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!(
            "`{text}` is not a share of memory: give a number above 0 and at most 1, e.g. 0.9"
        )),
    }
}

impl RankArgs {
    /// A builder for `model` on these ranks, with the environment's switches.
    pub fn builder(&self, model: &Path) -> Result<EngineBuilder> {
        if self.tp == 0 {
            bail!("--tp must be at least 1");
        }
        let gpus = match self.device {
            DeviceArg::Auto => cfg!(feature = "nccl") && DeviceKind::visible_gpus() > 0,
            DeviceArg::Cpu => false,
            DeviceArg::Cuda => true,
        };
        let device = match gpus {
            true => DeviceKind::Cuda {
                gpus: self.gpus.clone(),
            },
            false => DeviceKind::Cpu,
        };
        tracing::info!(?device, "the ranks' devices");
        let mut builder = crate::env::switches(Engine::builder(model)).tp(self.tp).device(device);
        if let Some(dtype) = self.dtype {
            builder = builder.dtype(dtype.dtype());
        }
        if let Some(bytes) = self.gpu_mem {
            builder = builder.gpu_mem(bytes);
        }
        if let Some(share) = self.gpu_memory_utilization {
            if !gpus {
                bail!(
                    "--gpu-memory-utilization is a share of each GPU's memory, and these are CPU ranks: give \
                     --gpu-mem BYTES, or --device cuda"
                );
            }
            builder = builder.gpu_memory_utilization(share);
        }
        Ok(builder)
    }
}
