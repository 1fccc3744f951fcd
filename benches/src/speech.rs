//! `tpinfer-bench speech`: the wav2vec2 speech encoder on the rank group at each TP width:
//! time per audio, device memory against the plan, and the hidden states as safetensors for
//! the reference (`scripts/reference/reference_wav2vec2.py compare`) to judge.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use tpinfer_family::Family;
use tpinfer_plan::Placement;
use tpinfer_runtime::{GroupOptions, Launch, RuntimeError, Topology};
use tpinfer_wav2vec2::{Wav2Vec2Model, STATES_PER_SECOND};

#[derive(Args)]
pub struct SpeechArgs {
    /// A wav2vec2 directory (transformers' `Wav2Vec2ForCTC` or `Wav2Vec2Model`).
    #[arg(long)]
    model: PathBuf,
    /// A WAV, FLAC or MP3 file, or safetensors (`.safetensors`, `.st`) with `audio` [samples]
    /// at 16 kHz, as `reference_wav2vec2.py run` writes.
    #[arg(long)]
    audio: PathBuf,
    #[arg(long)]
    cuda: bool,
    /// The compute dtype; S2V runs its speech encoder in f32.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: crate::DtypeArg,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    tp: Vec<usize>,
    /// Timed encodes per width, after one warm-up.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Before the encodes, takes the device memory past the plan plus this many MiB (rank 0's
    /// device, the process alone on it), as a card of that size would be. Negative: below
    /// the plan.
    #[arg(long, allow_negative_numbers = true)]
    limit_to_plan: Option<f64>,
    /// Writes `{out}_tp{N}.safetensors` (tensor `hidden_states`, f32) for each width.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn speech(args: SpeechArgs) -> Result<()> {
    let samples = read_audio(&args.audio)?;
    let dtype = crate::dtype_of(args.dtype);
    println!(
        "| TP | audio, s | dtype | first encode, ms | ms per audio (median of {}) | peak MiB measured / planned, fullest rank |",
        args.repeats
    );
    println!("|---:|---:|---|---:|---:|---|");
    for &tp in &args.tp {
        let model = Wav2Vec2Model::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
        let frames = model.config().frames(samples.len());
        let options = GroupOptions {
            comm: crate::comm_options(),
            ..GroupOptions::default()
        };
        let mut launch = Launch::new(Topology::new(tp, &crate::device_kind(args.cuda))?, options);
        let handle = launch.add(Arc::new(model), dtype, Placement::llm(frames.max(1), 1))?;
        let group = launch.start()?;
        let plan = &group.plans()[handle.index()];
        let taken = crate::take_past_plan(&group.device_memory(), plan, args.limit_to_plan)?;
        let (audio, repeats) = (samples.clone(), args.repeats);
        let mut ranks = group.run(move |rank| -> Result<(Tensor, f64, f64), RuntimeError> {
            let r = rank.env.rank;
            let encoder = rank.models.get_mut(&handle)?;
            crate::timed_runs(&rank.env.device, r, repeats, || {
                encoder.hidden_states(&audio).map_err(|e| RuntimeError::of_rank(r, e))
            })
        })?;
        let (states, first, median) = ranks.swap_remove(0);
        let memory = crate::memory_cell(&group.device_memory(), plan);
        println!(
            "| {tp} | {:.2} | {dtype:?} | {first:.1} | {median:.1} | {memory} |",
            frames as f64 / STATES_PER_SECOND as f64
        );
        crate::print_memory_parts(&group.device_memory(), plan);
        crate::print_limited(taken.as_ref(), &group.device_memory());
        if let Some(out) = &args.out {
            let path = PathBuf::from(format!("{}_tp{tp}.safetensors", out.display()));
            states
                .save_safetensors("hidden_states", &path)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// 16 kHz mono samples: a safetensors file's `audio`, or an audio file decoded and resampled.
fn read_audio(path: &Path) -> Result<Vec<f32>> {
    if path.extension().is_some_and(|e| e == "safetensors" || e == "st") {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("reading {}", path.display()))?;
        let audio = tensors
            .get("audio")
            .with_context(|| format!("{} has no tensor `audio`", path.display()))?;
        return Ok(audio.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?);
    }
    Ok(tpinfer_media::read_speech(path, 16_000)?.samples)
}
