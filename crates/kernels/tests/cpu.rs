//! The CPU twins of the fused ops against the same math written with candle's own ops
//! (f32, so agreement must be close to rounding).

// Helpers of these tests panic on failure, as the tests themselves do.
#![allow(clippy::expect_used)]

use candle_core::{DType, Device, Tensor, D};
use tpinfer_kernels::{
    add_rms_norm, argmax, decode_scratch_bytes, embed_owned_rows, flash_attention, flash_attention_cached, fp8_linear,
    gated_residual, gelu_tanh_mul, gemv, gemv_gate_up_silu, gemv_gate_up_silu_into, gemv_into, gemv_residual_into,
    gemv_residual_squares, gemv_tiled, layer_norm, linear_bias, linear_bias_into, mmvq_covers, mmvq_takes,
    paged_decode_attention, q8_1_row, q8_1_row_bytes, quantize_row_q8_1, residual_sum, rotary_qkv, rotary_qkv_into,
    rotary_qkv_paged, row_sum_squares, scale_rows_cols, silu_mul, silu_mul_into, softmax_relative_bias, write_u32s,
    ColumnTable, DecodeRows, DecodeScratch, GemvRow, HeadNorms, QueryGroups, ResidualNorm, RowWeight, RowsAt,
};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    // A small LCG: deterministic inputs without a random-number crate.
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).expect("tensor")
}

/// A position tensor as the kernels read it: one u32.
fn position(value: usize) -> Tensor {
    Tensor::new(&[value as u32], &Device::Cpu).expect("position")
}

fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b)
        .and_then(|d| d.sqr()?.sum_all()?.to_scalar::<f32>())
        .expect("diff");
    let norm = b.sqr().and_then(|n| n.sum_all()?.to_scalar::<f32>()).expect("norm");
    (diff / norm).sqrt()
}

/// Shapes below and above the work at which the CPU ops go parallel (2¹⁶ elements).
const SHAPES: [(usize, usize); 2] = [(37, 96), (300, 256)];

#[test]
fn row_wise_ops_match_candle() {
    for (rows, cols) in SHAPES {
        row_wise_ops_match_candle_at(rows, cols);
    }
}

fn row_wise_ops_match_candle_at(rows: usize, cols: usize) {
    let (x, y) = (randn(&[rows, cols], 1), randn(&[rows, cols], 2));
    let (w, b, g) = (randn(&[cols], 3), randn(&[cols], 4), randn(&[cols], 5));
    let r = (randn(&[rows, 1], 6).abs().expect("abs") + 0.5).expect("rows");

    let want = (&x + y.broadcast_mul(&g).expect("mul")).expect("add");
    assert!(
        rel(
            &gated_residual(&x, &y, ColumnTable::every_row(&g)).expect("gated"),
            &want
        ) < 1e-6
    );

    let want = x.sqr().and_then(|s| s.sum_keepdim(1)).expect("sum");
    assert!(rel(&row_sum_squares(&x).expect("sums"), &want) < 1e-6);

    let want = x.broadcast_mul(&r).and_then(|t| t.broadcast_mul(&w)).expect("scale");
    assert!(rel(&scale_rows_cols(&x, &r, &w, None).expect("scale"), &want) < 1e-6);

    // Rows of a wider matrix, read in place; then RoPE over heads of 16 after the scaling,
    // against candle's interleaved RoPE of the scaled rows.
    let wide = randn(&[rows, 2 * cols], 8);
    let view = wide.narrow(1, cols, cols).expect("view");
    let want = view.sqr().and_then(|s| s.sum_keepdim(1)).expect("sum");
    assert!(rel(&row_sum_squares(&view).expect("sums"), &want) < 1e-6);
    let (pairs, heads) = (8, cols / 16);
    let angles = (randn(&[rows, pairs], 9) * 3.0).expect("angles");
    let (cos, sin) = (angles.cos().expect("cos"), angles.sin().expect("sin"));
    let table = Tensor::stack(&[&cos, &sin], 1).expect("table");
    let scaled = view.broadcast_mul(&r).and_then(|t| t.broadcast_mul(&w)).expect("scale");
    let want = candle_nn::rotary_emb::rope_i(
        &scaled.reshape((rows, heads, 1, 2 * pairs)).expect("heads"),
        &cos.reshape((rows, 1, pairs)).expect("cos"),
        &sin.reshape((rows, 1, pairs)).expect("sin"),
    )
    .and_then(|t| t.reshape((rows, cols)))
    .expect("rope");
    let got = scale_rows_cols(&view, &r, &w, Some(&table)).expect("scale + rope");
    assert!(rel(&got, &want) < 1e-6, "{}", rel(&got, &want));

    let mean = x.mean_keepdim(1).expect("mean");
    let centered = x.broadcast_sub(&mean).expect("center");
    let var = centered.sqr().and_then(|c| c.mean_keepdim(1)).expect("var");
    let normed = centered
        .broadcast_div(&(var + 1e-6).and_then(|v| v.sqrt()).expect("std"))
        .expect("div");
    let want = normed
        .broadcast_mul(&w)
        .and_then(|t| t.broadcast_add(&b))
        .expect("affine");
    let (wt, bt) = (ColumnTable::every_row(&w), ColumnTable::every_row(&b));
    assert!(rel(&layer_norm(&x, wt, bt, 1e-6, DType::F32).expect("norm"), &want) < 1e-5);

    // 16-bit storage, f32 arithmetic: the result is the f32 result rounded once.
    let xb = x.to_dtype(DType::BF16).expect("bf16");
    let yb = y.to_dtype(DType::BF16).expect("bf16");
    let exact = (xb.to_dtype(DType::F32).expect("f32")
        + yb.to_dtype(DType::F32).expect("f32").broadcast_mul(&g).expect("mul"))
    .expect("add");
    let got = gated_residual(&xb, &yb, ColumnTable::every_row(&g))
        .expect("gated")
        .to_dtype(DType::F32)
        .expect("f32");
    assert!(rel(&got, &exact) < 4e-3);

    let narrow = y.narrow(1, 0, cols - 1).expect("narrow");
    assert!(gated_residual(&x, &narrow, ColumnTable::every_row(&g)).is_err());
    assert!(layer_norm(&x.flatten_all().expect("flat"), wt, bt, 1e-6, DType::F32).is_err());
}

