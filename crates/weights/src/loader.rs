use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

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

/// A rank's weights: the declared slices, read from a store and placed on the rank's device.
pub struct ShardLoader {
    tensors: HashMap<String, Tensor>,
    bytes_read: usize,
}

impl ShardLoader {
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
            })?;
            if info.shape != decl.shape {
                return Err(WeightError::Shape {
                    name: decl.name.clone(),
                    origin: store.origin(),
                    found: info.shape,
                    expected: decl.shape.clone(),
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

    /// Reads each declared slice, converts it to `dtype` and moves it to `device`.
    pub fn load(
        store: &dyn WeightStore,
        decls: &[WeightDecl],
        dtype: DType,
        device: &Device,
    ) -> Result<Self, WeightError> {
        let mut tensors = HashMap::with_capacity(decls.len());
        let mut bytes_read = 0;
        for decl in decls {
            let (host, n) = store.read(&decl.name, &decl.spec)?;
            bytes_read += n;
            let tensor = host
                .to_device(device)
                .and_then(|t| t.to_dtype(dtype))
                .map_err(|source| WeightError::Tensor {
                    name: decl.name.clone(),
                    source,
                })?;
            tensors.insert(decl.name.clone(), tensor);
        }
        Ok(Self { tensors, bytes_read })
    }

    /// The bytes copied out of the checkpoint for this rank.
    pub fn bytes_read(&self) -> usize {
        self.bytes_read
    }

    /// Hands over a loaded tensor; each is taken once, by the layer that owns it.
    pub fn take(&mut self, name: &str) -> Result<Tensor, WeightError> {
        self.tensors.remove(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
            origin: "the tensors loaded for this rank".to_string(),
        })
    }
}
