use std::collections::HashMap;

use candle_core::{CpuStorage, DType, Device, Tensor};

use crate::{ShardSpec, WeightError, WeightStore};

/// One tensor a model needs: its checkpoint name, the full shape its config implies, and the
/// slice this rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightDecl {
    pub name: String,
    pub shape: Vec<usize>,
    pub spec: ShardSpec,
}

impl WeightDecl {
    pub fn new(name: impl Into<String>, shape: &[usize], spec: ShardSpec) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            spec,
        }
    }
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
            decl.spec
                .local_shape(&decl.shape)
                .map_err(|detail| WeightError::Shard {
                    name: decl.name.clone(),
                    detail,
                })?;
        }
        let mut names = store.names();
        names.sort();
        if let Some(extra) = names
            .into_iter()
            .find(|n| !ignored(n) && !decls.iter().any(|d| &d.name == n))
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

    /// The device bytes of `decls` in `dtype`: what taking all of them places on the device.
    pub fn device_bytes(decls: &[WeightDecl], dtype: DType) -> Result<usize, WeightError> {
        decls.iter().try_fold(0, |total, decl| {
            let shape = decl
                .spec
                .local_shape(&decl.shape)
                .map_err(|detail| WeightError::Shard {
                    name: decl.name.clone(),
                    detail,
                })?;
            Ok(total + shape.iter().product::<usize>() * dtype.size_in_bytes())
        })
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
        let decl = self.decls.remove(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: "the tensors declared for this rank (or it was taken twice)".to_string(),
            config: self.store.config_origin(),
        })?;
        let (host, n) = self.store.read(&decl.name, &decl.spec)?;
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
        host.to_dtype(self.dtype).map_err(|source| WeightError::Tensor {
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
