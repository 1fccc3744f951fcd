//! The environment switches of measured alternatives: read here, in the binary, and handed to
//! the library as options.

use tpinfer_engine::{CommOptions, EngineBuilder};

/// `0` turns the chained decode step off (kernels launched one after the other).
const KERNEL_CHAINS: &str = "TPINFER_KERNEL_CHAINS";
/// `0` keeps small all-reduces on NCCL instead of the one-kernel peer sum.
const PEER_ALL_REDUCE: &str = "TPINFER_PEER_ALL_REDUCE";
/// `0` keeps the sequence-parallel row exchanges on NCCL instead of the copy engines.
const PEER_ROWS: &str = "TPINFER_PEER_ROWS";
/// NCCL's own switch: where NCCL must not use peer access, tpinfer's paths must not either.
const NCCL_P2P_DISABLE: &str = "NCCL_P2P_DISABLE";

fn is(var: &str, value: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v.trim() == value)
}

/// The peer paths the environment allows.
pub fn comm_options() -> CommOptions {
    CommOptions {
        peer_access: !is(NCCL_P2P_DISABLE, "1"),
        peer_all_reduce: !is(PEER_ALL_REDUCE, "0"),
        peer_rows: !is(PEER_ROWS, "0"),
    }
}

/// `--model` as given where such a path exists; otherwise, where it has the form
/// `ORG/NAME[@REVISION]`, that model's snapshot in the Hugging Face cache (`HF_HUB_CACHE`,
/// `HF_HOME/hub` or `~/.cache/huggingface/hub`), checked for the files a run reads, and with
/// those it lacks downloaded from `HF_ENDPOINT` (the Hub) unless `HF_HUB_OFFLINE` is set.
pub fn resolve_model(model: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let repo = match model.exists() {
        true => None,
        false => model.to_str().and_then(tpinfer_hub::RepoId::parse),
    };
    let Some(repo) = repo else {
        return Ok(model.to_path_buf());
    };
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let path = |name: &str| var(name).map(std::path::PathBuf::from);
    let cache = tpinfer_hub::HubCache::locate(path("HF_HUB_CACHE"), path("HF_HOME"), path("HOME"))
        .ok_or_else(|| anyhow::anyhow!("{}: no Hugging Face cache to look in (set HF_HOME)", model.display()))?;
    // `huggingface_hub`'s truthy values.
    let offline =
        var("HF_HUB_OFFLINE").is_some_and(|v| ["1", "true", "yes", "on"].contains(&v.trim().to_lowercase().as_str()));
    let remote = match offline {
        true => tpinfer_hub::Remote::Offline,
        false => tpinfer_hub::Remote::Hub {
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| tpinfer_hub::Remote::ENDPOINT.to_string()),
            token: var("HF_TOKEN"),
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        },
    };
    let snapshot = cache.fetch(&repo, &remote)?;
    eprintln!("{}: {}", model.display(), snapshot.display());
    Ok(snapshot)
}

/// `builder` with the environment's switches.
pub fn switches(builder: EngineBuilder) -> EngineBuilder {
    builder
        .comm_options(comm_options())
        .kernel_chains(!is(KERNEL_CHAINS, "0"))
}
