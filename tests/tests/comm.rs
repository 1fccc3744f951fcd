//! The in-process communicator: real sums across threads, and failures that name the rank.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use tpinfer_comm::{CommError, Communicator, ThreadGroup};

/// Runs `f` on `world` rank threads and returns each rank's result.
fn on_ranks<R: Send>(world: usize, timeout: Duration, f: impl Fn(&dyn Communicator) -> R + Sync) -> Vec<R> {
    let comms = ThreadGroup::ranks(world, timeout);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(&c))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().and_then(|t| t.to_vec1()).expect("values")
}

#[test]
fn all_reduce_sums_across_threads_in_every_world_size() {
    for world in 1..=5 {
        let results = on_ranks(world, Duration::from_secs(10), |c| {
            let r = c.rank() as f32;
            let x = Tensor::new(&[r, 10.0 * r + 1.0, -r], &Device::Cpu).expect("tensor");
            values(&c.all_reduce_sum(&x).expect("all_reduce"))
        });
        let n = world as f32;
        let sum_r = n * (n - 1.0) / 2.0;
        for got in results {
            assert_eq!(got, vec![sum_r, 10.0 * sum_r + n, -sum_r], "world {world}");
        }
    }
}

#[test]
fn all_reduce_is_deterministic_and_identical_on_all_ranks() {
    // Values whose f32 sum depends on the order of addition.
    let run = || {
        on_ranks(4, Duration::from_secs(10), |c| {
            let v: Vec<f32> = (0..1000)
                .map(|i| ((i * (c.rank() + 3)) as f32 * 0.37).sin() * 1e4_f32.powi(c.rank() as i32 % 2))
                .collect();
            values(
                &c.all_reduce_sum(&Tensor::new(v.as_slice(), &Device::Cpu).expect("t"))
                    .expect("ar"),
            )
        })
    };
    let first = run();
    for again in (0..5).map(|_| run()) {
        assert_eq!(first, again, "the reduction must not depend on thread timing");
    }
    assert!(
        first.iter().all(|r| r == &first[0]),
        "every rank must get the same bits"
    );
}

#[test]
fn reduce_scatter_gives_each_rank_its_rows_of_the_sum() {
    // 7 rows over 3 ranks: 3, 2 and 2; each row r of rank k's input is [k, r].
    let sizes = [3, 2, 2];
    let results = on_ranks(3, Duration::from_secs(10), |c| {
        let k = c.rank() as f32;
        let rows: Vec<f32> = (0..7).flat_map(|r| [k, r as f32]).collect();
        let x = Tensor::from_vec(rows, (7, 2), &Device::Cpu).expect("tensor");
        let mine = c.reduce_scatter_sum(&x, &sizes).expect("reduce_scatter");
        let bad = c
            .reduce_scatter_sum(&x, &[3, 3, 3])
            .expect_err("sizes that do not add up");
        (mine.dims().to_vec(), values(&mine), bad.to_string())
    });
    let mut first = 0;
    for (rank, (dims, got, bad)) in results.into_iter().enumerate() {
        assert_eq!(dims, vec![sizes[rank], 2]);
        // Sum over ranks: [0 + 1 + 2, 3 · r].
        let expected: Vec<f32> = (first..first + sizes[rank])
            .flat_map(|r| [3.0, 3.0 * r as f32])
            .collect();
        assert_eq!(got, expected, "rank {rank}");
        assert!(bad.contains("do not split 7 rows"), "{bad}");
        first += sizes[rank];
    }
}

