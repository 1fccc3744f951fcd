//! Hugging Face model ids resolved in the local hub cache, the layout `huggingface_hub`
//! writes: `<cache>/models--ORG--NAME/refs/<revision>` holds a commit hash, and
//! `snapshots/<commit>/` the files of that commit. A resolved snapshot is checked for the
//! files a run reads (the config, the tokenizer, every safetensors shard its index names; for
//! a diffusers pipeline, each stage's), and a missing one is named rather than found later.
//!
//! What the cache lacks is downloaded into it through `hf-hub` ([`HubCache::fetch`]), unless
//! the run is offline.
//!
//! Where the cache is, and where downloads come from, come from the caller
//! ([`HubCache::locate`] and [`Remote`] take the environment's values): the library reads no
//! environment.

mod fetch;

use std::path::{Path, PathBuf};

pub use fetch::Remote;

/// Why an id could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{id} is not in the Hugging Face cache ({dir} does not exist): download it first, e.g. \
         `huggingface-cli download {id}`, or give a local directory"
    )]
    NotCached { id: String, dir: PathBuf },
    #[error("{id}: the cache has no revision `{revision}` ({path} does not exist); cached: {cached}")]
    NoRevision {
        id: String,
        revision: String,
        path: PathBuf,
        cached: String,
    },
    #[error(
        "{id} in the cache ({snapshot}) lacks {}: download them, e.g. `huggingface-cli download {id}`",
        missing.join(", ")
    )]
    Incomplete {
        id: String,
        snapshot: PathBuf,
        missing: Vec<String>,
    },
    #[error("{path}: {detail}")]
    Unreadable { path: PathBuf, detail: String },
    #[error("cannot make an HTTP client for {endpoint}: {detail}")]
    Client { endpoint: String, detail: String },
    #[error("{id}: cannot download `{file}` from {endpoint}: {detail}")]
    Download {
        id: String,
        file: String,
        endpoint: String,
        detail: String,
    },
}

/// `ORG/NAME` with an optional `@REVISION` (a branch, a tag or a commit hash; `main` when
/// none is given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoId {
    pub org: String,
    pub name: String,
    pub revision: String,
}

impl RepoId {
    /// The id `spec` names, if it has that form: two names of letters, digits, `-`, `_` and
    /// `.`, joined by one `/`, neither starting with `.`.
    pub fn parse(spec: &str) -> Option<Self> {
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, revision)) if !revision.is_empty() && !revision.contains('/') => (repo, revision),
            Some(_) => return None,
            None => (spec, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        let valid = |part: &str| {
            !part.is_empty()
                && !part.starts_with('.')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        (valid(org) && valid(name)).then(|| Self {
            org: org.to_string(),
            name: name.to_string(),
            revision: revision.to_string(),
        })
    }

    fn id(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }

    /// `ORG/NAME@REVISION`.
    fn spec(&self) -> String {
        format!("{}@{}", self.id(), self.revision)
    }
}

/// The local hub cache.
#[derive(Debug, Clone)]
pub struct HubCache {
    root: PathBuf,
}

impl HubCache {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Where `huggingface_hub` keeps it, from the environment's values: `HF_HUB_CACHE`, else
    /// `HF_HOME/hub`, else `~/.cache/huggingface/hub` (`home` is `HOME`).
    pub fn locate(hf_hub_cache: Option<PathBuf>, hf_home: Option<PathBuf>, home: Option<PathBuf>) -> Option<Self> {
        hf_hub_cache
            .or_else(|| hf_home.map(|h| h.join("hub")))
            .or_else(|| home.map(|h| h.join(".cache/huggingface/hub")))
            .map(Self::new)
    }

    /// The snapshot directory of `repo` at its revision, once it holds what a run reads.
    pub fn resolve(&self, repo: &RepoId) -> Result<PathBuf, HubError> {
        let id = repo.id();
        let dir = self.root.join(format!("models--{}--{}", repo.org, repo.name));
        if !dir.is_dir() {
            return Err(HubError::NotCached { id, dir });
        }
        let commit = match is_commit(&repo.revision) {
            true => repo.revision.clone(),
            false => {
                let path = dir.join("refs").join(&repo.revision);
                match std::fs::read_to_string(&path) {
                    Ok(commit) => commit.trim().to_string(),
                    Err(_) => {
                        return Err(HubError::NoRevision {
                            id,
                            revision: repo.revision.clone(),
                            cached: listing(&dir.join("refs")),
                            path,
                        })
                    }
                }
            }
        };
        let snapshot = dir.join("snapshots").join(&commit);
        if !snapshot.is_dir() {
            return Err(HubError::NoRevision {
                id,
                revision: repo.revision.clone(),
                cached: listing(&dir.join("snapshots")),
                path: snapshot,
            });
        }
        let missing = missing_files(&snapshot)?;
        match missing.is_empty() {
            true => Ok(snapshot),
            false => Err(HubError::Incomplete { id, snapshot, missing }),
        }
    }
}

