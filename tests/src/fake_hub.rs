//! A Hugging Face hub on a local port, serving one repository's files the way the Hub's
//! `resolve` endpoint does (`GET /ORG/NAME/resolve/REVISION/FILE`, ranges, and the
//! `X-Repo-Commit` and `ETag` headers `hf-hub` reads), and recording every file asked for:
//! downloads are tested without a network.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A fake hub serving `repo`'s files (path → bytes) at `commit`, for revision `main` and the
/// commit itself. The server thread lives as long as the test process.
pub struct FakeHub {
    pub endpoint: String,
    requested: Arc<Mutex<Vec<String>>>,
}

impl FakeHub {
    /// Serves every file under `dir` as `repo`'s.
    pub fn serve_dir(repo: &str, commit: &str, dir: &Path) -> Self {
        let mut files = BTreeMap::new();
        collect(dir, dir, &mut files);
        Self::serve(repo, commit, files)
    }

    pub fn serve(repo: &str, commit: &str, files: BTreeMap<String, Vec<u8>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local port");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        let requested = Arc::new(Mutex::new(Vec::new()));
        let (log, repo, commit) = (requested.clone(), repo.to_string(), commit.to_string());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                respond(stream, &repo, &commit, &files, &log);
            }
        });
        Self { endpoint, requested }
    }

    /// The files asked for (each download asks twice: its size, then its bytes), each once,
    /// sorted.
    pub fn requested(&self) -> Vec<String> {
        let mut files = self.requested.lock().expect("log").clone();
        files.sort();
        files.dedup();
        files
    }
}

fn collect(root: &Path, dir: &Path, files: &mut BTreeMap<String, Vec<u8>>) {
    for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(root, &path, files);
        } else {
            let name = path
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            files.insert(name, std::fs::read(&path).expect("read file"));
        }
    }
}

/// Answers one request on `stream`, then closes it.
fn respond(stream: TcpStream, repo: &str, commit: &str, files: &BTreeMap<String, Vec<u8>>, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let target = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut range = None;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("range") {
                range = value.trim().strip_prefix("bytes=").map(str::to_string);
            }
        }
    }
    let file = ["main", commit]
        .iter()
        .find_map(|rev| target.strip_prefix(&format!("/{repo}/resolve/{rev}/")))
        .map(str::to_string);
    if let Some(file) = &file {
        log.lock().expect("log").push(file.clone());
    }
    let mut out = stream;
    let Some(bytes) = file.and_then(|f| files.get(&f)) else {
        let _ = out.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    let size = bytes.len();
    let (start, end) = match range.as_deref().and_then(|r| r.split_once('-')) {
        Some((start, end)) => (
            start.parse().unwrap_or(0),
            end.parse::<usize>().map_or(size, |e| (e + 1).min(size)),
        ),
        None => (0, size),
    };
    let body = &bytes[start.min(size)..end.max(start).min(size)];
    // An etag per content, as the Hub's are (blobs are named by it).
    let etag = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let head = format!(
        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{}/{size}\r\n\
         ETag: \"{etag:016x}\"\r\nX-Repo-Commit: {commit}\r\nConnection: close\r\n\r\n",
        body.len(),
        end.max(start + 1) - 1,
    );
    let _ = out.write_all(head.as_bytes()).and_then(|()| out.write_all(body));
}
