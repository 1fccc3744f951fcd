//! Speech-to-video with Wan2.2-S2V: the official checkpoint directory, its stages on the ranks
//! (umT5, wav2vec2, the S2V DiT, the VAE's encoder and decoder), and the clip-by-clip run of
//! the wan22 wheel's `WanS2V.generate`: the speech cut into clips of the clip's frames, each
//! clip denoised from its own seed (the run's seed + its index) with the reference image's
//! latent, its audio and, after the first, the motion latents of the last 73 frames made so
//! far; the first clip decoded after the reference latent and cut by its first three frames,
//! the others after their motion latents.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{Placement, ShardedModel};
use tpinfer_runtime::{Launch, ModelHandle, RankGroup, RuntimeError};
use tpinfer_umt5::Umt5Model;
use tpinfer_wan::{WanModel, S2V_MOTION_FRAMES};
use tpinfer_wan_vae::{WanVaeEncoder, WanVaeEncoderModel, WanVaeModel};
use tpinfer_wav2vec2::{
    per_video_frame, VideoFrameFeatures, Wav2Vec2Model, Wav2Vec2Rank, SAMPLE_RATE, STATES_FOR_A_FRAME,
};
use tpinfer_weights::WeightFormat;

use crate::error::finite;
use crate::video::{S2vInputs, StepReport, VideoRequest, VideoShape};
use crate::{EngineError, VideoEngine};

/// The frame rate S2V makes video at (`sample_fps`), and reads the speech for.
pub const S2V_FPS: usize = 16;

/// The frames of the first clip's decode that S2V cuts (`generate`, `drop_first_motion`):
/// its reference latent's frame and the two after it.
const FIRST_CLIP_CUT: usize = 3;

/// The folders and files of the official Wan2.2-S2V-14B checkpoint that tpinfer reads: the
/// DiT (`config.json` and its safetensors) at the top, Wan's own umT5 and VAE as `.pth`
/// state dicts beside it, the tokenizer and wav2vec2 in folders.
#[derive(Debug, Clone)]
pub struct S2vPipelineDir {
    pub dit: PathBuf,
    pub text_encoder: PathBuf,
    pub tokenizer: PathBuf,
    pub vae: PathBuf,
    pub wav2vec2: PathBuf,
}

impl S2vPipelineDir {
    const TEXT_ENCODER: &'static str = "models_t5_umt5-xxl-enc-bf16.pth";
    const TOKENIZER: &'static str = "google/umt5-xxl";
    const VAE: &'static str = "Wan2.1_VAE.pth";
    const WAV2VEC2: &'static str = "wav2vec2-large-xlsr-53-english";

    /// Whether `path` is laid out as the official S2V checkpoint (its DiT's `config.json`
    /// beside `Wan2.1_VAE.pth`).
    pub fn detect(path: &Path) -> bool {
        path.join("config.json").is_file() && path.join(Self::VAE).is_file()
    }

    /// Checks that every part tpinfer reads is there, naming the first that is not.
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let need = |name: &str, dir: bool| -> Result<PathBuf, EngineError> {
            let p = path.join(name);
            match (dir, p.is_dir(), p.is_file()) {
                (true, true, _) | (false, _, true) => Ok(p),
                _ => Err(EngineError::InvalidRequest(format!(
                    "{}: the speech-to-video checkpoint has no `{name}`{} beside its config.json (the layout \
                     Wan2.2-S2V-14B ships: {}, {}/, {}, {}/)",
                    path.display(),
                    if dir { "/ folder" } else { "" },
                    Self::TEXT_ENCODER,
                    Self::TOKENIZER,
                    Self::VAE,
                    Self::WAV2VEC2
                ))),
            }
        };
        Ok(Self {
            dit: path.to_path_buf(),
            text_encoder: need(Self::TEXT_ENCODER, false)?,
            tokenizer: need(Self::TOKENIZER, true)?,
            vae: need(Self::VAE, false)?,
            wav2vec2: need(Self::WAV2VEC2, true)?,
        })
    }
}

