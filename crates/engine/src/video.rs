//! Video generation with a Wan DiT on N ranks: every rank holds its shard, runs the same
//! sampler steps in lockstep (their velocities agree after each all-reduce), and rank 0
//! reports progress and returns the latents.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{Placement, Plan};
use tpinfer_runtime::{check_after_step, Launch, ModelHandle, RankGroup, RuntimeError, Topology};
use tpinfer_umt5::Umt5Model;
use tpinfer_wan::sampler::Solver;
use tpinfer_wan::{WanModel, WanRank};
use tpinfer_wan_vae::WanVaeModel;

use crate::denoise::denoise;
use crate::error::finite;
use crate::frames::{FrameDecoder, Frames};
use crate::pipeline::{PromptEncoder, WanPipelineDir};
use crate::s2v::{s2v_decode_shape, S2vPipelineDir, S2vStages};
use crate::{EngineBuilder, EngineError};

/// The video a [`VideoEngine`] denoises: `frames` (4k + 1) of `width` × `height` pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoShape {
    pub frames: usize,
    pub width: usize,
    pub height: usize,
}

/// One denoising run.
#[derive(Debug, Clone)]
pub struct VideoRequest {
    /// umT5 text states `[tokens, text_dim]`.
    pub text: Tensor,
    /// The negative prompt's states, for classifier-free guidance.
    pub negative: Option<Tensor>,
    pub steps: usize,
    /// The flow schedule's shift (Wan: 5.0 for T2V at 480p/720p, 3.0 for S2V).
    pub shift: f64,
    /// CFG scale: above 1, every step also runs the negative prompt and guides away from it
    /// (which needs `negative`); at most 1, one forward per step.
    pub guide_scale: f64,
    pub solver: Solver,
    /// The seed of the starting noise.
    pub seed: u64,
    /// Starting latents `[channels, latent frames, h, w]` instead of seeded noise (`--init-latents`):
    /// to compare with another implementation from the same noise, or to re-run one exactly.
    pub init_latents: Option<Tensor>,
}

impl VideoRequest {
    /// Why this request cannot denoise, if it cannot (`EngineError::InvalidRequest`, naming the
    /// option). The engine checks every request; a caller that loads a large model can check
    /// first.
    pub fn check(&self) -> Result<(), EngineError> {
        if self.steps == 0 {
            return Err(EngineError::InvalidRequest("--steps must be at least 1".into()));
        }
        // Either would turn every latent into NaN, found only after the whole run.
        if !(self.shift.is_finite() && self.shift > 0.0) {
            return Err(EngineError::InvalidRequest(format!(
                "--shift {} must be above 0 (Wan: 5 for text-to-video, 3 for S2V)",
                self.shift
            )));
        }
        if !self.guide_scale.is_finite() {
            return Err(EngineError::InvalidRequest(format!(
                "--guide-scale {} is not a number (1 turns guidance off)",
                self.guide_scale
            )));
        }
        // Any scale up to 1 runs unguided, as diffusers runs it: a negative one can only be a
        // slip, and would pass for guidance that never happens.
        if self.guide_scale < 0.0 {
            return Err(EngineError::InvalidRequest(format!(
                "--guide-scale {} is below 0: guidance runs above 1 (Wan: 5 for text-to-video, 4.5 for S2V), and 1 \
                 turns it off",
                self.guide_scale
            )));
        }
        // Guidance never turns itself off for want of a negative prompt.
        if self.guided() && self.negative.is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "--guide-scale {} guides each step away from the negative prompt, whose states are missing: give \
                 them (tensor `negative` of --text-embeds, or --negative-embeds), or --guide-scale 1",
                self.guide_scale
            )));
        }
        Ok(())
    }

    /// Whether each step runs the negative prompt too (classifier-free guidance), as
    /// diffusers decides it: a scale above 1.
    pub fn guided(&self) -> bool {
        self.guide_scale > 1.0
    }
}

/// Rank 0's report after each step.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    pub index: usize,
    pub steps: usize,
    pub timestep: f64,
    pub elapsed: Duration,
    /// Rank 0's host time inside collectives during the step (see
    /// [`crate::GenerationStats::collectives`]).
    pub collectives: Duration,
}

