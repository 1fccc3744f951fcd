//! `tpinfer generate` for a Wan DiT: a prompt (with a pipeline directory) or text embeddings
//! in; out, with a pipeline's VAE, an MP4 video and PNG frames, else the latents and a
//! preview. Each stage has a progress bar, and the run ends with each stage's time.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use tpinfer_engine::{S2vPipelineDir, SelfAttention, Solver, VideoEngine, VideoRequest, VideoShape, WanPipelineDir};

use crate::frames::FrameFiles;
use crate::progress::{self, Stages};
use crate::ranks::Ranks;

/// `--attention`'s values.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum AttentionArg {
    Dtype,
    Fp8,
}

impl AttentionArg {
    pub(crate) fn precision(self) -> SelfAttention {
        match self {
            Self::Dtype => SelfAttention::ComputeDtype,
            Self::Fp8 => SelfAttention::Fp8,
        }
    }
}

/// The video options of `tpinfer generate`.
#[derive(clap::Args)]
#[command(next_help_heading = "Video (a Wan pipeline or DiT)")]
pub struct VideoArgs {
    /// Frames, 4k + 1 (default 81); for speech-to-video, each clip's, 4k (default 80).
    #[arg(long)]
    pub(crate) frames: Option<usize>,
    /// WIDTHxHEIGHT in pixels, multiples of 16; for speech-to-video the largest area, the
    /// frame taking the reference image's shape within it.
    #[arg(long, default_value = "832x480", value_parser = crate::plan::parse_size)]
    pub(crate) size: (usize, usize),
    /// Denoising steps (default 50; speech-to-video 40).
    #[arg(long)]
    pub(crate) steps: Option<usize>,
    /// A safetensors file with the umT5 text states, `[tokens, 4096]` (tensor `text`, or its only tensor).
    #[arg(long)]
    pub(crate) text_embeds: Option<PathBuf>,
    /// The negative prompt's states (tensor `negative` of --text-embeds, or this file).
    #[arg(long)]
    pub(crate) negative_embeds: Option<PathBuf>,
    /// With a pipeline directory: what guidance steers away from (default: diffusers' empty
    /// prompt; for speech-to-video, its config's negative prompt).
    #[arg(long)]
    pub(crate) negative_prompt: Option<String>,
    /// With a pipeline directory: also write the prompt's and the negative prompt's umT5
    /// states (`text`, `negative`, [512, dim]) here, in the form --text-embeds reads.
    #[arg(long)]
    pub(crate) save_text_embeds: Option<PathBuf>,
    /// Classifier-free guidance scale: above 1, each step also runs the negative prompt; 1
    /// turns guidance off (default 5; speech-to-video 4.5).
    #[arg(long)]
    pub(crate) guide_scale: Option<f64>,
    /// The flow schedule's shift (default 5; speech-to-video 3).
    #[arg(long)]
    pub(crate) shift: Option<f64>,
    #[arg(long, value_enum, default_value_t = SolverArg::Unipc)]
    pub(crate) solver: SolverArg,
    /// Start from these latents (tensor `latents` [C, F', H', W'], f32) instead of --seed's
    /// noise; for speech-to-video, each clip from one row of [clips, C, F', H', W'].
    #[arg(long)]
    pub(crate) init_latents: Option<PathBuf>,
    /// With a pipeline that has vae/: the video, H.264 in MP4 (default video.mp4). Without a
    /// VAE: the latents, safetensors (default latents.safetensors), with previews beside it.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// With a pipeline that has vae/: also write every frame as an 8-bit PNG (00000.png, …)
    /// into this new or empty directory.
    #[arg(long)]
    pub(crate) save_frames: Option<PathBuf>,
    /// Also write the final latents (tensor `latents`, f32), as `tpinfer decode` reads them.
    #[arg(long)]
    pub(crate) save_latents: Option<PathBuf>,
    /// The video's frame rate (Wan2.1: 16).
    #[arg(long, default_value_t = 16)]
    pub(crate) fps: u32,
    /// The precision of the DiT's self-attention products: `dtype` (the compute dtype) or
    /// `fp8` (both products on E4M3 operands, FlashAttention-3's FP8 path: on Hopper and Ada
    /// GPUs in bf16; faster on an H200, and a different video).
    #[arg(long, value_enum, default_value_t = AttentionArg::Dtype)]
    pub(crate) attention: AttentionArg,
    /// Speech-to-video: the speech (WAV, FLAC or MP3) that drives the video and plays in it.
    #[arg(long)]
    pub(crate) audio: Option<PathBuf>,
    /// Speech-to-video: the reference image (PNG or JPEG) of who speaks.
    #[arg(long)]
    pub(crate) image: Option<PathBuf>,
    /// Speech-to-video: at most this many clips (the speech's length decides otherwise).
    #[arg(long)]
    pub(crate) max_clips: Option<usize>,
    /// Speech-to-video: a pose video (H.264 in MP4) whose frames, from its first at 16 a
    /// second, guide each clip's poses.
    #[arg(long)]
    pub(crate) pose_video: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum SolverArg {
    Unipc,
    Euler,
}

impl SolverArg {
    pub(crate) fn solver(self) -> Solver {
        match self {
            Self::Unipc => Solver::UniPc(2),
            Self::Euler => Solver::Euler,
        }
    }
}

/// Reads `name` from a safetensors file, or its only tensor, as f32 on the CPU.
pub fn read_tensor(path: &Path, name: &str) -> Result<Option<Tensor>> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("cannot read {} (safetensors)", path.display()))?;
    let tensor = match (tensors.get(name), tensors.len()) {
        (Some(t), _) => Some(t.clone()),
        (None, 1) if name == "text" => tensors.into_values().next(),
        _ => None,
    };
    tensor.map(|t| t.to_dtype(DType::F32)).transpose().map_err(Into::into)
}