/// Tables of two rows serve the rows before the split and the rest (S2V's video rows and its
/// timestep-0 rows), as the op on each part joined would; an f32 stream takes bf16 parts and
/// writes a bf16 norm, rounded once.
#[test]
fn split_tables_and_a_wider_stream_equal_the_parts_apart() {
    let (rows, cols, split) = (37, 96, 29);
    let (x, y) = (randn(&[rows, cols], 11), randn(&[rows, cols], 12));
    let (gates, weights, biases) = (randn(&[2, cols], 13), randn(&[2, cols], 14), randn(&[2, cols], 15));
    let row = |t: &Tensor, i: usize| t.get(i).expect("row");
    let apart = |f: &dyn Fn(&Tensor, Option<&Tensor>, usize) -> Tensor| {
        let first = f(
            &x.narrow(0, 0, split).expect("first"),
            Some(&y.narrow(0, 0, split).expect("y")),
            0,
        );
        let rest = f(
            &x.narrow(0, split, rows - split).expect("rest"),
            Some(&y.narrow(0, split, rows - split).expect("y")),
            1,
        );
        Tensor::cat(&[first, rest], 0).expect("cat")
    };

    let want = apart(&|x, y, i| {
        let y = y.expect("y");
        gated_residual(x, y, ColumnTable::every_row(&row(&gates, i))).expect("gated")
    });
    let got = residual_sum(&x, std::slice::from_ref(&y), Some(ColumnTable::split_at(&gates, split))).expect("split");
    assert_eq!(rel(&got, &want), 0.0);

    // Parts that bf16 holds but whose sum in bf16 would round (y + 1 + 2⁻⁹).
    let parts = [
        y.clone(),
        (y.ones_like().expect("ones") * (1.0 + 1.0 / 512.0)).expect("ones"),
    ];
    let narrow = parts.map(|p| p.to_dtype(DType::BF16).expect("bf16"));
    let widened = narrow.clone().map(|p| p.to_dtype(DType::F32).expect("f32"));
    let want = residual_sum(&x, &widened, None).expect("widened");
    let got = residual_sum(&x, &narrow, None).expect("bf16 parts");
    assert_eq!(got.dtype(), DType::F32);
    assert_eq!(rel(&got, &want), 0.0);

    let want = apart(&|x, _, i| {
        let (w, b) = (row(&weights, i), row(&biases, i));
        layer_norm(
            x,
            ColumnTable::every_row(&w),
            ColumnTable::every_row(&b),
            1e-6,
            DType::F32,
        )
        .and_then(|t| t.to_dtype(DType::BF16))
        .expect("norm")
    });
    let (w, b) = (
        ColumnTable::split_at(&weights, split),
        ColumnTable::split_at(&biases, split),
    );
    let got = layer_norm(&x, w, b, 1e-6, DType::BF16).expect("split norm");
    assert_eq!(got.dtype(), DType::BF16);
    let (got, want) = (
        got.to_dtype(DType::F32).expect("f32"),
        want.to_dtype(DType::F32).expect("f32"),
    );
    assert_eq!(rel(&got, &want), 0.0);

    assert!(
        layer_norm(&x, w, ColumnTable::every_row(&row(&biases, 0)), 1e-6, DType::F32).is_err(),
        "tables split apart are refused"
    );
    assert!(
        residual_sum(&x, std::slice::from_ref(&y), Some(ColumnTable::every_row(&gates))).is_err(),
        "a two-row table for every row is refused"
    );
}

#[test]
fn residual_add_and_rms_norm_match_candle() {
    for (rows, cols) in SHAPES {
        residual_add_and_rms_norm_match_candle_at(rows, cols);
    }
}

fn residual_add_and_rms_norm_match_candle_at(rows: usize, cols: usize) {
    let (x, y, w) = (randn(&[rows, cols], 10), randn(&[rows, cols], 11), randn(&[cols], 12));
    let sum = (&x + &y).expect("sum");
    let rms = sum
        .sqr()
        .and_then(|s| s.mean_keepdim(1))
        .and_then(|m| (m + 1e-5)?.sqrt())
        .expect("rms");
    let want = sum.broadcast_div(&rms).and_then(|n| n.broadcast_mul(&w)).expect("norm");
    let (got_sum, got_norm) = add_rms_norm(&x, &y, &w, 1e-5).expect("add_rms_norm");
    assert_eq!(rel(&got_sum, &sum), 0.0);
    assert!(rel(&got_norm, &want) < 1e-6);
    assert!(add_rms_norm(&x, &y, &randn(&[cols - 1], 12), 1e-5).is_err());
}

#[test]
fn silu_product_matches_candle() {
    for (rows, cols) in SHAPES {
        silu_product_matches_candle_at(rows, cols);
    }
}

fn silu_product_matches_candle_at(rows: usize, cols: usize) {
    let x = randn(&[rows, cols], 7);
    let half = cols / 2;
    let (g, u) = (
        x.narrow(1, 0, half).expect("gate"),
        x.narrow(1, half, half).expect("up"),
    );
    let sigmoid = (g.neg().and_then(|n| n.exp()).expect("exp") + 1.0).expect("denominator");
    let want = (g.div(&sigmoid).expect("silu") * &u).expect("product");
    assert!(rel(&silu_mul(&x).expect("silu_mul"), &want) < 1e-6);
    assert!(silu_mul(&randn(&[rows, cols - 1], 7)).is_err());
    // Written into a buffer, the same values; an output of the wrong width or dtype is refused
    // and left as it was.
    let out = Tensor::zeros((rows, half), DType::F32, &Device::Cpu).expect("out");
    silu_mul_into(&x, &out).expect("silu_mul_into");
    assert_eq!(rel(&out, &silu_mul(&x).expect("silu_mul")), 0.0);
    let narrow = Tensor::zeros((rows, half - 1), DType::F32, &Device::Cpu).expect("narrow");
    assert!(silu_mul_into(&x, &narrow).is_err());
    let wrong_dtype = Tensor::zeros((rows, half), DType::BF16, &Device::Cpu).expect("bf16");
    assert!(silu_mul_into(&x, &wrong_dtype).is_err());
    assert_eq!(
        narrow
            .abs()
            .and_then(|a| a.sum_all())
            .and_then(|s| s.to_scalar::<f32>())
            .expect("sum"),
        0.0
    );
}

