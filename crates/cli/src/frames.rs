//! Decoded frames to files: the MP4 video and the PNG frames, each written whole or not at
//! all, with a progress bar over the frames.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use indicatif::ProgressBar;
use tpinfer_media::{FrameSize, Mp4Writer};

/// Where decoded frames go.
pub struct FrameFiles {
    /// An MP4 video (`--out`).
    pub video: Option<PathBuf>,
    /// A folder of PNG frames `00000.png`, … (`--save-frames`).
    pub frames: Option<PathBuf>,
    pub fps: u32,
    /// Audio for the video's sound track (`--audio`), from its first frame to its last.
    pub audio: Option<PathBuf>,
}

impl FrameFiles {
    /// Checks every path before the run, naming the flag of any that cannot be written.
    pub fn check(&self) -> Result<()> {
        if let Some(path) = &self.video {
            if !path.extension().is_some_and(|e| e.eq_ignore_ascii_case("mp4")) {
                bail!(
                    "--out {}: the video is written as MP4; give a path ending in .mp4",
                    path.display()
                );
            }
            crate::output::check("--out", path)?;
        }
        if let Some(dir) = &self.frames {
            crate::output::check_dir("--save-frames", dir)?;
        }
        if self.fps == 0 || self.fps > 1000 {
            bail!("--fps {} must be from 1 to 1000 (Wan2.1 makes 16)", self.fps);
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.video.is_none() && self.frames.is_none()
    }

    /// Writes `frames` (`[frames, 3, height, width]` in [−1, 1]) to every file asked for.
    pub fn write(&self, frames: &Tensor) -> Result<()> {
        let (size, rgb) = rgb_frames(frames)?;
        let bar = crate::progress::bar(
            "write",
            (rgb.len() * (usize::from(self.video.is_some()) + usize::from(self.frames.is_some()))) as u64,
            "frames",
        );
        if let Some(path) = &self.video {
            crate::output::write("--out", path, |temp| {
                write_mp4(temp, size, self.fps, &rgb, self.audio.as_deref(), &bar)
            })?;
        }
        if let Some(dir) = &self.frames {
            crate::output::write_dir("--save-frames", dir, |temp| write_pngs(temp, size, &rgb, &bar))?;
        }
        bar.finish_and_clear();
        Ok(())
    }
}

/// Each frame's packed 8-bit RGB, rounded as diffusers' video processor rounds:
/// `round(clamp(x / 2 + 0.5, 0, 1) · 255)`.
pub fn rgb_frames(frames: &Tensor) -> Result<(FrameSize, Vec<Vec<u8>>)> {
    let (count, channels, height, width) = frames.dims4()?;
    if channels != 3 {
        bail!("the decoded video has {channels} channels, not RGB's 3");
    }
    let bytes = ((frames.to_dtype(DType::F32)? / 2.0)? + 0.5)?
        .clamp(0f32, 1f32)?
        .affine(255.0, 0.0)?
        .round()?
        .permute((0, 2, 3, 1))?
        .to_dtype(DType::U8)?
        .flatten_all()?
        .to_vec1::<u8>()?;
    let size = FrameSize { width, height };
    let per_frame = width * height * 3;
    let rgb = (0..count)
        .map(|f| bytes[f * per_frame..(f + 1) * per_frame].to_vec())
        .collect();
    Ok((size, rgb))
}

fn write_mp4(
    path: &Path,
    size: FrameSize,
    fps: u32,
    rgb: &[Vec<u8>],
    audio: Option<&Path>,
    bar: &ProgressBar,
) -> Result<()> {
    // The sound track's muxing reads back one field of the finished file: a plain file,
    // which reads as well as writes.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let mut video = Mp4Writer::new(file, size, fps)?;
    if let Some(audio) = audio {
        let sound = tpinfer_media::decode_mono(audio)?;
        // At its own rate where AAC has it (every common one), else at 48 kHz.
        if video.set_audio(sound.samples.clone(), sound.sample_rate).is_err() {
            let samples = tpinfer_media::resample(&sound.samples, sound.sample_rate, 48_000)
                .map_err(|e| anyhow::anyhow!("resampling {} to 48 kHz for AAC: {e}", audio.display()))?;
            video.set_audio(samples, 48_000)?;
        }
    }
    for frame in rgb {
        video.push(frame)?;
        bar.inc(1);
    }
    let mut file = video.finish()?;
    std::io::Write::flush(&mut file)?;
    Ok(())
}

fn write_pngs(dir: &Path, size: FrameSize, rgb: &[Vec<u8>], bar: &ProgressBar) -> Result<()> {
    for (index, frame) in rgb.iter().enumerate() {
        let path = dir.join(format!("{index:05}.png"));
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
        tpinfer_media::write_png(&mut file, size, frame)?;
        std::io::Write::flush(&mut file)?;
        bar.inc(1);
    }
    Ok(())
}
