//! The tpinfer engine: a tensor-parallel model on N ranks behind a handle a service can share.
//!
//! ```no_run
//! use tpinfer_engine::{Engine, GenerateRequest, Prompt, StreamEvent};
//!
//! let engine = Engine::builder("models/llama-3.2-1b").tp(2).build()?;
//! let request = GenerateRequest::new(Prompt::text("The capital of France is"), 16);
//! for event in engine.generate(request)? {
//!     match event? {
//!         StreamEvent::Token { text, .. } | StreamEvent::Tail(text) => print!("{text}"),
//!         StreamEvent::Done(stats) => eprintln!("\n{:.1} tok/s", stats.decode_tokens_per_second()),
//!     }
//! }
//! # Ok::<(), tpinfer_engine::EngineError>(())
//! ```

mod batching;
mod blocks;
mod builder;
mod denoise;
mod engine;
mod error;
mod frames;
mod logprobs;
mod on_ranks;
mod pipeline;
mod rank;
pub mod registry;
mod request;
mod s2v;
mod status;
mod stream;
mod video;

pub use builder::{EngineBuilder, Fault};
pub use candle_core::DType;
pub use engine::Engine;
pub use error::EngineError;
pub use frames::{Frames, VaeEngine};
pub use logprobs::{TokenLogprobs, MAX_TOP_LOGPROBS};
pub use pipeline::WanPipelineDir;
pub use request::{GenerateRequest, Prompt, SamplingParams};
pub use s2v::{wan21_vae_encoder, S2vPipelineDir, S2vProgress, S2vRequest, S2vStageModels, S2vVideo, S2V_FPS};
pub use status::{Health, Load};
pub use stream::{EventStream, GenerationStats, StopReason, StreamEvent, TokenStream};
pub use tpinfer_comm::CommOptions;
pub use tpinfer_plan::{Plan, RankPlan};
pub use tpinfer_runtime::{DeviceKind, DeviceMemory, LoadProgress, RuntimeError, PLAN_TOLERANCE};
pub use tpinfer_wav2vec2::VideoFrameFeatures;

pub use tpinfer_tokenizer::{ChatMessage, Tokenizer};
pub use tpinfer_wan::sampler::Solver;
pub use tpinfer_wan::{SelfAttention, S2V_MOTION_FRAMES};
pub use tpinfer_weights::{LoraAdapter, WeightFormat};
pub use video::{S2vInputs, StageProfile, StepReport, VideoEngine, VideoRequest, VideoShape};

/// What a run with FP8 weights on CPU ranks is told: the weights are expanded to the compute
/// dtype for each product (as on GPUs before compute capability 8.9), which saves memory, not
/// time.
const FP8_ON_CPU: &str = "FP8 weights on CPU ranks are expanded to the compute dtype for each product: \
    this saves memory, not time (FP8 products run on GPUs of compute capability 8.9 or later)";
