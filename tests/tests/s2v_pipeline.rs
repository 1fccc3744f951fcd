//! Speech-to-video end to end on a tiny random Wan2.2-S2V checkpoint in the official layout
//! (`tests/fixtures/s2v-pipeline`, written by `scripts/reference/reference_s2v_pipeline.py`):
//! the engine's clip-by-clip run against the wan22 wheel's `WanS2V.generate` loop on the same
//! weights, speech, reference image and per-clip noise (two clips of 16 frames: the second
//! conditioned on the first's last frames), at TP 1 and 2; a pose video guiding the clips; and
//! what it refuses.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tpinfer_engine::{DeviceKind, Engine, PoseFrames, S2vRequest, Solver, VideoEngine, VideoRequest, VideoShape};
use tpinfer_tests::tensor_rel_error;

const CLIP_FRAMES: usize = 16;
const SIZE: usize = 64;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/s2v-pipeline")
}

fn engine(tp: usize, pose: bool) -> VideoEngine {
    let speech = speech();
    let shape = VideoShape {
        frames: CLIP_FRAMES,
        width: SIZE,
        height: SIZE,
    };
    let builder = Engine::builder(fixture().join("model")).tp(tp).device(DeviceKind::Cpu);
    VideoEngine::start_s2v(builder, shape, speech.len(), pose).expect("start")
}

fn speech() -> Vec<f32> {
    tpinfer_media::read_speech(&fixture().join("inputs/speech.wav"), 16_000)
        .expect("speech")
        .samples
}

/// The run's frames `[frames, 3, 64, 64]` in [−1, 1] at TP `tp`, as the CLI makes them, with
/// `pose`'s frames if given.
fn run(tp: usize, pose: Option<PoseFrames>) -> Tensor {
    let engine = engine(tp, pose.is_some());
    let text = engine.encode_prompt("a person talks").expect("prompt");
    let negative = engine
        .encode_prompt(engine.default_negative_prompt())
        .expect("negative prompt");
    let features = engine.encode_speech(&speech()).expect("speech");
    assert_eq!(features.clips, 2, "1.5 s of speech fills two clips of a second");
    let pixels = tpinfer_media::read_reference_image(&fixture().join("inputs/face.png"), SIZE, SIZE).expect("image");
    let init = candle_core::safetensors::load(fixture().join("inputs/init.safetensors"), &Device::Cpu).expect("init");
    let request = S2vRequest {
        denoise: VideoRequest {
            text,
            negative: Some(negative),
            steps: 2,
            shift: 3.0,
            guide_scale: 4.5,
            solver: Solver::UniPc(2),
            seed: 0,
            init_latents: Some(init["latents"].clone()),
        },
        speech: features,
        reference: Tensor::from_vec(pixels, (3, 1, SIZE, SIZE), &Device::Cpu).expect("reference"),
        max_clips: None,
        pose,
    };
    let mut clips = Vec::new();
    let video = engine
        .generate_s2v(request, |event| {
            if let tpinfer_engine::S2vProgress::Clip { index, clips: n } = event {
                clips.push((index, n));
            }
        })
        .expect("generate");
    assert_eq!(clips, [(0, 2), (1, 2)]);
    assert_eq!(video.clips, 2);
    video.frames
}

/// `frames` in 8 bits, rounded as the video writer rounds.
fn eight_bit(frames: &Tensor) -> Vec<u8> {
    ((frames / 2.0).expect("half") + 0.5)
        .and_then(|f| f.clamp(0f32, 1f32))
        .and_then(|f| f.affine(255.0, 0.0))
        .and_then(|f| f.round())
        .and_then(|f| f.to_dtype(DType::U8))
        .and_then(|f| f.flatten_all())
        .and_then(|f| f.to_vec1::<u8>())
        .expect("8-bit frames")
}

/// The largest difference, in 8 bits, of `frames` from the wheel's in the fixture's `file`.
fn worst_from_wheel(frames: &Tensor, file: &str) -> u8 {
    let reference = candle_core::safetensors::load(fixture().join(file), &Device::Cpu).expect("reference")["frames"]
        .flatten_all()
        .and_then(|f| f.to_vec1::<u8>())
        .expect("reference frames");
    let ours = eight_bit(frames);
    ours.iter()
        .zip(&reference)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .expect("pixels")
}

/// The first clip's 13 frames (16 less the three S2V cuts) and the second's 16, within 2/255
/// of the wheel's in f32, at TP 1 and 2, and the widths equal.
#[test]
fn a_two_clip_video_matches_the_wan22_loop() {
    let one = run(1, None);
    assert_eq!(one.dims(), [13 + 16, 3, SIZE, SIZE]);
    let worst = worst_from_wheel(&one, "reference.safetensors");
    assert!(worst <= 2, "largest difference from the wheel's frames: {worst}/255");
    let two = run(2, None);
    let rel = tensor_rel_error(&two, &one);
    assert!(rel < 1e-5, "TP 2 against TP 1: {rel:e}");
}

