use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;

use crate::{QuantizedSlice, ShardSpec, TensorInfo, WeightError, WeightStore};

/// A store seen through another naming: a model declares its tensors in one naming
/// (diffusers', say) and reads a checkpoint saved in another (the original Wan code's).
pub struct RenamedStore {
    inner: Arc<dyn WeightStore>,
    /// Model name → stored name, for the names that differ.
    stored: HashMap<String, String>,
    /// Stored name → model name.
    model: HashMap<String, String>,
}

impl RenamedStore {
    /// `inner` read through `renames`, pairs of (model name, stored name) for the names that
    /// differ.
    pub fn new(inner: Arc<dyn WeightStore>, renames: impl IntoIterator<Item = (String, String)>) -> Self {
        let stored: HashMap<String, String> = renames.into_iter().collect();
        let model = stored.iter().map(|(m, s)| (s.clone(), m.clone())).collect();
        Self { inner, stored, model }
    }

    fn stored_name<'a>(&'a self, name: &'a str) -> &'a str {
        self.stored.get(name).map_or(name, String::as_str)
    }
}

impl WeightStore for RenamedStore {
    fn info(&self, name: &str) -> Option<TensorInfo> {
        self.inner.info(self.stored_name(name))
    }

    fn names(&self) -> Vec<String> {
        self.inner
            .names()
            .into_iter()
            .map(|n| self.model.get(&n).cloned().unwrap_or(n))
            .collect()
    }

    fn read(&self, name: &str, spec: &ShardSpec) -> Result<(Tensor, usize), WeightError> {
        self.inner.read(self.stored_name(name), spec)
    }

    fn read_quantized(&self, name: &str, spec: &ShardSpec) -> Result<(QuantizedSlice, usize), WeightError> {
        self.inner.read_quantized(self.stored_name(name), spec)
    }

    fn origin(&self) -> String {
        self.inner.origin()
    }

    fn config_origin(&self) -> String {
        self.inner.config_origin()
    }
}
