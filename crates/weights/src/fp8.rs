//! FP8 E4M3 matrices with one f32 scale per output row, as compressed-tensors checkpoints
//! store them and as `--quantize fp8` makes them.

use candle_core::{DType, Tensor};

use crate::{ShardSpec, WeightError, WeightStore};

/// The largest finite E4M3 magnitude.
const E4M3_MAX: f64 = 448.0;

/// Rows a worker of [`quantize_rows`] takes at a time: candle's CPU ops run on one thread, and
/// an 8B model's matrices took 110 s to quantize so on an H200 host's CPU.
const ROWS_PER_TASK: usize = 256;

/// `w` (`[rows, cols]`) as E4M3 values and one f32 scale per row, `w ≈ values · scale`: each
/// row scaled so that its largest magnitude is E4M3's largest (an all-zero row by 1). Blocks
/// of rows on rayon's threads; each row's bits are its own.
pub fn quantize_rows(w: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    use rayon::prelude::*;
    let rows = w.dim(0)?;
    let blocks = (0..rows)
        .step_by(ROWS_PER_TASK)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|first| quantize_block(&w.narrow(0, first, ROWS_PER_TASK.min(rows - first))?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (values, scales): (Vec<_>, Vec<_>) = blocks.into_iter().unzip();
    Ok((Tensor::cat(&values, 0)?, Tensor::cat(&scales, 0)?))
}

fn quantize_block(w: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let w = w.to_dtype(DType::F32)?;
    let amax = w.abs()?.max_keepdim(1)?;
    let zero = amax.eq(0f64)?;
    let scales = zero.where_cond(&amax.ones_like()?, &(amax / E4M3_MAX)?)?;
    let values = w.broadcast_div(&scales)?.to_dtype(DType::F8E4M3)?;
    Ok((values, scales.squeeze(1)?))
}

/// The `spec` slice of the `[rows, cols]` matrix `name` as E4M3 values, with its rows' scales,
/// on the CPU, and the bytes read. A matrix stored in E4M3 (a compressed-tensors checkpoint)
/// brings its `{name}_scale`, per row or per tensor; any other is quantized here from its
/// whole rows, so that the ranks of a row-parallel split share each row's scale.
pub(crate) fn read_fp8(
    store: &dyn WeightStore,
    name: &str,
    spec: &ShardSpec,
) -> Result<(Tensor, Tensor, usize), WeightError> {
    let tensor_err = |name: &str| {
        let name = name.to_string();
        move |source| WeightError::Tensor {
            name: name.clone(),
            source,
        }
    };
    let info = store.info(name).ok_or_else(|| WeightError::Missing {
        name: name.to_string(),
        origin: store.origin(),
        config: store.config_origin(),
    })?;
    let [rows, _] = info.shape[..] else {
        return Err(WeightError::Shard {
            name: name.to_string(),
            detail: format!("an FP8 matrix has two dims, not {:?}", info.shape),
        });
    };
    // The tensor a bad scale is blamed on: the stored scale, or the weight it was made from.
    let (values, scales, read, origin_of_scales) = match info.dtype {
        DType::F8E4M3 => {
            let (values, read) = store.read(name, spec)?;
            let scale_name = format!("{name}_scale");
            let (scale, scale_read) = store.read(&scale_name, &ShardSpec::Replicated)?;
            let scale = scale
                .to_dtype(DType::F32)
                .and_then(|s| s.flatten_all())
                .map_err(tensor_err(&scale_name))?;
            let scales = match scale.elem_count() {
                1 => scale.broadcast_as(rows).and_then(|s| s.contiguous()),
                n if n == rows => Ok(scale),
                n => {
                    return Err(WeightError::Shard {
                        name: scale_name,
                        detail: format!("{n} scales for {rows} rows: a weight scale is one per row or one in all"),
                    })
                }
            }
            .map_err(tensor_err(&scale_name))?;
            (values, scales, read + scale_read, scale_name)
        }
        _ => {
            let (full, read) = store.read(name, &ShardSpec::Replicated)?;
            let (values, scales) = quantize_rows(&full).map_err(tensor_err(name))?;
            let values = match *spec {
                ShardSpec::Replicated => values,
                ShardSpec::Range { dim, start, len } => values
                    .narrow(dim, start, len)
                    .and_then(|v| v.contiguous())
                    .map_err(tensor_err(name))?,
            };
            (values, scales, read, name.to_string())
        }
    };
    // A non-finite weight makes a non-finite row scale: either way the row is unusable. A
    // stored scale of 0 or below would zero or flip its row.
    let values_of_scales = scales.to_vec1::<f32>().map_err(tensor_err(name))?;
    if let Some((row, &s)) = values_of_scales
        .iter()
        .enumerate()
        .find(|(_, s)| !(s.is_finite() && **s > 0.0))
    {
        return Err(match s.is_finite() {
            false => WeightError::NonFinite {
                name: origin_of_scales,
                origin: store.origin(),
            },
            true => WeightError::Shard {
                name: origin_of_scales,
                detail: format!(
                    "row {row}'s scale is {s}, where every scale is above 0; the checkpoint is corrupt: download or \
                     convert it again"
                ),
            },
        });
    }
    let scales = match *spec {
        ShardSpec::Range { dim: 0, start, len } => scales.narrow(0, start, len).map_err(tensor_err(name))?,
        _ => scales,
    };
    Ok((values, scales, read))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    /// Blocks of rows quantize as the whole matrix in one block does, bit for bit: a last
    /// block short, an all-zero row scaled by 1.
    #[test]
    fn rows_quantized_in_blocks_equal_the_matrix_quantized_whole() {
        let rows = 2 * super::ROWS_PER_TASK + 3;
        let w = Tensor::randn(0f32, 3.0, (rows, 48), &Device::Cpu).expect("randn");
        let w = w
            .slice_assign(
                &[5..6, 0..48],
                &Tensor::zeros((1, 48), DType::F32, &Device::Cpu).expect("zeros"),
            )
            .expect("zero row")
            .to_dtype(DType::BF16)
            .expect("bf16");
        let (values, scales) = super::quantize_rows(&w).expect("blocks");
        let (whole_values, whole_scales) = super::quantize_block(&w).expect("whole");
        let bits = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("host")
        };
        assert_eq!(bits(&values), bits(&whole_values));
        assert_eq!(bits(&scales), bits(&whole_scales));
        assert_eq!(bits(&scales)[5], 1.0);
        assert_eq!(values.dims(), [rows, 48]);
    }
}
