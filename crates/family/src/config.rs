//! A model directory's `config.json` read as JSON, and the one error of the families that
//! take their configs field by field.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not {kind}: {source}")]
    Parse {
        path: String,
        /// What the file should have been, as "a UMT5 config".
        kind: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {detail}")]
    Field { path: String, detail: String },
}

/// The text of `dir`'s `config.json`, and its path for messages.
pub fn read_config(dir: &Path) -> Result<(String, String), ConfigError> {
    let path = dir.join("config.json");
    let origin = path.display().to_string();
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok((text, origin)),
        Err(source) => Err(ConfigError::Read { path: origin, source }),
    }
}

/// `text` as JSON; `origin` names it and `kind` says what it should be, in the error.
pub fn parse_config(text: &str, origin: &str, kind: &'static str) -> Result<serde_json::Value, ConfigError> {
    serde_json::from_str(text).map_err(|source| ConfigError::Parse {
        path: origin.to_string(),
        kind,
        source,
    })
}
