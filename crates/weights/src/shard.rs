use candle_core::quantized::GgmlDType;
use candle_core::DType;

/// Which part of a tensor one rank holds.
///
/// Column-parallel weights are a range of output rows (dim 0), row-parallel weights a range
/// of input columns (dim 1), vocab-parallel embeddings a range of vocabulary rows. A range
/// rather than an index of equal parts, because splits may be uneven and KV heads may be
/// replicated on several ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardSpec {
    /// Every rank holds the whole tensor.
    Replicated,
    /// The rank holds `start..start + len` along `dim`.
    Range { dim: usize, start: usize, len: usize },
}

impl ShardSpec {
    /// The slice `range` of dimension `dim`.
    pub fn range(dim: usize, range: std::ops::Range<usize>) -> Self {
        Self::Range {
            dim,
            start: range.start,
            len: range.len(),
        }
    }

    /// The shape of the slice of a tensor whose full shape is `full`.
    pub fn local_shape(&self, full: &[usize]) -> Result<Vec<usize>, String> {
        match *self {
            Self::Replicated => Ok(full.to_vec()),
            Self::Range { dim, start, len } => {
                let size = *full
                    .get(dim)
                    .ok_or_else(|| format!("cannot split dim {dim} of a tensor of shape {full:?}"))?;
                if start + len > size || len == 0 {
                    return Err(format!(
                        "range {start}..{} is outside dim {dim} of shape {full:?}",
                        start + len
                    ));
                }
                let mut shape = full.to_vec();
                shape[dim] = len;
                Ok(shape)
            }
        }
    }

    /// The bytes of the slice, as stored in `dtype`: what a rank reads for this tensor.
    pub fn bytes(&self, full: &[usize], dtype: DType) -> Result<usize, String> {
        let shape = self.local_shape(full)?;
        Ok(shape.iter().product::<usize>() * dtype.size_in_bytes())
    }

    /// The bytes of the slice of a `[rows, cols]` tensor stored in GGML blocks of `quant`,
    /// which run along the rows: a column range must fall on whole blocks.
    pub fn quantized_bytes(&self, full: &[usize], quant: GgmlDType) -> Result<usize, String> {
        let shape = self.local_shape(full)?;
        let block = quant.block_size();
        let [rows, cols] = shape[..] else {
            return Err(format!("a {quant:?} tensor must have two dims, not {full:?}"));
        };
        if let Self::Range { dim: 1, start, len } = *self {
            if !start.is_multiple_of(block) || !len.is_multiple_of(block) {
                return Err(format!(
                    "columns {start}..{} of a {quant:?} tensor do not fall on its blocks of {block}",
                    start + len
                ));
            }
        }
        if !cols.is_multiple_of(block) {
            return Err(format!("{cols} columns are not whole {quant:?} blocks of {block}"));
        }
        Ok(rows * cols / block * quant.type_size())
    }
}