/// The text states of `--text-embeds` (and the negative prompt's, if given).
fn read_embeds(text_path: &Path, negative_path: Option<&Path>) -> Result<(Tensor, Option<Tensor>)> {
    let text =
        read_tensor(text_path, "text")?.with_context(|| format!("{} has no tensor `text`", text_path.display()))?;
    let negative = match negative_path {
        Some(path) => read_tensor(path, "text")?,
        None => read_tensor(text_path, "negative")?,
    };
    if text.rank() != 2 {
        bail!("text embeddings must be [tokens, dim], got {:?}", text.dims());
    }
    Ok((text, negative))
}

pub fn generate_video(mut ranks: Ranks, model: &Path, prompt: Option<&str>, args: &VideoArgs, seed: u64) -> Result<()> {
    ranks.builder = ranks.builder.self_attention(args.attention.precision());
    if S2vPipelineDir::detect(model) {
        return crate::speech_video::generate(ranks, model, prompt, args, seed);
    }
    for (flag, given) in [
        ("--audio", args.audio.is_some()),
        ("--image", args.image.is_some()),
        ("--max-clips", args.max_clips.is_some()),
        ("--pose-video", args.pose_video.is_some()),
    ] {
        if given {
            bail!(
                "{flag} is for speech-to-video: {} is not a Wan2.2-S2V checkpoint directory (its config.json beside \
                 Wan2.1_VAE.pth)",
                model.display()
            );
        }
    }
    let (frames, steps) = (args.frames.unwrap_or(81), args.steps.unwrap_or(50));
    let (guide_scale, shift) = (args.guide_scale.unwrap_or(5.0), args.shift.unwrap_or(5.0));
    let negative_prompt = args.negative_prompt.clone().unwrap_or_default();
    let embeds = match (&args.text_embeds, prompt) {
        (Some(_), Some(_)) => bail!("--prompt and --text-embeds both give the text: give one, not both"),
        (Some(path), None) => Some(read_embeds(path, args.negative_embeds.as_deref())?),
        (None, Some(_)) if WanPipelineDir::detect(model) => None,
        (None, Some(_)) => bail!(
            "--prompt needs a pipeline directory (model_index.json, tokenizer/, text_encoder/, transformer/); a \
             transformer directory alone takes --text-embeds FILE"
        ),
        (None, None) => bail!("a Wan model needs --prompt (with a pipeline directory) or --text-embeds FILE"),
    };
    if embeds.is_some() && args.save_text_embeds.is_some() {
        bail!("--save-text-embeds writes the states of --prompt, but these come from --text-embeds");
    }
    let init_latents = match &args.init_latents {
        Some(path) => Some(
            read_tensor(path, "latents")?
                .with_context(|| format!("--init-latents {}: no tensor `latents`", path.display()))?,
        ),
        None => None,
    };
    let (width, height) = args.size;
    let shape = VideoShape { frames, width, height };
    let request = |text: Tensor, negative: Option<Tensor>| VideoRequest {
        text,
        negative,
        steps,
        shift,
        guide_scale,
        solver: args.solver.solver(),
        seed,
        init_latents: init_latents.clone(),
    };
    // Before the model loads. A prompt always has a negative (--negative-prompt).
    match &embeds {
        Some((text, negative)) => request(text.clone(), negative.clone()).check()?,
        None => {
            let stand_in = Tensor::zeros((1, 1), DType::F32, &Device::Cpu)?;
            request(stand_in.clone(), Some(stand_in)).check()?
        }
    }
    let outputs = Outputs::of(model, args)?;
    if let Some(path) = &args.save_text_embeds {
        crate::output::check("--save-text-embeds", path)?;
    }
    let mut stages = Stages::default();
    let engine = stages.time("load", || ranks.start(|b| VideoEngine::start(b, shape)))?;
    let [c, f, h, w] = engine.latent_shape();
    eprintln!(
        "{frames} frames at {width}x{height}: latents {c}×{f}×{h}×{w}, {} video tokens per forward; peak plan per rank {:.0} MiB",
        engine.plan().tokens_per_forward,
        tpinfer_plan::mib(engine.planned_peak())
    );
    if engine.frees_encoder() {
        eprintln!(
            "the text encoder does not fit beside the DiT and the VAE: it is freed after encoding, and they load then"
        );
    }
    let (text, negative) = match (embeds, prompt) {
        (Some(embeds), _) => embeds,
        (None, Some(prompt)) => stages.time("encode", || {
            encode(
                &engine,
                prompt,
                &negative_prompt,
                guide_scale,
                args.save_text_embeds.as_deref(),
            )
        })?,
        (None, None) => bail!("nothing to encode"),
    };
    if engine.frees_encoder() {
        stages.time("load DiT + VAE", || engine.end_encoding())?;
    }
    let request = request(text, negative);
    let latents = stages.time("denoise", || denoise(&engine, request, steps))?;
    for path in &outputs.latents {
        crate::output::write(path.0, &path.1, |temp| Ok(latents.save_safetensors("latents", temp)?))?;
        eprintln!("wrote {}", path.1.display());
    }
    if outputs.files.is_empty() {
        if let Some((_, path)) = outputs.latents.iter().find(|(flag, _)| *flag == "--out") {
            write_previews(&latents, path)?;
        }
    } else {
        let frames = stages.time("decode", || decode_frames(|on| engine.decode(&latents, on)))?;
        stages.time("write", || outputs.files.write(&frames))?;
        for path in [&outputs.files.video, &outputs.files.frames].into_iter().flatten() {
            eprintln!("wrote {}", path.display());
        }
    }
    eprintln!("{}", stages.summary());
    Ok(())
}

