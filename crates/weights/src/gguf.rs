use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};

use crate::{ShardSpec, TensorInfo, WeightError, WeightStore};

/// How a model's tensor names map onto a GGUF file's: checkpoint name → (GGUF name, and the
/// head count whose rotary row permutation llama.cpp applied, if any).
pub type GgufTensorMap = HashMap<String, (String, Option<usize>)>;

/// The tensors of a GGUF file, dequantized to f32 on read and presented under the model's own
/// (Hugging Face) names. Quantized blocks span whole rows, so a rank dequantizes each tensor
/// it needs in full and keeps its slice; the rest is dropped at once.
pub struct GgufStore {
    path: PathBuf,
    content: Content,
    names: GgufTensorMap,
}

impl GgufStore {
    /// Reads the GGUF header (metadata and tensor table) of `path`.
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let mut file = File::open(path).map_err(|source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let content = Content::read(&mut file).map_err(|e| WeightError::Gguf {
            path: path.to_path_buf(),
            detail: format!("{e}; the file is not GGUF or is corrupt"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            names: HashMap::new(),
        })
    }

    /// The key/value metadata (hyper-parameters, tokenizer, chat template).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Whether the file holds a tensor of this GGUF name.
    pub fn has_gguf_tensor(&self, gguf_name: &str) -> bool {
        self.content.tensor_infos.contains_key(gguf_name)
    }

    /// Presents the file's tensors under the names of `map`; tensors not in it are hidden.
    pub fn with_names(mut self, map: GgufTensorMap) -> Self {
        self.names = map;
        self
    }

    /// A tensor of the file that no name of the map covers: a tensor table the metadata
    /// does not describe (more layers than `block_count`, say), which would otherwise be
    /// left out without a word.
    pub fn unmapped_tensor(&self) -> Option<&str> {
        let mut names: Vec<&str> = self
            .content
            .tensor_infos
            .keys()
            .map(String::as_str)
            .filter(|gguf| !self.names.values().any(|(mapped, _)| mapped == gguf))
            .collect();
        names.sort_unstable();
        names.first().copied()
    }

    fn gguf_error(&self, detail: String) -> WeightError {
        WeightError::Gguf {
            path: self.path.clone(),
            detail,
        }
    }
}

/// Undoes llama.cpp's permutation of Q/K rows (`reshape(h, 2, d/2, in).swapaxes(1, 2)`),
/// which it applies so that rotary pairs are adjacent; tpinfer rotates halves, like HF.
fn unpermute_rotary_rows(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let half = rows / heads / 2;
    w.reshape((heads, half, 2, cols))?
        .transpose(1, 2)?
        .reshape((rows, cols))
}

impl WeightStore for GgufStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        let (gguf_name, _) = self.names.get(name)?;
        let info = self.content.tensor_infos.get(gguf_name)?;
        Some(TensorInfo {
            shape: info.shape.dims().to_vec(),
            // Every GGUF tensor is dequantized to f32 on read.
            dtype: DType::F32,
        })
    }

    fn names(&self) -> Vec<String> {
        self.names
            .iter()
            .filter(|(_, (gguf, _))| self.content.tensor_infos.contains_key(gguf))
            .map(|(name, _)| name.clone())
            .collect()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        let (gguf_name, rotary_heads) = self.names.get(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: self.origin(),
            config: self.config_origin(),
        })?;
        let mut file = File::open(&self.path).map_err(|source| WeightError::Io {
            path: self.path.clone(),
            source,
        })?;
        let qtensor = self
            .content
            .tensor(&mut file, gguf_name, &Device::Cpu)
            .map_err(|e| self.gguf_error(format!("tensor `{gguf_name}`: {e}")))?;
        let read_bytes = qtensor.storage_size_in_bytes();
        let tensor_err = |source| WeightError::Tensor {
            name: name.to_string(),
            source,
        };
        let mut full = qtensor.dequantize(&Device::Cpu).map_err(tensor_err)?;
        if let Some(heads) = rotary_heads {
            full = unpermute_rotary_rows(&full, *heads).map_err(tensor_err)?;
        }
        let local = match *spec {
            ShardSpec::Replicated => full,
            ShardSpec::Range { dim, start, len } => full
                .narrow(dim, start, len)
                .and_then(|t| t.contiguous())
                .map_err(tensor_err)?,
        };
        Ok((local, read_bytes))
    }

    fn origin(&self) -> String {
        self.path.display().to_string()
    }

    fn config_origin(&self) -> String {
        "its GGUF metadata".to_string()
    }
}