#[test]
fn rows_are_exchanged_part_by_part_own_first_and_cover_every_row_once() {
    // 7 rows over 3 ranks: 3, 2 and 2; rank k's rows of x hold [k, row].
    let sizes = [3, 2, 2];
    let results = on_ranks(3, Duration::from_secs(10), |c| {
        let k = c.rank();
        let start: usize = sizes[..k].iter().sum();
        let own: Vec<f32> = (start..start + sizes[k]).flat_map(|r| [k as f32, r as f32]).collect();
        let x = Tensor::from_vec(own, (sizes[k], 2), &Device::Cpu).expect("x");
        let mut seen = Vec::new();
        c.all_gather_rows(&x, &sizes, &mut |part, first| {
            seen.push((first, values(part)));
            Ok(())
        })
        .expect("gather rows");
        // Each rank's partial of row r is [r, k]; the parts asked for, and the sum handed over.
        let mut asked = Vec::new();
        let mut handed = 0;
        let sum = c
            .reduce_scatter_rows(
                &sizes,
                &mut |rows| {
                    asked.push(rows.clone());
                    let v: Vec<f32> = rows.clone().flat_map(|r| [r as f32, k as f32]).collect();
                    Tensor::from_vec(v, (rows.len(), 2), &Device::Cpu)
                },
                &mut |parts| {
                    handed = parts.len();
                    parts.iter().skip(1).try_fold(parts[0].clone(), |s, p| s + p)
                },
            )
            .expect("reduce-scatter rows");
        (seen, asked, handed, values(&sum))
    });
    let starts = [0usize, 3, 5];
    for (k, (seen, asked, handed, sum)) in results.into_iter().enumerate() {
        // This rank's rows first, then the others', each at its own first row.
        let order: Vec<usize> = (0..3).map(|i| (k + i) % 3).collect();
        assert_eq!(
            seen.iter().map(|(first, _)| *first).collect::<Vec<_>>(),
            order.iter().map(|&r| starts[r]).collect::<Vec<_>>()
        );
        for (first, part) in &seen {
            let r = starts.iter().position(|s| s == first).expect("a rank's first row");
            let expected: Vec<f32> = (*first..first + sizes[r])
                .flat_map(|row| [r as f32, row as f32])
                .collect();
            assert_eq!(part, &expected, "rank {k}: rank {r}'s rows");
        }
        // Every rank's rows asked for apart, this rank's last.
        let expected: Vec<_> = (1..=3)
            .map(|i| (k + i) % 3)
            .map(|r| starts[r]..starts[r] + sizes[r])
            .collect();
        assert_eq!(asked, expected, "rank {k}");
        assert_eq!(handed, 1, "thread ranks hand over the sum");
        let rows = starts[k]..starts[k] + sizes[k];
        assert_eq!(
            sum,
            rows.flat_map(|r| [3.0 * r as f32, 3.0]).collect::<Vec<_>>(),
            "rank {k}"
        );
    }
}

#[test]
fn all_gather_joins_uneven_shards_in_rank_order() {
    let results = on_ranks(3, Duration::from_secs(10), |c| {
        let len = 3 - c.rank(); // 3, 2, 1 columns
        let x = Tensor::full(c.rank() as f32, (2, len), &Device::Cpu).expect("t");
        c.all_gather(&x, 1).expect("gather")
    });
    for t in results {
        assert_eq!(t.dims(), &[2, 6]);
        assert_eq!(values(&t), vec![0., 0., 0., 1., 1., 2., 0., 0., 0., 1., 1., 2.]);
    }
}

#[test]
fn a_gather_of_known_sizes_equals_the_gather_and_checks_them() {
    let results = on_ranks(3, Duration::from_secs(10), |c| {
        let x = Tensor::full(c.rank() as f32, (2, 3 - c.rank()), &Device::Cpu).expect("t");
        let gathered = c.all_gather_sized(&x, 1, &[3, 2, 1]).expect("gather");
        // Sizes that do not match this rank's tensor, or the group, are refused up front.
        let wrong = c.all_gather_sized(&x, 1, &[4, 4, 4]).err();
        let short = c.all_gather_sized(&x, 1, &[3, 2]).err();
        c.wait().expect("CPU ranks have nothing queued");
        (values(&gathered), wrong, short)
    });
    for (rank, (got, wrong, short)) in results.into_iter().enumerate() {
        assert_eq!(got, vec![0., 0., 0., 1., 1., 2., 0., 0., 0., 1., 1., 2.]);
        assert!(matches!(wrong, Some(CommError::Shape { .. })), "rank {rank}: {wrong:?}");
        assert!(matches!(short, Some(CommError::Shape { .. })), "rank {rank}: {short:?}");
    }
}

#[test]
fn broadcast_and_barrier() {
    let results = on_ranks(4, Duration::from_secs(10), |c| {
        c.barrier().expect("barrier");
        let x = Tensor::new(&[c.rank() as f32 + 5.0], &Device::Cpu).expect("t");
        values(&c.broadcast(&x, 2).expect("broadcast"))
    });
    assert!(results.iter().all(|v| v == &vec![7.0]));
    let bad = on_ranks(2, Duration::from_secs(10), |c| {
        c.broadcast(&Tensor::new(&[1f32], &Device::Cpu).expect("t"), 5).is_err()
    });
    assert!(bad.iter().all(|&e| e), "a root outside the group is an error");
}