/// The fixture's pose video (40 frames of H.264 as libx264 writes it by default, with
/// B-frames stored out of display order) guides the clips as the wheel's `load_pose_cond`
/// does: its first 32 frames, within 2/255 of the wheel's frames in f32; the pose moves them;
/// TP 2 equals TP 1.
#[test]
fn a_pose_video_guides_the_clips_as_the_wan22_loop() {
    let frames = tpinfer_media::read_video_frames(&fixture().join("inputs/pose.mp4"), 16, 2 * CLIP_FRAMES)
        .expect("read the pose video");
    assert_eq!(frames.frames.len(), 2 * CLIP_FRAMES);
    let pixels = tpinfer_media::pose_pixels(&frames, SIZE, SIZE, 2 * CLIP_FRAMES);
    let pose = Tensor::from_vec(pixels, (3, 2 * CLIP_FRAMES, SIZE, SIZE), &Device::Cpu).expect("pose");
    let one = run(1, Some(PoseFrames::Whole(pose.clone())));
    let worst = worst_from_wheel(&one, "reference_pose.safetensors");
    assert!(
        worst <= 2,
        "largest difference from the wheel's frames with the pose: {worst}/255"
    );
    let without = run(1, None);
    assert!(tensor_rel_error(&one, &without) > 1e-3, "the pose moves the frames");
    let two = run(2, Some(PoseFrames::Whole(pose)));
    let rel = tensor_rel_error(&two, &one);
    assert!(rel < 1e-5, "TP 2 against TP 1 with a pose: {rel:e}");
    // Read a clip at a time, as the CLI reads a pose video: the same frames.
    let mut reader = tpinfer_media::VideoReader::open(&fixture().join("inputs/pose.mp4"), 16).expect("open");
    let streamed = run(
        1,
        Some(PoseFrames::PerClip(Box::new(move |_| {
            let clip = reader.next_frames(CLIP_FRAMES).map_err(|e| e.to_string())?;
            let pixels = tpinfer_media::pose_pixels(&clip, SIZE, SIZE, clip.frames.len());
            Tensor::from_vec(pixels, (3, clip.frames.len(), SIZE, SIZE), &Device::Cpu).map_err(|e| e.to_string())
        }))),
    );
    assert_eq!(tensor_rel_error(&streamed, &one), 0.0, "read clip by clip");
}

/// A pose video shorter than the speech holds only its own frames: the engine pads the rest
/// with −1, as S2V pads such a video. Twelve frames (clip 0 partly padded, clip 1 wholly)
/// give the frames of the same twelve padded ahead to both clips.
#[test]
fn a_short_pose_video_is_padded_by_the_engine() {
    let frames =
        tpinfer_media::read_video_frames(&fixture().join("inputs/pose.mp4"), 16, 12).expect("read the pose video");
    assert_eq!(frames.frames.len(), 12);
    let pose = |total: usize| {
        let pixels = tpinfer_media::pose_pixels(&frames, SIZE, SIZE, total);
        Tensor::from_vec(pixels, (3, total, SIZE, SIZE), &Device::Cpu).expect("pose")
    };
    let short = run(1, Some(PoseFrames::Whole(pose(12))));
    let padded = run(1, Some(PoseFrames::Whole(pose(2 * CLIP_FRAMES))));
    assert_eq!(tensor_rel_error(&short, &padded), 0.0, "padded by the engine as ahead");
    // Given clip by clip: twelve frames, then none.
    let twelve = pose(12);
    let per_clip = run(
        1,
        Some(PoseFrames::PerClip(Box::new(move |clip| {
            let first = (clip * CLIP_FRAMES).min(12);
            twelve
                .narrow(1, first, (12 - first).min(CLIP_FRAMES))
                .map_err(|e| e.to_string())
        }))),
    );
    assert_eq!(
        tensor_rel_error(&per_clip, &padded),
        0.0,
        "padded by the engine clip by clip"
    );
}

