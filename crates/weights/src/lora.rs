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

/// What other tools put before a diffusion model's weight names: ComfyUI's Wan adapters
/// (`diffusion_model.`) and diffusers' (`transformer.`).
const WRAPPER_PREFIXES: [&str; 2] = ["diffusion_model.", "transformer."];
/// kohya's, whose names also have their dots as underscores (`lora_unet_blocks_0_self_attn_q`).
const KOHYA_PREFIX: &str = "lora_unet_";

/// A LoRA adapter read from a safetensors file: for each weight it changes, the low-rank
/// pair and the scale of their product, or a whole delta.
#[derive(Debug)]
pub struct LoraAdapter {
    path: PathBuf,
    /// The changed weight's name as the file names it (`{module}.weight`, or `.bias` for a
    /// bias delta) → its change.
    changes: HashMap<String, Change>,
}

/// How an adapter changes one weight.
#[derive(Debug)]
enum Change {
    /// `scale · B·A`: `A` `[rank, in]` and `B` `[out, rank]`, f32 on the CPU.
    LowRank { down: Tensor, up: Tensor, scale: f64 },
    /// A delta of the weight's own shape, added as stored (ComfyUI's `.diff` and `.diff_b`:
    /// norms and biases that trained whole), f32 on the CPU.
    Whole(Tensor),
}

impl Change {
    /// The `[out, in]` or full shape of the weight it changes.
    fn shape(&self) -> Vec<usize> {
        match self {
            Self::LowRank { down, up, .. } => vec![up.dim(0).unwrap_or(0), down.dim(1).unwrap_or(0)],
            Self::Whole(delta) => delta.dims().to_vec(),
        }
    }
}

/// The parts of one module's change as a file names them, before they are matched.
#[derive(Default)]
struct Halves {
    down: Option<Tensor>,
    up: Option<Tensor>,
    alpha: Option<f64>,
}

