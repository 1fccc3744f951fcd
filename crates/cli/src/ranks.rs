//! Where the ranks run: the options every command that starts them shares.

use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use tpinfer_engine::{DeviceKind, Engine, EngineBuilder, EngineError, LoadProgress, RuntimeError, WeightFormat};

use crate::progress::LoadBar;

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

/// A tensor-parallel width as `--tp` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    /// The smallest width whose plan fits the GPUs' budget (1 on CPU ranks).
    Auto,
    Ranks(usize),
}

fn parse_width(text: &str) -> Result<Width, String> {
    match text {
        "auto" => Ok(Width::Auto),
        _ => match text.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Width::Ranks(n)),
            _ => Err(format!(
                "`{text}` is not a width: give `auto` or a number of ranks, at least 1"
            )),
        },
    }
}

/// The ranks' width, devices, dtype and memory budget.
#[derive(clap::Args)]
pub struct RankArgs {
    /// Tensor-parallel width: the number of ranks (vLLM's --tensor-parallel-size), or `auto`:
    /// the smallest number of the GPUs this run may use whose plan fits their memory (1 on
    /// CPU ranks). The chosen width and why are printed.
    #[arg(long, alias = "tensor-parallel-size", default_value = "auto", value_parser = parse_width)]
    pub tp: Width,
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
    #[command(flatten)]
    pub weights: WeightArgs,
}

/// The form the ranks hold the linear weights in.
#[derive(clap::Args)]
pub struct WeightArgs {
    /// Expand quantized weights (GGUF Q4_0 to Q6_K, FP8 checkpoints) to the compute dtype
    /// at load. By default they stay as stored: device memory follows the file.
    #[arg(long, conflicts_with = "quantize")]
    pub dequantize: bool,
    /// Quantize every linear weight at load, per output row (the embedding and LM head stay
    /// in the compute dtype; see `--quantize-lm-head`). FP8 halves a bf16 model's weights and
    /// runs as FP8 on GPUs of compute capability 8.9 or later; CPU ranks and older GPUs expand
    /// each product's weight (memory saved, not time).
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeArg>,
    /// With `--quantize fp8`, the LM head in FP8 too (a language model with its own head):
    /// half its bytes, which a decode step reads once per token, for logits a little further
    /// from the unquantized model's (benches/RESULTS.md).
    #[arg(long, requires = "quantize")]
    pub quantize_lm_head: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum QuantizeArg {
    /// FP8 E4M3 with one scale per output row.
    Fp8,
}

impl WeightArgs {
    pub fn format(&self) -> WeightFormat {
        match (self.dequantize, self.quantize) {
            (true, _) => WeightFormat::Dequantized,
            (false, Some(QuantizeArg::Fp8)) if self.quantize_lm_head => WeightFormat::Fp8WithLmHead,
            (false, Some(QuantizeArg::Fp8)) => WeightFormat::Fp8,
            (false, None) => WeightFormat::AsStored,
        }
    }
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
    /// Whether the ranks run on GPUs.
    fn on_gpus(&self) -> bool {
        match self.device {
            DeviceArg::Auto => cfg!(feature = "nccl") && DeviceKind::visible_gpus() > 0,
            DeviceArg::Cpu => false,
            DeviceArg::Cuda => true,
        }
    }

    /// The widths to try, smallest first: the one `--tp` gives, or with `auto` every width up
    /// to the GPUs the run may use (`--gpus`, or every visible one).
    fn widths(&self, gpus: bool) -> Vec<usize> {
        match (self.tp, gpus) {
            (Width::Ranks(n), _) => vec![n],
            (Width::Auto, false) => vec![1],
            (Width::Auto, true) => {
                let usable = self.gpus.as_ref().map_or_else(DeviceKind::visible_gpus, Vec::len);
                (1..=usable.max(1)).collect()
            }
        }
    }