/// An S2V pipeline's stages opened for planning (configs and headers only), in the order they
/// run: umT5, wav2vec2, the DiT, the VAE's decoder, and its encoder.
pub struct S2vStageModels {
    pub text_encoder: Arc<dyn ShardedModel>,
    pub speech_encoder: Arc<dyn ShardedModel>,
    pub dit: Arc<dyn ShardedModel>,
    pub vae: Arc<dyn ShardedModel>,
    pub vae_encoder: Arc<dyn ShardedModel>,
}

impl S2vPipelineDir {
    /// Its stages for the planner, the text encoder's and the DiT's linear weights in
    /// `format`, the DiT's self-attention at `self_attention`.
    pub fn stage_models(
        &self,
        format: WeightFormat,
        self_attention: tpinfer_wan::SelfAttention,
    ) -> Result<S2vStageModels, EngineError> {
        let err = |e: tpinfer_plan::PlanError| EngineError::from(RuntimeError::Model(e.to_string()));
        let vae = WanVaeModel::open_original(&self.vae).map_err(err)?;
        Ok(S2vStageModels {
            text_encoder: Arc::new(
                Umt5Model::open_original(&self.text_encoder)
                    .map_err(err)?
                    .with_format(format)
                    .map_err(err)?,
            ),
            speech_encoder: Arc::new(Wav2Vec2Model::open(&self.wav2vec2).map_err(err)?),
            dit: Arc::new(
                WanModel::open_checkpoint(&self.dit)
                    .map_err(|e| EngineError::from(RuntimeError::Model(e.to_string())))?
                    .with_format(format)
                    .map_err(err)?
                    .with_self_attention(self_attention),
            ),
            vae_encoder: Arc::new(WanVaeEncoderModel::of(&vae)),
            vae: Arc::new(vae),
        })
    }
}

/// The encoder of Wan2.1's VAE preset, for planning S2V's preset pipeline.
pub fn wan21_vae_encoder() -> Option<Arc<dyn ShardedModel>> {
    WanVaeModel::preset("wan2.1-vae").map(|vae| Arc::new(WanVaeEncoderModel::of(&vae)) as Arc<dyn ShardedModel>)
}

/// Fails unless `pose` is `[3, n, height, width]` of `shape`: n at least 1 for the whole
/// video's frames, at most `per_clip` for a clip's.
fn check_pose(pose: &Tensor, shape: VideoShape, per_clip: Option<usize>) -> Result<(), EngineError> {
    let (frames, want) = match per_clip {
        None => (1..=usize::MAX, "at least one frame".to_string()),
        Some(most) => (0..=most, format!("at most {most} frames")),
    };
    match pose.dims() {
        &[3, n, h, w] if frames.contains(&n) && h == shape.height && w == shape.width => Ok(()),
        dims => Err(EngineError::InvalidRequest(format!(
            "the pose frames are {dims:?}; give [3, frames, {}, {}] with {want}",
            shape.height, shape.width
        ))),
    }
}

/// Frames `first .. first + count` of the pose frames `pose` `[3, frames, h, w]`, −1 past their
/// end (S2V's padding of a pose video shorter than the speech).
fn clip_pose(pose: &Tensor, first: usize, count: usize) -> candle_core::Result<Tensor> {
    let (_, frames, h, w) = pose.dims4()?;
    let held = frames.saturating_sub(first).min(count);
    if held == count {
        return pose.narrow(1, first, count);
    }
    let padding = Tensor::full(-1f32, (3, count - held, h, w), pose.device())?.to_dtype(pose.dtype())?;
    match held {
        0 => Ok(padding),
        _ => Tensor::cat(&[&pose.narrow(1, first, held)?, &padding], 1),
    }
}

/// The most frames S2V encodes at once: the motion frames, or with a pose video a clip's pose
/// frames after a copy of their first.
fn encoded_frames(clip: VideoShape, pose: bool) -> usize {
    match pose {
        true => S2V_MOTION_FRAMES.max(clip.frames + 1),
        false => S2V_MOTION_FRAMES,
    }
}