fn expect_named(err: &CommError, rank: usize) {
    assert_eq!(err.culprit(), rank, "error must blame rank {rank}: {err}");
    assert!(
        err.to_string().contains(&rank.to_string()),
        "message must name rank {rank}: {err}"
    );
}

#[test]
fn a_panicking_rank_fails_its_peers_quickly() {
    let comms = ThreadGroup::ranks(3, Duration::from_secs(30));
    let start = Instant::now();
    let errors: Vec<CommError> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let x = Tensor::new(&[1f32], &Device::Cpu).expect("t");
                    if c.rank() == 1 {
                        panic!("injected fault");
                    }
                    c.all_reduce_sum(&x).expect_err("peer panicked")
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    assert_eq!(errors.len(), 2);
    for e in &errors {
        expect_named(e, 1);
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "peers must not wait for the timeout"
    );
}

#[test]
fn a_rank_that_returns_an_error_is_named() {
    let results = on_ranks(4, Duration::from_secs(30), |c| {
        let x = Tensor::new(&[1f32], &Device::Cpu).expect("t");
        c.all_reduce_sum(&x).expect("first step works");
        if c.rank() == 3 {
            c.abort("out of memory: injected");
            return None;
        }
        Some(c.all_reduce_sum(&x).expect_err("rank 3 failed"))
    });
    for e in results.into_iter().flatten() {
        expect_named(&e, 3);
        assert!(e.to_string().contains("out of memory: injected"), "{e}");
    }
}

#[test]
fn a_stalled_rank_is_named_after_the_timeout() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let results = on_ranks(3, timeout, |c| {
        let x = Tensor::new(&[1f32], &Device::Cpu).expect("t");
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_secs(2)); // stops calling
            return c.all_reduce_sum(&x).err();
        }
        c.all_reduce_sum(&x).err()
    });
    let elapsed = start.elapsed();
    for e in results[..2].iter() {
        let e = e.as_ref().expect("timed out");
        // The first rank to time out reports the timeout; the other is woken by that report.
        assert!(e.to_string().contains("did not enter all_reduce_sum"), "{e}");
        expect_named(e, 2);
    }
    // The stalled rank, when it comes back, finds the group failed rather than hanging.
    assert!(results[2].is_some());
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
}

#[test]
fn a_rank_that_exits_is_named() {
    let comms = ThreadGroup::ranks(2, Duration::from_secs(30));
    let start = Instant::now();
    let mut comms = comms.into_iter();
    let (c0, c1) = (comms.next().expect("rank 0"), comms.next().expect("rank 1"));
    let waiter = std::thread::spawn(move || {
        let x = Tensor::new(&[1f32], &Device::Cpu).expect("t");
        c0.all_reduce_sum(&x).expect_err("peer exited")
    });
    std::thread::sleep(Duration::from_millis(50));
    drop(Arc::new(c1));
    let e = waiter.join().expect("join");
    expect_named(&e, 1);
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn mismatched_collectives_are_reported() {
    let results = on_ranks(2, Duration::from_secs(10), |c| {
        let x = Tensor::new(&[1f32], &Device::Cpu).expect("t");
        match c.rank() {
            0 => c.all_reduce_sum(&x).err(),
            _ => c.all_gather(&x, 0).err(),
        }
    });
    assert!(results.iter().all(Option::is_some), "{results:?}");
}

#[test]
fn all_reduce_in_place_leaves_the_sum_in_every_ranks_buffer() {
    for world in [1, 3] {
        let results = on_ranks(world, Duration::from_secs(10), |c| {
            let k = c.rank() as f32;
            let x = Tensor::from_vec(vec![k, 10.0 * k + 1.0], (1, 2), &Device::Cpu).expect("x");
            let before = x.clone();
            c.all_reduce_sum_in_place(&x).expect("all-reduce in place");
            // The caller's own tensor (and every clone of it) holds the sum.
            (values(&x), values(&before))
        });
        let ranks: Vec<f32> = (0..world).map(|k| k as f32).collect();
        let expected = vec![
            ranks.iter().sum::<f32>(),
            ranks.iter().map(|k| 10.0 * k + 1.0).sum::<f32>(),
        ];
        for (after, clone) in results {
            assert_eq!(after, expected, "world {world}");
            assert_eq!(clone, expected, "world {world}");
        }
    }
}
