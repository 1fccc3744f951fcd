//! An OpenAI-compatible HTTP server over a [`tpinfer_engine::Engine`], through its public
//! async API only: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as
//! server-sent events when asked), `GET /v1/models`, `GET /health` and `GET /metrics`
//! (Prometheus text).
//!
//! Bad requests get OpenAI's error shape with status 400, naming the field; a full queue gets
//! 429; after a rank failure every request gets 503 with its cause, as `/health` does. A
//! client that disconnects drops its stream, which cancels its request.

mod logprobs;
mod metrics;
mod openai;
mod stop;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::{Listener, ListenerExt};
use axum::{Json, Router};
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tpinfer_engine::{Engine, EngineError, EventStream, Health, RuntimeError, StopReason, StreamEvent};

use logprobs::LogprobsOut;
pub use metrics::Metrics;
pub use openai::ApiError;
use openai::{ChatRequest, Checked, CompletionRequest};
use stop::{Matched, StopMatcher};

/// What the server answers to besides the engine.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The model name requests must give, as `/v1/models` lists it.
    pub model: String,
    /// Requests in flight (running or queued) beyond which new ones get 429.
    pub max_queue: usize,
}

struct AppState {
    engine: Arc<Engine>,
    options: ServerOptions,
    metrics: Metrics,
    in_flight: AtomicUsize,
    next_id: AtomicU64,
    created: u64,
}

/// `listener` with Nagle's algorithm off on every connection it accepts, as the server must
/// listen. Streamed tokens are small writes: with it on, the first token after the response's
/// headers waits until the client acknowledges them, which a client delaying its
/// acknowledgements (Linux does, up to 40 ms) makes the time to the first token. Measured on
/// loopback: 43.6 ms to the first token of a 512-token prompt whose prefill takes 13.3.
pub fn without_nagle(listener: TcpListener) -> impl Listener<Io = TcpStream, Addr = SocketAddr> {
    listener.tap_io(|stream| {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!("cannot turn off Nagle's algorithm on a connection: {e}");
        }
    })
}

/// The server's routes over `engine`.
pub fn router(engine: Arc<Engine>, options: ServerOptions) -> Router {
    let state = AppState {
        engine,
        options,
        metrics: Metrics::default(),
        in_flight: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        created: unix_time(),
    };
    state.metrics.started();
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Arc::new(state))
}

/// The routes, as a 404 or 405 lists them.
const ROUTES: &str = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics";

async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route {}: this server has {ROUTES}", uri.path()),
    )
}

async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} {} is not a route: this server has {ROUTES}", uri.path()),
    )
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": s.options.model,
        "object": "model",
        "created": s.created,
        "owned_by": "tpinfer",
        "max_model_len": s.engine.max_context(),
    }]}))
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s.engine.health() {
        Health::Serving => Json(json!({"status": "ok"})).into_response(),
        Health::Failed(cause) => unavailable(&cause).into_response(),
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let text = s.metrics.render(s.engine.load());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn unavailable(cause: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the engine has stopped: {cause}"),
    )
}

/// Which endpoint a request came through: it decides the shape of every answer.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

/// The largest request body taken: a prompt of a 128K context as text, escaped, fits.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// The body, or the error in OpenAI's shape where it could not be read (over
/// [`MAX_BODY_BYTES`]: 413).
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let message = match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => format!(
                "the request body is over the {} MiB this server reads: give a shorter prompt",
                MAX_BODY_BYTES >> 20
            ),
            _ => format!("the request body could not be read: {rejection}"),
        };
        ApiError::new(rejection.status(), message)
    })
}

async fn completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let checked = read_body(body)
        .and_then(|body| openai::parse::<CompletionRequest>(&body))
        .and_then(|r| r.check(&s.options.model, s.seed()));
    respond(s, Kind::Completion, checked).await
}

async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let context = s.engine.max_context();
    let checked = read_body(body)
        .and_then(|body| openai::parse::<ChatRequest>(&body))
        .and_then(|r| r.check(&s.options.model, s.seed(), context));
    respond(s, Kind::Chat, checked).await
}

