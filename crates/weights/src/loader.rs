use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
use candle_core::{CpuStorage, DType, Device, Tensor};

use crate::{Quant, QuantizedSlice, ShardSpec, TensorInfo, WeightError, WeightFormat, WeightStore};

/// One tensor a model needs: its checkpoint name, the full shape its config implies, the
/// slice this rank holds, and the quantized form it is held in, if any (else it is held in
/// the compute dtype, or in f32 where `wide`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightDecl {
    pub name: String,
    pub shape: Vec<usize>,
    pub spec: ShardSpec,
    pub quant: Option<Quant>,
    /// Held in f32 whatever the compute dtype: a small layer its reference runs in f32.
    pub wide: bool,
}

impl WeightDecl {
    pub fn new(name: impl Into<String>, shape: &[usize], spec: ShardSpec) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            spec,
            quant: None,
            wide: false,
        }
    }

    /// This declaration held in f32 whatever the compute dtype.
    pub fn wide(self) -> Self {
        Self { wide: true, ..self }
    }

    /// The bytes this rank holds of the tensor on its device, in `dtype` unless quantized.
    pub fn device_bytes(&self, dtype: DType) -> Result<usize, WeightError> {
        let shard_err = |detail| WeightError::Shard {
            name: self.name.clone(),
            detail,
        };
        let shape = self.spec.local_shape(&self.shape).map_err(shard_err)?;
        let elements = shape.iter().product::<usize>();
        match self.quant {
            Some(Quant::Ggml(quant)) => self.spec.quantized_bytes(&self.shape, quant).map_err(shard_err),
            // One byte a value, and an f32 scale for each of the slice's rows.
            Some(Quant::Fp8) => Ok(elements + shape.first().copied().unwrap_or(0) * 4),
            None if self.wide => Ok(elements * DType::F32.size_in_bytes()),
            None => Ok(elements * dtype.size_in_bytes()),
        }
    }
}

/// Sets each matrix of `decls` to the form `format` holds it in. `matrix` picks the weights
/// a product multiplies (not an embedding, whose rows are looked up), `fp8` those of them
/// `--quantize fp8` quantizes; `stored` gives a tensor's header (none for a preset). As
/// stored, GGUF blocks and E4M3 matrices (FP8 checkpoints) stay so.
pub fn hold_matrices(
    decls: &mut [WeightDecl],
    format: WeightFormat,
    matrix: impl Fn(&WeightDecl) -> bool,
    fp8: impl Fn(&WeightDecl) -> bool,
    stored: impl Fn(&str) -> Option<TensorInfo>,
) {
    for decl in decls.iter_mut().filter(|d| matrix(d)) {
        decl.quant = match format {
            WeightFormat::Dequantized => None,
            WeightFormat::Fp8 | WeightFormat::Fp8WithLmHead => fp8(decl).then_some(Quant::Fp8),
            WeightFormat::AsStored => match stored(&decl.name) {
                Some(TensorInfo {
                    quant: Some(blocks), ..
                }) => Some(Quant::Ggml(blocks)),
                Some(TensorInfo {
                    dtype: DType::F8E4M3, ..
                }) if fp8(decl) => Some(Quant::Fp8),
                _ => None,
            },
        };
    }
}

/// A matrix as a rank holds it: dense in the compute dtype, in the GGML blocks it is stored
/// in, or as FP8 E4M3 `values` (`[rows, cols]`) times f32 `scales` (`[rows]`).
#[derive(Clone)]
pub enum Weight {
    Dense(Tensor),
    Quantized(Arc<QTensor>),
    Fp8 { values: Tensor, scales: Tensor },
}

/// A rank's weights: the declared slices, read from a store one tensor at a time as layers take
/// them, converted to the compute dtype on the host and copied to the rank's device. Nothing
/// but the final tensors ever occupies device memory, so a rank's weight bytes are exactly
/// what its declarations imply.
pub struct ShardLoader<'a> {
    store: &'a dyn WeightStore,
    decls: HashMap<String, WeightDecl>,
    dtype: DType,
    device: Device,
    bytes_read: usize,
    bytes_on_device: usize,
}

