//! Hugging Face ids resolved in a hub cache laid out as `huggingface_hub` writes it
//! (`models--ORG--NAME/refs/REV` and `snapshots/COMMIT/`), and what it lacks downloaded from
//! a hub on a local port.

use std::path::{Path, PathBuf};

use tpinfer_hub::{HubCache, HubError, Remote, RepoId};
use tpinfer_tests::{hub_snapshot, FakeHub, TinyLlama, TinyWanPipeline, TinyWanVae, HUB_COMMIT};

/// A cache holding a tiny Llama as `org/tiny` (in two safetensors shards); returns the
/// snapshot.
fn cache_with_tiny(root: &Path) -> PathBuf {
    let snapshot = hub_snapshot(root, "org/tiny", HUB_COMMIT);
    TinyLlama {
        files: 2,
        ..TinyLlama::default()
    }
    .write(&snapshot);
    snapshot
}

#[test]
fn ids_are_org_and_name_with_an_optional_revision() {
    let id = RepoId::parse("meta-llama/Llama-3.1-8B-Instruct").expect("id");
    assert_eq!(
        (id.org.as_str(), id.name.as_str(), id.revision.as_str()),
        ("meta-llama", "Llama-3.1-8B-Instruct", "main")
    );
    assert_eq!(RepoId::parse("org/name@v1.0").expect("id").revision, "v1.0");
    for not_an_id in ["name", "a/b/c", "/b", "a/", "../x", "a/b@", "a/b@x/y", "a b/c", "./x"] {
        assert_eq!(RepoId::parse(not_an_id), None, "{not_an_id}");
    }
}

#[test]
fn the_cache_is_where_huggingface_hub_puts_it() {
    let (cache, home, user) = (PathBuf::from("/c"), PathBuf::from("/h"), PathBuf::from("/u"));
    let root = |c: HubCache| format!("{c:?}");
    let at = |p: &str| root(HubCache::new(p));
    assert_eq!(
        root(HubCache::locate(Some(cache), Some(home.clone()), Some(user.clone())).expect("cache")),
        at("/c")
    );
    assert_eq!(
        root(HubCache::locate(None, Some(home), Some(user.clone())).expect("cache")),
        at("/h/hub")
    );
    assert_eq!(
        root(HubCache::locate(None, None, Some(user)).expect("cache")),
        at("/u/.cache/huggingface/hub")
    );
    assert!(HubCache::locate(None, None, None).is_none());
}

#[test]
fn an_id_resolves_to_its_snapshot_by_ref_or_commit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let snapshot = cache_with_tiny(dir.path());
    let cache = HubCache::new(dir.path());
    let id = |spec: &str| RepoId::parse(spec).expect("id");
    assert_eq!(cache.resolve(&id("org/tiny")).expect("main"), snapshot);
    assert_eq!(
        cache.resolve(&id(&format!("org/tiny@{HUB_COMMIT}"))).expect("commit"),
        snapshot
    );
    let err = cache.resolve(&id("org/tiny@v2")).expect_err("no such ref");
    assert!(matches!(err, HubError::NoRevision { .. }), "{err}");
    assert!(
        err.to_string().contains("`v2`") && err.to_string().contains("cached: main"),
        "{err}"
    );
    let err = cache.resolve(&id("org/other")).expect_err("not cached");
    assert!(err.to_string().contains("huggingface-cli download org/other"), "{err}");
}

/// A snapshot that lacks a file the run reads is refused naming it: a shard its index names,
/// the tokenizer.
#[test]
fn an_incomplete_snapshot_names_what_it_lacks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let snapshot = cache_with_tiny(dir.path());
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(snapshot.join("model.safetensors.index.json")).expect("index"))
            .expect("json");
    let shard = index["weight_map"]
        .as_object()
        .expect("map")
        .values()
        .next()
        .expect("a shard")
        .as_str()
        .expect("name")
        .to_string();
    std::fs::remove_file(snapshot.join(&shard)).expect("remove");
    std::fs::remove_file(snapshot.join("tokenizer.json")).expect("remove");
    let err = HubCache::new(dir.path())
        .resolve(&RepoId::parse("org/tiny").expect("id"))
        .expect_err("incomplete");
    assert!(matches!(err, HubError::Incomplete { .. }), "{err}");
    assert!(
        err.to_string().contains(&shard) && err.to_string().contains("tokenizer.json"),
        "{err}"
    );
}