/// What the ranks run.
pub(crate) enum Work {
    Denoise(VideoRequest),
    /// One S2V clip, conditioned on its inputs.
    DenoiseS2v(VideoRequest, S2vInputs),
    /// One velocity evaluation (no sampler, no guidance): for numerics and step timing;
    /// with `profile`, rank 0 times the stages of its forward.
    Velocity {
        latents: Tensor,
        timestep: f64,
        text: Tensor,
        /// An S2V model's clip conditioning.
        s2v: Option<S2vInputs>,
        profile: bool,
    },
}

/// One speech-to-video clip's conditioning as the host holds it (f32): what
/// [`VideoEngine::s2v_velocity`] hands every rank.
#[derive(Debug, Clone)]
pub struct S2vInputs {
    /// The reference image's latent, `[channels, 1, h, w]`.
    pub reference: Tensor,
    /// The motion frames' latents `[channels, 19, h, w]` (the clip before's last 73
    /// frames); `None` for the first clip, which S2V runs without them.
    pub motion: Option<Tensor>,
    /// The pose latents `[cond channels, latent frames, h, w]`; zeros without a pose video.
    pub pose: Tensor,
    /// The clip's wav2vec2 features per video frame, `[frames, 25, audio dim]`.
    pub audio: Tensor,
}

