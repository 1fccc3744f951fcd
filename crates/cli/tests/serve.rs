//! `tpinfer serve` as a user starts it: it listens, answers over HTTP, refuses what it cannot
//! serve, and on SIGTERM under load stops within its grace period and exits 0.
#![allow(clippy::expect_used)] // test helpers: a failed expectation is a failed test

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tpinfer_tests::TinyLlama;

/// Starts the server on a free port; returns it, its address (read from the line that names
/// it) and the lines it wrote before that one.
fn start(model: &str, extra: &[&str]) -> (Child, String, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tpinfer"))
        .args([
            "serve",
            "--model",
            model,
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--port",
            "0",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tpinfer serve");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut before = Vec::new();
    let address = loop {
        let line = lines
            .next()
            .expect("a line before the server exits")
            .expect("stderr line");
        if let Some(at) = line.find("http://") {
            let rest = &line[at + "http://".len()..];
            break rest.split_whitespace().next().expect("an address").to_string();
        }
        before.push(line);
    };
    // Keep draining stderr so that the server never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (child, address, before)
}

/// A POST over a plain socket; the whole answer, headers included, once the server closes it
/// or the body ends.
fn post(address: &str, route: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(address).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    write!(
        stream,
        "POST {route} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn wait(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("tpinfer serve did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A SIGTERM the moment the address is announced stops the server and it exits 0: the
/// handler is in place before the announcement, not once the server's tasks first run.
#[test]
fn serve_stops_on_a_sigterm_right_after_it_announces_its_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let model = model.to_str().expect("utf8 path");
    for _ in 0..3 {
        let (mut child, _, _) = start(model, &[]);
        // SAFETY: a plain signal to the child this test started.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let status = wait(&mut child, Duration::from_secs(20));
        assert!(status.success(), "{status:?}");
    }
}

#[test]
fn serve_answers_then_stops_on_sigterm_under_load_and_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let model = model.to_str().expect("utf8 path");
    let (mut child, address, before) = start(model, &["--tp", "2", "--max-seqs", "2", "--shutdown-timeout-secs", "3"]);
    // The KV cache it holds, said before it listens: two full contexts of the tiny model's 512.
    assert!(
        before
            .iter()
            .any(|l| l.starts_with("KV cache: 1024 positions, 2 full contexts of 512")),
        "{before:?}"
    );
    // Sampled at OpenAI's default temperature, so the random model may draw its end-of-text
    // token: ignore_eos keeps the token counts (and the load below running) as asked.
    let answer = post(
        &address,
        "/v1/completions",
        r#"{"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": true}"#,
    );
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"completion_tokens\":3"), "{answer}");
    // Long streams running and queued, then SIGTERM.
    let load: Vec<_> = (0..8)
        .map(|i| {
            let address = address.clone();
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"model": "tiny", "prompt": "load {i}", "max_tokens": 500, "stream": true, "ignore_eos": true}}"#
                );
                let answer = post(&address, "/v1/completions", &body);
                (answer, Instant::now())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let signalled = Instant::now();
    // SAFETY: a plain signal to the child this test started.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = wait(&mut child, Duration::from_secs(20));
    assert!(status.success(), "exit status {status}");
    let ends: Vec<Instant> = load
        .into_iter()
        .map(|stream| {
            // Every stream ended: finished, or cut when the grace period ran out.
            let (answer, end) = stream.join().expect("load thread");
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            end
        })
        .collect();
    assert!(ends.iter().any(|&end| end > signalled), "the signal came under load");
}

#[test]
fn serve_refuses_a_bad_address_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let model = model.to_str().expect("utf8 path");
    let output = Command::new(env!("CARGO_BIN_EXE_tpinfer"))
        .args(["serve", "--model", model, "--device", "cpu", "--host", "not an address"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.starts_with("error: ") && stderr.contains("--host"), "{stderr}");
}

/// A zero count of sequences or step tokens is refused by its flag before anything loads.
#[test]
fn serve_refuses_zero_counts_by_flag() {
    for flag in ["--max-seqs", "--step-tokens"] {
        let output = Command::new(env!("CARGO_BIN_EXE_tpinfer"))
            .args(["serve", "--model", "no/such/model", "--device", "cpu", flag, "0"])
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(flag) && stderr.contains("at least 1"), "{stderr}");
    }
}

/// The port is claimed before the model loads: with it taken, the server fails on the port
/// (here before it would find that the model's weights are missing), not after a load.
#[test]
fn serve_claims_its_port_before_loading() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    std::fs::remove_file(model.join("model.safetensors")).expect("rm weights");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("address").port().to_string();
    let output = Command::new(env!("CARGO_BIN_EXE_tpinfer"))
        .args(["serve", "--model", model.to_str().expect("utf8 path")])
        .args(["--device", "cpu", "--port", &port])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains(&format!("cannot listen on 127.0.0.1:{port}")) && !stderr.contains("no weights"),
        "{stderr}"
    );
}

/// The prompt tokens an answer's `usage` reports.
fn prompt_tokens(answer: &str) -> usize {
    let at = answer.find("\"prompt_tokens\":").expect("usage") + "\"prompt_tokens\":".len();
    let digits: String = answer[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().expect("a count")
}

/// A model that ships no chat template answers chat requests with a 400 that names
/// `--chat-template`; served with one, its chats render through it: a template of the message
/// alone gives the completion's prompt less its BOS.
#[test]
fn serve_takes_a_chat_template_for_a_model_without_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = TinyLlama::default().write(dir.path());
    let config = model.join("tokenizer_config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).expect("read")).expect("json");
    json.as_object_mut().expect("object").remove("chat_template");
    std::fs::write(&config, json.to_string()).expect("write");
    let model = model.to_str().expect("utf8 path");
    let chat = r#"{"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}"#;
    let completion = r#"{"model": "tiny", "prompt": "hello there", "max_tokens": 1}"#;
    for template in [None, Some("{{ messages[0]['content'] }}")] {
        let extra: Vec<&str> = template.map(|t| vec!["--chat-template", t]).unwrap_or_default();
        let (mut child, address, _) = start(model, &extra);
        let answer = post(&address, "/v1/chat/completions", chat);
        match template {
            None => {
                assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
                assert!(answer.contains("--chat-template"), "{answer}");
            }
            Some(_) => {
                assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
                let plain = post(&address, "/v1/completions", completion);
                assert_eq!(prompt_tokens(&answer) + 1, prompt_tokens(&plain), "{answer}\n{plain}");
            }
        }
        // SAFETY: a plain signal to the child this test started.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        assert!(wait(&mut child, Duration::from_secs(20)).success());
    }
}
