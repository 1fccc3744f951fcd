//! Uneven parts along dim 0, padded to equal ones and back: NCCL's reduce-scatter and
//! all-gather move equal parts, while sequence parallelism may split rows unevenly.

use candle_core::{Result, Tensor};

/// `x`'s rows cut into parts of `sizes` rows, each padded with zero rows to the largest part:
/// `[parts · max, ..]`. `x` itself when the parts are equal.
pub(crate) fn pad_parts(x: &Tensor, sizes: &[usize]) -> Result<Tensor> {
    let max = sizes.iter().copied().max().unwrap_or(0);
    if sizes.iter().all(|&n| n == max) {
        return Ok(x.clone());
    }
    let mut parts = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in sizes {
        parts.push(x.narrow(0, at, n)?.pad_with_zeros(0, 0, max - n)?);
        at += n;
    }
    Tensor::cat(&parts, 0)
}

/// The inverse of [`pad_parts`]: from `[parts · max, ..]`, the first `sizes[p]` rows of each
/// part, joined. `padded` itself when the parts are equal.
pub(crate) fn unpad_parts(padded: &Tensor, sizes: &[usize]) -> Result<Tensor> {
    let max = sizes.iter().copied().max().unwrap_or(0);
    if sizes.iter().all(|&n| n == max) {
        return Ok(padded.clone());
    }
    let parts = sizes
        .iter()
        .enumerate()
        .map(|(p, &n)| padded.narrow(0, p * max, n))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2().expect("rows")
    }

    #[test]
    fn uneven_parts_pad_with_zero_rows_and_come_back() {
        // 5 rows [r, 10 r] as parts of 2, 1 and 2 rows.
        let x = Tensor::from_vec(
            (0..5).flat_map(|r| [r as f32, 10.0 * r as f32]).collect(),
            (5, 2),
            &Device::Cpu,
        )
        .expect("x");
        let sizes = [2, 1, 2];
        let padded = pad_parts(&x, &sizes).expect("pad");
        let zero = vec![0.0, 0.0];
        assert_eq!(
            rows(&padded),
            vec![
                vec![0.0, 0.0],
                vec![1.0, 10.0],
                vec![2.0, 20.0],
                zero.clone(),
                vec![3.0, 30.0],
                vec![4.0, 40.0],
            ]
        );
        assert_eq!(rows(&unpad_parts(&padded, &sizes).expect("unpad")), rows(&x));
    }

    #[test]
    fn equal_parts_are_left_alone() {
        let x = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .and_then(|t| t.reshape((6, 2)))
            .expect("x");
        for sizes in [&[3, 3][..], &[2, 2, 2], &[6]] {
            assert_eq!(rows(&pad_parts(&x, sizes).expect("pad")), rows(&x));
            assert_eq!(rows(&unpad_parts(&x, sizes).expect("unpad")), rows(&x));
        }
    }
}
