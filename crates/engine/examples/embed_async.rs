//! Many requests at once from an async service: the engine batches them continuously (every
//! running request advances in each step), and each answer streams back as it is generated.
//!
//! `cargo run --release --example embed_async -p tpinfer-engine -- MODEL [TP]`

use std::sync::Arc;

use futures_util::StreamExt;
use tpinfer_engine::{Engine, EngineError, GenerateRequest, Prompt, StreamEvent};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args.next().ok_or("usage: embed_async MODEL [TP]")?;
    let tp = args.next().map_or(Ok(1), |tp| tp.parse())?;
    // Loading blocks: off the async threads.
    let engine = tokio::task::spawn_blocking(move || Engine::builder(model).tp(tp).max_seqs(16).build()).await??;
    let engine = Arc::new(engine);
    let mut answers = tokio::task::JoinSet::new();
    for question in ["What is 2 + 2?", "Name a colour.", "Say hello in French."] {
        let engine = engine.clone();
        answers.spawn(async move {
            let request = GenerateRequest::new(Prompt::user(question), 32);
            // Dropping the stream would cancel the request and free its KV blocks.
            let mut stream = engine.generate_stream(request)?;
            let mut answer = String::new();
            while let Some(event) = stream.next().await {
                match event? {
                    StreamEvent::Token { text, .. } | StreamEvent::Tail(text) => answer.push_str(&text),
                    StreamEvent::Done(_) => break,
                }
            }
            Ok::<_, EngineError>((question, answer))
        });
    }
    while let Some(answer) = answers.join_next().await {
        let (question, answer) = answer??;
        println!("{question} → {answer}");
    }
    Ok(())
}
