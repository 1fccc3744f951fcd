//! `tpinfer plan` of a Wan pipeline: its stages (the umT5 text encoder, S2V's wav2vec2 speech
//! encoder, the DiT, the VAE, and for S2V the VAE's encoder) held on the same ranks, each
//! rank's bytes per stage and together, against the same pipeline under FSDP. A diffusers
//! pipeline directory, the official Wan2.2-S2V checkpoint directory, or a preset
//! `<DiT preset>-pipeline` (umT5-XXL, for S2V wav2vec2-large-xlsr-53, that DiT and Wan2.1's
//! VAE).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tpinfer_engine::{DType, SelfAttention, WeightFormat};
use tpinfer_plan::{mib, DeviceProfile, Placement, Plan, RankPlan, Residency, ShardedModel};

/// Wan's prompts, as the encoder is planned and run.
const TEXT_TOKENS: usize = 512;

/// The name a preset pipeline ends with.
pub const PIPELINE_SUFFIX: &str = "-pipeline";

/// A stage's model, with its name in the table and in JSON.
struct Stage {
    label: &'static str,
    key: &'static str,
    model: Arc<dyn ShardedModel>,
}

/// A stage's plan at one width.
struct Planned {
    label: &'static str,
    key: &'static str,
    plan: Plan,
}

/// A pipeline's models, opened for planning, in the order they run, and its name.
pub struct Models(Vec<Stage>, String);

impl Models {
    /// The stages of `name_or_dir`, the text encoder's and the DiT's linear weights in
    /// `format` (the VAE's convolutions as stored), the DiT's self-attention at `attention`.
    pub fn open(name_or_dir: &str, format: WeightFormat, attention: SelfAttention) -> Result<Self> {
        let open_as = |name: &str, format| -> Result<Arc<dyn ShardedModel>> {
            Ok(tpinfer_engine::registry::open_as(name, format)?.1)
        };
        let open = |name: &str| open_as(name, format);
        let open_vae = |name: &str| open_as(name, WeightFormat::AsStored);
        let open_dit = |name: &str| -> Result<Arc<dyn ShardedModel>> {
            let dit = tpinfer_engine::registry::open_dit_as(name, format, attention);
            Ok(dit.with_context(|| format!("{name} is not a Wan DiT"))??)
        };
        let path = |p: &Path| -> Result<String> {
            p.to_str()
                .map(str::to_string)
                .with_context(|| format!("{} is not UTF-8", p.display()))
        };
        let dir = Path::new(name_or_dir);
        let (encoder, speech, dit, vae, vae_encode) = match name_or_dir.strip_suffix(PIPELINE_SUFFIX) {
            Some(dit) if !dir.exists() => {
                let speech = speech_encoder_of(dit).map(open_vae).transpose()?;
                // S2V encodes its reference image and motion frames with the VAE's encoder.
                let vae_encode = match speech.is_some() {
                    true => Some(tpinfer_engine::wan21_vae_encoder().context("the wan2.1-vae preset")?),
                    false => None,
                };
                (
                    open("umt5-xxl")?,
                    speech,
                    open_dit(dit)?,
                    Some(open_vae("wan2.1-vae")?),
                    vae_encode,
                )
            }
            _ if tpinfer_engine::S2vPipelineDir::detect(dir) => {
                let s2v = tpinfer_engine::S2vPipelineDir::open(dir)?.stage_models(format, attention)?;
                (
                    s2v.text_encoder,
                    Some(s2v.speech_encoder),
                    s2v.dit,
                    Some(s2v.vae),
                    Some(s2v.vae_encoder),
                )
            }
            _ => {
                let pipeline = tpinfer_engine::WanPipelineDir::open(dir)?;
                let vae = match &pipeline.vae {
                    Some(dir) => Some(open_vae(&path(dir)?)?),
                    None => None,
                };
                (
                    open(&path(&pipeline.text_encoder)?)?,
                    None,
                    open_dit(&path(&pipeline.transformer)?)?,
                    vae,
                    None,
                )
            }
        };
        let mut stages = vec![Stage {
            label: "umT5",
            key: "text_encoder",
            model: encoder,
        }];
        stages.extend(speech.map(|model| Stage {
            label: "wav2vec2",
            key: "speech_encoder",
            model,
        }));
        stages.push(Stage {
            label: "DiT",
            key: "transformer",
            model: dit,
        });
        stages.extend(vae.map(|model| Stage {
            label: "VAE",
            key: "vae",
            model,
        }));
        stages.extend(vae_encode.map(|model| Stage {
            label: "VAE encode",
            key: "vae_encode",
            model,
        }));
        Ok(Self(stages, name_or_dir.to_string()))
    }

    /// Whether the pipeline is speech-to-video's (it has a speech encoder), whose clips are 4k
    /// frames.
    pub fn is_s2v(&self) -> bool {
        self.0.iter().any(|s| s.key == "speech_encoder")
    }

    /// The stages that run before the DiT, once a run: the encoders.
    fn encoders(&self) -> usize {
        self.0.iter().filter(|s| s.key.ends_with("_encoder")).count()
    }

