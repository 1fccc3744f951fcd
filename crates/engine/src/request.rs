use tpinfer_layers::RowSampling;
use tpinfer_tokenizer::ChatMessage;

use crate::EngineError;

/// What to continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Plain text; the tokenizer adds its special tokens (BOS for Llama 3).
    Text(String),
    /// A chat, rendered with the model's own chat template.
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

impl Prompt {
    pub fn text(text: impl Into<String>) -> Self {
        Self::Text(text.into())
    }

    /// A chat of one user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::Chat(vec![ChatMessage::user(text)])
    }
}

/// How the next token is chosen. The defaults are greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or less) means greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    /// Divides positive logits (multiplies negative ones) of tokens already seen; 1 disables.
    pub repetition_penalty: f32,
    /// How many of the last tokens the repetition penalty looks at.
    pub repetition_window: usize,
    /// Taken off a token's logit for each time it was generated (OpenAI's
    /// `frequency_penalty`, from −2 to 2); 0 disables.
    pub frequency_penalty: f32,
    /// Taken off the logit of every token generated at all (`presence_penalty`, −2 to 2);
    /// 0 disables.
    pub presence_penalty: f32,
    /// Added to the logits of these tokens after the penalties (OpenAI's `logit_bias`, each
    /// from −100, which bans the token in effect, to 100).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            repetition_window: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 299_792_458,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with no penalty: the plain argmax of the logits.
    pub(crate) fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && !self.penalizes() && self.logit_bias.is_empty()
    }

    /// Whether any penalty changes the logits.
    fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }

    /// How many of a context's last tokens the penalties look at, `draw` of them generated:
    /// the repetition penalty's window, and every generated token where the frequency or
    /// presence penalty is on.
    pub(crate) fn penalized_tail(&self, draw: usize) -> usize {
        let repeats = match self.repetition_penalty == 1.0 {
            true => 0,
            false => self.repetition_window,
        };
        let generated = match self.frequency_penalty == 0.0 && self.presence_penalty == 0.0 {
            true => 0,
            false => draw,
        };
        repeats.max(generated)
    }

    /// Why these parameters cannot sample, if they cannot (`EngineError::InvalidRequest`, naming
    /// the parameter). The engine checks every request it is given, so that a bad value is
    /// refused by name instead of failing (or sampling nonsense) mid-run; a caller that loads a
    /// large model can check first.
    pub fn check(&self) -> Result<(), EngineError> {
        self.problem()
            .map_or(Ok(()), |problem| Err(EngineError::InvalidRequest(problem)))
    }

    fn problem(&self) -> Option<String> {
        if !self.temperature.is_finite() {
            return Some(format!(
                "temperature {} is not a number (0 is greedy)",
                self.temperature
            ));
        }
        // A negative temperature would silently run greedy.
        if self.temperature < 0.0 {
            return Some(format!(
                "temperature {} is below 0; 0 is greedy, above 0 samples",
                self.temperature
            ));
        }
        if self.top_k == Some(0) {
            return Some("top_k must be at least 1 (leave it unset to sample from every token)".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Some(format!("top_p {p} must be in (0, 1] (1 keeps every token)"));
            }
        }
        let penalty = self.repetition_penalty;
        if !(penalty.is_finite() && penalty > 0.0) {
            return Some(format!("repetition_penalty {penalty} must be above 0 (1 disables it)"));
        }
        for (name, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Some(format!("{name} {value} must be from -2 to 2 (0 disables it)"));
            }
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Some(format!("logit_bias {bias} of token {token} must be from -100 to 100"));
        }
        let mut tokens: Vec<u32> = self.logit_bias.iter().map(|&(token, _)| token).collect();
        tokens.sort_unstable();
        if let Some(pair) = tokens.windows(2).find(|pair| pair[0] == pair[1]) {
            return Some(format!("logit_bias gives token {} twice", pair[0]));
        }
        None
    }

    /// The kernel's parameters for the request's `draw`-th token after `context`, whose last
    /// `draw` tokens it generated (the repetition penalty looks at the last
    /// `repetition_window` tokens, the frequency and presence penalties at the generated
    /// ones); `context` may be cut to its last [`Self::penalized_tail`] tokens.
    pub(crate) fn row<'a>(&'a self, draw: usize, context: &'a [u32]) -> RowSampling<'a> {
        let tail = |n: usize| &context[context.len().saturating_sub(n)..];
        RowSampling {
            temperature: self.temperature as f32,
            top_k: self.top_k,
            top_p: self.top_p.map(|p| p as f32),
            seed: self.seed,
            draw: draw as u64,
            repetition_penalty: self.repetition_penalty,
            penalized: tail(self.repetition_window),
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            generated: tail(draw),
            logit_bias: &self.logit_bias,
        }
    }
}

/// One generation: a prompt, a token budget and how to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generate past the model's end-of-sequence tokens, to `max_new_tokens` or a full
    /// context: for benchmarks that need outputs of a fixed length.
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and those of the `n` most likely
    /// tokens (at most [`crate::MAX_TOP_LOGPROBS`]) with every token (see
    /// [`crate::TokenLogprobs`]); `None` reports none. The logits then come to the host
    /// even for greedy decoding.
    pub logprobs: Option<usize>,
}

impl GenerateRequest {
    /// Greedy generation of at most `max_new_tokens` after `prompt`.
    pub fn new(prompt: Prompt, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            max_new_tokens,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            logprobs: None,
        }
    }

    pub fn with_sampling(mut self, sampling: SamplingParams) -> Self {
        self.sampling = sampling;
        self
    }
}
