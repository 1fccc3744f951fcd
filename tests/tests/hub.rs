//! Hugging Face ids resolved in a hub cache laid out as `huggingface_hub` writes it
//! (`models--ORG--NAME/refs/REV` and `snapshots/COMMIT/`), offline.

use std::path::{Path, PathBuf};

use tpinfer_hub::{HubCache, HubError, RepoId};
use tpinfer_tests::{hub_snapshot, TinyLlama, HUB_COMMIT};

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