/// candle's MMVQ kernels read a row quantized to Q8_1 as candle pads it: 512 values at a
/// time, 36 bytes a block of 32. On the CPU a GGML weight never takes that path.
#[test]
fn a_q8_1_row_is_padded_to_512_values_and_cpu_blocks_stay_off_mmvq() {
    assert_eq!(q8_1_row_bytes(4096), 4096 / 32 * 36);
    assert_eq!(q8_1_row_bytes(14336), 14336 / 32 * 36);
    assert_eq!(q8_1_row_bytes(576), 1024 / 32 * 36);
    assert_eq!(q8_1_row_bytes(1), 512 / 32 * 36);
    let w = candle_core::quantized::QTensor::quantize(&randn(&[8, 256], 3), candle_core::quantized::GgmlDType::Q4K)
        .expect("Q4_K");
    assert!(!mmvq_takes(&w));
    assert!(!mmvq_covers(&w, &randn(&[1, 256], 4)));
    let q8 = q8_1_row(256, &Device::Cpu).expect("row");
    assert_eq!(q8.elem_count(), q8_1_row_bytes(256));
    assert!(quantize_row_q8_1(&randn(&[1, 256], 4), &q8).is_err());
}

#[test]
fn the_gelu_product_is_candles_gelu_times_up() {
    let (rows, cols) = (5, 2 * 37);
    let x = (randn(&[rows, cols], 11) * 3.0).expect("scale");
    let (g, u) = (
        x.narrow(1, 0, cols / 2).expect("gate"),
        x.narrow(1, cols / 2, cols / 2).expect("up"),
    );
    let want = (g.gelu().expect("gelu") * &u).expect("product");
    assert!(rel(&gelu_tanh_mul(&x).expect("gelu_tanh_mul"), &want) < 1e-6);
    assert!(gelu_tanh_mul(&randn(&[rows, cols - 1], 7)).is_err());
}

/// T5's biased softmax: the bias gathered per query × key from the distance buckets, added to
/// the scores, softmax over keys, as candle's ops compute it.
#[test]
fn the_relative_bias_softmax_is_the_gathered_bias_added_then_softmax() {
    let (heads, queries, keys, buckets) = (3, 5, 7, 4);
    let scores = (randn(&[heads, queries, keys], 3) * 4.0).expect("scores");
    let table = randn(&[buckets, heads], 5);
    let distance: Vec<u32> = (0..queries + keys - 1)
        .map(|i| ((i * 7 + 3) % buckets) as u32)
        .collect();
    let grid: Vec<u32> = (0..queries)
        .flat_map(|q| (0..keys).map(move |k| k + queries - 1 - q))
        .map(|i| distance[i])
        .collect();
    let grid = Tensor::from_vec(grid, queries * keys, &Device::Cpu).expect("grid");
    let bias = table
        .index_select(&grid, 0)
        .and_then(|b| b.reshape((queries, keys, heads))?.permute((2, 0, 1)))
        .expect("bias");
    let want = candle_nn::ops::softmax_last_dim(&(&scores + bias).expect("sum")).expect("softmax");
    let distance = Tensor::new(distance, &Device::Cpu).expect("distance");
    let got = softmax_relative_bias(&scores, &table, &distance).expect("fused");
    assert!(rel(&got, &want) < 1e-6, "rel {}", rel(&got, &want));
    let bf16 = softmax_relative_bias(&scores.to_dtype(DType::BF16).expect("bf16"), &table, &distance).expect("bf16");
    assert_eq!(bf16.dtype(), DType::BF16);
    // A bucket past the table, and buckets of the wrong length, are refused.
    let outside = Tensor::new(vec![buckets as u32; queries + keys - 1], &Device::Cpu).expect("outside");
    assert!(softmax_relative_bias(&scores, &table, &outside).is_err());
    assert!(softmax_relative_bias(
        &scores,
        &table,
        &distance.narrow(0, 1, queries + keys - 2).expect("short")
    )
    .is_err());
}

/// Rotates each head of `x` `[rows, heads · d]` (halves layout) by `cos`, `sin` `[rows, d / 2]`.
fn rotate_heads(x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (rows, width) = x.dims2().expect("x");
    let d = width / heads;
    let x = x.reshape((rows, heads, d)).expect("heads");
    let (x1, x2) = (
        x.narrow(2, 0, d / 2).expect("x1"),
        x.narrow(2, d / 2, d / 2).expect("x2"),
    );
    let (c, s) = (cos.unsqueeze(1).expect("cos"), sin.unsqueeze(1).expect("sin"));
    let first = (x1.broadcast_mul(&c).expect("mul") - x2.broadcast_mul(&s).expect("mul")).expect("sub");
    let second = (x2.broadcast_mul(&c).expect("mul") + x1.broadcast_mul(&s).expect("mul")).expect("add");
    Tensor::cat(&[first, second], 2).expect("cat")
}

#[test]
fn rotary_kernels_split_rotate_and_cache_a_fused_projection() {
    // A prompt chunk, and one large enough for the CPU op to go parallel.
    for (rows, offset, capacity) in [(5, 4, 12), (3000, 7, 3010)] {
        rotary_kernels_at(rows, offset, capacity);
    }
}

