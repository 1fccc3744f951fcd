use std::path::PathBuf;

/// Why text could not be tokenized or a template rendered.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path} not found; the model directory needs the tokenizer.json of its model")]
    Missing { path: PathBuf },
    #[error("{path}: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error("GGUF tokenizer: {0}")]
    Gguf(String),
    #[error("cannot encode: {0}")]
    Encode(String),
    #[error("cannot decode: {0}")]
    Decode(String),
    #[error(
        "the model has no chat template (tokenizer_config.json `chat_template`, chat_template.jinja or GGUF \
         `tokenizer.chat_template`); give one with --chat-template, or send plain text (without --chat; \
         /v1/completions)"
    )]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
}