/// The VAE decode that S2V's clips need at most: a later clip's motion latents and its own.
pub(crate) fn s2v_decode_shape(clip: VideoShape, clip_latents: usize) -> VideoShape {
    VideoShape {
        frames: (S2V_MOTION_FRAMES.div_ceil(4) + clip_latents - 1) * 4 + 1,
        ..clip
    }
}

/// The speech encoder's stage: its model on the ranks, and the fewest samples of speech that
/// make a video frame.
#[derive(Clone, Copy)]
pub(crate) struct SpeechStage {
    model: ModelHandle<Wav2Vec2Rank>,
    least_samples: usize,
}

/// Refuses speech too short for a video frame before any rank encodes it.
fn check_speech_length(samples: usize, least: usize) -> Result<(), EngineError> {
    if samples >= least {
        return Ok(());
    }
    let ms = |samples: usize| 1000.0 * samples as f64 / SAMPLE_RATE as f64;
    Err(EngineError::InvalidRequest(format!(
        "the speech (--audio) is {samples} samples ({:.0} ms at {SAMPLE_RATE} Hz); the first video frame needs {least} \
         ({:.0} ms): give longer audio",
        ms(samples),
        ms(least)
    )))
}

/// S2V's stages besides the prompt encoder, the DiT and the decoder, on the ranks.
pub(crate) struct S2vStages {
    speech: SpeechStage,
    encoder: ModelHandle<WanVaeEncoder>,
    /// Whether the encoder was planned for a clip's pose frames.
    pose: bool,
}

impl S2vStages {
    /// The speech encoder, in f32 as S2V runs it, planned for `samples` of 16 kHz audio (or,
    /// unknown, a minute). Added with the prompt encoder, in the first turn.
    pub fn add_speech(
        launch: &mut Launch,
        dir: &S2vPipelineDir,
        samples: Option<usize>,
    ) -> Result<SpeechStage, EngineError> {
        let speech = Wav2Vec2Model::open(&dir.wav2vec2).map_err(|e| RuntimeError::Model(e.to_string()))?;
        let least_samples = speech.config().samples_for(STATES_FOR_A_FRAME);
        let placement = match samples {
            Some(n) => {
                check_speech_length(n, least_samples)?;
                Placement::llm(speech.config().frames(n).max(1), 1)
            }
            None => speech.default_placement(),
        };
        let model = launch.add(Arc::new(speech), DType::F32, placement)?;
        Ok(SpeechStage { model, least_samples })
    }

    /// The VAE's encoder beside its decoder, for the reference image and a clip's motion
    /// frames at `clip`'s size, and with `pose`, a clip's pose frames after their first.
    pub fn new(
        launch: &mut Launch,
        speech: SpeechStage,
        vae: &WanVaeModel,
        clip: VideoShape,
        pose: bool,
        dtype: DType,
    ) -> Result<Self, EngineError> {
        let placement = Placement::Dit {
            frames: encoded_frames(clip, pose),
            width: clip.width,
            height: clip.height,
            cfg: false,
        };
        let encoder = launch.add(Arc::new(WanVaeEncoderModel::of(vae)), dtype, placement)?;
        Ok(Self { speech, encoder, pose })
    }

    /// The speech's wav2vec2 states `[layers + 1, frames, width]` on every rank, rank 0's on
    /// the CPU.
    fn speech_states(&self, group: &RankGroup, samples: &[f32]) -> Result<Tensor, EngineError> {
        let (speech, samples) = (self.speech.model, samples.to_vec());
        crate::on_ranks::rank0_on_host(group, "speech states", move |rank| {
            let r = rank.env.rank;
            Ok(rank
                .models
                .get_mut(&speech)?
                .hidden_states(&samples)
                .map_err(|e| RuntimeError::of_rank(r, e))?)
        })
    }