fn rotary_kernels_at(rows: usize, offset: usize, capacity: usize) {
    let (q_heads, kv_heads, d) = (3, 1, 8);
    let qkv = randn(&[rows, (q_heads + 2 * kv_heads) * d], 8);
    let angles = (randn(&[capacity, d / 2], 9) * 3.0).expect("angles");
    let table = Tensor::stack(&[angles.cos().expect("cos"), angles.sin().expect("sin")], 0).expect("table");
    let (cos, sin) = (
        angles.cos().and_then(|c| c.narrow(0, offset, rows)).expect("cos"),
        angles.sin().and_then(|s| s.narrow(0, offset, rows)).expect("sin"),
    );
    let part = |from: usize, heads: usize| qkv.narrow(1, from * d, heads * d).expect("part");

    let cache = Tensor::zeros((2, kv_heads, capacity, d), DType::F32, &Device::Cpu).expect("cache");
    let want = rotate_heads(&part(0, q_heads), q_heads, &cos, &sin);
    let got = rotary_qkv(&cache, &qkv, &table, &position(offset), q_heads).expect("rotary_qkv");
    assert_eq!(got.dims(), [rows, q_heads, d]);
    assert!(rel(&got, &want) < 1e-6);

    let slots = |i: usize| {
        cache
            .get(i)
            .and_then(|c| c.narrow(1, offset, rows)?.transpose(0, 1)?.flatten_from(1))
            .expect("slots")
    };
    let keys = rotate_heads(&part(q_heads, kv_heads), kv_heads, &cos, &sin)
        .flatten_from(1)
        .expect("keys");
    assert!(rel(&slots(0), &keys) < 1e-6);
    assert_eq!(rel(&slots(1), &part(q_heads + kv_heads, kv_heads)), 0.0);
    // Slots outside offset..offset + rows stay untouched.
    let outside = cache
        .narrow(2, 0, offset)
        .and_then(|c| c.abs()?.sum_all()?.to_scalar::<f32>())
        .expect("outside");
    assert_eq!(outside, 0.0);

    // A cache too short, a position past the table, a projection of the wrong width, or a
    // position that is not one u32 is refused.
    let before = cache.flatten_all().and_then(|c| c.to_vec1::<f32>()).expect("before");
    assert!(rotary_qkv(&cache, &qkv, &table, &position(capacity - 2), q_heads).is_err());
    assert!(rotary_qkv(&cache, &qkv, &table, &position(offset), q_heads + 1).is_err());
    let two = Tensor::new(&[offset as u32, 0], &Device::Cpu).expect("two");
    assert!(rotary_qkv(&cache, &qkv, &table, &two, q_heads).is_err());
    // A table shorter than the cache: refused too, before anything is written.
    let short = table.narrow(1, 0, offset + rows - 1).expect("short");
    assert!(rotary_qkv(&cache, &qkv, &short, &position(offset), q_heads).is_err());
    let after = cache.flatten_all().and_then(|c| c.to_vec1::<f32>()).expect("after");
    assert_eq!(before, after, "a refused call wrote the cache");
}

/// Qwen3's per-head RMSNorm before the rotation: each query head normed by `q_norm`, each key
/// head by `k_norm`, then rotated; the values as they are.
#[test]
fn rotary_normed_kernel_norms_each_head_then_rotates() {
    for (rows, offset, capacity) in [(5, 4, 12), (3000, 7, 3010)] {
        let (q_heads, kv_heads, d, eps) = (4, 2, 16, 1e-6);
        let qkv = (randn(&[rows, (q_heads + 2 * kv_heads) * d], 18) * 3.0).expect("qkv");
        let angles = (randn(&[capacity, d / 2], 19) * 3.0).expect("angles");
        let table = Tensor::stack(&[angles.cos().expect("cos"), angles.sin().expect("sin")], 0).expect("table");
        let (cos, sin) = (
            angles.cos().and_then(|c| c.narrow(0, offset, rows)).expect("cos"),
            angles.sin().and_then(|s| s.narrow(0, offset, rows)).expect("sin"),
        );
        let (q_norm, k_norm) = (randn(&[d], 20), randn(&[d], 21));
        let part = |from: usize, heads: usize| qkv.narrow(1, from * d, heads * d).expect("part");
        // x / sqrt(mean(x²) + ε) · w over each head of x `[rows, heads · d]`.
        let normed = |x: Tensor, heads: usize, w: &Tensor| {
            let x = x.reshape((rows, heads, d)).expect("heads");
            let rms = x
                .sqr()
                .and_then(|s| s.mean_keepdim(2))
                .and_then(|m| (m + eps).and_then(|m| m.sqrt()))
                .expect("rms");
            x.broadcast_div(&rms)
                .and_then(|x| x.broadcast_mul(w))
                .and_then(|x| x.reshape((rows, heads * d)))
                .expect("normed")
        };
        let cache = Tensor::zeros((2, kv_heads, capacity, d), DType::F32, &Device::Cpu).expect("cache");
        let queries = Tensor::zeros((rows, q_heads, d), DType::F32, &Device::Cpu).expect("queries");
        let norms = HeadNorms {
            q: &q_norm,
            k: &k_norm,
            eps: eps as f32,
        };
        rotary_qkv_into(&cache, &qkv, Some(norms), &table, &position(offset), q_heads, &queries).expect("normed");
        let want = rotate_heads(&normed(part(0, q_heads), q_heads, &q_norm), q_heads, &cos, &sin)
            .reshape((rows, q_heads, d))
            .expect("want");
        let err = rel(&queries, &want);
        assert!(err < 1e-6, "queries: {err:e}");
        let slots = |i: usize| {
            cache
                .get(i)
                .and_then(|c| c.narrow(1, offset, rows)?.transpose(0, 1)?.flatten_from(1))
                .expect("slots")
        };
        let keys = rotate_heads(
            &normed(part(q_heads, kv_heads), kv_heads, &k_norm),
            kv_heads,
            &cos,
            &sin,
        )
        .flatten_from(1)
        .expect("keys");
        let err = rel(&slots(0), &keys);
        assert!(err < 1e-6, "keys: {err:e}");
        assert_eq!(rel(&slots(1), &part(q_heads + kv_heads, kv_heads)), 0.0);

        // A norm of the wrong width is refused before anything is written.
        let wide = randn(&[d + 1], 22);
        let before = cache.flatten_all().and_then(|c| c.to_vec1::<f32>()).expect("before");
        let bad = HeadNorms { k: &wide, ..norms };
        assert!(rotary_qkv_into(&cache, &qkv, Some(bad), &table, &position(offset), q_heads, &queries).is_err());
        let after = cache.flatten_all().and_then(|c| c.to_vec1::<f32>()).expect("after");
        assert_eq!(before, after, "a refused call wrote the cache");
    }
}

/// Softmax attention with the scores materialized, per head, with an optional causal mask
/// (queries are the last `s` of `t` positions) and GQA.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Tensor {
    let (s, heads, _) = q.dims3().expect("q");
    let (t, kv_heads, _) = k.dims3().expect("k");
    let head = |x: &Tensor, h: usize| x.narrow(1, h, 1).and_then(|x| x.squeeze(1)).expect("head");
    let mask: Vec<f32> = (0..s * t)
        .map(|i| {
            if causal && i % t > t - s + i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (s, t), &Device::Cpu).expect("mask");
    let outs: Vec<Tensor> = (0..heads)
        .map(|h| {
            let kv = h / (heads / kv_heads);
            let scores = (head(q, h) * scale)
                .and_then(|q| q.matmul(&head(k, kv).t()?))
                .expect("scores");
            let probs = candle_nn_softmax((scores + &mask).expect("mask"));
            probs.matmul(&head(v, kv)).expect("out")
        })
        .collect();
    Tensor::stack(&outs, 1).expect("stack")
}

