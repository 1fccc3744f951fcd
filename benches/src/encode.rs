//! `tpinfer-bench encode`: the umT5 text encoder on the rank group at each TP width: time per
//! prompt, device memory against the plan, and the states as safetensors for the reference
//! (`scripts/reference/reference_umt5.py compare`) to judge.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use tpinfer_family::Family;
use tpinfer_plan::Placement;
use tpinfer_runtime::{GroupOptions, Launch, RuntimeError, Topology};
use tpinfer_umt5::Umt5Model;

#[derive(Args)]
pub struct EncodeArgs {
    /// A umT5 text encoder directory (transformers' `UMT5EncoderModel`).
    #[arg(long)]
    model: PathBuf,
    /// safetensors with `ids` [tokens] (integers), as `reference_umt5.py ids` writes.
    #[arg(long)]
    ids: PathBuf,
    #[arg(long)]
    cuda: bool,
    #[arg(long, value_enum)]
    dtype: Option<crate::DtypeArg>,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    tp: Vec<usize>,
    /// Timed encodes per width, after one warm-up.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Writes `{out}_tp{N}.safetensors` (tensor `states`, f32) for each width.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn encode(args: EncodeArgs) -> Result<()> {
    let ids = read_ids(&args.ids)?;
    let dtype = crate::stage_dtype(args.dtype, args.cuda);
    println!(
        "| TP | tokens | dtype | first encode, ms | ms per prompt (median of {}) | peak MiB measured / planned, fullest rank |",
        args.repeats
    );
    println!("|---:|---:|---|---:|---:|---|");
    for &tp in &args.tp {
        let model = Umt5Model::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
        let kind = crate::device_kind(args.cuda);
        let options = GroupOptions {
            comm: crate::comm_options(),
            ..GroupOptions::default()
        };
        let mut launch = Launch::new(Topology::new(tp, &kind)?, options);
        let placement = Placement::llm(ids.len(), 1);
        let handle = launch.add(Arc::new(model), dtype, placement)?;
        let group = launch.start()?;
        let (prompt, repeats) = (ids.clone(), args.repeats);
        let mut ranks = group.run(move |rank| -> Result<(Tensor, f64, f64), RuntimeError> {
            let r = rank.env.rank;
            let encoder = rank.models.get_mut(&handle)?;
            crate::timed_runs(&rank.env.device, r, repeats, || {
                encoder.encode(&prompt).map_err(|e| RuntimeError::of_rank(r, e))
            })
        })?;
        let (states, first, median) = ranks.swap_remove(0);
        let plan = &group.plans()[handle.index()];
        let memory = crate::memory_cell(&group.device_memory(), plan);
        println!(
            "| {tp} | {} | {dtype:?} | {first:.2} | {median:.2} | {memory} |",
            ids.len()
        );
        crate::print_memory_parts(&group.device_memory(), plan);
        if let Some(out) = &args.out {
            let path = PathBuf::from(format!("{}_tp{tp}.safetensors", out.display()));
            states
                .save_safetensors("states", &path)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The token ids of a safetensors file's `ids` tensor, any integer dtype.
fn read_ids(path: &std::path::Path) -> Result<Vec<u32>> {
    let tensors =
        candle_core::safetensors::load(path, &Device::Cpu).with_context(|| format!("reading {}", path.display()))?;
    let ids = tensors
        .get("ids")
        .with_context(|| format!("{} has no tensor `ids`", path.display()))?;
    let ids: Vec<i64> = ids.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
    ids.into_iter()
        .map(|id| u32::try_from(id).with_context(|| format!("{}: token id {id} is not a u32", path.display())))
        .collect()
}