    /// `pixels` `[3, 1 + 4k, height, width]` in [−1, 1] encoded to normalised latents on
    /// every rank (each encodes whole frames), rank 0's as f32 on the CPU.
    fn encode_pixels(&self, group: &RankGroup, pixels: &Tensor) -> Result<Tensor, EngineError> {
        let (encoder, pixels) = (self.encoder, pixels.clone());
        let latents = crate::on_ranks::rank0_on_host(group, "latents", move |rank| {
            let r = rank.env.rank;
            Ok(rank
                .models
                .get_mut(&encoder)?
                .encode(&pixels)
                .map_err(|e| RuntimeError::of_rank(r, e))?)
        })?;
        match finite(&latents) {
            Ok(true) => Ok(latents),
            Ok(false) => Err(EngineError::NonFinite {
                what: "latents",
                stage: "the VAE's encode".into(),
            }),
            Err(e) => Err(RuntimeError::of_rank(0, e.into()).into()),
        }
    }
}

/// Where a speech-to-video run's pose frames come from: `[3, n, height, width]` in [−1, 1]
/// (`tpinfer_media::pose_pixels`). Clip `i` takes frames `i · clip frames ..`; those past the
/// video's end are −1, as S2V pads a pose video shorter than the speech.
pub enum PoseFrames {
    /// All of them at once.
    Whole(Tensor),
    /// Clip by clip, as a long video is read (`tpinfer_media::VideoReader`): called with each
    /// clip's index in order, it gives that clip's frames, at most a clip's (fewer, or none,
    /// past the video's end). Only one clip's pixels are held at a time.
    PerClip(Box<dyn FnMut(usize) -> Result<Tensor, String>>),
}

impl std::fmt::Debug for PoseFrames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Whole(frames) => f.debug_tuple("Whole").field(&frames.dims()).finish(),
            Self::PerClip(_) => f.write_str("PerClip"),
        }
    }
}

/// A speech-to-video run.
#[derive(Debug)]
pub struct S2vRequest {
    /// Each clip's denoising: the prompt's and the negative prompt's states, steps, shift,
    /// guidance, solver; clip `i` starts from the noise of `seed + i`, or from row `i` of
    /// `init_latents` (`[clips, channels, latent frames, h, w]`) where given: to compare with
    /// another implementation from the same noise.
    pub denoise: VideoRequest,
    /// The speech's features per video frame ([`VideoEngine::encode_speech`]).
    pub speech: VideoFrameFeatures,
    /// The reference image `[3, 1, height, width]` in [−1, 1], at the engine's size
    /// (`tpinfer_media::read_reference_image`).
    pub reference: Tensor,
    /// At most this many clips; the speech's length decides otherwise.
    pub max_clips: Option<usize>,
    /// The pose video's frames. Without one, the pose latents are zeros, as S2V's are. Needs
    /// an engine started with a pose.
    pub pose: Option<PoseFrames>,
}

/// What a speech-to-video run reports as it goes, from rank 0.
#[derive(Debug, Clone, Copy)]
pub enum S2vProgress {
    /// Clip `index` (from 0) of `clips` begins.
    Clip {
        index: usize,
        clips: usize,
    },
    Step(StepReport),
    /// The clip's decode: tiles and latent frames done, out of how many.
    Decode {
        done: usize,
        total: usize,
    },
}

/// A speech-to-video run's frames: `[frames, 3, height, width]` in [−1, 1], f32 on the CPU.
#[derive(Debug, Clone)]
pub struct S2vVideo {
    pub frames: Tensor,
    pub clips: usize,
}

impl VideoEngine {
    /// S2V: the features of `samples` (mono speech at 16 kHz) for every video frame of the
    /// whole clips they fill: wav2vec2's states on the ranks, resampled to the video's rate as
    /// S2V does. Run it with the prompts, before [`Self::end_encoding`]: the speech encoder
    /// is freed with the text encoder where the ranks hold them in turns.
    pub fn encode_speech(&self, samples: &[f32]) -> Result<VideoFrameFeatures, EngineError> {
        let stages = self.stages()?;
        check_speech_length(samples.len(), stages.speech.least_samples)?;
        if self.group.is_freed(stages.speech.model.index()) {
            return Err(EngineError::InvalidRequest(
                "the speech encoder was freed with the text encoder, to fit the DiT in the memory budget: encode the \
                 speech before the first clip (or give the ranks room for both: a wider --tp or a larger --gpu-mem)"
                    .into(),
            ));
        }
        let states = stages.speech_states(&self.group, samples)?;
        Ok(per_video_frame(&states, S2V_FPS, self.shape().frames).map_err(|e| RuntimeError::of_rank(0, e))?)
    }

