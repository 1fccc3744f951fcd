//! T5's relative position buckets, bidirectional (the encoder's).

/// The bucket of a key `relative` positions after its query (`key − query`), out of
/// `num_buckets` over `max_distance`: half the buckets for keys after the query; within each
/// half, exact buckets for the nearer half of the distances and logarithmic ones beyond, up to
/// `max_distance`, past which everything shares the last bucket. As transformers'
/// `UMT5Attention._relative_position_bucket` for an encoder.
pub fn relative_position_bucket(relative: i64, num_buckets: usize, max_distance: usize) -> usize {
    let half = num_buckets / 2;
    let offset = if relative > 0 { half } else { 0 };
    let distance = relative.unsigned_abs() as usize;
    let exact = half / 2;
    if distance < exact {
        return offset + distance;
    }
    // In f32 and truncated toward zero, as transformers computes it (its divisor is Python's
    // f64 `math.log`, taken to f32 by the tensor op).
    let divisor = (max_distance as f64 / exact as f64).ln() as f32;
    let log_ratio = (distance as f32 / exact as f32).ln() / divisor * (half - exact) as f32;
    offset + (exact + log_ratio as usize).min(half - 1)
}

/// The bucket of every key − query distance of a sequence of `tokens`, from −(tokens − 1) to
/// tokens − 1: what `tpinfer_kernels::softmax_relative_bias` looks each score's bias up by.
pub fn distance_buckets(tokens: usize, num_buckets: usize, max_distance: usize) -> Vec<u32> {
    let reach = tokens as i64 - 1;
    (-reach..=reach)
        .map(|relative| relative_position_bucket(relative, num_buckets, max_distance) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of transformers' `_relative_position_bucket(rel, bidirectional=True, 32, 128)`.
    #[test]
    fn buckets_match_t5s() {
        let cases = [
            (0, 0),
            (-1, 1),
            (1, 17),
            (-7, 7),
            (7, 23),
            (-8, 8),
            (8, 24),
            (-12, 9),
            (-20, 10),
            (-32, 12),
            (-64, 14),
            (-127, 15),
            (-128, 15),
            (-1000, 15),
            (1000, 31),
            (100, 31),
            (-16, 10),
        ];
        for (relative, bucket) in cases {
            assert_eq!(
                relative_position_bucket(relative, 32, 128),
                bucket,
                "relative {relative}"
            );
        }
    }
}