impl<'a> ShardLoader<'a> {
    /// Checks that the checkpoint holds exactly the declared tensors (apart from names
    /// matching `ignored`), with the declared shapes. Reads nothing but headers.
    pub fn check(
        store: &dyn WeightStore,
        decls: &[WeightDecl],
        ignored: &dyn Fn(&str) -> bool,
    ) -> Result<(), WeightError> {
        for decl in decls {
            let info = store.info(&decl.name).ok_or_else(|| WeightError::Missing {
                name: decl.name.clone(),
                origin: store.origin(),
                config: store.config_origin(),
            })?;
            if info.shape != decl.shape {
                return Err(WeightError::Shape {
                    name: decl.name.clone(),
                    origin: store.origin(),
                    config: store.config_origin(),
                    found: info.shape.into(),
                    expected: decl.shape.as_slice().into(),
                });
            }
            // The slice must exist, and a quantized one fall on whole blocks.
            decl.device_bytes(DType::F32)?;
            if let Some(Quant::Ggml(quant)) = decl.quant {
                if info.quant != Some(quant) {
                    return Err(WeightError::Shard {
                        name: decl.name.clone(),
                        detail: format!(
                            "declared as {quant:?} blocks, but {} holds {:?}",
                            store.origin(),
                            info.quant
                        ),
                    });
                }
            }
        }
        // A set, not a scan of the declarations per name: a plan checks every rank's shard at
        // every width it searches, and a scan made that quadratic in the tensors.
        let declared: HashSet<&str> = decls.iter().map(|d| d.name.as_str()).collect();
        if let Some(extra) = store
            .names()
            .into_iter()
            .filter(|n| !ignored(n) && !declared.contains(n.as_str()))
            .min()
        {
            return Err(WeightError::Unexpected {
                name: extra,
                origin: store.origin(),
                config: store.config_origin(),
                hint: "no layer of the configured model reads it".to_string(),
            });
        }
        Ok(())
    }

    /// The bytes this rank will read, computed from the headers alone.
    pub fn planned_bytes(store: &dyn WeightStore, decls: &[WeightDecl]) -> Result<usize, WeightError> {
        decls.iter().try_fold(0, |total, decl| {
            let info = store.info(&decl.name).ok_or_else(|| WeightError::Missing {
                name: decl.name.clone(),
                origin: store.origin(),
                config: store.config_origin(),
            })?;
            let bytes = decl
                .spec
                .bytes(&info.shape, info.dtype)
                .map_err(|detail| WeightError::Shard {
                    name: decl.name.clone(),
                    detail,
                })?;
            Ok(total + bytes)
        })
    }

    /// A loader for `decls` from `store`, placing tensors on `device` in `dtype`. Reads nothing
    /// until a tensor is taken.
    pub fn new(store: &'a dyn WeightStore, decls: &[WeightDecl], dtype: DType, device: &Device) -> Self {
        Self {
            store,
            decls: decls.iter().map(|d| (d.name.clone(), d.clone())).collect(),
            dtype,
            device: device.clone(),
            bytes_read: 0,
            bytes_on_device: 0,
        }
    }

    /// The device bytes of `decls` in `dtype` (quantized ones as stored): what taking all of
    /// them places on the device.
    pub fn device_bytes(decls: &[WeightDecl], dtype: DType) -> Result<usize, WeightError> {
        decls
            .iter()
            .try_fold(0, |total, decl| Ok(total + decl.device_bytes(dtype)?))
    }

    /// The compute dtype the tensors are placed in (f32 for those declared `wide`).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The bytes copied out of the checkpoint so far.
    pub fn bytes_read(&self) -> usize {
        self.bytes_read
    }

    /// The bytes of the tensors placed on the device so far.
    pub fn bytes_on_device(&self) -> usize {
        self.bytes_on_device
    }

    /// Reads a declared tensor's slice and places it on the device; each is taken once, by
    /// the layer that owns it.
    pub fn take(&mut self, name: &str) -> Result<Tensor, WeightError> {
        let host = self.read(name)?;
        self.upload(name, host)
    }

    /// Reads several declared slices and places their concatenation along `dim` on the
    /// device, for fused layers: the parts never occupy device memory.
    pub fn take_concat(&mut self, names: &[&str], dim: usize) -> Result<Tensor, WeightError> {
        let parts = names.iter().map(|n| self.read(n)).collect::<Result<Vec<_>, _>>()?;
        let joined = names.join(" + ");
        let host = Tensor::cat(&parts, dim).map_err(|source| WeightError::Tensor {
            name: joined.clone(),
            source,
        })?;
        self.upload(&joined, host)
    }

