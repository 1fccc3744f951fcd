//! The OpenAI-compatible server on loopback, driven by a real HTTP client: concurrent streamed
//! requests equal each one alone, stop strings, cancellation, every 400, a full queue, a soak,
//! and a rank failure reported on every route.
#![allow(clippy::expect_used)] // test helpers: a failed expectation is a failed test

use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use serde_json::{json, Value};
use tpinfer_engine::{Engine, EngineBuilder, Fault, GenerateRequest, Prompt, SamplingParams};
use tpinfer_server::{router, without_nagle, ServerOptions};
use tpinfer_tests::{assets_dir, TinyLlama};

const MODEL: &str = "tiny";

/// Serves `engine` on a free loopback port; returns its base URL.
async fn serve(engine: Engine, max_queue: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let app = router(
        Arc::new(engine),
        ServerOptions {
            model: MODEL.into(),
            max_queue,
        },
    );
    tokio::spawn(async move { axum::serve(without_nagle(listener), app).await.expect("serve") });
    format!("http://{address}")
}

/// Whether a connection `listener` accepts has Nagle's algorithm off.
async fn accepts_without_nagle<L: Listener<Io = tokio::net::TcpStream>>(
    mut listener: L,
    address: std::net::SocketAddr,
) -> bool {
    let (accepted, client) = tokio::join!(listener.accept(), tokio::net::TcpStream::connect(address));
    client.expect("connect");
    accepted.0.nodelay().expect("nodelay")
}

/// The server's connections send each streamed token at once: with Nagle's algorithm on, the
/// first token waits for the client's delayed acknowledgement of the headers (up to 40 ms).
/// A plain listener's connections keep it on, so the wrapper is what turns it off.
#[tokio::test]
async fn connections_are_accepted_without_nagle() {
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = plain.local_addr().expect("address");
    assert!(!accepts_without_nagle(plain, address).await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    assert!(accepts_without_nagle(without_nagle(listener), address).await);
}

fn tiny(dir: &tempfile::TempDir) -> EngineBuilder {
    Engine::builder(TinyLlama::default().write(dir.path()))
}

async fn post(base: &str, route: &str, body: Value) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("{base}{route}"))
        .json(&body)
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    (status, response.text().await.expect("body"))
}

/// A streamed answer's events: the JSON of each `data:` line before `[DONE]`, and whether
/// `[DONE]` ended it.
fn events(body: &str) -> (Vec<Value>, bool) {
    let data: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    let done = data.last() == Some(&"[DONE]");
    let values = data
        .iter()
        .filter(|d| **d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
        .collect();
    (values, done)
}

/// A streamed completion's text, finish reason and usage.
fn streamed(body: &str) -> (String, String, Option<Value>) {
    let (chunks, done) = events(body);
    assert!(done, "the stream ends with [DONE]: {body}");
    let mut text = String::new();
    let mut finish = String::new();
    let mut usage = None;
    for chunk in chunks {
        assert!(chunk.get("error").is_none(), "{chunk}");
        if let Some(choice) = chunk["choices"].get(0) {
            text.push_str(
                choice["text"]
                    .as_str()
                    .or(choice["delta"]["content"].as_str())
                    .unwrap_or(""),
            );
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = reason.to_string();
            }
        }
        if !chunk["usage"].is_null() {
            usage = Some(chunk["usage"].clone());
        }
    }
    (text, finish, usage)
}

