//! `tpinfer decode`: saved latents (a Wan DiT's) to a video with a pipeline's VAE, the frames
//! split by rows over the ranks.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tpinfer_engine::{VaeEngine, VideoShape};

use crate::frames::FrameFiles;
use crate::progress::Stages;

#[derive(clap::Args)]
pub struct DecodeArgs {
    /// A Wan pipeline directory (its vae/ decodes), or a VAE directory (AutoencoderKLWan).
    #[arg(long)]
    pub model: PathBuf,
    /// The latents: a safetensors file with `latents` [channels, latent frames, h, w], as
    /// `tpinfer generate --save-latents` writes them (the DiT's, normalised).
    #[arg(long)]
    latents: PathBuf,
    /// Write every frame as an 8-bit PNG (00000.png, …) into this new or empty directory.
    #[arg(long)]
    save_frames: Option<PathBuf>,
    /// Write the video as H.264 in an MP4 file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The video's frame rate (Wan2.1: 16).
    #[arg(long, default_value_t = 16)]
    fps: u32,
    #[command(flatten)]
    ranks: crate::ranks::RankArgs,
}

pub fn decode(args: DecodeArgs) -> Result<std::process::ExitCode> {
    let files = FrameFiles {
        video: args.out.clone(),
        frames: args.save_frames.clone(),
        fps: args.fps,
        audio: None,
    };
    if files.is_empty() {
        bail!("nothing to write: give --out VIDEO.mp4, --save-frames DIR, or both");
    }
    files.check()?;
    let latents = crate::video::read_tensor(&args.latents, "latents")?
        .with_context(|| format!("--latents {}: no tensor `latents`", args.latents.display()))?;
    let shape = video_shape(&args.model, latents.dims())?;
    let mut stages = Stages::default();
    let engine = stages.time("load", || {
        args.ranks.ranks(&args.model)?.start(|b| VaeEngine::start(b, shape))
    })?;
    let frames = stages.time("decode", || {
        crate::video::decode_frames(|on| engine.decode(&latents, on))
    })?;
    stages.time("write", || files.write(&frames))?;
    for path in [&files.video, &files.frames].into_iter().flatten() {
        eprintln!("wrote {}", path.display());
    }
    eprintln!("{}", stages.summary());
    Ok(std::process::ExitCode::SUCCESS)
}

/// The video that latents of `dims` decode to, with the VAE at `model`.
fn video_shape(model: &Path, dims: &[usize]) -> Result<VideoShape> {
    let &[_, frames, h, w] = dims else {
        bail!("--latents are {dims:?}: expected [channels, latent frames, h, w]");
    };
    let shape = VaeEngine::video_shape(model, frames, h, w)?;
    Ok(shape)
}