    /// A declared matrix as its declaration holds it: in its GGML blocks when quantized, else
    /// dense like [`Self::take`].
    pub fn take_weight(&mut self, name: &str) -> Result<Weight, WeightError> {
        match self.quant_of(name)? {
            Some(Quant::Ggml(_)) => {
                let slice = self.read_quantized(name)?;
                Ok(Weight::Quantized(Arc::new(self.upload_quantized(name, slice)?)))
            }
            Some(Quant::Fp8) => {
                let (values, scales) = self.read_fp8(name)?;
                self.upload_fp8(name, values, scales)
            }
            None => Ok(Weight::Dense(self.take(name)?)),
        }
    }

    /// Several declared matrices stacked by rows, for fused layers: each run of consecutive
    /// names in one form (dense, FP8, or the same GGML blocks) joined into one weight, with
    /// the range of `names` it holds. A Q4_K_M file's Q and K (Q4_K) join; its V (Q6_K) stands
    /// apart.
    pub fn take_stacked(&mut self, names: &[&str]) -> Result<Vec<(Weight, Range<usize>)>, WeightError> {
        let quants = names.iter().map(|n| self.quant_of(n)).collect::<Result<Vec<_>, _>>()?;
        let mut runs = Vec::new();
        let mut start = 0;
        for end in 1..=names.len() {
            if end == names.len() || quants[end] != quants[start] {
                runs.push((quants[start], start..end));
                start = end;
            }
        }
        runs.into_iter()
            .map(|(quant, run)| Ok((self.take_joined(&names[run.clone()], quant)?, run)))
            .collect()
    }

    /// `names`, all in form `quant`, stacked by rows into one weight.
    fn take_joined(&mut self, names: &[&str], quant: Option<Quant>) -> Result<Weight, WeightError> {
        let joined = names.join(" + ");
        match quant {
            None => Ok(Weight::Dense(self.take_concat(names, 0)?)),
            Some(Quant::Fp8) => {
                let parts = names.iter().map(|n| self.read_fp8(n)).collect::<Result<Vec<_>, _>>()?;
                let (values, scales): (Vec<Tensor>, Vec<Tensor>) = parts.into_iter().unzip();
                let cat = |parts: &[Tensor]| {
                    Tensor::cat(parts, 0).map_err(|source| WeightError::Tensor {
                        name: joined.clone(),
                        source,
                    })
                };
                let (values, scales) = (cat(&values)?, cat(&scales)?);
                self.upload_fp8(&joined, values, scales)
            }
            Some(Quant::Ggml(_)) => {
                let mut parts = names.iter().map(|n| self.read_quantized(n));
                let Some(mut stacked) = parts.next().transpose()? else {
                    return Err(WeightError::Missing {
                        name: joined,
                        origin: "a stack of no tensors".to_string(),
                        config: self.store.config_origin(),
                    });
                };
                for part in parts {
                    let part = part?;
                    stacked.shape[0] += part.shape[0];
                    stacked.bytes.extend_from_slice(&part.bytes);
                }
                let qtensor = self.upload_quantized(&joined, stacked)?;
                Ok(Weight::Quantized(Arc::new(qtensor)))
            }
        }
    }

    fn quant_of(&self, name: &str) -> Result<Option<Quant>, WeightError> {
        self.decls
            .get(name)
            .map(|d| d.quant)
            .ok_or_else(|| WeightError::Missing {
                name: name.to_string(),
                origin: "the tensors declared for this rank (or it was taken twice)".to_string(),
                config: self.store.config_origin(),
            })
    }