impl AppState {
    /// A seed for a request that gives none: requests without one sample differently.
    fn seed(&self) -> u64 {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        nanos ^ self.next_id.load(Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// Counts a request in flight until dropped.
struct InFlight(Arc<AppState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn respond(s: Arc<AppState>, kind: Kind, checked: Result<Checked, ApiError>) -> Response {
    match start(s, kind, checked) {
        Ok((generation, true)) => stream_response(generation).into_response(),
        Ok((generation, false)) => whole_response(generation).await,
        Err(e) => e.into_response(),
    }
}

/// A request accepted by the engine, as the server follows it.
struct Generation {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    events: EventStream,
    stops: StopMatcher,
    /// Each token's log-probabilities, when asked for, until a chunk carries them.
    logprobs: Option<LogprobsOut>,
    include_usage: bool,
    arrived: Instant,
    last_token: Option<Instant>,
    first_token: Option<Duration>,
    gaps: Vec<Duration>,
    generated: usize,
    /// The end, reported after the text before it.
    finish: Option<&'static str>,
    ended: bool,
    role_sent: bool,
    state: Arc<AppState>,
    _in_flight: InFlight,
}

fn start(s: Arc<AppState>, kind: Kind, checked: Result<Checked, ApiError>) -> Result<(Generation, bool), ApiError> {
    let arrived = Instant::now();
    let checked = checked?;
    if let Health::Failed(cause) = s.engine.health() {
        return Err(unavailable(&cause));
    }
    if s.in_flight.fetch_add(1, Ordering::Relaxed) >= s.options.max_queue {
        s.in_flight.fetch_sub(1, Ordering::Relaxed);
        s.metrics.rejected();
        tracing::info!(max_queue = s.options.max_queue, "a request refused: the queue is full");
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the server holds {} requests already: retry later", s.options.max_queue),
        ));
    }
    let in_flight = InFlight(s.clone());
    let prompt = match kind {
        Kind::Completion => "prompt",
        Kind::Chat => "messages",
    };
    let logprobs = checked
        .request
        .logprobs
        .map(|_| LogprobsOut::new(matches!(kind, Kind::Chat)));
    let events = s
        .engine
        .generate_stream(checked.request)
        .map_err(|e| request_error(e, prompt))?;
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Completion => format!("cmpl-{n}"),
        Kind::Chat => format!("chatcmpl-{n}"),
    };
    let generation = Generation {
        kind,
        id,
        model: s.options.model.clone(),
        created: unix_time(),
        events,
        stops: StopMatcher::new(checked.stops),
        logprobs,
        include_usage: checked.include_usage,
        arrived,
        last_token: None,
        first_token: None,
        gaps: Vec::new(),
        generated: 0,
        finish: None,
        ended: false,
        role_sent: false,
        state: s.clone(),
        _in_flight: in_flight,
    };
    Ok((generation, checked.stream))
}

/// An error of the engine's taking a request: the request's fault (400, naming the field its
/// prompt came in, `prompt`), or the engine's.
fn request_error(e: EngineError, prompt: &'static str) -> ApiError {
    match e {
        EngineError::PromptTooLong { .. } | EngineError::EmptyPrompt => {
            ApiError::bad_request(Some(prompt), e.to_string())
        }
        EngineError::InvalidRequest(_) | EngineError::Tokenizer(_) => ApiError::bad_request(None, e.to_string()),
        e => engine_error(e),
    }
}

/// An engine error during a request: a rank failed (503, as every later request gets), or
/// this request did (500: its logits were not finite, or its sampling failed).
fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Runtime(RuntimeError::Stopped(cause)) => unavailable(&cause),
        EngineError::Runtime(_) | EngineError::Injected { .. } => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// What a generation produced next, for either kind of response.
enum Step {
    Text(String),
    /// The end, with OpenAI's finish reason.
    Finish(&'static str),
    Failed(ApiError),
}

impl Generation {
    /// The next text, then the end; `None` after the end.
    async fn next(&mut self) -> Option<Step> {
        if let Some(reason) = self.finish.take() {
            self.ended = true;
            return Some(Step::Finish(reason));
        }
        if self.ended {
            return None;
        }
        loop {
            let event = match self.events.next().await {
                Some(Ok(event)) => event,
                Some(Err(e)) => return self.fail(engine_error(e)),
                None => return self.fail(unavailable("the request's stream ended without a result")),
            };
            let text = match event {
                StreamEvent::Token { id, text, logprobs } => {
                    self.token();
                    if let (Some(out), Some(lp)) = (&mut self.logprobs, &logprobs) {
                        out.push(self.state.engine.tokenizer(), id, lp);
                    }
                    text
                }
                StreamEvent::Tail(text) => text,
                StreamEvent::Done(stats) => {
                    let reason = match stats.stop_reason {
                        StopReason::MaxTokens | StopReason::ContextFull => "length",
                        StopReason::Eos | StopReason::Cancelled => "stop",
                    };
                    let held = self.stops.finish();
                    if held.is_empty() {
                        self.ended = true;
                        return Some(Step::Finish(reason));
                    }
                    self.finish = Some(reason);
                    return Some(Step::Text(held));
                }
            };
            match self.stops.push(&text) {
                Matched::Text(t) if t.is_empty() => continue,
                Matched::Text(t) => return Some(Step::Text(t)),
                // The engine's stream is dropped with the generation, which cancels it.
                Matched::Stop(t) if t.is_empty() => {
                    self.ended = true;
                    return Some(Step::Finish("stop"));
                }
                Matched::Stop(t) => {
                    self.finish = Some("stop");
                    return Some(Step::Text(t));
                }
            }
        }
    }