fn hub(endpoint: &str) -> Remote {
    Remote::Hub {
        endpoint: endpoint.to_string(),
        token: None,
        progress: false,
    }
}

/// A tiny Llama (two shards) as a hub repository holds it, with files a run never reads
/// beside it: PyTorch weights, Meta's originals, a shard no index names.
fn remote_tiny(dir: &Path) -> FakeHub {
    TinyLlama {
        files: 2,
        ..TinyLlama::default()
    }
    .write(dir);
    std::fs::create_dir_all(dir.join("original")).expect("original/");
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages[0]['content'] }}").expect("template");
    for extra in [
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "model-unused.safetensors",
        "README.md",
    ] {
        std::fs::write(dir.join(extra), b"never read").expect("extra file");
    }
    FakeHub::serve_dir("org/tiny", HUB_COMMIT, dir)
}

/// An id missing from the cache is downloaded into it, in `huggingface_hub`'s layout: only
/// the files a run reads and the shards the index names. Once cached, it is read without a
/// request, offline too.
#[test]
fn a_missing_model_is_downloaded_and_only_what_the_run_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = remote_tiny(&dir.path().join("remote"));
    let cache = HubCache::new(dir.path().join("cache"));
    let id = RepoId::parse("org/tiny").expect("id");
    let snapshot = cache.fetch(&id, &hub(&server.endpoint)).expect("download");
    assert_eq!(
        snapshot,
        dir.path().join("cache/models--org--tiny/snapshots").join(HUB_COMMIT)
    );
    let requested = server.requested();
    for extra in [
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "model-unused.safetensors",
        "README.md",
    ] {
        assert!(
            !requested.iter().any(|r| r == extra),
            "{extra} was downloaded: {requested:?}"
        );
    }
    let index = std::fs::read_to_string(snapshot.join("model.safetensors.index.json")).expect("index");
    let remote = dir.path().join("remote");
    for file in [
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    ] {
        assert!(
            requested.iter().any(|r| r == file),
            "{file} not asked for: {requested:?}"
        );
        assert_eq!(
            std::fs::read(snapshot.join(file)).ok(),
            std::fs::read(remote.join(file)).ok(),
            "{file}"
        );
    }
    let shards: Vec<&String> = requested.iter().filter(|r| r.ends_with(".safetensors")).collect();
    assert_eq!(shards.len(), 2, "{requested:?}");
    assert!(shards.iter().all(|s| index.contains(s.as_str())), "{shards:?}");
    // Cached now: no request, offline or not.
    assert_eq!(cache.fetch(&id, &hub(&server.endpoint)).expect("cached"), snapshot);
    assert_eq!(cache.fetch(&id, &Remote::Offline).expect("offline"), snapshot);
    assert_eq!(server.requested(), requested, "a cached snapshot asked the hub again");
}