fn candle_nn_softmax(x: Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).expect("max");
    let e = x.broadcast_sub(&max).and_then(|d| d.exp()).expect("exp");
    let sum = e.sum_keepdim(D::Minus1).expect("sum");
    e.broadcast_div(&sum).expect("div")
}

#[test]
fn flash_attention_matches_materialized_scores() {
    for (s, t, heads, kv_heads, d, causal) in [
        (5, 5, 2, 2, 16, false),
        (7, 19, 4, 2, 8, true),
        (19, 19, 6, 3, 32, true),
        (1, 11, 4, 1, 16, true),
        (13, 3, 2, 1, 24, false),
    ] {
        let q = randn(&[s, heads, d], 10 + s as u64);
        let k = randn(&[t, kv_heads, d], 20 + t as u64);
        let v = randn(&[t, kv_heads, d], 30 + t as u64);
        let scale = 1.0 / (d as f64).sqrt();
        let want = reference(&q, &k, &v, scale, causal);
        let got = flash_attention(&q, &k, &v, scale, causal).expect("flash");
        let err = rel(&got, &want);
        assert!(
            err < 1e-5,
            "s {s} t {t} heads {heads}/{kv_heads} causal {causal}: {err:e}"
        );
        // Strided views (`[heads, len, d]` transposed) give the same.
        let qt = q.transpose(0, 1).and_then(|x| x.contiguous()).expect("contiguous");
        let strided = flash_attention(&qt.transpose(0, 1).expect("view"), &k, &v, scale, causal).expect("flash");
        assert!(rel(&strided, &want) < 1e-5);
    }
    let q = randn(&[4, 2, 8], 1);
    assert!(
        flash_attention(&q, &randn(&[3, 2, 8], 2), &randn(&[3, 2, 8], 3), 1.0, true).is_err(),
        "more queries than keys"
    );
    assert!(
        flash_attention(&q, &randn(&[4, 3, 8], 2), &randn(&[4, 3, 8], 3), 1.0, false).is_err(),
        "heads not a multiple"
    );
}

#[test]
fn cached_flash_attention_reads_only_the_filled_slots() {
    // Queries at positions 9..12 over a cache of 20 slots: slots 12.. hold garbage that must
    // not count, and the answer equals causal attention over the 12 filled keys.
    let (s, filled, capacity, heads, kv_heads, d) = (3, 12, 20, 4, 2, 16);
    let q = randn(&[s, heads, d], 40);
    let (k, v) = (randn(&[capacity, kv_heads, d], 41), randn(&[capacity, kv_heads, d], 42));
    let scale = 1.0 / (d as f64).sqrt();
    let keys = |t: &Tensor| t.narrow(0, 0, filled).expect("filled");
    let want = reference(&q, &keys(&k), &keys(&v), scale, true);
    let at = position(filled - s);
    let got = flash_attention_cached(&q, &k, &v, &at, scale, &DecodeScratch::new()).expect("cached");
    assert!(rel(&got, &want) < 1e-5, "{:e}", rel(&got, &want));

    // The position is read when the op runs: rewriting it moves the window.
    write_u32s(&at, &[5]).expect("write");
    let want = reference(
        &q,
        &k.narrow(0, 0, 8).expect("k"),
        &v.narrow(0, 0, 8).expect("v"),
        scale,
        true,
    );
    let got = flash_attention_cached(&q, &k, &v, &at, scale, &DecodeScratch::new()).expect("cached");
    assert!(rel(&got, &want) < 1e-5);

    // Queries past the cache's end are refused.
    write_u32s(&at, &[(capacity - 1) as u32]).expect("write");
    assert!(flash_attention_cached(&q, &k, &v, &at, scale, &DecodeScratch::new()).is_err());
    // Writes must fill a contiguous u32 tensor exactly.
    assert!(write_u32s(&at, &[1, 2]).is_err());
    assert!(write_u32s(&q, &[1]).is_err());
}

fn u32s(values: &[u32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, &Device::Cpu).expect("u32s")
}

#[test]
fn paged_rotary_writes_each_row_at_its_own_slot_and_position() {
    let (q_heads, kv_heads, d, slots) = (4, 2, 8, 24);
    // Three rows of different sequences: positions and slots in no order.
    let (positions, at) = ([7u32, 0, 3], [17u32, 2, 9]);
    let qkv = randn(&[3, (q_heads + 2 * kv_heads) * d], 60);
    let angles = (randn(&[10, d / 2], 61) * 3.0).expect("angles");
    let table = Tensor::stack(&[angles.cos().expect("cos"), angles.sin().expect("sin")], 0).expect("table");
    let pool = Tensor::full(f32::NAN, (2, slots, kv_heads, d), &Device::Cpu).expect("pool");
    let (p, s) = (u32s(&positions, &[3]), u32s(&at, &[3]));
    let rows = RowsAt {
        positions: &p,
        slots: &s,
    };
    let got = rotary_qkv_paged(&pool, &qkv, &table, rows, q_heads).expect("paged rotary");
    assert_eq!(got.dims(), [3, q_heads, d]);
    // Each row against the contiguous kernel at its own position, one row at a time.
    for (r, (&position, &slot)) in positions.iter().zip(&at).enumerate() {
        let cache = Tensor::zeros((2, kv_heads, 1 + position as usize, d), DType::F32, &Device::Cpu).expect("cache");
        let row = qkv.narrow(0, r, 1).expect("row");
        let want = rotary_qkv(&cache, &row, &table, &self::position(position as usize), q_heads).expect("rotary");
        assert_eq!(rel(&got.narrow(0, r, 1).expect("got"), &want), 0.0, "row {r} queries");
        for i in 0..2 {
            let written = pool.get(i).and_then(|p| p.get(slot as usize)).expect("slot");
            let cached = cache
                .get(i)
                .and_then(|c| c.narrow(1, position as usize, 1)?.squeeze(1))
                .expect("cached");
            assert_eq!(rel(&written, &cached), 0.0, "row {r} {}", ["keys", "values"][i]);
        }
    }
    // Every other slot is untouched (still NaN).
    let untouched = pool
        .flatten_all()
        .and_then(|p| p.to_vec1::<f32>())
        .expect("pool")
        .iter()
        .filter(|x| x.is_nan())
        .count();
    assert_eq!(untouched, 2 * (slots - 3) * kv_heads * d);

    // A slot past the pool, or a position past the table, is refused.
    let past = u32s(&[7, 0, slots as u32], &[3]);
    let far = u32s(&[7, 10, 3], &[3]);
    for (p, s) in [(&p, &past), (&far, &s)] {
        let rows = RowsAt { positions: p, slots: s };
        assert!(rotary_qkv_paged(&pool, &qkv, &table, rows, q_heads).is_err());
    }
}

