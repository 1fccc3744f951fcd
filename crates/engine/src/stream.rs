use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

use tpinfer_tokenizer::Tokenizer;

use crate::EngineError;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-sequence token was generated.
    Eos,
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The stream was dropped.
    Cancelled,
}

/// Timings of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time to run the prompt and sample the first token.
    pub prefill: Duration,
    /// Time for the remaining tokens.
    pub decode: Duration,
    /// Rank 0's host time inside collectives over the request: on CPU ranks the reductions
    /// and the waits for peers; on NCCL ranks the launches (and the waits of gathers), not
    /// the reductions' GPU time. Decode steps replayed from a CUDA graph enter no collective
    /// on the host: of a decode step only its broadcast of the sampled token counts.
    pub collectives: Duration,
    pub stop_reason: StopReason,
}

impl GenerationStats {
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }

    /// Tokens after the first, over the time they took.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// What a [`TokenStream`] yields.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// A generated token and the text it completes (empty while a multi-byte character is
    /// still partial).
    Token {
        id: u32,
        text: String,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<crate::TokenLogprobs>,
    },
    /// Text held back at the end because its last character was incomplete, decoded with
    /// U+FFFD; comes just before `Done`, and only then.
    Tail(String),
    /// Generation ended; always the last event of a successful stream.
    Done(GenerationStats),
}

/// What rank 0 sends for a request.
pub(crate) enum RankEvent {
    Token(u32, Option<crate::TokenLogprobs>),
    Done(GenerationStats),
    Error(EngineError),
}

/// Where a request's events go: a blocking [`TokenStream`] or an async [`EventStream`].
pub(crate) enum EventSink {
    Blocking(std::sync::mpsc::Sender<RankEvent>),
    Async(tokio::sync::mpsc::UnboundedSender<RankEvent>),
}

impl EventSink {
    /// Fails when the stream was dropped: the request is cancelled.
    pub fn send(&self, event: RankEvent) -> Result<(), ()> {
        match self {
            Self::Blocking(tx) => tx.send(event).map_err(|_| ()),
            Self::Async(tx) => tx.send(event).map_err(|_| ()),
        }
    }
}

/// Turns a request's events into [`StreamEvent`]s: incremental detokenization, with text
/// emitted once the tokens since `read_offset` decode to whole characters, decoded from
/// `prefix_offset` so that spacing is right.
struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    finished: bool,
    /// `Done`, held while a `Tail` is yielded first.
    done: Option<GenerationStats>,
}

impl Detokenizer {
    fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            finished: false,
            done: None,
        }
    }

    /// The `Done` held back behind a `Tail`, or nothing once the stream ended.
    fn pending(&mut self) -> Option<Option<Result<StreamEvent, EngineError>>> {
        if let Some(stats) = self.done.take() {
            self.finished = true;
            return Some(Some(Ok(StreamEvent::Done(stats))));
        }
        self.finished.then_some(None)
    }

    /// The stream event of `event`; `None` when the ranks stopped without a word.
    fn next(&mut self, event: Option<RankEvent>) -> Result<StreamEvent, EngineError> {
        let event = match event {
            Some(RankEvent::Token(id, logprobs)) => {
                return self.next_text(id).map(|text| StreamEvent::Token { id, text, logprobs })
            }
            Some(RankEvent::Done(stats)) => match self.tail() {
                Ok(tail) if !tail.is_empty() => {
                    self.done = Some(stats);
                    return Ok(StreamEvent::Tail(tail));
                }
                Ok(_) => Ok(StreamEvent::Done(stats)),
                Err(e) => Err(e),
            },
            Some(RankEvent::Error(e)) => Err(e),
            None => Err(tpinfer_runtime::RuntimeError::Stopped(
                "the ranks stopped without finishing the request".into(),
            )
            .into()),
        };
        self.finished = true;
        event
    }

    fn next_text(&mut self, id: u32) -> Result<String, EngineError> {
        self.ids.push(id);
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(new.to_string());
            }
        }
        Ok(String::new())
    }

    /// What was held back after the last emitted text.
    fn tail(&self) -> Result<String, EngineError> {
        let emitted = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..])?;
        Ok(full.get(emitted.len()..).unwrap_or_default().to_string())
    }
}

/// The tokens of one request as they are generated, read by blocking. Dropping it cancels the
/// request.
pub struct TokenStream {
    events: Receiver<RankEvent>,
    detokenizer: Detokenizer,
}

impl TokenStream {
    pub(crate) fn new(events: Receiver<RankEvent>, tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            events,
            detokenizer: Detokenizer::new(tokenizer),
        }
    }

    /// Collects the whole generation: its text, token ids and stats.
    pub fn collect_text(self) -> Result<(String, Vec<u32>, GenerationStats), EngineError> {
        let mut text = String::new();
        let mut ids = Vec::new();
        for event in self {
            match event? {
                StreamEvent::Token { id, text: piece, .. } => {
                    ids.push(id);
                    text.push_str(&piece);
                }
                StreamEvent::Tail(tail) => text.push_str(&tail),
                StreamEvent::Done(stats) => return Ok((text, ids, stats)),
            }
        }
        Err(tpinfer_runtime::RuntimeError::Stopped("the stream ended without a result".into()).into())
    }
}

impl Iterator for TokenStream {
    type Item = Result<StreamEvent, EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(pending) = self.detokenizer.pending() {
            return pending;
        }
        Some(self.detokenizer.next(self.events.recv().ok()))
    }
}

/// The tokens of one request as they are generated, as an async [`futures_core::Stream`]
/// (for tokio services: polling never blocks a thread). Dropping it cancels the request,
/// which frees its KV blocks at the next step.
pub struct EventStream {
    events: tokio::sync::mpsc::UnboundedReceiver<RankEvent>,
    detokenizer: Detokenizer,
    prompt_tokens: usize,
}

impl EventStream {
    pub(crate) fn new(
        events: tokio::sync::mpsc::UnboundedReceiver<RankEvent>,
        tokenizer: Arc<Tokenizer>,
        prompt_tokens: usize,
    ) -> Self {
        Self {
            events,
            detokenizer: Detokenizer::new(tokenizer),
            prompt_tokens,
        }
    }

    /// The prompt's length in tokens, its template and special tokens included.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }
}

impl futures_core::Stream for EventStream {
    type Item = Result<StreamEvent, EngineError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        if let Some(pending) = self.detokenizer.pending() {
            return std::task::Poll::Ready(pending);
        }
        match self.events.poll_recv(cx) {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready(event) => std::task::Poll::Ready(Some(self.detokenizer.next(event))),
        }
    }
}
