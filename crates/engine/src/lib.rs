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

pub use builder::{EngineBuilder, Fault, DEFAULT_STEP_TOKENS};
pub use candle_core::DType;
pub use engine::Engine;
pub use error::EngineError;
pub use frames::{Frames, VaeEngine};
pub use logprobs::{TokenLogprobs, MAX_TOP_LOGPROBS};
pub use pipeline::WanPipelineDir;
pub use request::{GenerateRequest, Prompt, SamplingParams};
pub use s2v::{
    wan21_vae_encoder, PoseFrames, S2vPipelineDir, S2vProgress, S2vRequest, S2vStageModels, S2vVideo, S2V_FPS,
};
pub use status::{Health, Load};
pub use stream::{EventStream, GenerationStats, StopReason, StreamEvent, TokenStream};
pub use tpinfer_comm::CommOptions;
pub use tpinfer_plan::{Plan, RankPlan};
pub use tpinfer_runtime::{DeviceKind, DeviceMemory, LoadProgress, RuntimeError, PLAN_TOLERANCE};
pub use tpinfer_wav2vec2::{VideoFrameFeatures, SAMPLE_RATE as SPEECH_SAMPLE_RATE};

pub use tpinfer_tokenizer::{ChatMessage, Tokenizer};
pub use tpinfer_wan::sampler::Solver;
pub use tpinfer_wan::{SelfAttention, S2V_MOTION_FRAMES};
pub use tpinfer_weights::{LoraAdapter, WeightFormat};
pub use video::{S2vInputs, StageProfile, StepReport, VideoEngine, VideoRequest, VideoShape};

/// What a run with FP8 weights is told where ranks expand them to the compute dtype for each
/// product (CPU ranks, GPUs before compute capability 8.9): that saves memory, not time.
/// `None` where every rank has FP8 tensor cores.
fn fp8_expanded_note(topology: &tpinfer_runtime::Topology) -> Option<String> {
    let mut places: Vec<String> = Vec::new();
    for device in topology.devices() {
        if tpinfer_layers::fp8_tensor_cores_on(device) {
            continue;
        }
        let place = match device.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => format!("GPU {gpu_id}"),
            _ => "CPU ranks".into(),
        };
        if !places.contains(&place) {
            places.push(place);
        }
    }
    (!places.is_empty()).then(|| {
        format!(
            "FP8 weights on {} are expanded to the compute dtype for each product: this saves memory, not \
             time (FP8 products run on GPUs of compute capability 8.9 or later)",
            places.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use tpinfer_runtime::{DeviceKind, Topology};

    #[test]
    fn fp8_weights_on_cpu_ranks_are_told_they_save_memory_not_time() -> Result<(), tpinfer_runtime::RuntimeError> {
        let note = super::fp8_expanded_note(&Topology::new(3, &DeviceKind::Cpu)?);
        let note = note.unwrap_or_default();
        assert!(note.starts_with("FP8 weights on CPU ranks are expanded"), "{note}");
        assert!(note.contains("saves memory, not time"), "{note}");
        assert_eq!(note.matches("CPU ranks").count(), 1, "each place once: {note}");
        Ok(())
    }
}
