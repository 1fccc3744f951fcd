use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;
use serde_json::Value as Json;

use crate::TokenizerError;

/// One turn of a chat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: "system".into(),
            content: content.into(),
        }
    }
}

/// A model's Jinja chat template with the special tokens it refers to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: impl Into<String>, bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        }
    }

    /// The template of a `tokenizer_config.json` (a string, or a list of named templates of
    /// which `default` is taken), else `separate`: the `chat_template.jinja` beside it, where
    /// transformers now saves a template. The BOS and EOS tokens are the config's.
    pub fn from_tokenizer_config(config: &Json, separate: Option<String>) -> Option<Self> {
        let source = Self::source_in(config).or(separate)?;
        let (bos, eos) = Self::special_tokens(config);
        Some(Self::new(source, bos, eos))
    }

    /// The BOS and EOS tokens a `tokenizer_config.json` names (a string, or an added-token
    /// object's `content`), empty where it names none.
    pub fn special_tokens(config: &Json) -> (String, String) {
        let token = |key: &str| match config.get(key) {
            Some(Json::String(s)) => s.clone(),
            Some(obj) => obj
                .get("content")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_string(),
            None => String::new(),
        };
        (token("bos_token"), token("eos_token"))
    }

    fn source_in(config: &Json) -> Option<String> {
        Some(match config.get("chat_template")? {
            Json::String(s) => s.clone(),
            Json::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| list.first())?
                .get("template")?
                .as_str()?
                .to_string(),
            _ => return None,
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the assistant's turn is opened.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let mut env = Environment::new();
        // As transformers' `apply_chat_template` renders them: a block tag's line break and
        // the indentation before it are not output (templates laid out over many lines count
        // on it).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Templates are written for Python's Jinja: `.strip()`, `.startswith()` and friends.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_format: String| -> String {
            // Templates use it for a "Today Date" line; a fixed date keeps prompts reproducible.
            "26 Jul 2024".to_string()
        });
        env.add_template("chat", &self.source)
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let template = env
            .get_template("chat")
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| TokenizerError::Template(e.to_string()))
    }
}
