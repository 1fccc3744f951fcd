//! Load progress: the weight bytes the ranks have loaded, for a progress bar.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::{QuantizedSlice, ShardSpec, TensorInfo, WeightError, WeightStore};

/// The weight bytes loaded so far, out of the bytes to load, summed over the ranks that
/// share it: what a progress bar shows while a large model loads. Clones count into the same
/// totals. Bytes count as a rank's plan counts its weights: in the compute dtype, or as
/// stored for tensors kept quantized.
#[derive(Debug, Clone, Default)]
pub struct LoadProgress {
    placed: Arc<AtomicU64>,
    total: Arc<AtomicU64>,
}

impl LoadProgress {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `bytes` to the bytes to load (each start adds what it plans to load).
    pub fn add_total(&self, bytes: u64) {
        self.total.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The bytes loaded so far.
    pub fn placed(&self) -> u64 {
        self.placed.load(Ordering::Relaxed)
    }

    /// The bytes to load, as known so far.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// A store whose reads count into a [`LoadProgress`]: each tensor's elements at the size of
/// the dtype it will be loaded in.
pub struct CountingStore {
    inner: Arc<dyn WeightStore>,
    progress: LoadProgress,
    dtype: DType,
}

impl CountingStore {
    pub fn new(inner: Arc<dyn WeightStore>, progress: &LoadProgress, dtype: DType) -> Self {
        Self {
            inner,
            progress: progress.clone(),
            dtype,
        }
    }
}

impl WeightStore for CountingStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.inner.info(name)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        let (tensor, bytes) = self.inner.read(name, spec)?;
        let loaded = tensor.elem_count() * self.dtype.size_in_bytes();
        self.progress.placed.fetch_add(loaded as u64, Ordering::Relaxed);
        Ok((tensor, bytes))
    }

    fn read_quantized(&self, name: &str, spec: &ShardSpec) -> Result<(QuantizedSlice, usize), WeightError> {
        let (slice, bytes) = self.inner.read_quantized(name, spec)?;
        self.progress
            .placed
            .fetch_add(slice.bytes.len() as u64, Ordering::Relaxed);
        Ok((slice, bytes))
    }

    fn origin(&self) -> String {
        self.inner.origin()
    }

    fn config_origin(&self) -> String {
        self.inner.config_origin()
    }
}
