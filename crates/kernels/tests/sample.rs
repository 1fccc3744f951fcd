//! The token choice of `sample_rows` on CPU tensors (the arithmetic of the CUDA kernel):
//! greedy rows, the distribution of sampled draws, top-k and top-p sets, the repetition
//! penalty, and draws that do not depend on the batch around a row.

// Helpers of these tests panic on failure, as the tests themselves do.
#![allow(clippy::expect_used)]

use candle_core::{Device, Tensor};
use tpinfer_kernels::{sample_rows, RowSampling};

fn logits(rows: &[&[f32]]) -> Tensor {
    let vocab = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), vocab), &Device::Cpu).expect("logits")
}

fn ids(x: &Tensor, rows: &[RowSampling<'_>]) -> Vec<u32> {
    sample_rows(x, rows).expect("sample").to_vec1().expect("ids")
}

/// How often each token comes out over `draws` draws of one row.
fn counts(row: &[f32], sampling: RowSampling<'_>, draws: u64) -> Vec<u64> {
    let x = logits(&[row]);
    let mut counts = vec![0u64; row.len()];
    for draw in 0..draws {
        let id = ids(&x, &[RowSampling { draw, ..sampling }])[0];
        counts[id as usize] += 1;
    }
    counts
}

/// The softmax of `row / temperature` over the tokens `kept`.
fn softmax(row: &[f32], temperature: f32, kept: &[usize]) -> Vec<f64> {
    let e: Vec<f64> = (0..row.len())
        .map(|i| match kept.contains(&i) {
            true => ((row[i] / temperature) as f64).exp(),
            false => 0.0,
        })
        .collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// Every frequency within five standard deviations of its probability.
fn assert_follows(counts: &[u64], probs: &[f64], what: &str) {
    let n: u64 = counts.iter().sum();
    for (i, (&c, &p)) in counts.iter().zip(probs).enumerate() {
        let sd = (n as f64 * p * (1.0 - p)).sqrt().max(1.0);
        let off = (c as f64 - n as f64 * p).abs();
        assert!(
            off <= 5.0 * sd,
            "{what}: token {i} came {c} times of {n}, expected {:.0}",
            n as f64 * p
        );
    }
}

const ROW: [f32; 6] = [1.0, 2.5, 0.5, 2.0, -1.0, 0.0];

fn sampled(temperature: f32) -> RowSampling<'static> {
    RowSampling {
        temperature,
        seed: 7,
        ..RowSampling::GREEDY
    }
}

#[test]
fn greedy_rows_take_the_first_largest_logit() {
    let x = logits(&[
        &[0.0, 3.0, 1.0, 3.0],
        &[f32::NAN, -1.0, -2.0, -0.5],
        &[5.0, 1.0, 1.0, 1.0],
    ]);
    let greedy = [RowSampling::GREEDY; 3];
    assert_eq!(ids(&x, &greedy), vec![1, 3, 0]);
}

#[test]
fn sampled_draws_follow_the_softmax_of_the_scaled_logits() {
    let all: Vec<usize> = (0..ROW.len()).collect();
    for temperature in [0.7, 1.0, 2.0] {
        let counts = counts(&ROW, sampled(temperature), 20_000);
        assert_follows(&counts, &softmax(&ROW, temperature, &all), &format!("T {temperature}"));
    }
}

#[test]
fn top_k_and_top_p_keep_the_most_likely_tokens_and_draw_among_them() {
    // Two most likely: tokens 1 and 3, in their own proportion.
    let top_k = RowSampling {
        top_k: Some(2),
        ..sampled(1.0)
    };
    let c = counts(&ROW, top_k, 10_000);
    assert_follows(&c, &softmax(&ROW, 1.0, &[1, 3]), "top_k 2");
    // At T 1 the probabilities are about .48, .29, .11, .07, .04, .02 (tokens 1, 3, 0, 2, 5,
    // 4): top_p .8 needs tokens 1, 3 and 0; .45 token 1 alone.
    let p = softmax(&ROW, 1.0, &[0, 1, 2, 3, 4, 5]);
    assert!(p[1] + p[3] < 0.8 && p[1] + p[3] + p[0] > 0.8 && p[1] > 0.45);
    let top_p = RowSampling {
        top_p: Some(0.8),
        ..sampled(1.0)
    };
    let c = counts(&ROW, top_p, 10_000);
    assert_follows(&c, &softmax(&ROW, 1.0, &[0, 1, 3]), "top_p 0.8");
    let narrow = RowSampling {
        top_p: Some(0.45),
        ..sampled(1.0)
    };
    assert_eq!(counts(&ROW, narrow, 200)[1], 200, "top_p 0.45 keeps token 1 alone");
    // Top-k first, then top-p over what it kept: .7 of the mass of tokens 1, 3 and 0 needs 1
    // and 3.
    let both = RowSampling {
        top_k: Some(3),
        top_p: Some(0.7),
        ..sampled(1.0)
    };
    let c = counts(&ROW, both, 10_000);
    assert_follows(&c, &softmax(&ROW, 1.0, &[1, 3]), "top_k 3, top_p 0.7");
}

#[test]
fn a_seeded_row_draws_the_same_token_alone_and_in_any_batch() {
    let row = sampled(1.5);
    let other = RowSampling {
        seed: 99,
        top_k: Some(3),
        ..sampled(0.8)
    };
    let flat = [0.0f32; 6];
    for draw in 0..50 {
        let row = RowSampling { draw, ..row };
        let alone = ids(&logits(&[&ROW]), &[row])[0];
        let batched = ids(&logits(&[&flat, &ROW, &ROW]), &[RowSampling::GREEDY, other, row]);
        assert_eq!(batched[2], alone, "draw {draw}");
    }
    // Another seed draws another sequence.
    let tokens = |seed: u64| -> Vec<u32> {
        (0..50)
            .map(|draw| ids(&logits(&[&ROW]), &[RowSampling { seed, draw, ..row }])[0])
            .collect()
    };
    assert_eq!(tokens(7), tokens(7));
    assert_ne!(tokens(7), tokens(8));
}

#[test]
fn the_repetition_penalty_applies_once_per_seen_token() {
    // Token 1 (2.5) penalized by 2 falls below token 3 (2.0); seen twice, it is divided once.
    let seen = [1u32, 1, 4];
    let penalized = RowSampling {
        repetition_penalty: 2.0,
        penalized: &seen,
        ..RowSampling::GREEDY
    };
    let x = logits(&[&ROW]);
    assert_eq!(ids(&x, &[penalized]), vec![3]);
    let mild = RowSampling {
        repetition_penalty: 1.2,
        ..penalized
    };
    assert_eq!(ids(&x, &[mild]), vec![1], "2.5 / 1.2 still tops 2.0");
    // The caller's logits are left as they were.
    assert_eq!(x.to_vec2::<f32>().expect("x")[0], ROW.to_vec());
    let past = RowSampling {
        penalized: &[6],
        ..penalized
    };
    assert!(sample_rows(&x, &[past]).is_err(), "a token past the vocabulary");
    assert!(
        sample_rows(&x, &[penalized, penalized]).is_err(),
        "two parameter rows for one row"
    );
}

/// OpenAI's penalties on the generated tokens, after the repetition penalty: token 1 (2.5),
/// generated twice, loses `2 · frequency + presence`; a token never generated keeps its
/// logit.
#[test]
fn frequency_and_presence_penalties_count_the_generated_tokens() {
    let x = logits(&[&ROW]);
    let generated = [1u32, 1, 4];
    let with = |frequency_penalty: f32, presence_penalty: f32| RowSampling {
        frequency_penalty,
        presence_penalty,
        generated: &generated,
        ..RowSampling::GREEDY
    };
    // 2.5 − 2 · 0.2 = 2.1 still tops 2.0; − 2 · 0.3 = 1.9 does not.
    assert_eq!(ids(&x, &[with(0.2, 0.0)]), vec![1]);
    assert_eq!(ids(&x, &[with(0.3, 0.0)]), vec![3]);
    // Presence counts a token once: 2.5 − 0.45 = 2.05 tops 2.0, − 0.55 = 1.95 does not.
    assert_eq!(ids(&x, &[with(0.0, 0.45)]), vec![1]);
    assert_eq!(ids(&x, &[with(0.0, 0.55)]), vec![3]);
    // Both: 2.5 − 2 · 0.1 − 0.25 = 2.05 tops 2.0, − 0.35 = 1.95 does not.
    assert_eq!(ids(&x, &[with(0.1, 0.25)]), vec![1]);
    assert_eq!(ids(&x, &[with(0.1, 0.35)]), vec![3]);
    // Negative penalties favour what was generated: token 4 (−1.0), generated once, rises
    // to −1.0 + 2.0 + 1.6 = 2.6 past 2.5, and not with 1.4 (2.4).
    let once = [4u32];
    let favour = |presence_penalty: f32| RowSampling {
        generated: &once,
        ..with(-2.0, presence_penalty)
    };
    assert_eq!(ids(&x, &[favour(-1.6)]), vec![4]);
    assert_eq!(ids(&x, &[favour(-1.4)]), vec![1]);
    // After the repetition penalty: 2.5 / 1.2 = 2.083 − 0.1 = 1.983 falls below 2.0.
    let both = RowSampling {
        repetition_penalty: 1.2,
        penalized: &generated,
        ..with(0.05, 0.0)
    };
    assert_eq!(ids(&x, &[both]), vec![3]);
    assert_eq!(
        ids(
            &x,
            &[RowSampling {
                frequency_penalty: 0.0,
                ..both
            }]
        ),
        vec![1]
    );
    // The prompt is not looked at: tokens only in `penalized` keep their logit here.
    let prompt_only = RowSampling {
        penalized: &generated,
        generated: &[],
        ..with(5.0, 5.0)
    };
    assert_eq!(ids(&x, &[prompt_only]), vec![1]);
}

/// OpenAI's `logit_bias`, added after the penalties: −100 bans a token, a positive bias lifts
/// one; after a repetition penalty of 2 token 1's 2.5 is 1.25, and + 1 makes 2.25, above
/// token 3's 2.0 (biased first, it would be 3.5 / 2 = 1.75, below).
#[test]
fn a_logit_bias_is_added_after_the_penalties() {
    let x = logits(&[&ROW]);
    let biased = |logit_bias: &'static [(u32, f32)]| RowSampling {
        logit_bias,
        ..RowSampling::GREEDY
    };
    assert_eq!(ids(&x, &[biased(&[(1, -100.0)])]), vec![3]);
    assert_eq!(ids(&x, &[biased(&[(0, 1.6)])]), vec![0], "1.0 + 1.6 = 2.6 tops 2.5");
    assert_eq!(ids(&x, &[biased(&[(0, 1.4)])]), vec![1]);
    let seen = [1u32];
    let after_penalty = RowSampling {
        repetition_penalty: 2.0,
        penalized: &seen,
        ..biased(&[(1, 1.0)])
    };
    assert_eq!(ids(&x, &[after_penalty]), vec![1]);
    let past = biased(&[(6, 1.0)]);
    assert!(sample_rows(&x, &[past]).is_err(), "a token past the vocabulary");
}

/// A bias on every token of a 128K vocabulary and 8K generated tokens: the penalized set is
/// built in O(n log n) (a request could name the whole vocabulary; a quadratic pass took
/// minutes), and the bias still decides: the token biased most wins.
#[test]
fn a_bias_on_every_token_of_a_large_vocabulary_is_quick() {
    let vocab = 131_072u32;
    let x = Tensor::zeros((1, vocab as usize), candle_core::DType::F32, &Device::Cpu).expect("logits");
    let bias: Vec<(u32, f32)> = (0..vocab).map(|t| (t, if t == 77_777 { 5.0 } else { -1.0 })).collect();
    let generated: Vec<u32> = (0..8192u32).map(|i| i * 13 % vocab).collect();
    let started = std::time::Instant::now();
    let row = RowSampling {
        logit_bias: &bias,
        frequency_penalty: 0.5,
        generated: &generated,
        ..RowSampling::GREEDY
    };
    assert_eq!(ids(&x, &[row]), vec![77_777]);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
