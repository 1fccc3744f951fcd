//! LoRA adapters merged into the weights as each rank reads them: a rank's slice of
//! `W + s · B·A` is its slice of `W` plus `s` times its rows of `B` (a column-parallel slice)
//! or its columns of `A` (a row-parallel one) multiplied out, so no rank builds a whole
//! merged matrix and the model runs at its own speed afterwards.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::{QuantizedSlice, ShardSpec, TensorInfo, WeightError, WeightStore};

/// What PEFT puts before a module's name in a model's state dict (`get_peft_model`).
const PEFT_PREFIX: &str = "base_model.model.";

/// A LoRA adapter read from a safetensors file: for each weight it changes, the low-rank
/// pair, and the scale of their product.
#[derive(Debug)]
pub struct LoraAdapter {
    path: PathBuf,
    /// The changed weight's name, as the base checkpoint names it (`{module}.weight`) →
    /// `A` `[rank, in]` and `B` `[out, rank]`, f32 on the CPU.
    pairs: HashMap<String, (Tensor, Tensor)>,
    scale: f64,
}

/// The two halves of a pair as a file names them, before they are matched.
#[derive(Default)]
struct Halves {
    down: Option<Tensor>,
    up: Option<Tensor>,
    alpha: Option<f64>,
}

impl LoraAdapter {
    /// Reads `path`: PEFT's names (`{module}.lora_A[.{adapter}].weight` and `lora_B`, with
    /// or without `base_model.model.` before them; Live Avatar's form) or kohya's
    /// (`{module}.lora_down.weight`, `lora_up`, and `{module}.alpha`). `scale` multiplies
    /// `B·A`; without it, `alpha / rank` from the file's `.alpha` tensors or from the
    /// `adapter_config.json` PEFT saves beside it.
    pub fn open(path: &Path, scale: Option<f64>) -> Result<Self, WeightError> {
        let err = |detail: String| WeightError::Lora {
            path: path.to_path_buf(),
            detail,
        };
        let tensors = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| err(e.to_string()))?;
        let mut modules: HashMap<String, Halves> = HashMap::new();
        for (key, tensor) in tensors {
            let name = key.strip_prefix(PEFT_PREFIX).unwrap_or(&key);
            let (module, part) = split_lora_key(name).ok_or_else(|| {
                err(format!(
                    "it holds `{key}`, which is no LoRA pair's half (`lora_A`/`lora_B`, `lora_down`/`lora_up`) nor \
                     an `alpha`; give an adapter file, not a model"
                ))
            })?;
            let halves = modules.entry(module.to_string()).or_default();
            let as_f32 = |t: Tensor| t.to_dtype(DType::F32).map_err(|e| err(format!("`{key}`: {e}")));
            match part {
                Part::Down => halves.down = Some(as_f32(tensor)?),
                Part::Up => halves.up = Some(as_f32(tensor)?),
                Part::Alpha => {
                    let alpha = as_f32(tensor)?
                        .flatten_all()
                        .and_then(|t| t.to_vec1::<f32>())
                        .map_err(|e| err(format!("`{key}`: {e}")))?;
                    match alpha.as_slice() {
                        [a] => halves.alpha = Some(*a as f64),
                        _ => return Err(err(format!("`{key}` holds {} values, not one alpha", alpha.len()))),
                    }
                }
            }
        }
        let mut pairs = HashMap::new();
        let mut ratios = Vec::new();
        for (module, halves) in modules {
            let (Some(down), Some(up)) = (halves.down, halves.up) else {
                return Err(err(format!("`{module}` has only one half of its LoRA pair")));
            };
            let (rank, _) = down
                .dims2()
                .map_err(|_| err(format!("`{module}`: A is {:?}, not a matrix", down.dims())))?;
            let (_, up_rank) = up
                .dims2()
                .map_err(|_| err(format!("`{module}`: B is {:?}, not a matrix", up.dims())))?;
            if rank != up_rank || rank == 0 {
                return Err(err(format!(
                    "`{module}`: A is {:?} and B {:?}; their rank must agree",
                    down.dims(),
                    up.dims()
                )));
            }
            if let Some(alpha) = halves.alpha {
                ratios.push(alpha / rank as f64);
            }
            pairs.insert(format!("{module}.weight"), (down, up));
        }
        if pairs.is_empty() {
            return Err(err("it holds no LoRA pairs".into()));
        }
        let scale = match scale {
            Some(s) if s.is_finite() => s,
            Some(s) => return Err(err(format!("--lora-scale {s} is not a finite number"))),
            None => Self::stated_scale(path, &pairs, &ratios).map_err(err)?,
        };
        Ok(Self {
            path: path.to_path_buf(),
            pairs,
            scale,
        })
    }

    /// `alpha / rank`, from the file's alphas (one ratio for every pair) or a PEFT
    /// `adapter_config.json` beside it.
    fn stated_scale(path: &Path, pairs: &HashMap<String, (Tensor, Tensor)>, ratios: &[f64]) -> Result<f64, String> {
        if let Some(&first) = ratios.first() {
            if ratios.len() != pairs.len() || ratios.iter().any(|r| (r - first).abs() > 1e-9 * first.abs()) {
                return Err("its pairs' alpha / rank differ or some have no alpha; give --lora-scale".into());
            }
            return Ok(first);
        }
        let config = path.with_file_name("adapter_config.json");
        let text = std::fs::read_to_string(&config).map_err(|_| {
            "it says no alpha and no adapter_config.json is beside it: give --lora-scale (alpha / rank; Live Avatar's \
             is 64 / 128 = 0.5)"
                .to_string()
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", config.display()))?;
        let number = |key: &str| v.get(key).and_then(serde_json::Value::as_f64).filter(|x| *x > 0.0);
        match (number("lora_alpha"), number("r")) {
            (Some(alpha), Some(rank)) => Ok(alpha / rank),
            _ => Err(format!(
                "{} has no positive `lora_alpha` and `r`; give --lora-scale",
                config.display()
            )),
        }
    }

    /// The weights it changes, as the base checkpoint names them.
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.pairs.keys().map(String::as_str)
    }

    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// `s · B·A` restricted to `spec`'s slice of the `[out, in]` weight.
    fn delta(&self, name: &str, spec: &ShardSpec) -> Result<Option<(Tensor, usize)>, WeightError> {
        let Some((down, up)) = self.pairs.get(name) else {
            return Ok(None);
        };
        let tensor_err = |source| WeightError::Tensor {
            name: name.to_string(),
            source,
        };
        let (down, up) = match *spec {
            ShardSpec::Replicated => (down.clone(), up.clone()),
            ShardSpec::Range { dim: 0, start, len } => (down.clone(), up.narrow(0, start, len).map_err(tensor_err)?),
            ShardSpec::Range { dim: 1, start, len } => (down.narrow(1, start, len).map_err(tensor_err)?, up.clone()),
            ShardSpec::Range { dim, .. } => {
                return Err(WeightError::Shard {
                    name: name.to_string(),
                    detail: format!("a LoRA pair changes it, and it is split along dim {dim}, not a matrix's"),
                })
            }
        };
        let bytes = (down.elem_count() + up.elem_count()) * 4;
        let delta = up
            .matmul(&down.contiguous().map_err(tensor_err)?)
            .and_then(|d| d * self.scale)
            .map_err(tensor_err)?;
        Ok(Some((delta, bytes)))
    }
}

