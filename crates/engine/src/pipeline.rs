//! A diffusers Wan pipeline directory (`model_index.json`, `tokenizer/`, `text_encoder/`,
//! `transformer/`, …) and its prompt stage: the prompt's tokens, and its umT5 states handed to
//! the DiT as Wan and diffusers hand them over.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{Placement, ShardedModel};
use tpinfer_runtime::{Launch, ModelHandle, RankGroup, RuntimeError};
use tpinfer_tokenizer::Tokenizer;
use tpinfer_umt5::{Umt5Model, Umt5Rank, TEXT_TOKENS};
use tpinfer_weights::WeightFormat;

use crate::EngineError;

/// The folders of a Wan pipeline that tpinfer reads.
#[derive(Debug, Clone)]
pub struct WanPipelineDir {
    pub transformer: PathBuf,
    pub text_encoder: PathBuf,
    pub tokenizer: PathBuf,
    /// The VAE that decodes the latents to frames; without it a run ends at the latents.
    pub vae: Option<PathBuf>,
}

impl WanPipelineDir {
    /// Whether `path` is a pipeline directory rather than one model's.
    pub fn detect(path: &Path) -> bool {
        path.join("model_index.json").is_file()
    }

    /// Checks that `path` is a Wan pipeline with the folders tpinfer reads.
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let index = path.join("model_index.json");
        let invalid = |detail: String| EngineError::InvalidRequest(format!("{}: {detail}", index.display()));
        let text = std::fs::read_to_string(&index).map_err(|e| invalid(e.to_string()))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let class = json.get("_class_name").and_then(|c| c.as_str()).unwrap_or("");
        if !class.starts_with("Wan") {
            return Err(invalid(format!(
                "`_class_name` is `{class}`: tpinfer runs Wan text-to-video pipelines (WanPipeline)"
            )));
        }
        let folder = |name: &str| -> Result<PathBuf, EngineError> {
            let dir = path.join(name);
            match dir.is_dir() {
                true => Ok(dir),
                false => Err(invalid(format!("the pipeline has no `{name}/` folder beside it"))),
            }
        };
        Ok(Self {
            transformer: folder("transformer")?,
            text_encoder: folder("text_encoder")?,
            tokenizer: folder("tokenizer")?,
            vae: Some(path.join("vae")).filter(|dir| dir.is_dir()),
        })
    }
}

/// The prompt stage of a pipeline: its tokenizer, and its encoder on the ranks.
pub(crate) struct PromptEncoder {
    pub encoder: ModelHandle<Umt5Rank>,
    pub tokenizer: Arc<Tokenizer>,
}

impl PromptEncoder {
    /// Adds `encoder` (umT5, its tokenizer in `tokenizer`) to the ranks `launch` starts,
    /// beside a DiT whose text states are `text_dim` wide, for prompts of up to Wan's 512
    /// tokens.
    pub fn add(
        launch: &mut Launch,
        tokenizer: &Path,
        encoder: Umt5Model,
        text_dim: usize,
        dtype: DType,
        format: WeightFormat,
    ) -> Result<Self, EngineError> {
        let tokenizer = Arc::new(Tokenizer::from_hf_dir(tokenizer)?);
        let encoder = encoder
            .with_format(format)
            .map_err(|e| RuntimeError::Model(e.to_string()))?;
        if encoder.config().d_model != text_dim {
            return Err(EngineError::InvalidRequest(format!(
                "{}: the text encoder's d_model {} is not the DiT's text_dim {text_dim}",
                encoder.name(),
                encoder.config().d_model
            )));
        }
        let placement = Placement::llm(TEXT_TOKENS, 1);
        Ok(Self {
            encoder: launch.add(Arc::new(encoder), dtype, placement)?,
            tokenizer,
        })
    }

    /// The prompt's states on `group`'s ranks, zero-padded to 512 (see
    /// `VideoEngine::encode_prompt`).
    pub fn encode(&self, group: &RankGroup, prompt: &str) -> Result<Tensor, EngineError> {
        let start = std::time::Instant::now();
        let ids = self.ids(prompt, TEXT_TOKENS)?;
        let tokens = ids.len();
        let encoder = self.encoder;
        let states = crate::on_ranks::rank0_on_host(group, "states", move |rank| {
            let r = rank.env.rank;
            Ok(rank
                .models
                .get_mut(&encoder)?
                .encode(&ids)
                .map_err(|e| RuntimeError::of_rank(r, e))?)
        })?;
        tracing::debug!(tokens, seconds = start.elapsed().as_secs_f64(), "encoded a prompt");
        // NaN states would denoise into NaN, found only after the whole run.
        match crate::error::finite(&states) {
            Ok(true) => pad_states(&states, TEXT_TOKENS),
            Ok(false) => Err(EngineError::NonFinite {
                what: "text encoder's states",
                stage: "encoding the prompt".into(),
            }),
            Err(e) => Err(RuntimeError::of_rank(0, e.into()).into()),
        }
    }

    /// The prompt's token ids as Wan's pipeline makes them: whitespace runs folded to one
    /// space and trimmed, the tokenizer's `</s>` appended, at most `tokens` ids (a longer
    /// prompt is cut, keeping its `</s>`).
    pub fn ids(&self, prompt: &str, tokens: usize) -> Result<Vec<u32>, EngineError> {
        let clean = prompt.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut ids = self.tokenizer.encode(&clean, true)?;
        if ids.len() > tokens {
            let end = ids.last().copied();
            ids.truncate(tokens - 1);
            ids.extend(end);
        }
        Ok(ids)
    }
}

/// `states` `[n, d]` (n ≤ `tokens`) zero-padded to `[tokens, d]` in f32: the DiT
/// cross-attends to all of them, as Wan and diffusers give it the padded states.
fn pad_states(states: &Tensor, tokens: usize) -> Result<Tensor, EngineError> {
    let tensor_err = |e: candle_core::Error| EngineError::from(RuntimeError::of_rank(0, e.into()));
    let (n, d) = states.dims2().map_err(tensor_err)?;
    let states = states.to_dtype(DType::F32).map_err(tensor_err)?;
    match tokens.checked_sub(n) {
        Some(0) => Ok(states),
        Some(pad) => {
            let zeros = Tensor::zeros((pad, d), DType::F32, states.device()).map_err(tensor_err)?;
            Tensor::cat(&[&states, &zeros], 0).map_err(tensor_err)
        }
        None => Err(EngineError::InvalidRequest(format!(
            "{n} prompt tokens are more than the {tokens} the DiT takes"
        ))),
    }
}
