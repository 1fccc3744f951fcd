//! Log-probabilities of generated tokens, as OpenAI's `logprobs` reports them.

/// The most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model, and the most likely tokens' at that
/// step: the log-softmax of the raw logits, before temperature, top-k/top-p and the repetition
/// penalty shape the choice (as vLLM reports them).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: the lower id first), with their
    /// log-probabilities.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// From one step's `logits` over the vocabulary: `token`'s, and the `top` most likely.
    pub(crate) fn of(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
        let log_norm = f64::from(max) + sum.ln();
        let logprob = |id: u32| {
            logits
                .get(id as usize)
                .map_or(f32::NEG_INFINITY, |&x| (f64::from(x) - log_norm) as f32)
        };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        let top = top.min(ids.len());
        if top > 0 && top < ids.len() {
            ids.select_nth_unstable_by(top - 1, order);
        }
        ids.truncate(top);
        ids.sort_unstable_by(order);
        Self {
            logprob: logprob(token),
            top: ids.into_iter().map(|id| (id, logprob(id))).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_come_most_likely_first() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let got = TokenLogprobs::of(&logits, 4, 3);
        let norm: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        let want = |i: usize| (f64::from(logits[i]) - norm) as f32;
        assert!((got.logprob - want(4)).abs() < 1e-6);
        // Tokens 1 and 3 tie: the lower id first.
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        for &(id, lp) in &got.top {
            assert!((lp - want(id as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..5).map(|i| f64::from(want(i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        // None asked, or more than the vocabulary.
        assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
        assert_eq!(TokenLogprobs::of(&logits, 0, 9).top.len(), 5);
    }

    #[test]
    fn a_huge_logit_does_not_overflow() {
        let got = TokenLogprobs::of(&[1e30, 0.0], 1, 1);
        assert_eq!(got.top, [(0, 0.0)]);
        assert_eq!(got.logprob, -1e30);
    }
}
