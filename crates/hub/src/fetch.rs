//! What a run reads, downloaded into the cache from the Hub (or a mirror) through `hf-hub`,
//! which writes the layout `huggingface_hub` does: blobs named by their etag, the snapshot's
//! files linked to them, the revision's ref. Only what the run reads is fetched: the files of
//! [`crate::Reads`], and of the weights only the shards their index names.

use std::path::PathBuf;

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use crate::{shards_of, HubCache, HubError, RepoId, MODEL, PIPELINE};

/// Where files the cache lacks come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remote {
    /// Nowhere: the cache alone is read, and no request is made (`HF_HUB_OFFLINE=1`).
    Offline,
    /// A hub at `endpoint` (`https://huggingface.co`, or a mirror's `HF_ENDPOINT`), with the
    /// token gated and private models need (else the one `huggingface-cli login` saved
    /// beside the cache, if any).
    Hub {
        endpoint: String,
        token: Option<String>,
        /// A progress bar per file on the terminal.
        progress: bool,
    },
}

impl Remote {
    /// The Hub itself.
    pub const ENDPOINT: &'static str = "https://huggingface.co";
}

impl HubCache {
    /// The snapshot of `repo` with what a run reads: from the cache where it is complete;
    /// else, unless `remote` is offline, with the missing files downloaded into the cache
    /// first.
    pub fn fetch(&self, repo: &RepoId, remote: &Remote) -> Result<PathBuf, HubError> {
        let cached = self.resolve(repo);
        let (endpoint, token, progress) = match (remote, &cached) {
            (Remote::Offline, _) | (_, Ok(_) | Err(HubError::Unreadable { .. })) => return cached,
            (
                Remote::Hub {
                    endpoint,
                    token,
                    progress,
                },
                Err(_),
            ) => (endpoint, token, *progress),
        };
        let mut builder = ApiBuilder::from_cache(Cache::new(self.root.clone()))
            .with_endpoint(endpoint.trim_end_matches('/').to_string())
            .with_progress(progress);
        // Without one given, the token `huggingface-cli login` left beside the cache.
        if let Some(token) = token {
            builder = builder.with_token(Some(token.clone()));
        }
        let api = builder.build().map_err(|e| HubError::Client {
            endpoint: endpoint.clone(),
            detail: e.to_string(),
        })?;
        let download = Download {
            repo: api.repo(Repo::with_revision(repo.id(), RepoType::Model, repo.revision.clone())),
            id: repo.spec(),
            endpoint,
        };
        let reads = match download.get("model_index.json", false)? {
            Some(_) => PIPELINE,
            None => MODEL,
        };
        for &(file, required) in reads.files {
            download.get(file, required)?;
        }
        for stem in reads.weights {
            let fetched = download.weights(&format!("{stem}.safetensors"), stem)?;
            // A model repository of PyTorch pickles alone, as older ones are.
            let fetched = match (fetched, reads.pickles) {
                (false, Some(pickles)) => download.weights(pickles, pickles)?,
                (fetched, _) => fetched,
            };
            if !fetched {
                download.get(&format!("{stem}.safetensors"), true)?;
            }
        }
        self.resolve(repo)
    }
}

/// One repository's files from one endpoint.
struct Download<'a> {
    repo: ApiRepo,
    /// `ORG/NAME@REVISION`, for errors.
    id: String,
    endpoint: &'a str,
}

impl Download<'_> {
    /// `file`'s index (`file.index.json`) and the shards it names, or `file` alone: whether
    /// the repository had either.
    fn weights(&self, file: &str, stem: &str) -> Result<bool, HubError> {
        match self.get(&format!("{file}.index.json"), false)? {
            Some(index) => {
                for shard in shards_of(&index, stem)? {
                    self.get(&shard, true)?;
                }
                Ok(true)
            }
            None => Ok(self.get(file, false)?.is_some()),
        }
    }

    /// `file` from the cache, or downloaded into it; `None` where the repository has no such
    /// file and it is not `required`.
    fn get(&self, file: &str, required: bool) -> Result<Option<PathBuf>, HubError> {
        let failed = |detail: String| HubError::Download {
            id: self.id.clone(),
            file: file.to_string(),
            endpoint: self.endpoint.to_string(),
            detail,
        };
        match self.repo.get(file) {
            Ok(path) => Ok(Some(path)),
            Err(e) => match status(&e) {
                Some(404) if !required => Ok(None),
                Some(404) => Err(failed(
                    "the repository has no such file at this revision: check the id and the revision".into(),
                )),
                Some(code @ (401 | 403)) => Err(failed(format!(
                    "access denied (HTTP {code}): a gated or private model needs a token with access \
                     (HF_TOKEN, or `huggingface-cli login`)"
                ))),
                Some(code) => Err(failed(format!("HTTP {code}"))),
                None => Err(failed(format!(
                    "{e}; with HF_HUB_OFFLINE=1 only the cache is read, without waiting on the network"
                ))),
            },
        }
    }
}

/// The HTTP status of a failed request, if it got as far as a response.
fn status(e: &ApiError) -> Option<u16> {
    match e {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        ApiError::TooManyRetries(e) => status(e),
        _ => None,
    }
}