    fn stages(&self) -> Result<&S2vStages, EngineError> {
        self.s2v_stages.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "speech-to-video needs an engine started on a Wan2.2-S2V checkpoint directory (its config.json \
                 beside Wan2.1_VAE.pth, the umT5 .pth, google/umt5-xxl/ and the wav2vec2 folder)"
                    .into(),
            )
        })
    }

    /// Makes the video of `request`'s speech and reference image clip by clip, as
    /// Wan2.2-S2V's `generate` does (see the module's summary). Needs an engine started on an
    /// S2V checkpoint directory ([`VideoEngine::start_s2v`]).
    pub fn generate_s2v(
        &self,
        request: S2vRequest,
        mut on_progress: impl FnMut(S2vProgress),
    ) -> Result<S2vVideo, EngineError> {
        let stages = self.stages()?;
        request.denoise.check()?;
        let shape = self.shape();
        let [z, clip_latents, h, w] = self.latent_shape();
        let tensor_err = |e: candle_core::Error| EngineError::from(RuntimeError::of_rank(0, e.into()));
        let init = request.denoise.init_latents.clone();
        if let Some(init) = &init {
            match init.dims() {
                &[n, c, f, lh, lw] if n >= 1 && [c, f, lh, lw] == [z, clip_latents, h, w] => {}
                dims => {
                    return Err(EngineError::InvalidRequest(format!(
                        "--init-latents are {dims:?}; a speech-to-video run starts each clip from one row of [clips, \
                         {z}, {clip_latents}, {h}, {w}]"
                    )))
                }
            }
        }
        match request.reference.dims() {
            &[3, 1, rh, rw] if rh == shape.height && rw == shape.width => {}
            dims => {
                return Err(EngineError::InvalidRequest(format!(
                    "the reference image is {dims:?}; this engine makes {}x{} frames and takes [3, 1, {}, {}]",
                    shape.width, shape.height, shape.height, shape.width
                )))
            }
        }
        let features = &request.speech;
        if features.features.dim(0).map_err(tensor_err)? != features.clips * shape.frames {
            return Err(EngineError::InvalidRequest(format!(
                "the speech features {:?} are not {} clips of {} frames (encode them with this engine)",
                features.features.dims(),
                features.clips,
                shape.frames
            )));
        }
        let mut clips = request.max_clips.map_or(features.clips, |n| n.min(features.clips));
        if let Some(init) = &init {
            clips = clips.min(init.dim(0).map_err(tensor_err)?);
        }
        if clips == 0 {
            return Err(EngineError::InvalidRequest(
                "no clip to make: --max-clips 0 or --init-latents of no rows".into(),
            ));
        }
        if let Some(pose) = &request.pose {
            if !stages.pose {
                return Err(EngineError::InvalidRequest(
                    "a pose video needs an engine started with one (its encode of a clip's frames is planned then)"
                        .into(),
                ));
            }
            if let PoseFrames::Whole(frames) = pose {
                check_pose(frames, shape, None)?;
            }
        }
        // Every input checked; the prompt and speech encoders are done: the DiT's turn.
        self.group.next_turn()?;
        let reference = stages.encode_pixels(&self.group, &request.reference)?;
        let no_pose = self.s2v_pose()?;
        let mut pose = request.pose;
        let mut motion: Option<Tensor> = None;
        // The last frames made, as the motion frames' pixels: zeros before the first clip.
        let mut last = Tensor::zeros(
            (S2V_MOTION_FRAMES, 3, shape.height, shape.width),
            DType::F32,
            &Device::Cpu,
        )
        .map_err(tensor_err)?;
        let mut parts = Vec::with_capacity(clips);
        for index in 0..clips {
            on_progress(S2vProgress::Clip { index, clips });
            let audio = features
                .features
                .narrow(0, index * shape.frames, shape.frames)
                .map_err(tensor_err)?;
            // The clip's pose frames after a copy of their first, encoded, less that latent.
            let pose = match &mut pose {
                Some(pose) => {
                    let frames = match pose {
                        PoseFrames::Whole(frames) => clip_pose(frames, index * shape.frames, shape.frames),
                        PoseFrames::PerClip(next) => {
                            let frames = next(index).map_err(|detail| {
                                EngineError::InvalidRequest(format!("clip {index}'s pose frames: {detail}"))
                            })?;
                            check_pose(&frames, shape, Some(shape.frames))?;
                            clip_pose(&frames, 0, shape.frames)
                        }
                    }
                    .map_err(tensor_err)?;
                    let first = frames.narrow(1, 0, 1).map_err(tensor_err)?;
                    let pixels = Tensor::cat(&[&first, &frames], 1).map_err(tensor_err)?;
                    let latents = stages.encode_pixels(&self.group, &pixels)?;
                    latents.narrow(1, 1, clip_latents).map_err(tensor_err)?
                }
                None => no_pose.clone(),
            };
            let inputs = S2vInputs {
                reference: reference.clone(),
                motion: motion.clone(),
                pose,
                audio,
            };
            let denoise = VideoRequest {
                seed: request.denoise.seed.wrapping_add(index as u64),
                init_latents: init.as_ref().map(|i| i.get(index)).transpose().map_err(tensor_err)?,
                ..request.denoise.clone()
            };
            let latents = self.generate_s2v_clip(denoise, inputs, |step| on_progress(S2vProgress::Step(step)))?;
            // The first clip decodes after the reference latent, the others after their
            // motion latents; each keeps its last clip's frames, the first less its first three.
            let before = motion.as_ref().unwrap_or(&reference);
            let joined = Tensor::cat(&[before, &latents], 1).map_err(tensor_err)?;
            let decoded = self.decode(&joined, |done, total| on_progress(S2vProgress::Decode { done, total }))?;
            let made = decoded.dim(0).map_err(tensor_err)?;
            let keep = match index {
                0 => shape.frames - FIRST_CLIP_CUT,
                _ => shape.frames,
            };
            let image = decoded.narrow(0, made - keep, keep).map_err(tensor_err)?;
            // The next clip's motion: the last 73 frames made (zeros before the first clip's
            // where it made fewer), encoded.
            if index + 1 < clips {
                let overlap = S2V_MOTION_FRAMES.min(keep);
                last = Tensor::cat(
                    &[
                        &last
                            .narrow(0, overlap, S2V_MOTION_FRAMES - overlap)
                            .map_err(tensor_err)?,
                        &image.narrow(0, keep - overlap, overlap).map_err(tensor_err)?,
                    ],
                    0,
                )
                .map_err(tensor_err)?;
                let pixels = last.permute((1, 0, 2, 3)).map_err(tensor_err)?;
                motion = Some(stages.encode_pixels(&self.group, &pixels)?);
            }
            parts.push(image);
        }
        let frames = Tensor::cat(&parts, 0).map_err(tensor_err)?;
        Ok(S2vVideo { frames, clips })
    }

    /// The pose latents of a run without a pose video: zeros, as S2V's `COND[0] * 0`.
    fn s2v_pose(&self) -> Result<Tensor, EngineError> {
        let [_, frames, h, w] = self.latent_shape();
        let cond = self
            .s2v_cond_dim()
            .ok_or_else(|| EngineError::InvalidRequest("this model is not a speech-to-video one".into()))?;
        Tensor::zeros((cond, frames, h, w), DType::F32, &Device::Cpu)
            .map_err(|e| RuntimeError::of_rank(0, e.into()).into())
    }
}