    fn fail(&mut self, e: ApiError) -> Option<Step> {
        self.ended = true;
        Some(Step::Failed(e))
    }

    fn token(&mut self) {
        let now = Instant::now();
        match self.last_token {
            None => self.first_token = Some(now - self.arrived),
            Some(last) => self.gaps.push(now - last),
        }
        self.last_token = Some(now);
        self.generated += 1;
    }

    fn usage(&self) -> Value {
        let prompt = self.events.prompt_tokens();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": self.generated,
            "total_tokens": prompt + self.generated,
        })
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
        }
    }

    /// The log-probabilities of the tokens since the last chunk, or null when not asked for.
    fn take_logprobs(&mut self) -> Value {
        self.logprobs.as_mut().map_or(Value::Null, LogprobsOut::take)
    }

    /// One streamed chunk: a piece of text, or the end's finish reason, with the
    /// log-probabilities of the tokens since the last chunk when asked for (those of a stop
    /// string's tokens included).
    fn chunk(&mut self, text: Option<String>, finish: Option<&str>) -> Event {
        let logprobs = self.take_logprobs();
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text.unwrap_or_default(), "logprobs": logprobs, "finish_reason": finish,
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if !std::mem::replace(&mut self.role_sent, true) {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(text) = text {
                    delta.insert("content".into(), json!(text));
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        self.event(json!([choice]), None)
    }

    fn event(&self, choices: Value, usage: Option<Value>) -> Event {
        let mut body = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = usage;
        }
        Event::default().data(body.to_string())
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        let prompt = self.events.prompt_tokens();
        self.state
            .metrics
            .finished(prompt, self.generated, self.first_token, &self.gaps);
    }
}

/// Server-sent events: a chunk per piece of text, the finish reason, the usage when asked
/// for, then `data: [DONE]`. An error mid-stream comes as an error object before `[DONE]`.
fn stream_response(generation: Generation) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let done = || Event::default().data("[DONE]");
    let events = futures_util::stream::unfold(Some(generation), move |state| async move {
        let mut g = state?;
        let events = match g.next().await? {
            Step::Text(text) => return Some((vec![g.chunk(Some(text), None)], Some(g))),
            Step::Finish(reason) => {
                let mut events = vec![g.chunk(None, Some(reason))];
                if g.include_usage {
                    events.push(g.event(json!([]), Some(g.usage())));
                }
                events.push(done());
                events
            }
            Step::Failed(e) => vec![Event::default().data(e.body().to_string()), done()],
        };
        Some((events, None))
    });
    Sse::new(events.flat_map(|events| futures_util::stream::iter(events.into_iter().map(Ok))))
        .keep_alive(KeepAlive::default())
}

/// The whole generation as one JSON answer, with its usage.
async fn whole_response(mut g: Generation) -> Response {
    let mut text = String::new();
    let reason = loop {
        match g.next().await {
            Some(Step::Text(piece)) => text.push_str(&piece),
            Some(Step::Finish(reason)) => break reason,
            Some(Step::Failed(e)) => return e.into_response(),
            None => return unavailable("the request ended without a result").into_response(),
        }
    };
    let logprobs = g.take_logprobs();
    let choice = match g.kind {
        Kind::Completion => json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}),
        Kind::Chat => json!({
            "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": reason,
        }),
    };
    Json(json!({
        "id": g.id, "object": g.object(false), "created": g.created, "model": g.model,
        "choices": [choice], "usage": g.usage(),
    }))
    .into_response()
}