    fn take_decl(&mut self, name: &str) -> Result<WeightDecl, WeightError> {
        self.decls.remove(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: "the tensors declared for this rank (or it was taken twice)".to_string(),
            config: self.store.config_origin(),
        })
    }

    fn read_quantized(&mut self, name: &str) -> Result<QuantizedSlice, WeightError> {
        let decl = self.take_decl(name)?;
        let (slice, n) = self.store.read_quantized(&decl.name, &decl.spec)?;
        self.bytes_read += n;
        if Some(Quant::Ggml(slice.dtype)) != decl.quant {
            return Err(WeightError::Shard {
                name: decl.name,
                detail: format!(
                    "declared as {:?}, but the store holds {:?} blocks",
                    decl.quant, slice.dtype
                ),
            });
        }
        Ok(slice)
    }

    /// A declared FP8 matrix's values and row scales, on the host.
    fn read_fp8(&mut self, name: &str) -> Result<(Tensor, Tensor), WeightError> {
        let decl = self.take_decl(name)?;
        let (values, scales, n) = crate::fp8::read_fp8(self.store, &decl.name, &decl.spec)?;
        self.bytes_read += n;
        Ok((values, scales))
    }

    fn upload_fp8(&mut self, name: &str, values: Tensor, scales: Tensor) -> Result<Weight, WeightError> {
        let upload = |t: Tensor| {
            t.to_device(&self.device).map_err(|source| WeightError::Tensor {
                name: name.to_string(),
                source,
            })
        };
        let (values, scales) = (upload(values)?, upload(scales)?);
        self.bytes_on_device += values.elem_count() + scales.elem_count() * 4;
        Ok(Weight::Fp8 { values, scales })
    }

    fn upload_quantized(&mut self, name: &str, slice: QuantizedSlice) -> Result<QTensor, WeightError> {
        let qtensor = qtensor_from_ggml(slice.dtype, &slice.bytes, slice.shape, &self.device).map_err(|source| {
            WeightError::Tensor {
                name: name.to_string(),
                source,
            }
        })?;
        self.bytes_on_device += slice.bytes.len();
        Ok(qtensor)
    }

    /// The shape of a declared, not yet taken tensor's slice.
    pub fn local_shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        let decl = self.decls.get(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: "the tensors declared for this rank (or it was taken twice)".to_string(),
            config: self.store.config_origin(),
        })?;
        decl.spec.local_shape(&decl.shape).map_err(|detail| WeightError::Shard {
            name: name.to_string(),
            detail,
        })
    }

    fn read(&mut self, name: &str) -> Result<Tensor, WeightError> {
        let decl = self.take_decl(name)?;
        let stored_fp8 = self.store.info(name).is_some_and(|i| i.dtype == DType::F8E4M3);
        let (host, n) = match stored_fp8 {
            // E4M3 values mean nothing without their row scales.
            true => {
                let (values, scales, n) = crate::fp8::read_fp8(self.store, &decl.name, &decl.spec)?;
                let dense = values
                    .to_dtype(DType::F32)
                    .and_then(|v| v.broadcast_mul(&scales.unsqueeze(1)?))
                    .map_err(|source| WeightError::Tensor {
                        name: decl.name.clone(),
                        source,
                    })?;
                (dense, n)
            }
            false => self.store.read(&decl.name, &decl.spec)?,
        };
        self.bytes_read += n;
        // The slice is in host memory now: checked here, a corrupt checkpoint is named at load
        // rather than found as NaN output, and no pass over the file is added.
        if !all_finite(&host).map_err(|source| WeightError::Tensor {
            name: decl.name.clone(),
            source,
        })? {
            return Err(WeightError::NonFinite {
                name: decl.name.clone(),
                origin: self.store.origin(),
            });
        }
        // Converting on the host keeps the checkpoint-dtype copy off the device.
        let dtype = match decl.wide {
            true => DType::F32,
            false => self.dtype,
        };
        host.to_dtype(dtype).map_err(|source| WeightError::Tensor {
            name: decl.name.clone(),
            source,
        })
    }

    fn upload(&mut self, name: &str, host: Tensor) -> Result<Tensor, WeightError> {
        let tensor = host.to_device(&self.device).map_err(|source| WeightError::Tensor {
            name: name.to_string(),
            source,
        })?;
        self.bytes_on_device += tensor.elem_count() * tensor.dtype().size_in_bytes();
        Ok(tensor)
    }
}

/// Whether every value of a host tensor is finite (integer tensors always are).
fn all_finite(t: &Tensor) -> candle_core::Result<bool> {
    fn finite<T: Copy + Send + Sync>(values: &[T], is_finite: fn(T) -> bool) -> bool {
        // Large tensors in parallel chunks: a rank's weights pass through here once.
        use rayon::prelude::*;
        values
            .par_chunks(1 << 16)
            .all(|chunk| chunk.iter().all(|&v| is_finite(v)))
    }
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("a contiguous tensor has no contiguous offsets".into()))?;
    Ok(match &*storage {
        candle_core::Storage::Cpu(cpu) => match cpu {
            CpuStorage::F32(v) => finite(&v[start..end], f32::is_finite),
            CpuStorage::F64(v) => finite(&v[start..end], f64::is_finite),
            CpuStorage::BF16(v) => finite(&v[start..end], half::bf16::is_finite),
            CpuStorage::F16(v) => finite(&v[start..end], half::f16::is_finite),
            _ => true,
        },
        // Stores read to the host; a device tensor is not theirs to check.
        _ => true,
    })
}
