//! Embedding tpinfer in a service: one engine shared by threads, tokens streamed as they come.
//! The README shows this program. Run: `cargo run --release --example embed -p tpinfer-engine -- MODEL`.

use std::sync::Arc;

use tpinfer_engine::{Engine, GenerateRequest, Prompt, StreamEvent};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args().nth(1).ok_or("usage: embed MODEL_DIR_OR_GGUF")?;
    let engine = Arc::new(Engine::builder(&model).tp(2).build()?);

    let worker = {
        let engine = engine.clone();
        std::thread::spawn(move || -> Result<String, tpinfer_engine::EngineError> {
            let request = GenerateRequest::new(Prompt::user("Name a primary color."), 16);
            Ok(engine.generate(request)?.collect_text()?.0)
        })
    };

    let request = GenerateRequest::new(Prompt::user("What is 2 + 2?"), 32);
    for event in engine.generate(request)? {
        match event? {
            StreamEvent::Token { text, .. } | StreamEvent::Tail(text) => print!("{text}"),
            StreamEvent::Done(stats) => {
                println!("\n[{:.1} tok/s]", stats.decode_tokens_per_second())
            }
        }
    }
    println!("other thread: {}", worker.join().map_err(|_| "worker panicked")??);
    Ok(())
}