impl LoraAdapter {
    /// Reads `path`: PEFT's names (`{module}.lora_A[.{adapter}].weight` and `lora_B`, with
    /// or without `base_model.model.` before them; Live Avatar's form), kohya's and
    /// ComfyUI's (`{module}.lora_down.weight`, `lora_up`, `{module}.alpha`, and whole deltas
    /// `{module}.diff` and `{module}.diff_b` for a weight and a bias). `scale` multiplies
    /// every pair's `B·A`; without it, each pair's `alpha / rank` from the file's `.alpha`
    /// tensors or from the `adapter_config.json` PEFT saves beside it. Whole deltas are added
    /// as stored.
    pub fn open(path: &Path, scale: Option<f64>) -> Result<Self, WeightError> {
        let err = |detail: String| WeightError::Lora {
            path: path.to_path_buf(),
            detail,
        };
        if let Some(s) = scale.filter(|s| !s.is_finite()) {
            return Err(err(format!("--lora-scale {s} is not a finite number")));
        }
        let tensors = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| err(e.to_string()))?;
        let mut modules: HashMap<String, Halves> = HashMap::new();
        let mut changes = HashMap::new();
        for (key, tensor) in tensors {
            let name = key.strip_prefix(PEFT_PREFIX).unwrap_or(&key);
            let (module, part) = split_lora_key(name).ok_or_else(|| {
                err(format!(
                    "it holds `{key}`, which is no LoRA pair's half (`lora_A`/`lora_B`, `lora_down`/`lora_up`), \
                     `alpha` nor whole delta (`diff`, `diff_b`); give an adapter file, not a model"
                ))
            })?;
            let values = tensor.to_dtype(DType::F32).map_err(|e| err(format!("`{key}`: {e}")))?;
            let finite = values
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| err(format!("`{key}`: {e}")))?
                .iter()
                .all(|v| v.is_finite());
            if !finite {
                return Err(err(format!(
                    "`{key}` holds a value that is not finite (NaN or infinity); the file is corrupt"
                )));
            }
            match part {
                Part::Down => halves(&mut modules, module).down = Some(values),
                Part::Up => halves(&mut modules, module).up = Some(values),
                Part::Alpha => match values.flatten_all().and_then(|t| t.to_vec1::<f32>()).as_deref() {
                    Ok([a]) => halves(&mut modules, module).alpha = Some(*a as f64),
                    _ => {
                        return Err(err(format!(
                            "`{key}` holds {} values, not one alpha",
                            values.elem_count()
                        )))
                    }
                },
                Part::Whole(suffix) => {
                    changes.insert(format!("{module}.{suffix}"), Change::Whole(values));
                }
            }
        }
        let config_scale = Self::config_scale(path).map_err(err)?;
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
            let scale = match (scale, halves.alpha, config_scale) {
                (Some(s), _, _) => s,
                (None, Some(alpha), _) => alpha / rank as f64,
                (None, None, Some(s)) => s,
                (None, None, None) => {
                    return Err(err(format!(
                        "`{module}` has no alpha and no adapter_config.json is beside the file: give --lora-scale \
                         (alpha / rank; Live Avatar's is 64 / 128 = 0.5)"
                    )))
                }
            };
            changes.insert(format!("{module}.weight"), Change::LowRank { down, up, scale });
        }
        if changes.is_empty() {
            return Err(err("it holds no LoRA pairs".into()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            changes,
        })
    }

    /// `lora_alpha / r` from a PEFT `adapter_config.json` beside `path`, if there is one.
    fn config_scale(path: &Path) -> Result<Option<f64>, String> {
        let config = path.with_file_name("adapter_config.json");
        let Ok(text) = std::fs::read_to_string(&config) else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", config.display()))?;
        let number = |key: &str| v.get(key).and_then(serde_json::Value::as_f64).filter(|x| *x > 0.0);
        match (number("lora_alpha"), number("r")) {
            (Some(alpha), Some(rank)) => Ok(Some(alpha / rank)),
            _ => Err(format!(
                "{} has no positive `lora_alpha` and `r`; give --lora-scale",
                config.display()
            )),
        }
    }

    /// The weights it changes, as the file names them.
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.changes.keys().map(String::as_str)
    }

    /// The scale of the pair that changes `target` (as the file names it); none for a
    /// whole delta or a weight it does not change.
    pub fn scale_of(&self, target: &str) -> Option<f64> {
        match self.changes.get(target)? {
            Change::LowRank { scale, .. } => Some(*scale),
            Change::Whole(_) => None,
        }
    }

    /// The change of the file's `target` restricted to `spec`'s slice of the weight.
    fn delta(&self, target: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        let tensor_err = |source| WeightError::Tensor {
            name: target.to_string(),
            source,
        };
        let change = self.changes.get(target).ok_or_else(|| WeightError::Lora {
            path: self.path.clone(),
            detail: format!("no change of `{target}`"),
        })?;
        let (down, up, scale) = match change {
            Change::Whole(delta) => {
                let slice = match *spec {
                    ShardSpec::Replicated => delta.clone(),
                    ShardSpec::Range { dim, start, len } => delta.narrow(dim, start, len).map_err(tensor_err)?,
                };
                let bytes = slice.elem_count() * 4;
                return Ok((slice, bytes));
            }
            Change::LowRank { down, up, scale } => (down, up, *scale),
        };
        let (down, up) = match *spec {
            ShardSpec::Replicated => (down.clone(), up.clone()),
            ShardSpec::Range { dim: 0, start, len } => (down.clone(), up.narrow(0, start, len).map_err(tensor_err)?),
            ShardSpec::Range { dim: 1, start, len } => (down.narrow(1, start, len).map_err(tensor_err)?, up.clone()),
            ShardSpec::Range { dim, .. } => {
                return Err(WeightError::Shard {
                    name: target.to_string(),
                    detail: format!("a LoRA pair changes it, and it is split along dim {dim}, not a matrix's"),
                })
            }
        };
        let bytes = (down.elem_count() + up.elem_count()) * 4;
        let delta = up
            .matmul(&down.contiguous().map_err(tensor_err)?)
            .and_then(|d| d * scale)
            .map_err(tensor_err)?;
        Ok((delta, bytes))
    }
}

/// The parts of `module` read so far.
fn halves<'a>(modules: &'a mut HashMap<String, Halves>, module: &str) -> &'a mut Halves {
    modules.entry(module.to_string()).or_default()
}