/// What a speech-to-video engine refuses by name, before any clip runs.
#[test]
fn speech_to_video_refuses_what_it_cannot_run() {
    let posed = engine(1, true);
    let engine = engine(1, false);
    let text = engine.encode_prompt("a person talks").expect("prompt");
    let features = engine.encode_speech(&speech()).expect("speech");
    let request = |reference: Tensor, init: Option<Tensor>| S2vRequest {
        denoise: VideoRequest {
            text: text.clone(),
            negative: None,
            steps: 1,
            shift: 3.0,
            guide_scale: 1.0,
            solver: Solver::UniPc(2),
            seed: 0,
            init_latents: init,
        },
        speech: features.clone(),
        reference,
        max_clips: None,
        pose: None,
    };
    let wrong_size = Tensor::zeros((3, 1, 32, 64), DType::F32, &Device::Cpu).expect("zeros");
    let err = engine
        .generate_s2v(request(wrong_size, None), |_| {})
        .expect_err("a reference of another size")
        .to_string();
    assert!(
        err.contains("reference image") && err.contains("[3, 1, 64, 64]"),
        "{err}"
    );
    let right = Tensor::zeros((3, 1, SIZE, SIZE), DType::F32, &Device::Cpu).expect("zeros");
    let bad_init = Tensor::zeros((2, 16, 3, 8, 8), DType::F32, &Device::Cpu).expect("zeros");
    let err = engine
        .generate_s2v(request(right.clone(), Some(bad_init)), |_| {})
        .expect_err("noise of another clip length")
        .to_string();
    assert!(
        err.contains("--init-latents") && err.contains("[clips, 16, 4, 8, 8]"),
        "{err}"
    );
    let mut none = request(right.clone(), None);
    none.max_clips = Some(0);
    let err = engine.generate_s2v(none, |_| {}).expect_err("no clip").to_string();
    assert!(err.contains("no clip"), "{err}");
    let mut unplanned_pose = request(right, None);
    unplanned_pose.pose = Some(PoseFrames::Whole(
        Tensor::zeros((3, 32, SIZE, SIZE), DType::F32, &Device::Cpu).expect("zeros"),
    ));
    let err = engine
        .generate_s2v(unplanned_pose, |_| {})
        .expect_err("a pose the engine was not planned for")
        .to_string();
    assert!(err.contains("pose video needs an engine started with one"), "{err}");
    // Pose frames of another size, or none, to an engine planned for a pose.
    for (frames, width) in [(4, 32), (0, SIZE)] {
        let mut request = request(
            Tensor::zeros((3, 1, SIZE, SIZE), DType::F32, &Device::Cpu).expect("zeros"),
            None,
        );
        request.pose = Some(PoseFrames::Whole(
            Tensor::zeros((3, frames, SIZE, width), DType::F32, &Device::Cpu).expect("zeros"),
        ));
        let err = posed
            .generate_s2v(request, |_| {})
            .expect_err("pose frames it cannot take")
            .to_string();
        assert!(
            err.contains("the pose frames are") && err.contains("[3, frames, 64, 64]"),
            "{err}"
        );
    }
    // A clip's frames given clip by clip: more than a clip's, or a reader's failure.
    let zeros = |frames: usize| Tensor::zeros((3, frames, SIZE, SIZE), DType::F32, &Device::Cpu);
    for (source, named) in [
        (
            PoseFrames::PerClip(Box::new(move |_| zeros(CLIP_FRAMES + 1).map_err(|e| e.to_string()))),
            "at most 16 frames",
        ),
        (
            PoseFrames::PerClip(Box::new(|_| Err("the file went away".into()))),
            "clip 0's pose frames: the file went away",
        ),
    ] {
        let mut request = request(zeros(1).expect("zeros"), None);
        request.pose = Some(source);
        let err = posed.generate_s2v(request, |_| {}).expect_err(named).to_string();
        assert!(err.contains(named), "{err}");
    }
    // Speech too short for one video frame: refused before any rank encodes it, by the
    // engine's start and by the encode; a sample more makes the first frame.
    let config = tpinfer_wav2vec2::Wav2Vec2Config::from_dir(&fixture().join("model/wav2vec2-large-xlsr-53-english"))
        .expect("wav2vec2 config");
    let least = config.samples_for(tpinfer_wav2vec2::STATES_FOR_A_FRAME);
    assert_eq!(least, config.receptive_field() + 320, "two states, one hop apart");
    let speech = speech();
    let err = engine
        .encode_speech(&speech[..least - 1])
        .expect_err("too short")
        .to_string();
    assert!(
        err.contains("(--audio)") && err.contains(&format!("needs {least}")),
        "{err}"
    );
    let features = engine.encode_speech(&speech[..least]).expect("one frame's speech");
    assert_eq!(features.clips, 1);
    let shape = VideoShape {
        frames: CLIP_FRAMES,
        width: SIZE,
        height: SIZE,
    };
    let builder = Engine::builder(fixture().join("model")).device(DeviceKind::Cpu);
    let err = VideoEngine::start_s2v(builder, shape, least - 1, false)
        .err()
        .expect("planned for too short a speech")
        .to_string();
    assert!(err.contains("give longer audio"), "{err}");
    // A text-to-video DiT's engine has no speech stages.
    let t2v = tpinfer_tests::TinyWan::default();
    let dir = tempfile::tempdir().expect("tempdir");
    let dit = t2v.write(dir.path());
    let shape = VideoShape {
        frames: 5,
        width: 32,
        height: 32,
    };
    let err = VideoEngine::start_s2v(Engine::builder(&dit), shape, 16_000, false)
        .err()
        .expect("a T2V DiT")
        .to_string();
    assert!(err.contains("not a Wan2.2-S2V checkpoint"), "{err}");
}
