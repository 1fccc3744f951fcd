//! PyTorch `.pth` checkpoints: `torch.save` of a state dict, a zip archive holding the pickled
//! dict and one raw storage per tensor. The pickle is read by candle's reader, which runs no
//! code: it recognises only torch's tensor-rebuilding calls and takes their arguments (dtype,
//! shape, strides, storage). The archive stores the storages uncompressed, so each tensor's
//! bytes are memory-mapped and a rank copies only its slice, as from safetensors.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use memmap2::Mmap;

use crate::safetensors_store::{index_weight_map, read_slice};
use crate::{ShardSpec, TensorInfo, WeightError, WeightStore};

/// The tensors of one `.pth` state dict, memory-mapped.
pub struct PthStore {
    path: PathBuf,
    mmap: Mmap,
    /// Tensor name → (header, offset of its first byte in the file).
    tensors: HashMap<String, (TensorInfo, usize)>,
}

impl PthStore {
    /// Opens `path`, reading its pickled state dict's tensor headers and finding each tensor's
    /// bytes in the archive; no tensor data is read. Tensors that are not row-major
    /// (transposed views saved as such) or whose storage is compressed are refused by name.
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let bad = |detail: String| WeightError::Pth {
            path: path.to_path_buf(),
            detail,
        };
        let io = |source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        };
        // The reader opens the file itself; a missing file is named as such.
        File::open(path).map_err(io)?;
        // candle's reader indexes what a malformed pickle leaves it without checking (a
        // tuple too short for torch's rebuild call panics); such a file is refused like any
        // other it cannot read. It holds no state past the call: unwinding out of it is safe.
        let infos = std::panic::catch_unwind(|| candle_core::pickle::read_pth_tensor_info(path, false, None))
            .map_err(|_| bad("its pickled state dict is malformed; save it again with torch.save".into()))?
            .map_err(|e| bad(e.to_string()))?;
        if infos.is_empty() {
            return Err(bad(
                "it holds no tensors: tpinfer reads a state dict saved with torch.save".into(),
            ));
        }
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and checkpoints are not modified while loading;
        // a file truncated underneath us is the same hazard every mmap-based loader accepts.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut archive = zip::ZipArchive::new(File::open(path).map_err(io)?).map_err(|e| bad(e.to_string()))?;
        let mut tensors = HashMap::with_capacity(infos.len());
        for info in infos {
            let name = info.name.clone();
            let tensor_bad = |detail: &str| bad(format!("tensor `{name}`: {detail}"));
            let entry = archive
                .by_name(&info.path)
                .map_err(|e| tensor_bad(&format!("its storage {}: {e}", info.path)))?;
            if entry.compression() != zip::CompressionMethod::Stored {
                return Err(tensor_bad(
                    "its storage is compressed; save it again with torch.save, which stores storages as they are",
                ));
            }
            let start = entry
                .data_start()
                .ok_or_else(|| tensor_bad("its storage's place in the archive is unknown"))?;
            let stored = entry.size();
            drop(entry);
            if !info.layout.is_contiguous() {
                return Err(tensor_bad(&format!(
                    "it is stored strided ({:?} with strides {:?}), not row-major; save `.contiguous()` tensors",
                    info.layout.dims(),
                    info.layout.stride()
                )));
            }
            let shape = info.layout.dims().to_vec();
            let bytes = shape
                .iter()
                .try_fold(info.dtype.size_in_bytes(), |n, &d| n.checked_mul(d))
                .ok_or_else(|| tensor_bad("its shape's size overflows"))?;
            // candle's reader gives the storage offset in bytes.
            let offset = info.layout.start_offset();
            let end = offset.checked_add(bytes).map(|e| e as u64);
            let placed = (start as usize).checked_add(offset);
            match (end, placed) {
                (Some(end), Some(placed)) if end <= stored && placed + bytes <= mmap.len() => {
                    let header = TensorInfo {
                        shape,
                        dtype: info.dtype,
                        quant: None,
                    };
                    tensors.insert(name, (header, placed));
                }
                _ => {
                    return Err(tensor_bad(&format!(
                        "its {bytes} bytes at offset {offset} overrun its storage of {stored} bytes; the file is \
                         truncated or corrupt: download it again"
                    )))
                }
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            tensors,
        })
    }
}

impl WeightStore for PthStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.tensors.get(name).map(|(info, _)| info.clone())
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        let (info, at) = self.tensors.get(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: self.origin(),
            config: self.config_origin(),
        })?;
        read_slice(name, &self.mmap[*at..], info, spec)
    }

    fn origin(&self) -> String {
        self.path.display().to_string()
    }

    fn config_origin(&self) -> String {
        format!("the model the layout of {} implies", self.path.display())
    }
}

/// A transformers model directory that ships PyTorch pickles instead of safetensors:
/// `pytorch_model.bin`, or the shards `pytorch_model.bin.index.json` names, each a
/// [`PthStore`].
pub struct PthDirStore {
    dir: PathBuf,
    files: Vec<PthStore>,
    /// Tensor name → the file holding it.
    file_of: HashMap<String, usize>,
}

/// The index of a sharded `.bin` checkpoint, as transformers writes it.
pub const PTH_INDEX: &str = "pytorch_model.bin.index.json";
/// The one file of an unsharded one.
pub const PTH_SINGLE: &str = "pytorch_model.bin";

impl PthDirStore {
    /// Opens `dir`'s [`PTH_INDEX`] and every shard it names, or its [`PTH_SINGLE`]; reads
    /// headers only. An index naming a tensor its shard lacks is refused by name.
    pub fn open(dir: &Path) -> Result<Self, WeightError> {
        let index = dir.join(PTH_INDEX);
        let named = match index.is_file() {
            true => Some(index_weight_map(&index)?),
            false => None,
        };
        let mut paths: Vec<PathBuf> = match &named {
            Some(named) => named.iter().map(|(_, path)| path.clone()).collect(),
            None => vec![dir.join(PTH_SINGLE)],
        };
        paths.sort();
        paths.dedup();
        let files = paths
            .iter()
            .map(|path| PthStore::open(path))
            .collect::<Result<Vec<_>, _>>()?;
        let mut file_of = HashMap::new();
        for (i, file) in files.iter().enumerate() {
            for name in file.tensors.keys() {
                file_of.insert(name.clone(), i);
            }
        }
        for (tensor, path) in named.iter().flatten() {
            let holder = paths.iter().position(|p| p == path);
            if holder.is_none() || file_of.get(tensor) != holder.as_ref() {
                return Err(WeightError::BadIndex {
                    path: index.clone(),
                    detail: format!("it puts `{tensor}` in {}, which does not hold it", path.display()),
                });
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            file_of,
        })
    }

    fn file(&self, name: &str) -> Result<&PthStore, WeightError> {
        self.file_of
            .get(name)
            .map(|&i| &self.files[i])
            .ok_or_else(|| WeightError::Missing {
                name: name.to_string(),
                origin: self.origin(),
                config: self.config_origin(),
            })
    }
}

impl WeightStore for PthDirStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.file(name).ok()?.info(name)
    }

    fn names(&self) -> Vec<String> {
        self.file_of.keys().cloned().collect()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        self.file(name)?.read(name, spec)
    }

    fn origin(&self) -> String {
        self.dir.display().to_string()
    }
}