enum Part {
    Down,
    Up,
    Alpha,
    /// A whole delta of the module's weight or bias.
    Whole(&'static str),
}

/// `{module}.lora_A[.{adapter}].weight` and the like: the module and which part.
fn split_lora_key(name: &str) -> Option<(&str, Part)> {
    for (suffix, part) in [
        (".alpha", Part::Alpha),
        (".diff", Part::Whole("weight")),
        (".diff_b", Part::Whole("bias")),
    ] {
        if let Some(module) = name.strip_suffix(suffix) {
            return Some((module, part));
        }
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
/// of [`WeightStore::read`] as its slice of `W + s · B·A` (or `W + Δ`), in the checkpoint's
/// dtype.
pub struct LoraStore {
    inner: Arc<dyn WeightStore>,
    adapter: Arc<LoraAdapter>,
    /// The checkpoint's name of each weight the adapter changes → the file's name of it.
    targets: HashMap<String, String>,
}

impl LoraStore {
    /// Matches each weight the adapter changes to the checkpoint's: by its own name, by the
    /// name under one of the common prefixes taken off, by the other name `aliases` pairs it
    /// with (a family's second naming: Wan's original names beside diffusers'), or, for
    /// kohya's `lora_unet_` names, by the one checkpoint name that reads the same with dots
    /// as underscores. Fails, naming the weight, where the checkpoint holds none of them, or
    /// not in the change's shape: an adapter for another model.
    pub fn new(
        inner: Arc<dyn WeightStore>,
        adapter: Arc<LoraAdapter>,
        aliases: &[(String, String)],
    ) -> Result<Self, WeightError> {
        let err = |detail: String| WeightError::Lora {
            path: adapter.path.clone(),
            detail,
        };
        let mut partner: HashMap<&str, &str> = HashMap::new();
        for (a, b) in aliases {
            partner.insert(a, b);
            partner.insert(b, a);
        }
        let held = |name: &str| inner.info(name).map(|_| name.to_string());
        // Every name a stored weight goes by, dots as underscores → the stored name (none
        // where two stored weights would read alike).
        let mut underscored: HashMap<String, Option<String>> = HashMap::new();
        for stored in inner.names() {
            for name in [Some(stored.as_str()), partner.get(stored.as_str()).copied()]
                .into_iter()
                .flatten()
            {
                underscored
                    .entry(name.replace('.', "_"))
                    .and_modify(|s| {
                        if s.as_deref() != Some(stored.as_str()) {
                            *s = None
                        }
                    })
                    .or_insert_with(|| Some(stored.clone()));
            }
        }
        let mut targets = HashMap::new();
        for (name, change) in &adapter.changes {
            let bare = WRAPPER_PREFIXES
                .iter()
                .find_map(|p| name.strip_prefix(p))
                .unwrap_or(name);
            let stored = held(bare)
                .or_else(|| partner.get(bare).and_then(|p| held(p)))
                .or_else(|| {
                    let kohya = bare.strip_prefix(KOHYA_PREFIX)?;
                    underscored.get(&kohya.replace('.', "_")).cloned().flatten()
                })
                .ok_or_else(|| {
                    err(format!(
                        "it changes `{name}`, which {} does not hold; is the adapter for this model?",
                        inner.origin()
                    ))
                })?;
            let info = inner
                .info(&stored)
                .ok_or_else(|| err(format!("`{stored}` went missing")))?;
            if info.shape != change.shape() {
                return Err(err(format!(
                    "its change of `{name}` makes {:?}, but {} holds {:?}; is the adapter for this model?",
                    change.shape(),
                    inner.origin(),
                    info.shape
                )));
            }
            if let Some(first) = targets.insert(stored.clone(), name.clone()) {
                return Err(err(format!(
                    "it changes `{stored}` twice, as `{first}` and as `{name}`; give one change per weight"
                )));
            }
        }
        Ok(Self {
            inner,
            adapter,
            targets,
        })
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
        let Some(target) = self.targets.get(name) else {
            return Ok((base, bytes));
        };
        let (delta, lora_bytes) = self.adapter.delta(target, spec)?;
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
        if self.targets.contains_key(name) {
            return Err(WeightError::Shard {
                name: name.to_string(),
                detail: format!(
                    "{} changes it, and it is stored in quantized blocks, which a LoRA change cannot be merged into; \
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
