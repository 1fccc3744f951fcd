//! Tokenizers and chat templates.
//!
//! [`Tokenizer`] loads a Hugging Face `tokenizer.json` (with `tokenizer_config.json` for the
//! chat template and special tokens) or rebuilds the tokenizer that a GGUF file describes in
//! its metadata. Chat templates are the model's own Jinja templates, rendered by minijinja.

mod chat;
mod error;
mod gguf;

pub use chat::{ChatMessage, ChatTemplate};
pub use error::TokenizerError;

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;
use std::collections::HashMap;

/// A model's tokenizer, its special tokens and its chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<ChatTemplate>,
    /// The BOS and EOS tokens a chat template is given (empty where the model names none).
    bos_eos: (String, String),
}

impl Tokenizer {
    /// Loads `tokenizer.json` from `dir`, and the chat template and BOS/EOS tokens from
    /// `tokenizer_config.json` when it exists (the template from `chat_template.jinja` where
    /// the config has none, as transformers now saves it).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(TokenizerError::Missing { path });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Invalid {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| TokenizerError::Invalid {
                path: config_path.clone(),
                detail: e.to_string(),
            })?,
            Err(_) => Json::Null,
        };
        let separate = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        Ok(Self {
            inner,
            chat_template: ChatTemplate::from_tokenizer_config(&config, separate),
            bos_eos: ChatTemplate::special_tokens(&config),
        })
    }

    /// This tokenizer with `source` as its chat template (vLLM's `--chat-template`), given the
    /// model's BOS and EOS tokens and checked by rendering a one-message chat.
    pub fn with_chat_template(mut self, source: impl Into<String>) -> Result<Self, TokenizerError> {
        let (bos, eos) = &self.bos_eos;
        let template = ChatTemplate::new(source, bos, eos);
        template.render(&[ChatMessage::user("Hi")], true)?;
        self.chat_template = Some(template);
        Ok(self)
    }

    /// Rebuilds the tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata).
    pub fn from_gguf(metadata: &HashMap<String, Value>) -> Result<Self, TokenizerError> {
        gguf::tokenizer_from_gguf(metadata)
    }

    /// Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (BOS for Llama 3).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// The id of a token given by its text, e.g. `<|eot_id|>`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The number of tokens, special ones included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The token ids of a chat, rendered by the model's template with the assistant's turn
    /// opened. The template writes any BOS itself, so none is added.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        let template = self.chat_template.as_ref().ok_or(TokenizerError::NoChatTemplate)?;
        let text = template.render(messages, true)?;
        self.encode(&text, false)
    }
}
