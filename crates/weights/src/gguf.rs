use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::{QuantizedSlice, ShardSpec, TensorInfo, WeightError, WeightStore};

/// How a model's tensor names map onto a GGUF file's: checkpoint name → (GGUF name, and the
/// head count whose rotary row permutation llama.cpp applied, if any).
pub type GgufTensorMap = HashMap<String, (String, Option<usize>)>;

/// The tensors of a GGUF file under the model's own (Hugging Face) names: dequantized to f32
/// on [`WeightStore::read`], or kept in their blocks on [`WeightStore::read_quantized`]. A
/// rank reads each tensor it needs in full and keeps its slice; the rest is dropped at once.
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
        let length = file.metadata().map_err(|source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        check_tensor_table(&content, length.len()).map_err(|detail| WeightError::Gguf {
            path: path.to_path_buf(),
            detail,
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

    /// The GGML type a tensor of this GGUF name is stored in.
    pub fn gguf_dtype(&self, gguf_name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(gguf_name).map(|info| info.ggml_dtype)
    }

    /// A vector tensor of the file by its GGUF name (a `rope_freqs`, say), as f32 values.
    pub fn read_vector(&self, gguf_name: &str) -> Result<Vec<f32>, WeightError> {
        let mut file = File::open(&self.path).map_err(|source| WeightError::Io {
            path: self.path.clone(),
            source,
        })?;
        self.content
            .tensor(&mut file, gguf_name, &Device::Cpu)
            .and_then(|t| t.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(|e| self.gguf_error(format!("tensor `{gguf_name}`: {e}")))
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

    /// Reads the GGUF tensor behind `name` in full, with the head count of its rotary row
    /// permutation.
    fn read_full(&self, name: &str) -> Result<(QTensor, Option<usize>), WeightError> {
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
        Ok((qtensor, *rotary_heads))
    }

    fn gguf_error(&self, detail: String) -> WeightError {
        WeightError::Gguf {
            path: self.path.clone(),
            detail,
        }
    }
}

/// Checks that every tensor of the table lies inside a file of `length` bytes, so that a
/// truncated download fails when it is opened, not after the ranks have read the tensors
/// before the cut.
fn check_tensor_table(content: &Content, length: u64) -> Result<(), String> {
    let mut end_of_data = (0u64, "");
    for (name, info) in &content.tensor_infos {
        let dtype = info.ggml_dtype;
        let bytes = info
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .map(|values| values / dtype.block_size() as u64)
            .and_then(|blocks| blocks.checked_mul(dtype.type_size() as u64));
        let end = bytes
            .and_then(|b| b.checked_add(info.offset))
            .and_then(|e| e.checked_add(content.tensor_data_offset))
            .ok_or_else(|| {
                format!(
                    "tensor `{name}` of shape {:?} is past any file's end; the file is corrupt",
                    info.shape
                )
            })?;
        if end > end_of_data.0 {
            end_of_data = (end, name);
        }
    }
    let (end, name) = end_of_data;
    if end > length {
        return Err(format!(
            "the file is {length} bytes but its tensors need {end} (tensor `{name}` ends there): it is truncated; \
             download it again"
        ));
    }
    Ok(())
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

/// The stored row that [`unpermute_rotary_rows`] moves to row `row` of `rows`.
fn rotary_source_row(row: usize, rows: usize, heads: usize) -> usize {
    let half = rows / heads / 2;
    let (head, within) = (row / (2 * half), row % (2 * half));
    head * 2 * half + (within % half) * 2 + within / half
}

/// Whether tensors of `dtype` are blocks to keep rather than plain floats.
fn is_quantized(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

impl WeightStore for GgufStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        let (gguf_name, _) = self.names.get(name)?;
        let info = self.content.tensor_infos.get(gguf_name)?;
        Some(TensorInfo {
            shape: info.shape.dims().to_vec(),
            // A dense read dequantizes every GGUF tensor to f32.
            dtype: DType::F32,
            quant: is_quantized(info.ggml_dtype).then_some(info.ggml_dtype),
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
        let (qtensor, rotary_heads) = self.read_full(name)?;
        let read_bytes = qtensor.storage_size_in_bytes();
        let tensor_err = |source| WeightError::Tensor {
            name: name.to_string(),
            source,
        };
        let mut full = qtensor.dequantize(&Device::Cpu).map_err(tensor_err)?;
        if let Some(heads) = rotary_heads {
            full = unpermute_rotary_rows(&full, heads).map_err(tensor_err)?;
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

    fn read_quantized(&self, name: &str, spec: &ShardSpec) -> Result<(QuantizedSlice, usize), WeightError> {
        let (qtensor, rotary_heads) = self.read_full(name)?;
        let dtype = qtensor.dtype();
        let shard_err = |detail: String| WeightError::Shard {
            name: name.to_string(),
            detail,
        };
        let full = qtensor.shape().dims().to_vec();
        let [rows, cols] = full[..] else {
            return Err(shard_err(format!(
                "a quantized tensor of shape {full:?} is not a matrix"
            )));
        };
        spec.quantized_bytes(&full, dtype).map_err(shard_err)?;
        let block_bytes = |values: usize| values / dtype.block_size() * dtype.type_size();
        let row_bytes = block_bytes(cols);
        let (row_range, col_bytes) = match *spec {
            ShardSpec::Replicated => (0..rows, 0..row_bytes),
            ShardSpec::Range { dim: 0, start, len } => (start..start + len, 0..row_bytes),
            ShardSpec::Range { start, len, .. } => (0..rows, block_bytes(start)..block_bytes(start + len)),
        };
        let data = qtensor.data().map_err(|source| WeightError::Tensor {
            name: name.to_string(),
            source,
        })?;
        let mut bytes = Vec::with_capacity(row_range.len() * col_bytes.len());
        let mut shape = vec![row_range.len(), cols];
        for row in row_range {
            let stored = rotary_heads.map_or(row, |heads| rotary_source_row(row, rows, heads));
            bytes.extend_from_slice(&data[stored * row_bytes..][col_bytes.clone()]);
        }
        shape[1] = col_bytes.len() / dtype.type_size() * dtype.block_size();
        Ok((QuantizedSlice { dtype, shape, bytes }, qtensor.storage_size_in_bytes()))
    }

    fn origin(&self) -> String {
        self.path.display().to_string()
    }

    fn config_origin(&self) -> String {
        "its GGUF metadata".to_string()
    }
}