    /// A builder for `model` on these ranks, with the environment's switches, and the widths
    /// to start it at.
    pub fn ranks(&self, model: &Path) -> Result<Ranks> {
        let gpus = self.on_gpus();
        let device = match gpus {
            true => DeviceKind::Cuda {
                gpus: self.gpus.clone(),
            },
            false => DeviceKind::Cpu,
        };
        tracing::info!(?device, "the ranks' devices");
        let widths = self.widths(gpus);
        let mut builder = crate::env::switches(Engine::builder(model)).device(device);
        if let Some(dtype) = self.dtype {
            builder = builder.dtype(dtype.dtype());
        }
        if let Some(bytes) = self.gpu_mem {
            builder = builder.gpu_mem(bytes);
        }
        builder = builder.weight_format(self.weights.format());
        if let Some(share) = self.gpu_memory_utilization {
            if !gpus {
                bail!(
                    "--gpu-memory-utilization is a share of each GPU's memory, and these are CPU ranks: give \
                     --gpu-mem BYTES, or --device cuda"
                );
            }
            builder = builder.gpu_memory_utilization(share);
        }
        Ok(Ranks {
            builder,
            widths,
            auto: self.tp == Width::Auto,
        })
    }
}

/// A builder and the tensor-parallel widths to start it at.
pub struct Ranks {
    pub builder: EngineBuilder,
    /// Smallest first; more than one only for `--tp auto` on GPUs.
    widths: Vec<usize>,
    auto: bool,
}

impl Ranks {
    /// `start` at the first width whose plan fits the budget: each width over budget is
    /// refused by the plan before any rank loads a weight or joins NCCL, and the next is
    /// tried; the last one's refusal is the error. With `--tp auto` the width chosen, and
    /// why, is printed (logged where only one width was possible). A bar shows the weight
    /// bytes loaded meanwhile.
    pub fn start<T>(self, mut start: impl FnMut(EngineBuilder) -> Result<T, EngineError>) -> Result<T> {
        let progress = LoadProgress::new();
        let builder = self.builder.load_progress(progress.clone());
        let _bar = LoadBar::new(progress);
        let mut refused: Option<(usize, String)> = None;
        for (i, &tp) in self.widths.iter().enumerate() {
            match start(builder.clone().tp(tp)) {
                Ok(started) => {
                    if self.auto {
                        let why = match &refused {
                            None => "the smallest width, and its plan fits".to_string(),
                            Some((narrower, refusal)) => format!("TP {narrower} does not fit: {refusal}"),
                        };
                        let chosen = format!("--tp auto: TP {tp} of {} usable ranks ({why})", self.widths.len());
                        // Printed where there was a choice; a lone width is logged (-v), so
                        // that a later error stays the run's one line.
                        match self.widths.len() {
                            1 => tracing::info!("{chosen}"),
                            _ => eprintln!("{chosen}"),
                        }
                    }
                    return Ok(started);
                }
                Err(EngineError::Runtime(RuntimeError::OverBudget(refusal))) if i + 1 < self.widths.len() => {
                    tracing::info!(tp, %refusal, "--tp auto: over budget, trying a wider one");
                    refused = Some((tp, refusal));
                }
                Err(e) => return Err(e.into()),
            }
        }
        bail!("--tp: no width to start at")
    }
}

/// The chat template `--chat-template` gives: the file it names, or the template itself
/// (Jinja's `{% %}` or `{{ }}` in it); a value that is neither is refused, not used as a
/// template that prints itself.
pub fn chat_template(value: &str) -> Result<String> {
    let path = Path::new(value);
    if path.is_file() {
        return std::fs::read_to_string(path)
            .with_context(|| format!("--chat-template {value}: the file cannot be read as text"));
    }
    if !(value.contains("{%") || value.contains("{{")) {
        bail!(
            "--chat-template {value}: no such file, nor a Jinja template ({{% %}} or {{{{ }}}}); give a template \
             file or the template itself"
        );
    }
    Ok(value.to_string())
}

#[cfg(test)]
mod tests {
    use tpinfer_engine::{Engine, EngineError, RuntimeError};

    use super::{parse_width, Ranks, Width};

    fn ranks(widths: Vec<usize>) -> Ranks {
        Ranks {
            builder: Engine::builder("model"),
            widths,
            auto: true,
        }
    }

    fn over_budget(tp: usize) -> EngineError {
        EngineError::Runtime(RuntimeError::OverBudget(format!("TP {tp} needs more")))
    }

    /// `auto` starts at the first width whose plan fits, trying each narrower one first.
    #[test]
    fn auto_takes_the_smallest_width_that_fits() {
        let mut tried = Vec::new();
        let tp = ranks(vec![1, 2, 3, 4])
            .start(|b| {
                let tp = b.width();
                tried.push(tp);
                match tp {
                    3.. => Ok(tp),
                    _ => Err(over_budget(tp)),
                }
            })
            .expect("starts");
        assert_eq!((tp, tried), (3, vec![1, 2, 3]));
    }

    /// Where no width fits, the widest one's refusal is the error; other errors end the
    /// search at once.
    #[test]
    fn auto_reports_the_widest_refusal_and_stops_at_other_errors() {
        let err = ranks(vec![1, 2]).start(|b| -> Result<(), _> { Err(over_budget(b.width())) });
        let message = format!("{:#}", err.expect_err("nothing fits"));
        assert!(message.contains("TP 2 needs more"), "{message}");
        let mut calls = 0;
        let err = ranks(vec![1, 2]).start(|_| -> Result<(), _> {
            calls += 1;
            Err(EngineError::InvalidRequest("bad prompt".into()))
        });
        assert!(format!("{:#}", err.expect_err("fails")).contains("bad prompt"));
        assert_eq!(calls, 1);
    }

    #[test]
    fn a_width_is_auto_or_a_positive_number() {
        assert_eq!(parse_width("auto"), Ok(Width::Auto));
        assert_eq!(parse_width("3"), Ok(Width::Ranks(3)));
        for bad in ["0", "-1", "two", ""] {
            let err = parse_width(bad).expect_err(bad);
            assert!(err.contains("auto"), "{err}");
        }
    }
}