/// Time per named stage of one rank's forward, in first-seen order.
pub type StageProfile = Vec<(&'static str, Duration)>;

pub(crate) struct VideoJob {
    pub work: Work,
    pub steps: Option<Sender<StepReport>>,
}

/// Rank 0's result: the latents (or velocity), and its stage profile when one was asked for.
pub(crate) type JobResult = Result<Option<(Tensor, StageProfile)>, EngineError>;

/// A Wan DiT loaded on its ranks.
pub struct VideoEngine {
    pub(crate) group: RankGroup,
    dit: ModelHandle<WanRank>,
    shape: VideoShape,
    latent_shape: [usize; 4],
    /// The width of the text states the model takes (umT5's 4096 for Wan).
    text_dim: usize,
    /// Wan2.2-S2V's modules, whose forwards need a clip's conditioning.
    s2v: Option<tpinfer_wan::S2vModules>,
    /// Whether a run at the planned size has yet to be held to the plan.
    unchecked: AtomicBool,
    /// The prompt stage, when the engine was started on a pipeline directory.
    prompts: Option<PromptEncoder>,
    /// The decode stage, when the engine was started on a pipeline directory with a VAE.
    frames: Option<FrameDecoder>,
    /// S2V's speech encoder and VAE encoder, when started on an S2V checkpoint directory.
    pub(crate) s2v_stages: Option<S2vStages>,
}

/// Where a video engine's models come from.
enum Source {
    /// A Wan transformer directory alone.
    Dit,
    /// A diffusers Wan pipeline directory.
    Diffusers(WanPipelineDir),
    /// The official Wan2.2-S2V checkpoint directory.
    S2v(S2vPipelineDir),
}

impl Source {
    fn of(model: &std::path::Path) -> Result<Self, EngineError> {
        Ok(match (WanPipelineDir::detect(model), S2vPipelineDir::detect(model)) {
            (true, _) => Self::Diffusers(WanPipelineDir::open(model)?),
            (false, true) => Self::S2v(S2vPipelineDir::open(model)?),
            (false, false) => Self::Dit,
        })
    }
}

impl VideoEngine {
    /// Opens the model of `b` (a Wan transformer directory, a diffusers Wan pipeline
    /// directory, whose text encoder and VAE then run on the same ranks, or a Wan2.2-S2V
    /// checkpoint directory, whose speech encoder is then planned for a minute of speech),
    /// plans every rank for `shape` (refusing over budget), and loads the ranks.
    pub fn start(b: EngineBuilder, shape: VideoShape) -> Result<Self, EngineError> {
        Self::launch(b, shape, None, false)
    }

    /// [`Self::start`] on a Wan2.2-S2V checkpoint directory, its speech encoder planned for
    /// `speech_samples` of 16 kHz speech, and with `pose` its VAE encoder for a clip's pose
    /// frames; `shape` is a clip's (4k frames).
    pub fn start_s2v(
        b: EngineBuilder,
        shape: VideoShape,
        speech_samples: usize,
        pose: bool,
    ) -> Result<Self, EngineError> {
        if !S2vPipelineDir::detect(&b.model) {
            return Err(EngineError::InvalidRequest(format!(
                "{} is not a Wan2.2-S2V checkpoint directory (its config.json beside Wan2.1_VAE.pth)",
                b.model.display()
            )));
        }
        Self::launch(b, shape, Some(speech_samples), pose)
    }

    fn launch(
        b: EngineBuilder,
        shape: VideoShape,
        speech_samples: Option<usize>,
        pose: bool,
    ) -> Result<Self, EngineError> {
        let model_err = |e: tpinfer_plan::PlanError| EngineError::from(RuntimeError::Model(e.to_string()));
        if b.chat_template.is_some() {
            return Err(EngineError::InvalidRequest(format!(
                "{}: a chat template is for language models, not video models",
                b.model.display()
            )));
        }
        let source = Source::of(&b.model)?;
        let transformer = match &source {
            Source::Dit => &b.model,
            Source::Diffusers(p) => &p.transformer,
            Source::S2v(p) => &p.dit,
        };
        let wan_err = |e: &dyn std::fmt::Display| EngineError::from(RuntimeError::Model(e.to_string()));
        let model = WanModel::open_checkpoint(transformer)
            .map_err(|e| wan_err(&e))?
            .with_format(b.weight_format)
            .map_err(|e| wan_err(&e))?
            .with_self_attention(b.self_attention);
        let model = match &b.lora {
            Some(adapter) => model.with_lora(adapter.clone()).map_err(|e| wan_err(&e))?,
            None => model,
        };
        let config = model.config().clone();
        if matches!(source, Source::S2v(_)) && config.s2v.is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "{}: its config.json is not a speech-to-video DiT's (model_type s2v)",
                b.model.display()
            )));
        }
        let topology = Topology::new(b.tp, &b.device)?;
        if let Some(note) =
            crate::fp8_expanded_note(&topology).filter(|_| b.weight_format == tpinfer_weights::WeightFormat::Fp8)
        {
            tracing::warn!("{note}");
        }
        let dtype = b.dtype.unwrap_or(match topology.is_cpu() {
            true => DType::F32,
            false => DType::BF16,
        });
        // Requests choose their guidance; plan for the larger case.
        let placement = Placement::Dit {
            frames: shape.frames,
            width: shape.width,
            height: shape.height,
            cfg: true,
        };
        let mut launch = Launch::new(topology, b.group.clone());
        // The encoders run first; where they do not fit beside the DiT and the VAE, they are
        // freed before those load.
        let (text_dim, format) = (config.text_dim, b.weight_format);
        let prompts = match &source {
            Source::Dit => None,
            Source::Diffusers(p) => Some((&p.tokenizer, Umt5Model::open(&p.text_encoder).map_err(model_err)?)),
            Source::S2v(p) => Some((
                &p.tokenizer,
                Umt5Model::open_original(&p.text_encoder).map_err(model_err)?,
            )),
        }
        .map(|(tokenizer, encoder)| PromptEncoder::add(&mut launch, tokenizer, encoder, text_dim, dtype, format))
        .transpose()?;
        let speech = match &source {
            Source::S2v(p) => Some(S2vStages::add_speech(&mut launch, p, speech_samples)?),
            _ => None,
        };
        launch.may_free_here();
        let dit = launch.add(Arc::new(model), dtype, placement)?;
        let latent_shape = [
            config.in_channels,
            config.latent_frames(shape.frames),
            shape.height / 8,
            shape.width / 8,
        ];
        let (frames, s2v_stages) = match (&source, speech) {
            (Source::Diffusers(p), _) => match &p.vae {
                Some(vae) => {
                    let vae = WanVaeModel::open(vae).map_err(model_err)?;
                    (
                        Some(FrameDecoder::add(&mut launch, vae, shape, config.out_channels, dtype)?),
                        None,
                    )
                }
                None => (None, None),
            },
            (Source::S2v(p), Some(speech)) => {
                let vae = WanVaeModel::open_original(&p.vae).map_err(model_err)?;
                let decode = s2v_decode_shape(shape, latent_shape[1]);
                let frames = FrameDecoder::add(&mut launch, vae.clone(), decode, config.out_channels, dtype)?;
                let stages = S2vStages::new(&mut launch, speech, &vae, shape, pose, dtype)?;
                (Some(frames), Some(stages))
            }
            _ => (None, None),
        };
        let group = launch.start()?;
        Ok(Self {
            group,
            dit,
            shape,
            latent_shape,
            text_dim: config.text_dim,
            s2v: config.s2v.clone(),
            unchecked: AtomicBool::new(true),
            prompts,
            frames,
            s2v_stages,
        })
    }

    /// A prompt's umT5 states as the DiT takes them, `[512, text_dim]` f32 on the CPU: its
    /// tokens (whitespace folded, `</s>` appended, cut at 512) encoded on every rank, then
    /// zero-padded to 512, as Wan and diffusers hand them over. The empty prompt is diffusers'
    /// default negative. Needs an engine started on a pipeline directory, and where its
    /// encoder must make room for the DiT ([`Self::frees_encoder`]), no run before.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Tensor, EngineError> {
        let prompts = self.prompts.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "this engine holds a DiT alone: give text states (--text-embeds), or start it on a pipeline directory \
                 (model_index.json, tokenizer/, text_encoder/, transformer/) to encode prompts"
                    .into(),
            )
        })?;
        if self.group.is_freed(prompts.encoder.index()) {
            return Err(EngineError::InvalidRequest(
                "the text encoder was freed after the first run's prompts, to fit the DiT in the memory budget: encode \
                 every prompt before the first run, give text states (--save-text-embeds, then --text-embeds), or \
                 give the ranks room for both (a wider --tp or a larger --gpu-mem)"
                    .into(),
            ));
        }
        prompts.encode(&self.group, prompt)
    }

    /// Frees the text encoder and loads the DiT and the VAE, where the encoder must make room
    /// for them ([`Self::frees_encoder`]); otherwise nothing. The first run does it anyway:
    /// call it to time the load apart from the run.
    pub fn end_encoding(&self) -> Result<(), EngineError> {
        self.group.next_turn()?;
        Ok(())
    }

    /// Whether the text encoder is freed before the DiT and the VAE load, because the ranks'
    /// budget cannot hold all three (see [`tpinfer_plan::Residency`]).
    pub fn frees_encoder(&self) -> bool {
        matches!(self.group.residency(), tpinfer_plan::Residency::InTurns { .. })
    }

    /// Whether the engine holds a prompt encoder (it was started on a pipeline directory).
    pub fn encodes_prompts(&self) -> bool {
        self.prompts.is_some()
    }

    /// Decodes latents from [`Self::generate`] to the video on every rank, each decoding a
    /// band of every frame's rows: `[frames, 3, height, width]` in [−1, 1], f32 on the CPU.
    /// `on_progress` hears rank 0's tiles and latent frames done, out of how many. Needs an
    /// engine started on a pipeline directory with a `vae/`.
    pub fn decode(&self, latents: &Tensor, mut on_progress: impl FnMut(usize, usize)) -> Result<Frames, EngineError> {
        let frames = self.frames.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest(
                "this engine holds no VAE: start it on a pipeline directory with a vae/ folder to decode frames".into(),
            )
        })?;
        self.group.next_turn()?;
        frames.decode(&self.group, latents, &mut on_progress)
    }

    /// Whether the engine holds a VAE (it was started on a pipeline directory with `vae/`).
    pub fn decodes_frames(&self) -> bool {
        self.frames.is_some()
    }

    /// Denoises from seeded noise; `on_step` hears rank 0 after every step. Returns the
    /// latents `[channels, latent frames, height / 8, width / 8]`, f32 on the CPU.
    pub fn generate(&self, request: VideoRequest, on_step: impl FnMut(StepReport)) -> Result<Tensor, EngineError> {
        if self.s2v.is_some() {
            return Err(EngineError::InvalidRequest(
                "this is a speech-to-video (Wan2.2-S2V) model: it denoises clip by clip from audio and a \
                 reference image (`generate_s2v_clip`), which `generate` does not run"
                    .into(),
            ));
        }
        self.denoise(request, None, on_step)
    }

    /// An S2V model's clip, denoised from seeded noise as Wan2.2-S2V's `generate` denoises
    /// each clip: every step's conditional pass with the clip's conditioning, and with
    /// guidance an unconditional pass with the negative prompt and silent audio (the same
    /// reference, motion and pose). Returns the clip's latents, f32 on the CPU.
    pub fn generate_s2v_clip(
        &self,
        request: VideoRequest,
        inputs: S2vInputs,
        on_step: impl FnMut(StepReport),
    ) -> Result<Tensor, EngineError> {
        if self.s2v.is_none() {
            return Err(EngineError::InvalidRequest(
                "this model is not a speech-to-video one: `generate` denoises its videos".into(),
            ));
        }
        self.denoise(request, Some(inputs), on_step)
    }

    fn denoise(
        &self,
        request: VideoRequest,
        s2v: Option<S2vInputs>,
        mut on_step: impl FnMut(StepReport),
    ) -> Result<Tensor, EngineError> {
        request.check()?;
        self.check_text("the text states", &request.text)?;
        if let Some(negative) = &request.negative {
            self.check_text("the negative prompt's states", negative)?;
        }
        if let Some(init) = &request.init_latents {
            if !finite(init).map_err(|e| EngineError::from(RuntimeError::of_rank(0, e.into())))? {
                return Err(EngineError::InvalidRequest(
                    "--init-latents hold NaN or infinite values".into(),
                ));
            }
            if init.dims() != self.latent_shape {
                return Err(EngineError::InvalidRequest(format!(
                    "--init-latents are {:?}, but {} frames at {}x{} take latents {:?}",
                    init.dims(),
                    self.shape.frames,
                    self.shape.width,
                    self.shape.height,
                    self.latent_shape
                )));
            }
        }
        let work = match s2v {
            Some(inputs) => Work::DenoiseS2v(request, inputs),
            None => Work::Denoise(request),
        };
        Ok(self.run(work, &mut on_step)?.0)
    }

    /// The model's velocity for `latents` `[channels, latent frames, h, w]` at `timestep`
    /// given text states `[tokens, text_dim]`: one forward on every rank, f32 on the CPU.
    pub fn velocity(&self, latents: &Tensor, timestep: f64, text: &Tensor) -> Result<Tensor, EngineError> {
        Ok(self.velocity_with(latents, timestep, text, None, false)?.0)
    }

    /// An S2V model's velocity for one clip's `latents` given its conditioning: the
    /// audio encoded and the reference, motion and pose embedded on every rank, then one
    /// forward, f32 on the CPU. With `profile`, rank 0's stages as [`Self::velocity_profiled`].
    pub fn s2v_velocity(
        &self,
        latents: &Tensor,
        timestep: f64,
        text: &Tensor,
        inputs: &S2vInputs,
        profile: bool,
    ) -> Result<(Tensor, StageProfile), EngineError> {
        self.velocity_with(latents, timestep, text, Some(inputs.clone()), profile)
    }

    /// [`Self::velocity`] with the time of each stage of rank 0's forward (CUDA events on a
    /// GPU): where a step's time goes at this TP width, collectives included. Run a velocity
    /// first: this forward is not a warm-up.
    pub fn velocity_profiled(
        &self,
        latents: &Tensor,
        timestep: f64,
        text: &Tensor,
    ) -> Result<(Tensor, StageProfile), EngineError> {
        self.velocity_with(latents, timestep, text, None, true)
    }

    fn velocity_with(
        &self,
        latents: &Tensor,
        timestep: f64,
        text: &Tensor,
        s2v: Option<S2vInputs>,
        profile: bool,
    ) -> Result<(Tensor, StageProfile), EngineError> {
        self.check_text("the text states", text)?;
        if self.s2v.is_some() != s2v.is_some() {
            return Err(EngineError::InvalidRequest(
                match self.s2v.is_some() {
                    true => "a speech-to-video model's forward needs a clip's reference, pose and audio",
                    false => "this model is not a speech-to-video one: it takes no clip conditioning",
                }
                .into(),
            ));
        }
        if latents.dims() != self.latent_shape {
            return Err(EngineError::InvalidRequest(format!(
                "latents {:?} are not the {:?} this engine was planned for",
                latents.dims(),
                self.latent_shape
            )));
        }
        let work = Work::Velocity {
            latents: latents.clone(),
            timestep,
            text: text.clone(),
            s2v,
            profile,
        };
        self.run(work, &mut |_| {})
    }

    /// Text states must be `[tokens, text_dim]`: checked here, where the error can say so,
    /// rather than as a shape mismatch inside every rank's first forward.
    fn check_text(&self, what: &str, text: &Tensor) -> Result<(), EngineError> {
        match text.dims() {
            &[tokens, width] if tokens > 0 && width == self.text_dim => {}
            dims => {
                return Err(EngineError::InvalidRequest(format!(
                    "{what} are {dims:?}, but this model takes [tokens, {}] (umT5 states; --text-embeds, \
                     --negative-embeds)",
                    self.text_dim
                )))
            }
        }
        // NaN or infinite states would denoise into NaN, found only after the whole run.
        match finite(text) {
            Ok(true) => Ok(()),
            Ok(false) => Err(EngineError::InvalidRequest(format!(
                "{what} hold NaN or infinite values"
            ))),
            Err(e) => Err(RuntimeError::of_rank(0, e.into()).into()),
        }
    }

    fn run(&self, work: Work, on_step: &mut dyn FnMut(StepReport)) -> Result<(Tensor, StageProfile), EngineError> {
        // The plan is for the engine's video size; a velocity of other latents is not its case.
        let planned_size = match &work {
            Work::Denoise(_) | Work::DenoiseS2v(..) => true,
            Work::Velocity { latents, .. } => latents.dims() == self.latent_shape,
        };
        // The DiT runs in the pipeline's second turn when its text encoder must make room.
        self.group.next_turn()?;
        let check_memory = planned_size && self.unchecked.swap(false, Ordering::SeqCst);
        let held_now = self.group.held_now();
        let (steps_tx, steps_rx) = mpsc::channel();
        let job = Arc::new(VideoJob {
            work,
            steps: Some(steps_tx),
        });
        let (dit, latent_shape) = (self.dit, self.latent_shape);
        let task_job = job.clone();
        let pending = self.group.submit(move |rank| -> JobResult {
            let model = rank.models.get_mut(&dit)?;
            let out = denoise(model, &*rank.env.comm, &rank.env.device, latent_shape, &task_job)?;
            if check_memory {
                check_after_step(rank.env.rank, &rank.env.device, held_now[rank.env.rank]);
            }
            Ok(out)
        });
        // Every rank holds a clone of the job: the reports end when the last one is dropped.
        drop(job);
        for report in steps_rx.iter() {
            on_step(report);
        }
        pending
            .wait()?
            .into_iter()
            .flatten()
            .next()
            .ok_or_else(|| RuntimeError::Stopped("rank 0 returned no latents".into()).into())
    }

    pub fn shape(&self) -> VideoShape {
        self.shape
    }

    /// S2V: the pose latents' channels; `None` for other models.
    pub(crate) fn s2v_cond_dim(&self) -> Option<usize> {
        self.s2v.as_ref().map(|s| s.cond_dim)
    }

    /// The negative prompt a run guides away from when none is given: diffusers' empty
    /// prompt for text-to-video; for S2V, the one its config gives (`sample_neg_prompt`).
    pub fn default_negative_prompt(&self) -> &'static str {
        match self.s2v {
            Some(_) => tpinfer_wan::S2V_NEGATIVE_PROMPT,
            None => "",
        }
    }

    /// `[channels, latent frames, latent height, latent width]`.
    pub fn latent_shape(&self) -> [usize; 4] {
        self.latent_shape
    }

    /// The DiT's plan.
    pub fn plan(&self) -> &Plan {
        &self.group.plans()[self.dit.index()]
    }

    /// The fullest rank's planned bytes for everything it holds: the DiT, and a pipeline's
    /// text encoder beside it.
    pub fn planned_peak(&self) -> u64 {
        self.group.planned_totals().into_iter().max().unwrap_or(0)
    }

    /// Each rank's device memory now, with its peak since the start; `None` for CPU ranks.
    pub fn device_memory(&self) -> Vec<Option<crate::DeviceMemory>> {
        self.group.device_memory()
    }
}