/// Where a video run's results go.
struct Outputs {
    /// The decoded frames' files, with a VAE.
    files: FrameFiles,
    /// The latents' files, each with the flag that named it.
    latents: Vec<(&'static str, PathBuf)>,
}

impl Outputs {
    /// Every output path of `args`, checked before the run: a pipeline with `vae/` writes a
    /// video, a DiT without one its latents.
    fn of(model: &Path, args: &VideoArgs) -> Result<Self> {
        let decodes = WanPipelineDir::detect(model) && WanPipelineDir::open(model)?.vae.is_some();
        let mut latents: Vec<(&'static str, PathBuf)> = args
            .save_latents
            .iter()
            .map(|p| ("--save-latents", p.clone()))
            .collect();
        let files = match decodes {
            true => FrameFiles {
                video: Some(args.out.clone().unwrap_or_else(|| PathBuf::from("video.mp4"))),
                frames: args.save_frames.clone(),
                fps: args.fps,
                audio: None,
            },
            false => {
                if args.save_frames.is_some() {
                    bail!(
                        "--save-frames needs a VAE to decode frames with: {} has no vae/ (give a pipeline directory \
                         with one, or --save-latents and `tpinfer decode` later)",
                        model.display()
                    );
                }
                let out = args.out.clone().unwrap_or_else(|| PathBuf::from("latents.safetensors"));
                if out.extension().is_some_and(|e| e.eq_ignore_ascii_case("mp4")) {
                    bail!(
                        "--out {}: {} has no vae/ to decode a video with; without one --out writes the latents \
                         (.safetensors), which `tpinfer decode --model PIPELINE_DIR` turns into a video",
                        out.display(),
                        model.display()
                    );
                }
                latents.push(("--out", out));
                FrameFiles {
                    video: None,
                    frames: None,
                    fps: args.fps,
                    audio: None,
                }
            }
        };
        files.check()?;
        for (flag, path) in &latents {
            crate::output::check(flag, path)?;
        }
        Ok(Self { files, latents })
    }
}

/// Denoises with a bar over the steps and a line per step above it.
fn denoise(engine: &VideoEngine, request: VideoRequest, steps: usize) -> Result<Tensor> {
    let bar = progress::bar("denoise", steps as u64, "steps");
    let start = std::time::Instant::now();
    let latents = engine.generate(request, |step| progress::report_step(&bar, &step))?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    eprintln!(
        "{steps} steps in {seconds:.2} s ({:.3} s per step)",
        seconds / steps as f64
    );
    Ok(latents)
}

/// Runs a VAE decode with a bar over its tiles and latent frames.
pub fn decode_frames(
    run: impl FnOnce(&mut dyn FnMut(usize, usize)) -> Result<Tensor, tpinfer_engine::EngineError>,
) -> Result<Tensor> {
    let bar = progress::bar("decode", 0, "chunks");
    let frames = run(&mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    Ok(frames)
}

/// False-colour previews of the first and last latent frames beside `out`, for a run that has
/// no VAE to decode with.
fn write_previews(latents: &Tensor, out: &Path) -> Result<()> {
    let frames = latents.dim(1)?;
    for (label, index) in [("first", 0), ("last", frames - 1)] {
        let path = out.with_extension(format!("{label}.png"));
        let frame = latents.narrow(1, index, 1)?.squeeze(1)?;
        crate::output::write("the preview", &path, |temp| write_preview(&frame, temp))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The prompt's states, and the negative prompt's where guidance or --save-text-embeds needs
/// them, encoded on the engine's ranks; written to --save-text-embeds if asked.
pub(crate) fn encode(
    engine: &VideoEngine,
    prompt: &str,
    negative_prompt: &str,
    guide_scale: f64,
    save_text_embeds: Option<&Path>,
) -> Result<(Tensor, Option<Tensor>)> {
    let needs_negative = guide_scale > 1.0 || save_text_embeds.is_some();
    let bar = progress::bar("encode", 1 + u64::from(needs_negative), "prompts");
    let text = engine.encode_prompt(prompt)?;
    bar.inc(1);
    let negative = match needs_negative {
        true => Some(engine.encode_prompt(negative_prompt)?),
        false => None,
    };
    bar.finish_and_clear();
    if let (Some(path), Some(negative)) = (save_text_embeds, &negative) {
        let tensors = std::collections::HashMap::from([
            ("text".to_string(), text.clone()),
            ("negative".to_string(), negative.clone()),
        ]);
        crate::output::write("--save-text-embeds", path, |temp| {
            Ok(candle_core::safetensors::save(&tensors, temp)?)
        })?;
        eprintln!("wrote {}", path.display());
    }
    let negative = negative.filter(|_| guide_scale > 1.0);
    Ok((text, negative))
}

/// One latent frame `[channels, h, w]` as an RGB image: its pixels projected on the three
/// principal components of their channels, each stretched to 0–255.
fn write_preview(frame: &Tensor, path: &Path) -> Result<()> {
    let (c, h, w) = frame.dims3()?;
    let pixels = frame.reshape((c, h * w))?.t()?.contiguous()?; // [pixels, channels]
    let centered = pixels.broadcast_sub(&pixels.mean_keepdim(0)?)?;
    let cov = (centered.t()?.matmul(&centered)? / (h * w) as f64)?;
    let mut cov: Vec<Vec<f32>> = cov.to_vec2()?;
    let mut components = Vec::new();
    for k in 0..3 {
        // Power iteration, then deflation.
        let mut v: Vec<f32> = (0..c).map(|i| 1.0 + ((i * 7 + k * 3) % 5) as f32).collect();
        for _ in 0..200 {
            let next: Vec<f32> = cov
                .iter()
                .map(|row| row.iter().zip(&v).map(|(a, b)| a * b).sum())
                .collect();
            let norm = next.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            v = next.into_iter().map(|x| x / norm).collect();
        }
        let lambda: f32 = cov
            .iter()
            .zip(&v)
            .map(|(row, vi)| vi * row.iter().zip(&v).map(|(a, b)| a * b).sum::<f32>())
            .sum();
        for (i, row) in cov.iter_mut().enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                *x -= lambda * v[i] * v[j];
            }
        }
        components.extend(v);
    }
    let basis = Tensor::from_vec(components, (3, c), &Device::Cpu)?;
    let rgb = centered.matmul(&basis.t()?)?; // [pixels, 3]
    let (lo, hi) = (rgb.min_keepdim(0)?, rgb.max_keepdim(0)?);
    let scaled = (rgb
        .broadcast_sub(&lo)?
        .broadcast_div(&(hi - &lo)?.clamp(1e-6, f32::MAX)?)?
        * 255.0)?;
    let bytes: Vec<u8> = scaled
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|v| v.round().clamp(0.0, 255.0) as u8)
        .collect();
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let size = tpinfer_media::FrameSize { width: w, height: h };
    tpinfer_media::write_png(file, size, &bytes)?;
    Ok(())
}