#[test]
fn paged_decode_attention_equals_attention_over_each_sequences_gathered_keys() {
    let (q_heads, kv_heads, d, block_size, blocks) = (6, 2, 16, 4, 12);
    let slots = block_size * blocks;
    let pool = randn(&[2, slots, kv_heads, d], 70);
    // Blocks 0 and 11 unused: NaN there must not reach any output.
    let nan = Tensor::full(f32::NAN, (2, block_size, kv_heads, d), &Device::Cpu).expect("nan");
    pool.slice_set(&nan, 1, 0).expect("block 0");
    pool.slice_set(&nan, 1, 11 * block_size).expect("block 11");
    // Three sequences: 9 keys, 1 key, 16 keys, their blocks scattered; rows 2, 0, 4 of q.
    let tables = [[5u32, 1, 8, 0], [3, 0, 0, 0], [10, 2, 7, 4]];
    let (lens, q_rows) = ([9u32, 1, 16], [2u32, 0, 4]);
    let q = randn(&[5, q_heads, d], 71);
    let scale = 1.0 / (d as f64).sqrt();
    let flat: Vec<u32> = tables.iter().flatten().copied().collect();
    let (t, l, r) = (u32s(&flat, &[3, 4]), u32s(&lens, &[3]), u32s(&q_rows, &[3]));
    // Query heads 0..3 on KV head 0, 3..6 on KV head 1; then a rank's shard that starts
    // inside a group of 4 (heads 0, 1 on KV head 0, heads 2..6 on KV head 1).
    let mut decode = DecodeRows {
        q_rows: &r,
        tables: &t,
        lens: &l,
        block_size,
        groups: QueryGroups { group: 3, offset: 0 },
    };
    for groups in [QueryGroups { group: 3, offset: 0 }, QueryGroups { group: 4, offset: 2 }] {
        decode.groups = groups;
        let got = paged_decode_attention(&q, &pool, decode, scale).expect("paged attention");
        assert_eq!(got.dims(), [3, q_heads, d]);
        for i in 0..3 {
            let keys: Vec<u32> = (0..lens[i] as usize)
                .map(|p| tables[i][p / block_size] * block_size as u32 + (p % block_size) as u32)
                .collect();
            for h in 0..q_heads {
                let kv = groups.kv_head(h);
                let gather = |part: usize| {
                    pool.get(part)
                        .and_then(|p| p.index_select(&u32s(&keys, &[keys.len()]), 0))
                        .and_then(|p| p.narrow(1, kv, 1))
                };
                let query = q
                    .narrow(0, q_rows[i] as usize, 1)
                    .and_then(|x| x.narrow(1, h, 1))
                    .expect("query");
                let want = reference(&query, &gather(0).expect("k"), &gather(1).expect("v"), scale, false);
                let got = got.narrow(0, i, 1).and_then(|x| x.narrow(1, h, 1)).expect("row");
                let err = rel(&got, &want);
                assert!(err < 1e-5, "{groups:?} sequence {i} head {h}: {err:e}");
            }
        }
    }
    // Groups that send a query head past the KV heads are refused.
    let past = DecodeRows {
        groups: QueryGroups { group: 2, offset: 0 },
        ..decode
    };
    assert!(paged_decode_attention(&q, &pool, past, scale).is_err());
    // So is a q without heads (no KV head to name).
    let headless = Tensor::zeros((5, 0, d), DType::F32, &Device::Cpu).expect("q");
    assert!(paged_decode_attention(&headless, &pool, decode, scale).is_err());

    // A table reaching past the pool, or a row past q, is refused.
    let beyond = u32s(&[5, 1, 8, 0, 3, 0, 0, 0, 10, 2, 7, blocks as u32], &[3, 4]);
    let outside = u32s(&[2, 0, 5], &[3]);
    for (t, r) in [(&beyond, &r), (&t, &outside)] {
        let decode = DecodeRows {
            tables: t,
            q_rows: r,
            ..decode
        };
        assert!(paged_decode_attention(&q, &pool, decode, scale).is_err());
    }
}

#[test]
fn one_row_products_match_candle_matmul() {
    // Below and above the parallel threshold, with n not a multiple of the 64-row chunks.
    for (n, k) in [(37, 96), (1000, 256)] {
        let (x, w) = (randn(&[1, 1, k], 50), randn(&[n, k], 51));
        let want = x.broadcast_matmul(&w.t().expect("t")).expect("matmul");
        let got = gemv(&x, &w).expect("gemv");
        assert_eq!(got.dims(), [1, 1, n]);
        assert!(rel(&got, &want) < 1e-6, "n {n} k {k}: {:e}", rel(&got, &want));
    }
    let w = randn(&[8, 16], 52);
    assert!(gemv(&randn(&[2, 16], 53), &w).is_err(), "two rows");
    assert!(gemv(&randn(&[1, 8], 53), &w).is_err(), "k mismatch");
}

#[test]
fn the_fused_gate_up_silu_product_gives_the_unfused_bits() {
    // f32 and bf16 (where the products' rounding matters), below and above the threshold.
    for dtype in [DType::F32, DType::BF16] {
        for (n, k) in [(37, 96), (1000, 256)] {
            let cast = |t: Tensor| t.to_dtype(dtype).expect("cast");
            let (x, w) = (cast(randn(&[1, 1, k], 54)), cast(randn(&[2 * n, k], 55)));
            let gate_up = gemv(&x, &w).expect("gemv");
            let want = silu_mul(&gate_up.reshape((1, 2 * n)).expect("rows")).expect("silu");
            let got = gemv_gate_up_silu(&x, &w).expect("fused");
            assert_eq!(got.dims(), [1, 1, n]);
            let bits = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                    .expect("v")
            };
            assert_eq!(bits(&got), bits(&want), "{dtype:?} n {n} k {k}");
        }
    }
    assert!(
        gemv_gate_up_silu(&randn(&[1, 16], 56), &randn(&[7, 16], 57)).is_err(),
        "an odd number of rows is not [gate | up]"
    );
    assert!(
        gemv_tiled(&randn(&[1, 16], 58), &randn(&[8, 16], 59), 3).is_err(),
        "no such tile"
    );
}

