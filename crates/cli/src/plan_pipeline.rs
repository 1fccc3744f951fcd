//! `tpinfer plan` of a Wan pipeline directory: the text encoder and the DiT held on the same
//! ranks, each rank's bytes per stage and together, against the same pipeline under FSDP.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tpinfer_engine::DType;
use tpinfer_plan::{held_together, mib, DeviceProfile, Placement, Plan, RankPlan, ShardedModel};

/// Wan's prompts, as the encoder is planned and run.
const TEXT_TOKENS: usize = 512;

/// A pipeline's two models, opened for planning.
struct Models {
    encoder: Arc<dyn ShardedModel>,
    dit: Arc<dyn ShardedModel>,
}

/// The encoder's and the DiT's plans at one width.
struct Stages {
    encoder: Plan,
    dit: Plan,
}

impl Models {
    fn open(dir: &Path) -> Result<Self> {
        let pipeline = tpinfer_engine::WanPipelineDir::open(dir)?;
        let open = |path: &Path| -> Result<Arc<dyn ShardedModel>> {
            let name = path
                .to_str()
                .with_context(|| format!("{} is not UTF-8", path.display()))?;
            Ok(tpinfer_engine::registry::open(name)?.1)
        };
        Ok(Self {
            encoder: open(&pipeline.text_encoder)?,
            dit: open(&pipeline.transformer)?,
        })
    }

    fn stages(&self, tp: usize, dtype: DType, video: Placement, device: DeviceProfile) -> Result<Stages> {
        let text = Placement::Llm {
            max_context: TEXT_TOKENS,
            batch: 1,
        };
        Ok(Stages {
            encoder: Plan::new(&*self.encoder, tp, dtype, text, device)?,
            dit: Plan::new(&*self.dit, tp, dtype, video, device)?,
        })
    }
}

impl Stages {
    /// Each rank's bytes with both stages resident.
    fn rank_totals(&self) -> Vec<u64> {
        self.encoder
            .ranks
            .iter()
            .zip(&self.dit.ranks)
            .map(|(e, d)| held_together([e, d]))
            .collect()
    }

    fn peak(&self) -> (usize, u64) {
        self.rank_totals()
            .into_iter()
            .enumerate()
            .max_by_key(|&(rank, total)| (total, std::cmp::Reverse(rank)))
            .unwrap_or((0, 0))
    }

    /// One FSDP GPU for the pipeline: both stages' even shards resident, and at each stage
    /// its unshard buffer and full activations; the larger stage decides.
    fn fsdp_total(&self) -> u64 {
        let (e, d) = (&self.encoder.fsdp, &self.dit.fsdp);
        let resident = |g: &RankPlan| g.weights + g.buffers + g.cache;
        let stage = |unshard: u64, g: &RankPlan| unshard + g.activations + g.allocator_slack;
        resident(&e.gpu)
            + resident(&d.gpu)
            + stage(e.unshard_buffer, &e.gpu).max(stage(d.unshard_buffer, &d.gpu))
            + (d.gpu.workspace + d.gpu.context).max(e.gpu.workspace + e.gpu.context)
    }
}

/// Prints the pipeline's plan at `tp` (or the smallest width that fits, without one); exits
/// 2 when nothing fits.
pub fn plan(
    dir: &Path,
    tp: Option<usize>,
    dtype: DType,
    video: Placement,
    device: DeviceProfile,
    budget: u64,
    json: bool,
) -> Result<ExitCode> {
    let models = Models::open(dir)?;
    let widest = models.encoder.max_tp().min(models.dit.max_tp());
    let searched = tp.is_none();
    let tp = match tp {
        Some(0) => bail!("--tp must be at least 1"),
        Some(tp) => tp,
        None => (1..=widest)
            .find(|&tp| {
                models
                    .stages(tp, dtype, video, device)
                    .is_ok_and(|s| s.peak().1 <= budget)
            })
            .unwrap_or(widest),
    };
    let stages = models.stages(tp, dtype, video, device)?;
    let (peak_rank, peak) = stages.peak();
    let fits = peak <= budget;
    if json {
        let report = serde_json::json!({
            "pipeline": dir.display().to_string(),
            "tp": tp,
            "budget": budget,
            "stages": {"text_encoder": stages.encoder, "transformer": stages.dit},
            "rank_totals": stages.rank_totals(),
            "peak_rank": peak_rank,
            "peak": peak,
            "fits": fits,
            "encoder_resident": true,
            "fsdp_total": stages.fsdp_total(),
            "fsdp_fits": stages.fsdp_total() <= budget,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&stages, dir, tp, budget);
        if searched && fits {
            println!("\nThe smallest width that fits: --tp {tp}");
        }
    }
    Ok(match fits {
        true => ExitCode::SUCCESS,
        false => {
            eprintln!(
                "does not fit: rank {peak_rank} needs {:.1} MiB of the {:.1} MiB budget with the text encoder and the DiT \
                 held together; try a wider --tp, fewer --frames or a smaller --size",
                mib(peak),
                mib(budget)
            );
            ExitCode::from(2)
        }
    })
}

fn print(stages: &Stages, dir: &Path, tp: usize, budget: u64) {
    let (e, d) = (&stages.encoder, &stages.dit);
    println!(
        "{}, {}, TP {tp}: umT5 on {} tokens, then the DiT on {} video tokens; budget {:.0} MiB per GPU ({} profile)\n",
        dir.display(),
        d.dtype,
        e.tokens_per_forward,
        d.tokens_per_forward,
        mib(budget),
        d.device.name
    );
    println!(
        "| rank | encoder weights | encoder activations | DiT weights | DiT latents + buffers | DiT activations | workspace + context | held together | headroom |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for ((re, rd), total) in e.ranks.iter().zip(&d.ranks).zip(stages.rank_totals()) {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            rd.rank,
            mib(re.weights),
            mib(re.activations + re.allocator_slack),
            mib(rd.weights),
            mib(rd.cache + rd.buffers),
            mib(rd.activations + rd.allocator_slack),
            mib(rd.workspace + rd.context),
            mib(total),
            mib(budget) as f64 - mib(total),
        );
    }
    println!(
        "\n(MiB per rank; activations include the allocator's slack.) Both stages stay resident: the encoder's shard \
         is kept for the next prompt, and the stages run one at a time, so only the larger one's activations count.\n"
    );
    let fsdp = stages.fsdp_total();
    println!(
        "FSDP on {tp} GPUs, for comparison: encoder shard {:.1} + DiT shard {:.1} + the larger stage's unshard buffer \
         and full activations ({} {:.1} or {} {:.1}) = {:.1} MiB per GPU: {}",
        mib(e.fsdp.gpu.weights),
        mib(d.fsdp.gpu.weights),
        e.fsdp.largest_unit,
        mib(e.fsdp.unshard_buffer),
        d.fsdp.largest_unit,
        mib(d.fsdp.unshard_buffer),
        mib(fsdp),
        match fsdp <= budget {
            true => "fits",
            false => "does not fit",
        }
    );
}
