//! `tpinfer generate` for Wan2.2-S2V: speech and a reference image in, a talking video out
//! (H.264 with the speech as AAC in one MP4), made clip by clip; a bar per stage and per
//! clip, and each stage's time at the end.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use tpinfer_engine::{
    PoseFrames, S2vProgress, S2vRequest, VideoEngine, VideoRequest, VideoShape, S2V_FPS, SPEECH_SAMPLE_RATE,
};

use crate::frames::FrameFiles;
use crate::progress::{self, Stages};
use crate::ranks::Ranks;
use crate::video::{encode, VideoArgs};

/// S2V's defaults (`wan/configs/wan_s2v_14B.py`, `generate`).
const CLIP_FRAMES: usize = 80;
const STEPS: usize = 40;
const GUIDE_SCALE: f64 = 4.5;
const SHIFT: f64 = 3.0;

pub fn generate(ranks: Ranks, model: &Path, prompt: Option<&str>, args: &VideoArgs, seed: u64) -> Result<()> {
    for (flag, given) in [
        ("--text-embeds", args.text_embeds.is_some()),
        ("--negative-embeds", args.negative_embeds.is_some()),
        ("--save-text-embeds", args.save_text_embeds.is_some()),
        ("--save-latents", args.save_latents.is_some()),
    ] {
        if given {
            bail!(
                "{flag} is for text-to-video; {} is a speech-to-video checkpoint, which makes its video clip by clip \
                 from --audio and --image",
                model.display()
            );
        }
    }
    let (Some(audio), Some(image)) = (&args.audio, &args.image) else {
        bail!(
            "{} is a speech-to-video checkpoint: give --audio FILE (WAV, FLAC or MP3) and --image FILE (PNG or JPEG)",
            model.display()
        );
    };
    if args.fps != S2V_FPS as u32 {
        bail!(
            "--fps {}: speech-to-video makes {S2V_FPS} frames a second, the rate its speech features follow",
            args.fps
        );
    }
    if args.max_clips == Some(0) {
        bail!("--max-clips 0 makes no video: give at least 1, or leave it out for the whole speech");
    }
    let clip_frames = args.frames.unwrap_or(CLIP_FRAMES);
    if clip_frames == 0 || !clip_frames.is_multiple_of(4) {
        bail!("--frames {clip_frames}: a speech-to-video clip is 4k frames ({CLIP_FRAMES} by default)");
    }
    let (steps, guide_scale, shift) = (
        args.steps.unwrap_or(STEPS),
        args.guide_scale.unwrap_or(GUIDE_SCALE),
        args.shift.unwrap_or(SHIFT),
    );
    // Read before the model loads: a bad file costs nothing.
    let speech = tpinfer_media::read_speech(audio, SPEECH_SAMPLE_RATE)
        .with_context(|| format!("--audio {}", audio.display()))?;
    let (image_height, image_width) =
        tpinfer_media::image_size(image).with_context(|| format!("--image {}", image.display()))?;
    let (area_width, area_height) = args.size;
    let (height, width) = tpinfer_media::s2v_frame_size(image_height, image_width, area_width * area_height);
    if height == 0 || width == 0 {
        bail!(
            "--image {} ({image_width}x{image_height}) makes no frame within --size {area_width}x{area_height}: give a \
             larger image or area",
            image.display()
        );
    }
    let pixels = tpinfer_media::read_reference_image(image, height, width)
        .with_context(|| format!("--image {}", image.display()))?;
    let reference = Tensor::from_vec(pixels, (3, 1, height, width), &Device::Cpu)?;
    let files = FrameFiles {
        video: Some(args.out.clone().unwrap_or_else(|| PathBuf::from("video.mp4"))),
        frames: args.save_frames.clone(),
        fps: args.fps,
        audio: Some(audio.clone()),
    };
    files.check()?;
    let init_latents = match &args.init_latents {
        Some(path) => Some(
            crate::video::read_tensor(path, "latents")?
                .with_context(|| format!("--init-latents {}: no tensor `latents`", path.display()))?,
        ),
        None => None,
    };
    let denoise = |text: Tensor, negative: Option<Tensor>| VideoRequest {
        text,
        negative,
        steps,
        shift,
        guide_scale,
        solver: args.solver.solver(),
        seed,
        init_latents: init_latents.clone(),
    };
    let stand_in = Tensor::zeros((1, 1), candle_core::DType::F32, &Device::Cpu)?;
    denoise(stand_in.clone(), Some(stand_in)).check()?;

    let mut stages = Stages::default();
    let shape = VideoShape {
        frames: clip_frames,
        width,
        height,
    };
    // The pose video, read a clip at a time as the engine asks for it (one clip's frames in
    // memory), its header checked now, before the model loads.
    let pose = match &args.pose_video {
        Some(path) => {
            let named = || format!("--pose-video {}", path.display());
            let mut reader = tpinfer_media::VideoReader::open(path, S2V_FPS).with_context(named)?;
            if reader.frames() == 0 {
                bail!("{} holds no frames: give an H.264 video with at least one", named());
            }
            Some(PoseFrames::PerClip(Box::new(move |_clip| {
                let video = reader.next_frames(clip_frames).map_err(|e| e.to_string())?;
                let frames = video.frames.len();
                let pixels = tpinfer_media::pose_pixels(&video, height, width, frames);
                Tensor::from_vec(pixels, (3, frames, height, width), &Device::Cpu).map_err(|e| e.to_string())
            })))
        }
        None => None,
    };
    let samples = speech.samples.len();
    let with_pose = pose.is_some();
    let engine = stages.time("load", || {
        ranks.start(|b| VideoEngine::start_s2v(b, shape, samples, with_pose))
    })?;
    eprintln!(
        "{:.1} s of speech, clips of {clip_frames} frames at {width}x{height} (the reference image's {image_width}x\
         {image_height} within {area_width}x{area_height}); peak plan per rank {:.0} MiB",
        speech.seconds(),
        tpinfer_plan::mib(engine.planned_peak())
    );
    if engine.frees_encoder() {
        eprintln!(
            "the text and speech encoders do not fit beside the DiT and the VAE: they are freed after encoding, and \
             those load then"
        );
    }
    let negative_prompt = args
        .negative_prompt
        .clone()
        .unwrap_or_else(|| engine.default_negative_prompt().to_string());
    let (text, negative) = stages.time("encode", || {
        encode(&engine, prompt.unwrap_or(""), &negative_prompt, guide_scale, None)
    })?;
    let features = stages.time("speech", || -> Result<_> {
        let bar = progress::bar("speech", 1, "encodes");
        let features = engine.encode_speech(&speech.samples)?;
        bar.finish_and_clear();
        Ok(features)
    })?;
    if engine.frees_encoder() {
        stages.time("load DiT + VAE", || engine.end_encoding())?;
    }
    let request = S2vRequest {
        denoise: denoise(text, negative),
        speech: features,
        reference,
        max_clips: args.max_clips,
        pose,
    };
    let video = stages.time("clips", || run_clips(&engine, request, steps))?;
    // Cut at the speech's end, as the reference's muxing (`-shortest`) does.
    let spoken = (speech.seconds() * S2V_FPS as f64).ceil() as usize;
    let made = video.frames.dim(0)?;
    let frames = video.frames.narrow(0, 0, made.min(spoken.max(1)))?;
    stages.time("write", || files.write(&frames))?;
    for path in [&files.video, &files.frames].into_iter().flatten() {
        eprintln!("wrote {}", path.display());
    }
    eprintln!("{} clips, {} frames; {}", video.clips, frames.dim(0)?, stages.summary());
    Ok(())
}

/// The clips, with a bar over each one's steps and one over its decode.
fn run_clips(engine: &VideoEngine, request: S2vRequest, steps: usize) -> Result<tpinfer_engine::S2vVideo> {
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut clips = 0;
    let video = engine.generate_s2v(request, |event| match event {
        S2vProgress::Clip { index, clips: n } => {
            clips = n;
            if let Some(done) = bar.take() {
                done.finish_and_clear();
            }
            bar = Some(progress::bar(&format!("clip {}/{n}", index + 1), steps as u64, "steps"));
        }
        S2vProgress::Step(step) => {
            if let Some(bar) = &bar {
                progress::report_step(bar, &step);
            }
        }
        S2vProgress::Decode { done, total } => {
            if let Some(bar) = &bar {
                if bar.position() >= steps as u64 && bar.length() != Some(total as u64) {
                    bar.set_prefix("decode");
                    bar.set_length(total as u64);
                }
                bar.set_position(done as u64);
            }
        }
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    eprintln!("{clips} clips made");
    Ok(video)
}