#[test]
fn an_fp8_weight_runs_the_gemvs_as_its_expanded_products() {
    // On the CPU an FP8 weight is expanded for the product, as fp8_linear does on every rank
    // without FP8 kernels: the GEMVs give fp8_linear's values, the fused one its SiLU product.
    let (n, k) = (24, 64);
    let x = randn(&[1, 1, k], 60);
    let w = randn(&[2 * n, k], 61).affine(0.25, 0.0).expect("scale");
    let values = w.to_dtype(DType::F8E4M3).expect("e4m3");
    let scales = randn(&[2 * n], 62).abs().expect("abs").affine(1.0, 0.5).expect("shift");
    let weight = RowWeight::Fp8 {
        values: &values,
        scales: &scales,
    };
    let want = fp8_linear(&x, &values, &scales, None, false).expect("fp8 linear");
    let got = gemv(&x, weight).expect("gemv");
    assert_eq!(got.dims(), [1, 1, 2 * n]);
    assert!(rel(&got, &want) < 1e-7, "{:e}", rel(&got, &want));
    let want = silu_mul(&want.reshape((1, 2 * n)).expect("rows"))
        .and_then(|t| t.reshape((1, 1, n)))
        .expect("silu");
    let got = gemv_gate_up_silu(&x, weight).expect("fused");
    assert_eq!(got.dims(), [1, 1, n]);
    assert!(rel(&got, &want) < 1e-7, "{:e}", rel(&got, &want));
    let out = Tensor::zeros(n, DType::F32, &Device::Cpu).expect("out");
    gemv_gate_up_silu_into(&x, weight, &out).expect("into");
    assert!(rel(&out.reshape((1, 1, n)).expect("shape"), &got) < 1e-7);

    let short = scales.narrow(0, 0, n).expect("narrow");
    let mismatched = RowWeight::Fp8 {
        values: &values,
        scales: &short,
    };
    assert!(gemv(&x, mismatched).is_err(), "a scale per row");
}

#[test]
fn a_residual_product_makes_the_next_norm_that_a_normed_row_multiplies() {
    // A decode step at TP 1: the row-parallel product adds its output to the residual stream
    // and leaves u = s · weight and Σ s²; the next product's row is that norm (on CUDA made in
    // the two GEMVs' kernels; here with the same math), and equals add_rms_norm then the product.
    let (k, inner, n, eps) = (64, 48, 24, 1e-5);
    let stream = randn(&[1, k], 63);
    let (x, w_row) = (randn(&[1, inner], 64), randn(&[k, inner], 65));
    let (weight, w_next) = (randn(&[k], 66), randn(&[2 * n, k], 67));
    let y = gemv(&x, &w_row).expect("product");
    let (sum, normed) = add_rms_norm(&stream, &y, &weight, eps).expect("add_rms_norm");

    let (normed_out, squares) = (
        Tensor::zeros((1, k), DType::F32, &Device::Cpu).expect("u"),
        Tensor::ones(gemv_residual_squares(k) + 3, DType::F32, &Device::Cpu).expect("squares"),
    );
    let out = ResidualNorm {
        stream: &stream,
        weight: &weight,
        eps,
        normed: &normed_out,
        squares: &squares,
    };
    let row = gemv_residual_into(&x, &w_row, out).expect("residual");
    assert!(rel(&stream, &sum) < 1e-7, "the stream after: {:e}", rel(&stream, &sum));
    let want = sum.broadcast_mul(&weight).expect("u");
    assert!(rel(&normed_out, &want) < 1e-7);
    let GemvRow::Normed { squares: written, .. } = &row else {
        panic!("a residual product's output is a normed row");
    };
    assert!(written.elem_count() <= gemv_residual_squares(k));
    let total = written.sum_all().and_then(|t| t.to_scalar::<f32>()).expect("total");
    let want = sum
        .sqr()
        .and_then(|t| t.sum_all()?.to_scalar::<f32>())
        .expect("squares");
    assert!((total - want).abs() <= 1e-6 * want, "{total} against {want}");

    let out = Tensor::zeros(2 * n, DType::F32, &Device::Cpu).expect("out");
    gemv_into(row.clone(), &w_next, &out).expect("normed gemv");
    let want = gemv(&normed, &w_next).expect("gemv").flatten_all().expect("flat");
    assert!(rel(&out, &want) < 1e-6, "{:e}", rel(&out, &want));
    let hidden = Tensor::zeros(n, DType::F32, &Device::Cpu).expect("hidden");
    gemv_gate_up_silu_into(row, &w_next, &hidden).expect("normed gate/up");
    let want = gemv_gate_up_silu(&normed, &w_next)
        .and_then(|t| t.flatten_all())
        .expect("fused");
    assert!(rel(&hidden, &want) < 1e-6, "{:e}", rel(&hidden, &want));

    let short = Tensor::zeros(gemv_residual_squares(k) - 1, DType::F32, &Device::Cpu).expect("short");
    let out = ResidualNorm {
        stream: &stream,
        weight: &weight,
        eps,
        normed: &normed_out,
        squares: &short,
    };
    assert!(gemv_residual_into(&x, &w_row, out).is_err(), "room for a sum per block");
}

