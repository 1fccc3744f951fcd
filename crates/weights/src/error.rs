use std::path::PathBuf;

/// Why weights could not be loaded. Messages name the file or tensor and say what to do.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("{path}: {source}; check that the model path is right and the file is readable")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("no weights in {dir}: expected model.safetensors, model.safetensors.index.json or *.safetensors{}",
        pickle.as_ref().map_or(String::new(), |file| format!(
            "; it holds {file}, PyTorch pickles, which this model is not read from: convert them to safetensors \
             once (transformers: `save_pretrained(dir, safe_serialization=True)`)"
        ))
    )]
    NoWeights {
        dir: PathBuf,
        /// A `.bin` or `.pth` file the directory holds instead.
        pickle: Option<String>,
    },
    #[error("{path} is not a valid safetensors file ({detail}); the file is truncated or corrupt: download or convert it again")]
    Corrupt { path: PathBuf, detail: String },
    #[error("{path} is not a PyTorch checkpoint tpinfer can read: {detail}")]
    Pth { path: PathBuf, detail: String },
    #[error("{path}: {detail}; the index does not match the files beside it: download the model again")]
    BadIndex { path: PathBuf, detail: String },
    #[error("tensor `{name}` is missing from {origin}; the checkpoint does not match {config}")]
    Missing {
        name: String,
        origin: String,
        config: String,
    },
    #[error("tensor `{name}` in {origin} is not used by this model ({hint}); the checkpoint and {config} disagree")]
    Unexpected {
        name: String,
        origin: String,
        config: String,
        hint: String,
    },
    #[error("tensor `{name}` in {origin} has shape {found:?}, but {config} implies {expected:?}; the checkpoint does not match {config}")]
    Shape {
        name: String,
        origin: String,
        config: String,
        // Boxed slices keep the error small on every `Result` path.
        found: Box<[usize]>,
        expected: Box<[usize]>,
    },
    #[error("tensor `{name}` has dtype {dtype}, which tpinfer does not load (use f32, f16 or bf16 weights)")]
    Dtype { name: String, dtype: String },
    #[error("shard of `{name}`: {detail}")]
    Shard { name: String, detail: String },
    #[error("{path}: GGUF error: {detail}")]
    Gguf { path: PathBuf, detail: String },
    #[error("tensor `{name}`: {source}")]
    Tensor { name: String, source: candle_core::Error },
    #[error("tensor `{name}` in {origin} holds NaN or infinite values; the checkpoint is corrupt: download or convert it again")]
    NonFinite { name: String, origin: String },
    #[error("LoRA adapter {path}: {detail}")]
    Lora { path: PathBuf, detail: String },
}