enum Part {
    Down,
    Up,
    Alpha,
}

/// `{module}.lora_A[.{adapter}].weight` and the like: the module and which half.
fn split_lora_key(name: &str) -> Option<(&str, Part)> {
    if let Some(module) = name.strip_suffix(".alpha") {
        return Some((module, Part::Alpha));
    }
    let stem = name.strip_suffix(".weight")?;
    for (marker, part) in [
        (".lora_A", Part::Down),
        (".lora_B", Part::Up),
        (".lora_down", Part::Down),
        (".lora_up", Part::Up),
    ] {
        if let Some(at) = stem.rfind(marker) {
            let rest = &stem[at + marker.len()..];
            // Nothing after the marker, or PEFT's adapter name (`.default`).
            if rest.is_empty() || (rest.starts_with('.') && !rest[1..].contains('.')) {
                return Some((&stem[..at], part));
            }
        }
    }
    None
}

/// A checkpoint read with an adapter merged in: every tensor the adapter changes comes out
/// of [`WeightStore::read`] as its slice of `W + s · B·A`, in the checkpoint's dtype.
pub struct LoraStore {
    inner: Arc<dyn WeightStore>,
    adapter: Arc<LoraAdapter>,
}

impl LoraStore {
    /// Fails, naming the tensor, where the adapter changes a weight the checkpoint does not
    /// hold as a matrix of the pair's shape: an adapter for another model.
    pub fn new(inner: Arc<dyn WeightStore>, adapter: Arc<LoraAdapter>) -> Result<Self, WeightError> {
        for (name, (down, up)) in &adapter.pairs {
            let err = |detail: String| WeightError::Lora {
                path: adapter.path.clone(),
                detail,
            };
            let info = inner.info(name).ok_or_else(|| {
                err(format!(
                    "it changes `{name}`, which {} does not hold; is the adapter for this model?",
                    inner.origin()
                ))
            })?;
            let expected = [up.dim(0).unwrap_or(0), down.dim(1).unwrap_or(0)];
            if info.shape != expected {
                return Err(err(format!(
                    "its pair for `{name}` makes {expected:?}, but {} holds {:?}; is the adapter for this model?",
                    inner.origin(),
                    info.shape
                )));
            }
        }
        Ok(Self { inner, adapter })
    }
}

impl WeightStore for LoraStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.inner.info(name)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        let (base, bytes) = self.inner.read(name, spec)?;
        let Some((delta, lora_bytes)) = self.adapter.delta(name, spec)? else {
            return Ok((base, bytes));
        };
        let merged = base
            .to_dtype(DType::F32)
            .and_then(|w| w + delta)
            .and_then(|w| w.to_dtype(base.dtype()))
            .map_err(|source| WeightError::Tensor {
                name: name.to_string(),
                source,
            })?;
        Ok((merged, bytes + lora_bytes))
    }

    fn read_quantized(&self, name: &str, spec: &ShardSpec) -> Result<(QuantizedSlice, usize), WeightError> {
        if self.adapter.pairs.contains_key(name) {
            return Err(WeightError::Shard {
                name: name.to_string(),
                detail: format!(
                    "{} changes it, and it is stored in quantized blocks, which a LoRA pair cannot be merged into; \
                     load with --dequantize",
                    self.adapter.path.display()
                ),
            });
        }
        self.inner.read_quantized(name, spec)
    }

    fn origin(&self) -> String {
        format!("{} with {}", self.inner.origin(), self.adapter.path.display())
    }

    fn config_origin(&self) -> String {
        self.inner.config_origin()
    }
}