#[test]
fn biased_linear_keeps_leading_dims_and_applies_gelu_after_the_bias() {
    let (x, w, b) = (randn(&[2, 3, 16], 31), randn(&[5, 16], 32), randn(&[5], 33));
    let flat = x.reshape((6, 16)).expect("flat");
    let expected = flat
        .matmul(&w.t().expect("t"))
        .and_then(|y| y.broadcast_add(&b))
        .expect("reference");
    let y = linear_bias(&x, &w, &b, false).expect("linear");
    assert_eq!(y.dims(), [2, 3, 5]);
    assert!(rel(&y.reshape((6, 5)).expect("flat"), &expected) < 1e-6);
    let y = linear_bias(&x, &w, &b, true).expect("linear + gelu");
    assert!(rel(&y.reshape((6, 5)).expect("flat"), &expected.gelu().expect("gelu")) < 1e-6);
    assert!(
        linear_bias(&x, &w, &randn(&[4], 34), false).is_err(),
        "a bias of the wrong size is refused"
    );
    // A strided view (every row shifted by one element of a wider buffer) gives the same.
    let wide = randn(&[2, 3, 17], 35);
    let view = wide.narrow(2, 1, 16).expect("view");
    let from_view = linear_bias(&view, &w, &b, true).expect("view");
    let from_copy = linear_bias(&view.contiguous().expect("copy"), &w, &b, true).expect("copy");
    assert!(rel(&from_view, &from_copy) < 1e-7);
}

#[test]
fn biased_linear_into_rows_writes_each_part_where_it_belongs() {
    let (x, w, b) = (randn(&[7, 16], 36), randn(&[5, 16], 37), randn(&[5], 38));
    for gelu in [false, true] {
        let whole = linear_bias(&x, &w, &b, gelu).expect("whole");
        let out = tpinfer_kernels::empty(&[7, 5], DType::F32, &Device::Cpu).expect("out");
        // Parts in the order peer rows arrive: the middle rows first, then the others.
        for (first, rows) in [(3, 4), (0, 3)] {
            let part = x.narrow(0, first, rows).expect("part");
            linear_bias_into(&out, first, &part, &w, &b, gelu).expect("into");
        }
        assert!(rel(&out, &whole) < 1e-6, "gelu {gelu}");
    }
    let out = Tensor::zeros((4, 5), DType::F32, &Device::Cpu).expect("out");
    assert!(
        linear_bias_into(&out, 2, &x.narrow(0, 0, 3).expect("part"), &w, &b, false).is_err(),
        "rows past the output are refused"
    );
}

#[test]
fn residual_sums_add_the_parts_in_order_then_the_gated_update() {
    let (x, gate) = (randn(&[6, 40], 70), randn(&[40], 71));
    let parts: Vec<Tensor> = (72..75).map(|seed| randn(&[6, 40], seed)).collect();
    let sum = ((&parts[0] + &parts[1]).expect("sum") + &parts[2]).expect("sum");
    let gated = residual_sum(&x, &parts, Some(ColumnTable::every_row(&gate))).expect("gated");
    let reference = gated_residual(&x, &sum, ColumnTable::every_row(&gate)).expect("reference");
    assert!(rel(&gated, &reference) < 1e-7);
    let plain = residual_sum(&x, &parts[..2], None).expect("plain");
    assert!(
        rel(
            &plain,
            &(&x + (&parts[0] + &parts[1]).expect("sum")).expect("reference")
        ) < 1e-7
    );
    assert!(residual_sum(&x, &[], None).is_err(), "no parts is refused");
    assert!(
        residual_sum(&x, &[randn(&[6, 39], 75)], None).is_err(),
        "a part of another shape is refused"
    );
}

#[test]
fn owned_embedding_rows_are_looked_up_and_the_rest_zeroed() {
    // A rank holding vocabulary rows 4..9 of a 12-row vocabulary.
    let (first, hidden) = (4usize, 6usize);
    for dtype in [DType::F32, DType::BF16] {
        let weight = randn(&[5, hidden], 60).to_dtype(dtype).expect("cast");
        let ids = Tensor::new(&[[0u32, 4, 8, 9], [11, 6, 3, 5]], &Device::Cpu).expect("ids");
        let got = embed_owned_rows(&ids, &weight, first).expect("embed");
        assert_eq!(got.dims(), [8, hidden]);
        let rows = got.to_dtype(DType::F32).and_then(|t| t.to_vec2::<f32>()).expect("rows");
        let table = weight
            .to_dtype(DType::F32)
            .and_then(|t| t.to_vec2::<f32>())
            .expect("table");
        for (row, id) in rows.iter().zip([0usize, 4, 8, 9, 11, 6, 3, 5]) {
            match (first..first + 5).contains(&id) {
                true => assert_eq!(row, &table[id - first], "{dtype:?} id {id}"),
                false => assert!(row.iter().all(|v| *v == 0.0), "{dtype:?} id {id} is not ours"),
            }
        }
    }
    let weight = randn(&[5, hidden], 61);
    assert!(
        embed_owned_rows(&Tensor::new(&[1f32], &Device::Cpu).expect("ids"), &weight, 0).is_err(),
        "float ids are refused"
    );
}

#[test]
fn argmax_takes_the_first_of_tied_maxima() {
    let x = Tensor::new(&[[1f32, 3., 3., -2.], [f32::NEG_INFINITY, 0., 5., 5.]], &Device::Cpu).expect("x");
    let got = argmax(&x).expect("argmax");
    assert_eq!(got.dims(), [2, 1]);
    assert_eq!(got.flatten_all().and_then(|t| t.to_vec1::<u32>()).expect("v"), [1, 2]);
}

/// The decode kernel's launch contract, as the plan counts its scratch: whole clusters of 8
/// slices (a Hopper launch of any other width fails), at most 128 (its merge's arrays), one
/// cluster a KV head on a rank of 8 KV heads, and more slices a head for fewer heads.
#[test]
fn the_decode_scratch_holds_whole_clusters_of_slices() {
    let splits = |q_heads: usize, kv_heads: usize, capacity: usize| {
        let d = 128;
        let bytes = decode_scratch_bytes(q_heads, kv_heads, capacity, d);
        let partials = bytes / 4 - 1024;
        assert_eq!(partials % (q_heads * (d + 2)), 0, "{bytes} bytes");
        partials / (q_heads * (d + 2))
    };
    for kv_heads in 1..=32 {
        for capacity in [1, 100, 1024, 4096, 131_072] {
            let s = splits(kv_heads * 4, kv_heads, capacity);
            assert!(
                s % 8 == 0 && (8..=128).contains(&s),
                "{s} slices for {kv_heads} KV heads, {capacity} rows"
            );
        }
    }
    assert_eq!(splits(32, 8, 8192), 8);
    assert_eq!(splits(16, 4, 8192), 16);
    assert_eq!(splits(8, 1, 8192), 64);
    assert_eq!(splits(8, 1, 256), 8, "a short cache takes fewer");
}