fn completion(i: usize, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "prompt": format!("request {i}: {}", "abc".repeat(i % 5)),
        "max_tokens": 4 + i % 9,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// 32 concurrent streamed greedy requests equal each run alone, with nothing mixed between them.
async fn concurrent_equals_alone(base: &str, request: fn(usize) -> Value) {
    let mut alone = Vec::new();
    for i in 0..32 {
        let (status, body) = post(base, "/v1/completions", request(i)).await;
        assert_eq!(status, 200, "{body}");
        alone.push(streamed(&body));
    }
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let base = base.to_string();
            tokio::spawn(async move { post(&base, "/v1/completions", request(i)).await })
        })
        .collect();
    for (i, (task, want)) in tasks.into_iter().zip(&alone).enumerate() {
        let (status, body) = task.await.expect("task");
        assert_eq!(status, 200, "{body}");
        let got = streamed(&body);
        assert_eq!(&got, want, "request {i}");
        let usage = got.2.expect("usage when include_usage is set");
        assert!(usage["completion_tokens"].as_u64().is_some_and(|n| n >= 1), "{usage}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_on_the_tiny_llama_equal_each_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(
        tiny(&dir).tp(2).max_seqs(8).step_tokens(16).build().expect("engine"),
        64,
    )
    .await;
    concurrent_equals_alone(&base, |i| completion(i, true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_on_smollm2_equal_each_alone() {
    let model = assets_dir().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let engine = Engine::builder(model)
        .tp(2)
        .max_context(256)
        .max_seqs(16)
        .build()
        .expect("engine");
    let base = serve(engine, 64).await;
    concurrent_equals_alone(&base, |i| {
        json!({
            "model": MODEL,
            "prompt": format!("The number {i} is"),
            "max_tokens": 6,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_answers_chat_and_models() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(tiny(&dir).max_seqs(4).build().expect("engine"), 16).await;
    let (status, body) = post(&base, "/v1/completions", completion(3, false)).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["usage"]["completion_tokens"], 4 + 3);
    let (_, streamed_body) = post(&base, "/v1/completions", completion(3, true)).await;
    assert_eq!(answer["choices"][0]["text"], streamed(&streamed_body).0);
    // What clients send by default asks for nothing this server lacks: the same answer.
    let mut defaults = completion(3, false);
    for (field, value) in [
        ("echo", json!(false)),
        ("suffix", json!(null)),
        ("best_of", json!(1)),
        ("response_format", json!({"type": "text"})),
        ("tools", json!([{"type": "function", "function": {"name": "f"}}])),
        ("tool_choice", json!("none")),
        ("user", json!("someone")),
    ] {
        defaults[field] = value;
    }
    let (status, body) = post(&base, "/v1/completions", defaults).await;
    assert_eq!(status, 200, "{body}");
    let same: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(same["choices"][0]["text"], answer["choices"][0]["text"]);
    let chat = json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
    });
    let (status, body) = post(&base, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(answer["object"], "chat.completion");
    // The same chat with its content as text parts, as newer clients send it.
    let mut parts = chat.clone();
    parts["messages"][1]["content"] = json!([{"type": "text", "text": "hi"}]);
    let (status, parts_body) = post(&base, "/v1/chat/completions", parts).await;
    assert_eq!(status, 200, "{parts_body}");
    let parts_answer: Value = serde_json::from_str(&parts_body).expect("JSON");
    assert_eq!(parts_answer["choices"], answer["choices"]);
    let mut image = chat;
    image["messages"][1]["content"] = json!([{"type": "image_url", "image_url": {"url": "data:,"}}]);
    let (status, image_body) = post(&base, "/v1/chat/completions", image).await;
    assert_eq!(status, 400, "{image_body}");
    assert!(image_body.contains("image_url"), "{image_body}");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert!(
        answer["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 2),
        "{answer}"
    );
    let models: Value = reqwest::get(format!("{base}/v1/models"))
        .await
        .expect("models")
        .json()
        .await
        .expect("JSON");
    assert_eq!(models["data"][0]["id"], MODEL);
    let health = reqwest::get(format!("{base}/health")).await.expect("health");
    assert_eq!(health.status().as_u16(), 200);
    // OpenAI's penalties and logit bias reach the sampler: the answer is the engine's own for
    // them, and not the plain greedy one.
    let penalized = json!({
        "model": MODEL, "prompt": "xyz", "max_tokens": 16, "temperature": 0,
        "frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"7": -100, "8": 2.5},
    });
    let (status, body) = post(&base, "/v1/completions", penalized).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("JSON");
    let same_model = tempfile::tempdir().expect("tempdir");
    let engine = tiny(&same_model).build().expect("engine");
    let text = |sampling: SamplingParams| {
        let request = GenerateRequest::new(Prompt::text("xyz"), 16).with_sampling(sampling);
        engine
            .generate(request)
            .expect("generate")
            .collect_text()
            .expect("stream")
            .0
    };
    let expected = text(SamplingParams {
        frequency_penalty: 1.5,
        presence_penalty: 0.5,
        logit_bias: vec![(7, -100.0), (8, 2.5)],
        ..SamplingParams::default()
    });
    assert_eq!(answer["choices"][0]["text"], expected.as_str());
    assert_ne!(
        expected,
        text(SamplingParams::default()),
        "the penalties change the answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_text_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(tiny(&dir).max_seqs(4).build().expect("engine"), 16).await;
    let (_, body) = post(&base, "/v1/completions", completion(1, false)).await;
    let full: Value = serde_json::from_str(&body).expect("JSON");
    let full = full["choices"][0]["text"].as_str().expect("text").to_string();
    // A stop string from the middle of the greedy text, spanning whatever tokens it spans.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 4, "{full:?}");
    let stop: String = chars[2..4].iter().collect();
    let cut = &full[..full.find(&stop).expect("the stop string is in the text")];
    for stream in [false, true] {
        let mut request = completion(1, stream);
        request["stop"] = json!(["never appears", stop]);
        let (status, body) = post(&base, "/v1/completions", request).await;
        assert_eq!(status, 200, "{body}");
        let (text, reason) = match stream {
            true => {
                let (text, reason, _) = streamed(&body);
                (text, reason)
            }
            false => {
                let answer: Value = serde_json::from_str(&body).expect("JSON");
                let choice = &answer["choices"][0];
                (
                    choice["text"].as_str().unwrap_or("").to_string(),
                    choice["finish_reason"].to_string().replace('"', ""),
                )
            }
        };
        assert_eq!((text.as_str(), reason.as_str()), (cut, "stop"), "stream {stream}");
    }
}

async fn metric(base: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// A prompt of token ids that begins as an earlier one's is served from the blocks that one
/// computed, with the same answer; `/metrics` counts the positions found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prompt_prefix_is_served_from_the_cache_with_the_same_answer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prompt = |last: u32| -> Vec<u32> { (0..40).map(|t| t * 7 % 250).chain([last]).collect() };
    let body = |last: u32| json!({"model": MODEL, "prompt": prompt(last), "max_tokens": 8, "temperature": 0});
    let text = |answer: String| -> String {
        let v: Value = serde_json::from_str(&answer).expect("json");
        v["choices"][0]["text"].as_str().expect("text").to_string()
    };
    // Each prompt alone on a server of its own, then both on one.
    let mut alone = Vec::new();
    for last in [3, 4] {
        let base = serve(tiny(&dir).max_seqs(4).build().expect("engine"), 16).await;
        let (status, answer) = post(&base, "/v1/completions", body(last)).await;
        assert_eq!(status, 200, "{answer}");
        alone.push(text(answer));
    }
    let base = serve(tiny(&dir).max_seqs(4).build().expect("engine"), 16).await;
    for (last, want) in [3, 4].into_iter().zip(&alone) {
        let (status, answer) = post(&base, "/v1/completions", body(last)).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(&text(answer), want, "prompt ending in {last}");
    }
    // The second found the first's two whole blocks of 16 positions.
    assert_eq!(metric(&base, "tpinfer_prefix_cache_hit_tokens_total").await, 32.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_cancels_its_request_and_frees_its_blocks() {
    use futures_util::StreamExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(tiny(&dir).max_seqs(4).max_context(512).build().expect("engine"), 16).await;
    let request = json!({"model": MODEL, "prompt": "go", "max_tokens": 500, "temperature": 0, "stream": true});
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&request)
        .send()
        .await
        .expect("request");
    let mut body = response.bytes_stream();
    body.next().await.expect("a first chunk").expect("bytes");
    assert!(metric(&base, "tpinfer_kv_blocks_used").await > 0.0);
    drop(body);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(&base, "tpinfer_kv_blocks_used").await > 0.0 || metric(&base, "tpinfer_requests_running").await > 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the request still holds its blocks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(metric(&base, "tpinfer_generation_tokens_total").await < 500.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_400_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(tiny(&dir).max_seqs(2).max_context(64).build().expect("engine"), 16).await;
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("request");
    assert_eq!(response.status().as_u16(), 400);
    let error: Value = response.json().await.expect("JSON");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    let with = |field: &str, value: Value| {
        let mut request = completion(0, false);
        request[field] = value;
        request
    };
    let cases = [
        (with("model", json!("gpt-4")), Some("model")),
        (with("prompt", json!("x".repeat(200))), Some("prompt")),
        (with("temperature", json!(5)), Some("temperature")),
        (with("top_p", json!(0)), Some("top_p")),
        (with("top_k", json!(0)), Some("top_k")),
        (with("max_tokens", json!(0)), Some("max_tokens")),
        (with("n", json!(2)), Some("n")),
        (with("logprobs", json!(21)), Some("logprobs")),
        (with("logprobs", json!("many")), Some("logprobs")),
        (with("presence_penalty", json!(2.5)), Some("presence_penalty")),
        (with("frequency_penalty", json!(-3)), Some("frequency_penalty")),
        (with("logit_bias", json!({"seven": 1})), Some("logit_bias")),
        (with("logit_bias", json!({"7": 101})), Some("logit_bias")),
        (with("echo", json!(true)), Some("echo")),
        (with("suffix", json!("end")), Some("suffix")),
        (with("best_of", json!(3)), Some("best_of")),
        (
            with("response_format", json!({"type": "json_object"})),
            Some("response_format"),
        ),
        (
            with("tools", json!([{"type": "function", "function": {"name": "f"}}])),
            Some("tools"),
        ),
        (with("temperature", json!("hot")), None),
    ];
    for (request, param) in cases {
        let (status, body) = post(&base, "/v1/completions", request.clone()).await;
        assert_eq!(status, 400, "{request}: {body}");
        let error: Value = serde_json::from_str(&body).expect("JSON");
        assert!(
            error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        if let Some(param) = param {
            assert_eq!(error["error"]["param"], param, "{request}: {body}");
        }
    }
    // A route that is not there, or not for that method: OpenAI's shape, with the routes.
    let (status, body) = post(&base, "/v1/embeddings", json!({})).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains("/v1/embeddings") && body.contains("POST /v1/completions"),
        "{body}"
    );
    let response = reqwest::get(format!("{base}/v1/completions")).await.expect("GET");
    assert_eq!(response.status().as_u16(), 405);
    let error: Value = response.json().await.expect("JSON");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("GET /v1/completions")),
        "{error}"
    );
    // A body past the server's limit: 413, in OpenAI's shape, saying the limit.
    let mut huge = completion(0, false);
    huge["prompt"] = json!("z".repeat(tpinfer_server::MAX_BODY_BYTES + 1));
    let (status, body) = post(&base, "/v1/completions", huge).await;
    assert_eq!(status, 413, "{}", &body[..body.len().min(300)]);
    let error: Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        error["error"]["message"].as_str().is_some_and(|m| m.contains("16 MiB")),
        "{body}"
    );
    for messages in [json!([]), json!([{"role": "user", "content": "y".repeat(200)}])] {
        let chat = json!({"model": MODEL, "messages": messages});
        let (status, body) = post(&base, "/v1/chat/completions", chat).await;
        assert_eq!(status, 400, "{body}");
        let error: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(error["error"]["param"], "messages", "{body}");
    }
    // Alternatives without logprobs, or more than 20 of them.
    for (logprobs, top) in [(json!(null), 2), (json!(true), 21), (json!(true), -1)] {
        let chat = json!({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "logprobs": logprobs, "top_logprobs": top,
        });
        let (status, body) = post(&base, "/v1/chat/completions", chat).await;
        assert_eq!(status, 400, "{body}");
        let error: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(error["error"]["param"], "top_logprobs", "{body}");
    }
}

/// The log-softmax of `logits` in f64: an independent reference for the server's figures.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let norm = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&x| x as f64 - norm).collect()
}

/// The ids of the `n` largest `values`, largest first (ties: the lower id first).
fn top_ids(values: &[f64], n: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..values.len()).collect();
    ids.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    ids.truncate(n);
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_the_log_softmax_of_the_logits_each_token_came_from() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The reference: the same requests through an engine of its own, with their logits.
    let reference = tiny(&dir).build().expect("reference engine");
    let tokenizer = reference.tokenizer();
    // One request at a time (the captured greedy step's path is left for the host's), and
    // continuously batched.
    for max_seqs in [1, 4] {
        let base = serve(tiny(&dir).max_seqs(max_seqs).build().expect("engine"), 16).await;
        for (temperature, seed) in [(0.0, 1u64), (0.9, 7)] {
            let prompt = "logprobs of a tiny model";
            let mut request = tpinfer_engine::GenerateRequest::new(tpinfer_engine::Prompt::text(prompt), 6);
            request.sampling.temperature = temperature;
            request.sampling.seed = seed;
            let (stream, logits) = reference.generate_traced(request).expect("traced");
            let (_, ids, _) = stream.collect_text().expect("reference run");
            let steps: Vec<Vec<f64>> = logits.iter().take(ids.len()).map(|l| log_softmax(&l)).collect();
            assert_eq!(steps.len(), ids.len());

            // A whole completion, the legacy shape: parallel arrays.
            let body = json!({
                "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": temperature,
                "seed": seed, "logprobs": 3,
            });
            let (status, answer) = post(&base, "/v1/completions", body).await;
            assert_eq!(status, 200, "{answer}");
            let answer: Value = serde_json::from_str(&answer).expect("JSON");
            let lp = &answer["choices"][0]["logprobs"];
            let chosen = lp["token_logprobs"].as_array().expect("token_logprobs");
            assert_eq!(chosen.len(), ids.len(), "{lp}");
            let mut offset = 0;
            for (i, (&id, want)) in ids.iter().zip(&steps).enumerate() {
                let got = chosen[i].as_f64().expect("a number");
                assert!(
                    (got - want[id as usize]).abs() < 1e-4,
                    "T {temperature} token {i}: {got} vs {}",
                    want[id as usize]
                );
                let top = lp["top_logprobs"][i].as_object().expect("top_logprobs");
                // Keyed by text: alternatives that decode alike (pieces of characters) keep the
                // likelier one.
                let mut want_top = std::collections::BTreeMap::new();
                for t in top_ids(want, 3) {
                    let text = tokenizer.decode(&[t as u32]).expect("decode");
                    want_top.entry(text).or_insert(want[t]);
                }
                assert_eq!(top.len(), want_top.len(), "{top:?}");
                for (text, w) in &want_top {
                    let got = top.get(text).and_then(Value::as_f64).expect("an alternative");
                    assert!((got - w).abs() < 1e-4, "token {i} alternative {text:?}: {got} vs {w}");
                }
                let token = lp["tokens"][i].as_str().expect("token");
                assert_eq!(token, tokenizer.decode(&[id]).expect("decode"));
                assert_eq!(lp["text_offset"][i], offset);
                offset += token.chars().count();
            }

            // A streamed chat's entries, gathered over its chunks, against the chat's own run.
            let messages = [tpinfer_engine::ChatMessage::user(prompt)];
            let mut request = tpinfer_engine::GenerateRequest::new(tpinfer_engine::Prompt::Chat(messages.to_vec()), 5);
            request.sampling.temperature = temperature;
            request.sampling.seed = seed;
            let (stream, logits) = reference.generate_traced(request).expect("traced chat");
            let (_, ids, _) = stream.collect_text().expect("reference chat");
            let body = json!({
                "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 5,
                "temperature": temperature, "seed": seed, "logprobs": true, "top_logprobs": 2, "stream": true,
            });
            let (status, text) = post(&base, "/v1/chat/completions", body).await;
            assert_eq!(status, 200, "{text}");
            let entries: Vec<Value> = events(&text)
                .0
                .iter()
                .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
                .flatten()
                .collect();
            assert_eq!(entries.len(), ids.len(), "{text}");
            for (i, (entry, (&id, logits))) in entries.iter().zip(ids.iter().zip(logits.iter())).enumerate() {
                let want = log_softmax(&logits);
                let got = entry["logprob"].as_f64().expect("logprob");
                assert!((got - want[id as usize]).abs() < 1e-4, "chat token {i}");
                assert_eq!(entry["token"], tokenizer.decode(&[id]).expect("decode"));
                let top = entry["top_logprobs"].as_array().expect("top_logprobs");
                let alternatives: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().expect("logprob")).collect();
                let want_top: Vec<f64> = top_ids(&want, 2).iter().map(|&t| want[t]).collect();
                assert_eq!(alternatives.len(), 2);
                for (g, w) in alternatives.iter().zip(&want_top) {
                    assert!(
                        (g - w).abs() < 1e-4,
                        "chat token {i} alternatives {alternatives:?} vs {want_top:?}"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_gets_429_and_every_accepted_request_completes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(tiny(&dir).max_seqs(2).max_context(512).build().expect("engine"), 3).await;
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let base = base.clone();
            let request = json!({"model": MODEL, "prompt": "q", "max_tokens": 300, "temperature": 0});
            tokio::spawn(async move { post(&base, "/v1/completions", request).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        let (status, body) = task.await.expect("task");
        match status {
            200 => {
                let answer: Value = serde_json::from_str(&body).expect("JSON");
                assert_eq!(answer["usage"]["completion_tokens"], 300, "{body}");
            }
            429 => assert!(body.contains("rate_limit_error"), "{body}"),
            _ => panic!("{status}: {body}"),
        }
        statuses.push(status);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.iter().filter(|&&s| s == 200).count() >= 3, "{statuses:?}");
    assert!(metric(&base, "tpinfer_requests_rejected_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_soak_of_500_requests_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = serve(tiny(&dir).tp(2).max_seqs(16).build().expect("engine"), 1000).await;
    let client = reqwest::Client::new();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..500usize {
        let (base, client) = (base.clone(), client.clone());
        tasks.spawn(async move {
            // One request every 2 ms: a second of arrivals, far more than the engine clears.
            tokio::time::sleep(Duration::from_millis(i as u64 * 2)).await;
            let request = json!({
                "model": MODEL, "prompt": format!("soak {i}"), "max_tokens": 1 + i % 7,
                "temperature": 0.7, "seed": i, "stream": i % 2 == 0, "stream_options": {"include_usage": true},
            });
            let response = client
                .post(format!("{base}/v1/completions"))
                .json(&request)
                .send()
                .await;
            let body = response.expect("request").text().await.expect("body");
            (i, body)
        });
    }
    let mut completed = 0;
    while let Some(joined) = tasks.join_next().await {
        let (i, body) = joined.expect("task");
        let usage = match i % 2 {
            0 => streamed(&body).2.expect("usage"),
            _ => serde_json::from_str::<Value>(&body).expect("JSON")["usage"].clone(),
        };
        let tokens = usage["completion_tokens"].as_u64().expect("completion tokens");
        assert!(tokens >= 1 && tokens as usize <= 1 + i % 7, "request {i}: {body}");
        completed += 1;
    }
    assert_eq!(completed, 500);
    assert_eq!(metric(&base, "tpinfer_requests_total").await, 500.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_rank_failure_every_request_and_health_get_503_with_the_cause() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = tiny(&dir)
        .tp(2)
        .max_seqs(4)
        .comm_timeout(Duration::from_secs(5))
        .inject_fault(Fault::Error { rank: 1, step: 2 })
        .build()
        .expect("engine");
    let base = serve(engine, 16).await;
    let (status, body) = post(&base, "/v1/completions", completion(0, true)).await;
    assert_eq!(status, 200, "the stream had started: {body}");
    let (chunks, done) = events(&body);
    assert!(done);
    let error = chunks.last().expect("an error chunk");
    assert!(
        error["error"]["message"].as_str().is_some_and(|m| m.contains("rank 1")),
        "{body}"
    );
    let health = reqwest::get(format!("{base}/health")).await.expect("health");
    assert_eq!(health.status().as_u16(), 503);
    assert!(health.text().await.expect("body").contains("rank 1"));
    let (status, body) = post(&base, "/v1/completions", completion(1, false)).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("rank 1: injected fault"), "{body}");
}
