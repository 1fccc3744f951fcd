//! FP8 E4M3 matrices with one f32 scale per output row, as compressed-tensors checkpoints
//! store them and as `--quantize fp8` makes them.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use float8::F8E4M3;

use crate::{ShardSpec, WeightError, WeightStore};

/// The largest finite E4M3 magnitude.
const E4M3_MAX: f64 = 448.0;

/// `1 / 448` as an f32: a scale is `amax · (1 / 448)`, the product candle's `amax / 448`
/// makes, so that scales keep the bits of every checkpoint quantized before.
const INV_E4M3_MAX: f32 = (1.0 / E4M3_MAX) as f32;

/// Rows a worker of [`quantize_rows`] takes at a time.
const ROWS_PER_TASK: usize = 256;

/// `w` (`[rows, cols]`) as E4M3 values and one f32 scale per row, `w ≈ values · scale`: each
/// row scaled so that its largest magnitude is E4M3's largest (an all-zero row by 1; a row with
/// a non-finite value gets a NaN scale, which the loader refuses). Blocks of rows on rayon's
/// threads, each row read twice (its largest magnitude, then its values) and written once,
/// rounded by [`e4m3_bits`]: a third of the time of candle's ops, which took a pass and a
/// buffer for each step (to f32, abs, max, divide, round) and rounded through f64.
pub fn quantize_rows(w: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, cols) = w.dims2()?;
    if cols == 0 {
        candle_core::bail!("quantize_rows: a matrix of {rows} rows has no columns to scale")
    }
    let w = match w.dtype() {
        DType::BF16 | DType::F16 | DType::F32 => w.contiguous()?,
        _ => w.to_dtype(DType::F32)?,
    };
    let (storage, layout) = w.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("quantize_rows reads a matrix on the CPU, not on {:?}", w.device())
    };
    let range = layout.start_offset()..layout.start_offset() + rows * cols;
    let (values, scales) = match cpu {
        CpuStorage::BF16(data) => quantize_slice(&data[range], rows, cols, half::bf16::to_f32),
        CpuStorage::F16(data) => quantize_slice(&data[range], rows, cols, half::f16::to_f32),
        CpuStorage::F32(data) => quantize_slice(&data[range], rows, cols, |v| v),
        _ => candle_core::bail!("quantize_rows reads bf16, f16 or f32, not {:?}", w.dtype()),
    };
    Ok((
        Tensor::from_vec(values, (rows, cols), &Device::Cpu)?,
        Tensor::from_vec(scales, rows, &Device::Cpu)?,
    ))
}

