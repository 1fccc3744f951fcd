use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::{ShardSpec, TensorInfo, WeightError, WeightStore};

/// The index files a sharded checkpoint names its shards in, in the order they are looked for.
const INDEXES: [&str; 2] = [
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors.index.json",
];

/// The tensors of one safetensors checkpoint, single-file or sharded with an index,
/// memory-mapped so that reading a slice touches only that slice's pages.
pub struct SafetensorsStore {
    dir: PathBuf,
    files: Vec<MappedFile>,
    /// Tensor name → (index into `files`, header entry).
    tensors: HashMap<String, (usize, Entry)>,
}

struct MappedFile {
    path: PathBuf,
    mmap: Mmap,
    /// Offset of the data section: 8 bytes of header length, then the JSON header.
    data_start: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    info: TensorInfo,
    /// Byte range of the tensor within the data section.
    begin: usize,
}

impl SafetensorsStore {
    /// Opens the index in `dir` if there is one (transformers' `model.safetensors.index.json`,
    /// diffusers' `diffusion_pytorch_model.safetensors.index.json`), else `model.safetensors`,
    /// else every `*.safetensors` file in `dir`. Headers are parsed and checked against the
    /// file sizes now; no tensor data is read.
    pub fn open(dir: &Path) -> Result<Self, WeightError> {
        let index = INDEXES.iter().map(|name| dir.join(name)).find(|p| p.exists());
        let paths = if let Some(index) = index {
            files_of_index(&index)?
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|source| WeightError::Io {
                    path: dir.to_path_buf(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if paths.is_empty() {
            let pickle = std::fs::read_dir(dir).ok().and_then(|entries| {
                let mut pickles: Vec<String> = entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|name| name.ends_with(".bin") || name.ends_with(".pth"))
                    .collect();
                pickles.sort();
                pickles.into_iter().next()
            });
            return Err(WeightError::NoWeights {
                dir: dir.to_path_buf(),
                pickle,
            });
        }
        let mut store = Self {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        for path in paths {
            store.add_file(path)?;
        }
        Ok(store)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<(), WeightError> {
        let file = File::open(&path).map_err(|source| WeightError::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the mapping is read-only and checkpoints are not modified while loading;
        // a file truncated underneath us is the same hazard every mmap-based loader accepts.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| WeightError::Io {
            path: path.clone(),
            source,
        })?;
        let corrupt = |detail: String| WeightError::Corrupt {
            path: path.clone(),
            detail,
        };
        // Full validation (offsets inside the file, sizes matching shapes) before trusting it.
        SafeTensors::deserialize(&mmap).map_err(|e| corrupt(e.to_string()))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| corrupt(e.to_string()))?;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            let dtype = to_candle_dtype(info.dtype).ok_or_else(|| WeightError::Dtype {
                name: name.clone(),
                dtype: format!("{:?}", info.dtype),
            })?;
            let entry = Entry {
                info: TensorInfo {
                    shape: info.shape.clone(),
                    dtype,
                    quant: None,
                },
                begin: info.data_offsets.0,
            };
            self.tensors.insert(name, (file_index, entry));
        }
        self.files.push(MappedFile {
            path,
            mmap,
            data_start: 8 + header_len,
        });
        Ok(())
    }
}

fn files_of_index(index: &Path) -> Result<Vec<PathBuf>, WeightError> {
    let mut files: Vec<PathBuf> = index_weight_map(index)?.into_iter().map(|(_, path)| path).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Each tensor an index (`*.index.json`, transformers' `weight_map`) names, and the file
/// beside the index that it says holds it; a file that does not exist is refused.
pub(crate) fn index_weight_map(index: &Path) -> Result<Vec<(String, PathBuf)>, WeightError> {
    let bad = |detail: String| WeightError::BadIndex {
        path: index.to_path_buf(),
        detail,
    };
    let text = std::fs::read_to_string(index).map_err(|source| WeightError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".to_string()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    map.iter()
        .map(|(tensor, file)| {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("`{tensor}` maps to a non-string")))?;
            let path = dir.join(file);
            if !path.exists() {
                return Err(bad(format!("`{tensor}` is in {file}, which does not exist")));
            }
            Ok((tensor.clone(), path))
        })
        .collect()
}

fn to_candle_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        Dtype::F8_E4M3 => DType::F8E4M3,
        _ => return None,
    })
}

impl WeightStore for SafetensorsStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.tensors.get(name).map(|(_, e)| e.info.clone())
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        let (file_index, entry) = self.tensors.get(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: self.origin(),
            config: self.config_origin(),
        })?;
        let file = &self.files[*file_index];
        read_slice(name, &file.mmap[file.data_start + entry.begin..], &entry.info, spec)
    }

    fn origin(&self) -> String {
        match self.files.as_slice() {
            [one] => one.path.display().to_string(),
            _ => format!("the safetensors files in {}", self.dir.display()),
        }
    }
}

/// The `spec` slice of the row-major tensor `info` whose bytes start `data`, copied to the
/// CPU in its stored dtype, and the bytes copied.
pub(crate) fn read_slice(
    name: &str,
    data: &[u8],
    info: &TensorInfo,
    spec: &ShardSpec,
) -> Result<(Tensor, usize), WeightError> {
    let full = &info.shape;
    let local = spec.local_shape(full).map_err(|detail| WeightError::Shard {
        name: name.to_string(),
        detail,
    })?;
    let elem = info.dtype.size_in_bytes();
    let bytes: Vec<u8> = match *spec {
        ShardSpec::Replicated => data[..full.iter().product::<usize>() * elem].to_vec(),
        ShardSpec::Range { dim, start, len } => {
            // Row-major: `outer` runs of `len` rows of `inner` bytes, one per index of the
            // dims before `dim`; only those runs are copied.
            let outer: usize = full[..dim].iter().product();
            let inner: usize = full[dim + 1..].iter().product::<usize>() * elem;
            let mut out = Vec::with_capacity(outer * len * inner);
            for o in 0..outer {
                let begin = (o * full[dim] + start) * inner;
                out.extend_from_slice(&data[begin..begin + len * inner]);
            }
            out
        }
    };
    let n = bytes.len();
    let tensor =
        Tensor::from_raw_buffer(&bytes, info.dtype, &local, &Device::Cpu).map_err(|source| WeightError::Tensor {
            name: name.to_string(),
            source,
        })?;
    Ok((tensor, n))
}