/// A full commit hash, which names a snapshot without a ref.
fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// The names in `dir`, sorted, for an error message.
fn listing(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    match names.is_empty() {
        true => "none".into(),
        false => names.join(", "),
    }
}

/// What a run reads of a snapshot besides the weights: each file, and whether it must be
/// there (the rest are read where present); then the weights' stems, each
/// `stem.safetensors` or `stem.safetensors.index.json` with every shard it names.
struct Reads {
    files: &'static [(&'static str, bool)],
    weights: &'static [&'static str],
    /// The PyTorch pickles read where the weights have no safetensors (`pytorch_model.bin`,
    /// or its index and shards).
    pickles: Option<&'static str>,
}

/// A diffusers pipeline (`model_index.json`): each stage tpinfer runs.
const PIPELINE: Reads = Reads {
    files: &[
        ("model_index.json", true),
        ("tokenizer/tokenizer.json", true),
        ("tokenizer/tokenizer_config.json", false),
        ("text_encoder/config.json", true),
        ("transformer/config.json", true),
        ("vae/config.json", true),
    ],
    weights: &[
        "text_encoder/model",
        "transformer/diffusion_pytorch_model",
        "vae/diffusion_pytorch_model",
    ],
    pickles: None,
};

/// One model: its config, tokenizer (with its chat template, in `tokenizer_config.json` or,
/// as transformers now saves it, `chat_template.jinja`) and EOS ids.
const MODEL: Reads = Reads {
    files: &[
        ("config.json", true),
        ("tokenizer.json", true),
        ("tokenizer_config.json", false),
        ("chat_template.jinja", false),
        ("generation_config.json", false),
    ],
    weights: &["model"],
    pickles: Some("pytorch_model.bin"),
};

/// The files a run reads that `snapshot` lacks, relative to it.
fn missing_files(snapshot: &Path) -> Result<Vec<String>, HubError> {
    let mut missing = Vec::new();
    let reads = match snapshot.join("model_index.json").is_file() {
        true => PIPELINE,
        false => MODEL,
    };
    for &(file, required) in reads.files {
        if required {
            need(snapshot, file, &mut missing);
        }
    }
    for stem in reads.weights {
        let mut lacks = Vec::new();
        weights_of(snapshot, &format!("{stem}.safetensors"), stem, &mut lacks)?;
        // A snapshot of pickles (its index or single file there) is held to those instead.
        if let Some(pickles) = reads.pickles.filter(|_| !lacks.is_empty()) {
            let index = snapshot.join(format!("{pickles}.index.json"));
            if index.is_file() || snapshot.join(pickles).is_file() {
                lacks.clear();
                weights_of(snapshot, pickles, pickles, &mut lacks)?;
            }
        }
        missing.extend(lacks);
    }
    Ok(missing)
}

fn need(snapshot: &Path, file: &str, missing: &mut Vec<String>) {
    if !snapshot.join(file).is_file() {
        missing.push(file.to_string());
    }
}

/// `single` (`stem.safetensors`), or its index (`single.index.json`) and every shard it
/// names.
fn weights_of(snapshot: &Path, single: &str, stem: &str, missing: &mut Vec<String>) -> Result<(), HubError> {
    if snapshot.join(single).is_file() {
        return Ok(());
    }
    let index = snapshot.join(format!("{single}.index.json"));
    if !index.is_file() {
        missing.push(format!("{single} (or its index)"));
        return Ok(());
    }
    for shard in shards_of(&index, stem)? {
        if !snapshot.join(&shard).is_file() {
            missing.push(shard);
        }
    }
    Ok(())
}

/// The shards a safetensors `index` (of weights `stem`) names, relative to the snapshot,
/// sorted and each once.
fn shards_of(index: &Path, stem: &str) -> Result<Vec<String>, HubError> {
    let unreadable = |detail: String| HubError::Unreadable {
        path: index.to_path_buf(),
        detail,
    };
    let text = std::fs::read_to_string(index).map_err(|e| unreadable(e.to_string()))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| unreadable("no `weight_map` object".into()))?;
    let folder = Path::new(stem).parent().unwrap_or(Path::new(""));
    let mut shards: Vec<String> = Vec::new();
    for shard in map.values().filter_map(|v| v.as_str()) {
        // A shard names a file beside its index: nothing that climbs out of the snapshot.
        if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
            return Err(unreadable(format!(
                "shard `{shard}` is not a file name beside the index"
            )));
        }
        shards.push(folder.join(shard).to_string_lossy().into_owned());
    }
    shards.sort_unstable();
    shards.dedup();
    Ok(shards)
}
