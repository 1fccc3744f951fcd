//! The OpenAI request bodies this server reads, checked field by field into an engine request,
//! and the error shape it answers with.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tpinfer_engine::{ChatMessage, GenerateRequest, Prompt, SamplingParams, MAX_TOP_LOGPROBS};

/// An error in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::NOT_FOUND
            | StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The fields both endpoints share.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: String,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub repetition_penalty: Option<f32>,
    /// vLLM's: generate past end-of-sequence tokens (benchmarks of fixed output lengths).
    #[serde(default)]
    pub ignore_eos: bool,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// Token ids (as strings, OpenAI's form) → a bias from −100 to 100.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Fields that change what an answer is, which this server does not do: refused by name
    /// rather than ignored, where a client asks for more than plain text.
    pub response_format: Option<serde_json::Value>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    pub logprobs: Option<serde_json::Value>,
    /// Refused where set: the prompt is not echoed, nothing is inserted, one answer is made.
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: serde_json::Value,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

/// A request checked and ready for the engine.
pub struct Checked {
    pub request: GenerateRequest,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Parses a JSON body, naming what is wrong with it.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(None, format!("the request body is not valid: {e}")))
}

impl CompletionRequest {
    pub fn check(self, served: &str, seed: u64) -> Result<Checked, ApiError> {
        if self.echo == Some(true) {
            return Err(unsupported("echo", "the answer does not repeat the prompt"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported(
                "suffix",
                "there is no insertion between a prompt and a suffix",
            ));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(unsupported("best_of", "one answer is made per request"));
        }
        // The legacy field: how many alternatives, with each token's own log-probability.
        let logprobs = match self.logprobs {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(n) if n as usize <= MAX_TOP_LOGPROBS => Some(n as usize),
                _ => {
                    return Err(ApiError::bad_request(
                        Some("logprobs"),
                        format!("logprobs {v} must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                    ))
                }
            },
        };
        let prompt = match self.prompt {
            PromptInput::Text(text) => Prompt::Text(text),
            PromptInput::Texts(mut texts) if texts.len() == 1 => Prompt::Text(texts.remove(0)),
            PromptInput::Texts(_) => {
                return Err(ApiError::bad_request(Some("prompt"), "give one prompt per request"));
            }
            PromptInput::Tokens(ids) => Prompt::Tokens(ids),
        };
        // OpenAI's default for completions.
        let mut checked = self.common.check(served, prompt, None, 16, seed)?;
        checked.request.logprobs = logprobs;
        Ok(checked)
    }
}

impl ChatRequest {
    pub fn check(self, served: &str, seed: u64, context: usize) -> Result<Checked, ApiError> {
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(ApiError::bad_request(
                    Some("top_logprobs"),
                    "top_logprobs needs logprobs: true",
                ))
            }
            (true, None) => Some(0),
            (true, Some(n)) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
            (true, Some(n)) => {
                return Err(ApiError::bad_request(
                    Some("top_logprobs"),
                    format!("top_logprobs {n} must be from 0 to {MAX_TOP_LOGPROBS}"),
                ))
            }
        };
        if self.messages.is_empty() {
            return Err(ApiError::bad_request(Some("messages"), "messages is empty"));
        }
        let messages = self
            .messages
            .into_iter()
            .map(|m| {
                Ok(ChatMessage {
                    content: message_text(m.content)?,
                    role: m.role,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        // Without a limit a chat runs to the end of its turn or of the context.
        let max_tokens = self.max_completion_tokens;
        let mut checked = self
            .common
            .check(served, Prompt::Chat(messages), max_tokens, context, seed)?;
        checked.request.logprobs = logprobs;
        Ok(checked)
    }
}

/// The 400 for a field this server does not implement, saying what it does instead.
fn unsupported(param: &'static str, instead: &str) -> ApiError {
    ApiError::bad_request(Some(param), format!("{param} is not supported: {instead}"))
}

/// A message's text: its `content` string, or its text parts joined by newlines (as vLLM
/// joins them); an assistant turn that called tools has none. A part that is not text (an
/// image, audio) is refused: the models served read text.
fn message_text(content: serde_json::Value) -> Result<String, ApiError> {
    let refused = |detail: String| ApiError::bad_request(Some("messages"), detail);
    match content {
        serde_json::Value::String(text) => Ok(text),
        serde_json::Value::Null => Ok(String::new()),
        serde_json::Value::Array(parts) => {
            let texts = parts
                .iter()
                .map(|part| match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("text"), Some(text)) => Ok(text),
                    (Some("text"), None) => Err(refused("a text content part has no `text` string".into())),
                    (Some(kind), _) => Err(refused(format!(
                        "a content part of type '{kind}': this server's model reads text parts only"
                    ))),
                    (None, _) => Err(refused("a content part has no `type`".into())),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        _ => Err(refused(
            "a message's content must be a string or a list of text parts".into(),
        )),
    }
}

impl Common {
    fn check(
        self,
        served: &str,
        prompt: Prompt,
        max_tokens: Option<i64>,
        default_max_tokens: usize,
        seed: u64,
    ) -> Result<Checked, ApiError> {
        if self.model != served {
            return Err(ApiError::bad_request(
                Some("model"),
                format!("unknown model '{}': this server serves '{served}'", self.model),
            ));
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(Some("n"), "n must be 1"));
        }
        let kind = |v: &serde_json::Value| v.get("type").and_then(serde_json::Value::as_str).map(str::to_owned);
        if let Some(format) = self.response_format.as_ref().and_then(kind).filter(|t| t != "text") {
            return Err(unsupported(
                "response_format",
                &format!("of type '{format}': answers are free text, not constrained to JSON"),
            ));
        }
        let no_tools = self.tool_choice.as_ref().is_some_and(|c| c == "none");
        if self
            .tools
            .as_ref()
            .is_some_and(|t| t.as_array().is_none_or(|t| !t.is_empty()))
            && !no_tools
        {
            return Err(unsupported(
                "tools",
                "the model's answers are not parsed into tool calls",
            ));
        }
        let max_new_tokens = match max_tokens.or(self.max_tokens) {
            None => default_max_tokens,
            Some(n) if n >= 1 => n as usize,
            Some(n) => {
                return Err(ApiError::bad_request(
                    Some("max_tokens"),
                    format!("max_tokens {n} must be at least 1"),
                ))
            }
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad_request(
                Some("temperature"),
                format!("temperature {temperature} must be in [0, 2]"),
            ));
        }
        let top_k = match self.top_k {
            None | Some(-1) => None,
            Some(k) if k >= 1 => Some(k as usize),
            Some(k) => {
                return Err(ApiError::bad_request(
                    Some("top_k"),
                    format!("top_k {k} must be at least 1 (-1 disables it)"),
                ))
            }
        };
        let logit_bias = self
            .logit_bias
            .unwrap_or_default()
            .into_iter()
            .map(|(token, bias)| match token.parse::<u32>() {
                Ok(id) => Ok((id, bias)),
                Err(_) => Err(ApiError::bad_request(
                    Some("logit_bias"),
                    format!("logit_bias key '{token}' is not a token id"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sampling = SamplingParams {
            temperature,
            top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            logit_bias,
            seed: self.seed.unwrap_or(seed),
            ..SamplingParams::default()
        };
        if let Err(e) = sampling.check() {
            let message = e.to_string();
            let param = ["top_p", "frequency_penalty", "presence_penalty", "logit_bias"]
                .into_iter()
                .find(|p| message.contains(p))
                .unwrap_or("repetition_penalty");
            return Err(ApiError::bad_request(Some(param), message));
        }
        let stops = match self.stop {
            None => Vec::new(),
            Some(Stop::One(stop)) => vec![stop],
            Some(Stop::Many(stops)) => stops,
        };
        let mut request = GenerateRequest::new(prompt, max_new_tokens).with_sampling(sampling);
        request.ignore_eos = self.ignore_eos;
        Ok(Checked {
            request,
            stops,
            stream: self.stream,
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
        })
    }
}