/// [`quantize_rows`] over row-major `data` of `rows` × `cols` (above 0).
fn quantize_slice<T: Copy + Sync>(
    data: &[T],
    rows: usize,
    cols: usize,
    to_f32: impl Fn(T) -> f32 + Sync,
) -> (Vec<F8E4M3>, Vec<f32>) {
    use rayon::prelude::*;
    let mut values = vec![F8E4M3::ZERO; data.len()];
    let mut scales = vec![0f32; rows];
    let block = ROWS_PER_TASK * cols;
    values
        .par_chunks_mut(block)
        .zip(scales.par_chunks_mut(ROWS_PER_TASK))
        .zip(data.par_chunks(block))
        .for_each(|((values, scales), data)| {
            for ((values, scale), row) in values.chunks_mut(cols).zip(scales).zip(data.chunks(cols)) {
                let (amax, finite) = row.iter().fold((0f32, true), |(amax, finite), &v| {
                    let v = to_f32(v);
                    (amax.max(v.abs()), finite && v.is_finite())
                });
                *scale = match (finite, amax) {
                    (false, _) => f32::NAN,
                    (true, 0.0) => 1.0,
                    (true, amax) => amax * INV_E4M3_MAX,
                };
                for (q, &v) in values.iter_mut().zip(row) {
                    *q = F8E4M3::from_bits(e4m3_bits(to_f32(v) / *scale));
                }
            }
        });
    (values, scales)
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

/// `x` rounded to E4M3 to nearest, ties to even, saturating at ±448, NaN to NaN: the bits
/// `F8E4M3::from_f32` gives, by f32 arithmetic instead of its branches on f64.
fn e4m3_bits(x: f32) -> u8 {
    const MIN_NORMAL: u32 = 121 << 23; // 2^-6, E4M3's least normal
    const SATURATED: u32 = 0x43e8_0000; // 464, the midpoint of 448 and 480: ties go to 448
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    let magnitude = if abs > 0x7f80_0000 {
        0x7f
    } else if abs > SATURATED {
        0x7e
    } else if abs < MIN_NORMAL {
        // Adding 2^14 leaves f32 a unit of 2^-9, E4M3's least subnormal: the hardware's
        // rounding to nearest even makes the subnormal (or, at 2^-6, the least normal).
        let shifted = f32::from_bits(abs) + 16384.0;
        (shifted.to_bits() - 16384f32.to_bits()) as u8
    } else {
        // Rebias the exponent (127 to 7), then round the 20 bits dropped to nearest even.
        let odd = (abs >> 20) & 1;
        let rounded = abs.wrapping_sub((127 - 7) << 23) + 0x7_ffff + odd;
        (rounded >> 20) as u8
    };
    sign | magnitude
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    /// The quantization written as candle's ops (as `quantize_rows` was before it read each
    /// row once): scales `max|w| / 448` per row, 1 for an all-zero row, values `w / scale`.
    fn quantized_by_ops(w: &Tensor) -> (Tensor, Tensor) {
        let w = w.to_dtype(DType::F32).expect("f32");
        let amax = w.abs().and_then(|a| a.max_keepdim(1)).expect("amax");
        let zero = amax.eq(0f64).expect("eq");
        let ones = amax.ones_like().expect("ones");
        let scales = zero
            .where_cond(&ones, &(amax / super::E4M3_MAX).expect("div"))
            .expect("where");
        let values = w
            .broadcast_div(&scales)
            .and_then(|v| v.to_dtype(DType::F8E4M3))
            .expect("e4m3");
        (values, scales.squeeze(1).expect("squeeze"))
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("host")
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    /// Rows in blocks over rayon's threads (the last block short) equal the ops' result bit
    /// for bit, from bf16, f16 and f32, across magnitudes from E4M3's subnormals to f16's
    /// largest, an all-zero row scaled by 1.
    #[test]
    fn rows_read_once_equal_the_quantization_by_ops_bit_for_bit() {
        let rows = 2 * super::ROWS_PER_TASK + 3;
        let cols = 48;
        // Rows from e^-12 to e^8 times the normal: scales across f16's range, its subnormals too.
        let magnitudes: Vec<f32> = (0..rows).map(|r| ((r % 11) as f32 * 2.0 - 12.0).exp()).collect();
        let magnitudes = Tensor::from_vec(magnitudes, (rows, 1), &Device::Cpu).expect("magnitudes");
        let w = Tensor::randn(0f32, 3.0, (rows, cols), &Device::Cpu)
            .and_then(|w| w.broadcast_mul(&magnitudes))
            .and_then(|w| w.slice_assign(&[5..6, 0..cols], &Tensor::zeros((1, cols), DType::F32, &Device::Cpu)?))
            .expect("weights");
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let w = w.to_dtype(dtype).expect("dtype");
            let (values, scales) = super::quantize_rows(&w).expect("quantize");
            let (values_by_ops, scales_by_ops) = quantized_by_ops(&w);
            assert_eq!(values.dims(), [rows, cols]);
            assert_eq!(values.dtype(), DType::F8E4M3);
            for (what, got, want) in [("values", &values, &values_by_ops), ("scales", &scales, &scales_by_ops)] {
                let (got, want) = (bits(got), bits(want));
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(differ, 0, "{dtype:?}: {differ} of {} {what} differ", want.len());
            }
            assert_eq!(f32::from_bits(bits(&scales)[5]), 1.0);
        }
    }

    /// `e4m3_bits` gives `F8E4M3::from_f32`'s bits for every exponent and sign, every one of
    /// the 11 high mantissa bits, and low bits at and around each rounding tie: every boundary
    /// of the normal rounding (20 bits dropped) and of the subnormals' (more).
    #[test]
    fn e4m3_bits_equal_float8s_rounding_at_every_boundary() {
        let mut checked = 0;
        for high in 0u32..1 << 20 {
            for low in [0u32, 1, 0x7ff, 0x800, 0x801, 0xfff] {
                let x = f32::from_bits(high << 12 | low);
                let want = float8::F8E4M3::from_f32(x).to_bits();
                assert_eq!(super::e4m3_bits(x), want, "{x:e} ({:#010x})", x.to_bits());
                checked += 1;
            }
        }
        assert_eq!(checked, 6 << 20);
    }

    /// A row holding NaN or an infinity gets a NaN scale (which the loader refuses by the
    /// weight's name); the other rows are untouched.
    #[test]
    fn a_row_with_a_non_finite_value_gets_a_nan_scale() {
        let w = Tensor::new(
            &[[1.0f32, 2.0], [f32::NAN, 1.0], [3.0, f32::NEG_INFINITY], [-4.0, 0.5]],
            &Device::Cpu,
        )
        .expect("w");
        let (_, scales) = super::quantize_rows(&w).expect("quantize");
        let scales = scales.to_vec1::<f32>().expect("scales");
        assert_eq!(scales[0], 2.0 * super::INV_E4M3_MAX);
        assert!(scales[1].is_nan() && scales[2].is_nan(), "{scales:?}");
        assert_eq!(scales[3], 4.0 * super::INV_E4M3_MAX);
    }
}