/// A repository of PyTorch pickles alone (two shards and their index) downloads those, and
/// the snapshot loads and runs.
#[test]
fn a_repository_of_pickles_downloads_its_shards() {
    let dir = tempfile::tempdir().expect("tempdir");
    let remote = TinyLlama::default().write_torch(&dir.path().join("remote"), 2);
    let server = FakeHub::serve_dir("org/old", HUB_COMMIT, &remote);
    let cache = HubCache::new(dir.path().join("cache"));
    let id = RepoId::parse("org/old").expect("id");
    let snapshot = cache.fetch(&id, &hub(&server.endpoint)).expect("download");
    let requested = server.requested();
    for file in [
        "pytorch_model.bin.index.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
    ] {
        assert!(snapshot.join(file).is_file(), "{file}: {requested:?}");
    }
    assert_eq!(cache.fetch(&id, &Remote::Offline).expect("complete offline"), snapshot);
    // A shard gone from the cache is named, not the safetensors the repository never had.
    let shard = snapshot.join("pytorch_model-00002-of-00002.bin");
    let kept = std::fs::read(&shard).expect("shard");
    std::fs::remove_file(&shard).expect("rm shard");
    let err = cache
        .fetch(&id, &Remote::Offline)
        .expect_err("a shard missing")
        .to_string();
    assert!(
        err.contains("pytorch_model-00002-of-00002.bin") && !err.contains("model.safetensors"),
        "{err}"
    );
    std::fs::write(&shard, kept).expect("restore shard");
    let engine = tpinfer_engine::Engine::builder(&snapshot).build().expect("engine");
    let request = tpinfer_engine::GenerateRequest::new(tpinfer_engine::Prompt::text("ab"), 2);
    let (_, ids, _) = engine
        .generate(request)
        .expect("generate")
        .collect_text()
        .expect("stream");
    assert_eq!(ids.len(), 2);
}

/// A diffusers pipeline downloads each stage tpinfer runs, and resolves as complete.
#[test]
fn a_missing_pipeline_is_downloaded_stage_by_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    TinyWanPipeline {
        vae: Some(TinyWanVae::default()),
        ..TinyWanPipeline::default()
    }
    .write(&dir.path().join("remote"));
    std::fs::write(dir.path().join("remote/text_encoder/pytorch_model.bin"), b"never read").expect("extra");
    let server = FakeHub::serve_dir("org/wan", HUB_COMMIT, &dir.path().join("remote"));
    let cache = HubCache::new(dir.path().join("cache"));
    let id = RepoId::parse("org/wan").expect("id");
    let snapshot = cache.fetch(&id, &hub(&server.endpoint)).expect("download");
    assert!(snapshot.join("transformer/config.json").is_file());
    assert!(snapshot.join("vae/diffusion_pytorch_model.safetensors").is_file());
    assert!(
        !server.requested().iter().any(|r| r.ends_with(".bin")),
        "{:?}",
        server.requested()
    );
}

/// Offline (`HF_HUB_OFFLINE=1`), a model the cache lacks is refused at once, naming it and
/// how to get it; an unreachable hub fails at once, naming the file, the endpoint and the
/// offline switch; a shard the hub lacks is named.
#[test]
fn what_cannot_be_had_is_named_without_waiting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = HubCache::new(dir.path().join("cache"));
    let id = RepoId::parse("org/tiny").expect("id");
    let err = cache.fetch(&id, &Remote::Offline).expect_err("offline, not cached");
    assert!(matches!(err, HubError::NotCached { .. }), "{err}");

    // Nothing listens on port 1.
    let start = std::time::Instant::now();
    let err = cache.fetch(&id, &hub("http://127.0.0.1:1")).expect_err("unreachable");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(10),
        "waited {:?}",
        start.elapsed()
    );
    let text = err.to_string();
    assert!(matches!(err, HubError::Download { .. }), "{text}");
    assert!(
        text.contains("127.0.0.1:1") && text.contains("HF_HUB_OFFLINE=1"),
        "{text}"
    );

    let remote = dir.path().join("remote");
    remote_tiny(&remote);
    let index = std::fs::read_to_string(remote.join("model.safetensors.index.json")).expect("index");
    let shard = index
        .split('"')
        .find(|s| s.ends_with(".safetensors"))
        .expect("a shard")
        .to_string();
    std::fs::remove_file(remote.join(&shard)).expect("remove");
    let server = FakeHub::serve_dir("org/tiny", HUB_COMMIT, &remote);
    let err = cache.fetch(&id, &hub(&server.endpoint)).expect_err("a shard missing");
    assert!(
        err.to_string().contains(&shard) && err.to_string().contains("no such file"),
        "{err}"
    );
}