    fn widest(&self) -> usize {
        self.0.iter().map(|s| s.model.max_tp()).min().unwrap_or(1)
    }

    fn plan(&self, tp: usize, dtype: DType, video: Placement, device: DeviceProfile) -> Result<Stages> {
        let text = Placement::llm(TEXT_TOKENS, 1);
        let planned = self
            .0
            .iter()
            .map(|s| {
                let placement = match (s.key, video) {
                    ("text_encoder", _) => text,
                    // A minute of speech, as the encoder plans by itself.
                    ("speech_encoder", _) => s.model.default_placement(),
                    // S2V decodes each clip after its motion frames' latents.
                    (
                        "vae",
                        Placement::Dit {
                            frames,
                            width,
                            height,
                            cfg,
                        },
                    ) if self.encoders() > 1 => Placement::Dit {
                        frames: frames + tpinfer_engine::S2V_MOTION_FRAMES,
                        width,
                        height,
                        cfg,
                    },
                    // The encode of a clip's motion frames, the most it encodes at once.
                    ("vae_encode", Placement::Dit { width, height, .. }) => Placement::Dit {
                        frames: tpinfer_engine::S2V_MOTION_FRAMES,
                        width,
                        height,
                        cfg: false,
                    },
                    _ => video,
                };
                // S2V runs its speech encoder in f32 whatever the DiT's dtype.
                let stage_dtype = match s.key {
                    "speech_encoder" => s.model.default_dtype(),
                    _ => dtype,
                };
                Ok(Planned {
                    label: s.label,
                    key: s.key,
                    plan: Plan::new(&*s.model, tp, stage_dtype, placement, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Stages(planned, self.encoders()))
    }
}

/// The speech encoder of a DiT preset's pipeline: S2V's wav2vec2.
fn speech_encoder_of(dit: &str) -> Option<&'static str> {
    dit.to_ascii_lowercase()
        .starts_with("wan2.2-s2v")
        .then_some("wav2vec2-large-xlsr-53")
}

/// Every stage's plan at one width, and how many of them are encoders that run first.
struct Stages(Vec<Planned>, usize);

/// What a stage keeps for the whole run: weights, buffers, caches and its libraries' memory.
fn resident(r: &RankPlan) -> u64 {
    r.weights + r.buffers + r.cache + r.libraries
}

fn temporaries(r: &RankPlan) -> u64 {
    r.activations + r.allocator_slack
}

impl Stages {
    fn ranks(&self) -> usize {
        self.0.first().map_or(0, |s| s.plan.ranks.len())
    }

    /// Each rank's bytes with the stages held as `residency` says.
    fn rank_totals(&self, residency: Residency) -> Vec<u64> {
        (0..self.ranks())
            .map(|rank| {
                let ranks: Vec<_> = self.0.iter().map(|s| &s.plan.ranks[rank]).collect();
                residency.rank_bytes(&ranks)
            })
            .collect()
    }

    fn peak(&self, residency: Residency) -> (usize, u64) {
        self.rank_totals(residency)
            .into_iter()
            .enumerate()
            .max_by_key(|&(rank, total)| (total, std::cmp::Reverse(rank)))
            .unwrap_or((0, 0))
    }

    /// How the engine holds the stages within `budget`, as `Launch` decides it: every stage
    /// resident where that fits, else the encoders freed after encoding, before the DiT and
    /// the VAE load.
    fn residency(&self, budget: u64) -> Residency {
        match self.peak(Residency::Together).1 <= budget {
            true => Residency::Together,
            false => Residency::InTurns { first: self.1 },
        }
    }

    /// One FSDP GPU for the pipeline: every stage's even shard resident, and at each stage
    /// its unshard buffer and full activations; the largest stage decides.
    fn fsdp_total(&self) -> u64 {
        let stages = self.0.iter().map(|s| &s.plan.fsdp);
        let resident_all: u64 = stages.clone().map(|f| resident(&f.gpu)).sum();
        let stage_peak = stages
            .clone()
            .map(|f| f.unshard_buffer + temporaries(&f.gpu))
            .max()
            .unwrap_or(0);
        let reserves = stages.map(|f| f.gpu.comm + f.gpu.context).max().unwrap_or(0);
        resident_all + stage_peak + reserves
    }
}

/// Prints the pipeline's plan at `tp` (or the smallest width that fits, without one); exits
/// 2 when nothing fits.
pub fn plan(
    models: Models,
    tp: Option<usize>,
    dtype: DType,
    video: Placement,
    device: DeviceProfile,
    budget: u64,
    json: bool,
) -> Result<ExitCode> {
    let widest = models.widest();
    let searched = tp.is_none();
    let tp = match tp {
        Some(0) => bail!("--tp must be at least 1"),
        Some(tp) => tp,
        None => (1..=widest)
            .find(|&tp| {
                models
                    .plan(tp, dtype, video, device)
                    .is_ok_and(|s| s.peak(s.residency(budget)).1 <= budget)
            })
            .unwrap_or(widest),
    };
    let stages = models.plan(tp, dtype, video, device)?;
    let residency = stages.residency(budget);
    let (peak_rank, peak) = stages.peak(residency);
    let fits = peak <= budget;
    if json {
        let plans: serde_json::Map<String, serde_json::Value> = stages
            .0
            .iter()
            .map(|s| Ok((s.key.to_string(), serde_json::to_value(&s.plan)?)))
            .collect::<Result<_>>()?;
        let report = serde_json::json!({
            "pipeline": models.1,
            "tp": tp,
            "budget": budget,
            "stages": plans,
            "rank_totals": stages.rank_totals(residency),
            "peak_rank": peak_rank,
            "peak": peak,
            "fits": fits,
            "residency": residency,
            "encoder_freed_after_encoding": residency != Residency::Together,
            "fsdp_total": stages.fsdp_total(),
            "fsdp_fits": stages.fsdp_total() <= budget,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&stages, &models.1, tp, budget, residency);
        if searched && fits {
            println!("\nThe smallest width that fits: --tp {tp}");
        }
    }
    Ok(match fits {
        true => ExitCode::SUCCESS,
        false => {
            eprintln!(
                "does not fit: rank {peak_rank} needs {:.1} MiB of the {:.1} MiB budget even with the encoders \
                 freed after encoding; try a wider --tp, fewer --frames or a smaller --size",
                mib(peak),
                mib(budget)
            );
            ExitCode::from(2)
        }
    })
}

fn print(stages: &Stages, name: &str, tp: usize, budget: u64, residency: Residency) {
    let dit = stages.0.iter().find(|s| s.key == "transformer").map(|s| &s.plan);
    println!(
        "{name}, {}, TP {tp}: {}; budget {:.0} MiB per GPU ({} profile)\n",
        dit.map_or("", |p| p.dtype.as_str()),
        stages
            .0
            .iter()
            .map(|s| format!("{} ({} tokens a forward)", s.label, s.plan.tokens_per_forward))
            .collect::<Vec<_>>()
            .join(", then "),
        mib(budget),
        dit.map_or("", |p| p.device.name)
    );
    let mut header = vec!["rank".to_string()];
    for s in &stages.0 {
        header.push(format!("{} resident", s.label));
        header.push(format!("{} temporaries", s.label));
    }
    let held = match residency {
        Residency::Together => "held together",
        Residency::InTurns { .. } => "held at the peak",
    };
    header.extend(["NCCL + context", held, "headroom"].map(String::from));
    println!("| {} |", header.join(" | "));
    println!("|{}", "---:|".repeat(header.len()));
    for (rank, total) in stages.rank_totals(residency).into_iter().enumerate() {
        let mut row = vec![rank.to_string()];
        for s in &stages.0 {
            let r = &s.plan.ranks[rank];
            row.push(format!("{:.1}", mib(resident(r))));
            row.push(format!("{:.1}", mib(temporaries(r))));
        }
        let reserves = stages
            .0
            .iter()
            .map(|s| s.plan.ranks[rank].comm + s.plan.ranks[rank].context)
            .max();
        row.push(format!("{:.1}", mib(reserves.unwrap_or(0))));
        row.push(format!("{:.1}", mib(total)));
        row.push(format!("{:.1}", mib(budget) - mib(total)));
        println!("| {} |", row.join(" | "));
    }
    println!(
        "\n(MiB per rank; resident: weights, buffers, the DiT's latents and each stage's libraries; temporaries: one stage's activation peak \
         with the allocator's slack.) The stages run one at a time, so only the largest one's temporaries count. \
         The VAE holds its whole weights on every rank and decodes a band of each frame's rows."
    );
    match residency {
        Residency::Together => println!("Every stage stays resident, its weights loaded once for every run.\n"),
        Residency::InTurns { .. } => {
            let (rank, together) = stages.peak(Residency::Together);
            println!(
                "The encoders' shards are freed after encoding, before the DiT and the VAE load: with every stage \
                 held together rank {rank} would need {:.1} MiB. A run encodes its prompts first; an engine that \
                 serves several runs takes text states for the later ones.\n",
                mib(together)
            );
        }
    }
    let fsdp = stages.fsdp_total();
    println!(
        "FSDP on {tp} GPU{}, for comparison: {} + the largest stage's unshard buffer and full activations ({}) = \
         {:.1} MiB per GPU: {}",
        if tp == 1 { "" } else { "s" },
        stages
            .0
            .iter()
            .map(|s| format!("{} shard {:.1}", s.label, mib(resident(&s.plan.fsdp.gpu))))
            .collect::<Vec<_>>()
            .join(" + "),
        stages
            .0
            .iter()
            .map(|s| format!(
                "{} {:.1} + {:.1}",
                s.label,
                mib(s.plan.fsdp.unshard_buffer),
                mib(temporaries(&s.plan.fsdp.gpu))
            ))
            .collect::<Vec<_>>()
            .join(" or "),
        mib(fsdp),
        match fsdp <= budget {
            true => "fits",
            false => "does not fit",
        }
    );
}
