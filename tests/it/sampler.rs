//! Properties of the per-rank batch plan over many (len, world, batch size, shuffle, epoch) cases.

use std::collections::HashMap;

use std::sync::Arc;

use accelerate_rs::Error;
use accelerate_rs::{DistributedSampler, EvenBatches};
use accelerate_rs::{LengthGroupedSampler, Sampler, WeightedSampler};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const SEED: u64 = 1234;

fn lens() -> Vec<usize> {
    let mut v: Vec<usize> = (1..=23).collect();
    v.extend([97, 100]);
    v
}

fn batch_sizes(n: usize) -> Vec<usize> {
    vec![1, 2, 3, 4, n + 3]
}

/// The epoch's global order, computed independently of the crate.
fn expected_order(n: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch));
        order.shuffle(&mut rng);
    }
    order
}

fn samplers(
    n: usize,
    b: usize,
    w: usize,
    shuffle: bool,
    epoch: u64,
    even: EvenBatches,
    drop_last: bool,
) -> Vec<DistributedSampler> {
    (0..w)
        .map(|r| {
            let mut s = DistributedSampler::new(n, b)
                .shuffle(shuffle)
                .seed(SEED)
                .even_batches(even)
                .drop_last(drop_last)
                .shard(r, w)
                .unwrap();
            s.set_epoch(epoch);
            s
        })
        .collect()
}

/// Concatenates the ranks' batches rank-major for each global batch.
fn rank_major(all: &[Vec<Vec<usize>>]) -> Vec<usize> {
    let nb = all[0].len();
    let mut out = Vec::new();
    for g in 0..nb {
        for rank in all {
            out.extend(&rank[g]);
        }
    }
    out
}

#[test]
fn pad_mode_covers_everything_and_padding_is_the_global_tail() {
    for w in 1..=5 {
        for n in lens() {
            for b in batch_sizes(n) {
                for shuffle in [false, true] {
                    for epoch in 0..3 {
                        let ss = samplers(n, b, w, shuffle, epoch, EvenBatches::Pad, false);
                        let all: Vec<Vec<Vec<usize>>> =
                            ss.iter().map(|s| s.batches().unwrap()).collect();
                        let ctx = format!("n={n} b={b} w={w} shuffle={shuffle} epoch={epoch}");

                        // Equal batch counts, matching num_batches().
                        let nb = all[0].len();
                        for (r, batches) in all.iter().enumerate() {
                            assert_eq!(batches.len(), nb, "{ctx}: rank {r} batch count");
                            assert_eq!(ss[r].num_batches(), nb, "{ctx}: rank {r} num_batches");
                        }
                        // Same batch sizes across ranks per global batch; full batches are b.
                        for g in 0..nb {
                            let size = all[0][g].len();
                            for batches in &all {
                                assert_eq!(batches[g].len(), size, "{ctx}: batch {g} size");
                            }
                            if g + 1 < nb {
                                assert_eq!(size, b, "{ctx}: non-last batch {g} is full");
                            }
                        }

                        // Reconstruction: rank-major concat == order[p % n] for p in 0..total.
                        let m = n.div_ceil(w);
                        let total = m * w;
                        let order = expected_order(n, shuffle, SEED, epoch);
                        let expected: Vec<usize> = (0..total).map(|p| order[p % n]).collect();
                        let got = rank_major(&all);
                        assert_eq!(got, expected, "{ctx}: reconstruction");
                        assert_eq!(ss[0].order(), order, "{ctx}: order()");

                        // Every index appears; duplicates are exactly the padded positions.
                        let mut counts: HashMap<usize, usize> = HashMap::new();
                        for &i in &got {
                            *counts.entry(i).or_default() += 1;
                        }
                        for i in 0..n {
                            assert!(
                                counts.get(&i).copied().unwrap_or(0) >= 1,
                                "{ctx}: {i} missing"
                            );
                        }
                        let extra: usize = counts.values().map(|c| c - 1).sum();
                        let total_padding = ss[0].total_padding();
                        assert_eq!(extra, total_padding, "{ctx}: duplicates == total_padding");
                        assert_eq!(total_padding, total - n, "{ctx}: total_padding value");
                        assert!(total_padding < w, "{ctx}: padding < world");
                        let mut seen = vec![false; n];
                        for (p, &i) in got.iter().enumerate() {
                            let dup = seen[i];
                            seen[i] = true;
                            assert_eq!(dup, p >= n, "{ctx}: position {p} padding-ness");
                        }
                        for s in &ss {
                            assert_eq!(
                                s.total_padding(),
                                total_padding,
                                "{ctx}: same on all ranks"
                            );
                        }
                        let sum_last: usize = ss.iter().map(|s| s.padding_in_last_batch()).sum();
                        assert_eq!(sum_last, total_padding, "{ctx}: sum padding_in_last_batch");
                    }
                }
            }
        }
    }
}

#[test]
fn epochs_change_the_order_and_seed_epoch_reproduce_it() {
    for n in [10, 11, 23, 97, 100] {
        for w in 1..=5 {
            let a = samplers(n, 3, w, true, 0, EvenBatches::Pad, false);
            let a2 = samplers(n, 3, w, true, 0, EvenBatches::Pad, false);
            let c = samplers(n, 3, w, true, 1, EvenBatches::Pad, false);
            let ba: Vec<_> = a.iter().map(|s| s.batches().unwrap()).collect();
            let ba2: Vec<_> = a2.iter().map(|s| s.batches().unwrap()).collect();
            let bc: Vec<_> = c.iter().map(|s| s.batches().unwrap()).collect();
            assert_eq!(ba, ba2, "n={n} w={w}: same (seed, epoch) must reproduce");
            assert_ne!(
                rank_major(&ba),
                rank_major(&bc),
                "n={n} w={w}: epochs differ"
            );
            // A different seed differs too.
            let other = DistributedSampler::new(n, 3).shuffle(true).seed(SEED + 99);
            assert_ne!(other.order(), a[0].order(), "n={n}: seeds differ");
        }
    }
    // Without shuffling the epoch does not matter.
    let mut s = DistributedSampler::new(10, 3);
    let first = s.batches().unwrap();
    s.set_epoch(5);
    assert_eq!(s.epoch(), 5);
    assert_eq!(s.batches().unwrap(), first);
}

#[test]
fn single_replica_unshuffled_is_plain_chunks() {
    for n in lens() {
        for b in batch_sizes(n) {
            let s = DistributedSampler::new(n, b);
            let expected: Vec<Vec<usize>> = (0..n)
                .collect::<Vec<_>>()
                .chunks(b)
                .map(|c| c.to_vec())
                .collect();
            assert_eq!(s.batches().unwrap(), expected, "n={n} b={b}");
            assert_eq!(s.total_padding(), 0);
            assert_eq!(s.padding_in_last_batch(), 0);
        }
    }
}

#[test]
fn exact_layout_examples() {
    // n=10, w=3, b=2: m=4, 12 positions, two full global batches; rank 2 gets the padding.
    let ss = samplers(10, 2, 3, false, 0, EvenBatches::Pad, false);
    let all: Vec<_> = ss.iter().map(|s| s.batches().unwrap()).collect();
    assert_eq!(all[0], vec![vec![0, 1], vec![6, 7]]);
    assert_eq!(all[1], vec![vec![2, 3], vec![8, 9]]);
    assert_eq!(all[2], vec![vec![4, 5], vec![0, 1]]);
    assert_eq!(ss[0].padding_in_last_batch(), 0);
    assert_eq!(ss[2].padding_in_last_batch(), 2);
    assert_eq!(ss[0].total_padding(), 2);

    // n=7, w=2, b=3: m=4, one full global batch, then a partial one of 1 per rank.
    let ss = samplers(7, 3, 2, false, 0, EvenBatches::Pad, false);
    let all: Vec<_> = ss.iter().map(|s| s.batches().unwrap()).collect();
    assert_eq!(all[0], vec![vec![0, 1, 2], vec![6]]);
    assert_eq!(all[1], vec![vec![3, 4, 5], vec![0]]);
    assert_eq!(ss[1].padding_in_last_batch(), 1);

    // n < w: everyone still gets a sample.
    let ss = samplers(2, 4, 5, false, 0, EvenBatches::Pad, false);
    let all: Vec<_> = ss.iter().map(|s| s.batches().unwrap()).collect();
    assert_eq!(
        all,
        vec![
            vec![vec![0]],
            vec![vec![1]],
            vec![vec![0]],
            vec![vec![1]],
            vec![vec![0]]
        ]
    );
    assert_eq!(ss[0].total_padding(), 3);
}

#[test]
fn drop_mode_has_no_duplicates() {
    for w in 1..=5 {
        for n in lens() {
            if n < w {
                continue;
            }
            for b in batch_sizes(n) {
                for shuffle in [false, true] {
                    for epoch in 0..2 {
                        let ctx = format!("n={n} b={b} w={w} shuffle={shuffle} epoch={epoch}");
                        let ss = samplers(n, b, w, shuffle, epoch, EvenBatches::Drop, false);
                        let all: Vec<_> = ss.iter().map(|s| s.batches().unwrap()).collect();
                        let nb = all[0].len();
                        assert!(all.iter().all(|a| a.len() == nb), "{ctx}: equal counts");
                        let got = rank_major(&all);
                        let mut sorted = got.clone();
                        sorted.sort_unstable();
                        sorted.dedup();
                        assert_eq!(sorted.len(), got.len(), "{ctx}: duplicates");
                        assert_eq!(got.len(), (n / w) * w, "{ctx}: distinct count");
                        let order = expected_order(n, shuffle, SEED, epoch);
                        assert_eq!(got, order[..(n / w) * w].to_vec(), "{ctx}: reconstruction");
                        for s in &ss {
                            assert_eq!(s.total_padding(), 0, "{ctx}");
                            assert_eq!(s.padding_in_last_batch(), 0, "{ctx}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn drop_last_yields_only_full_batches() {
    for w in 1..=5 {
        for n in lens() {
            for b in batch_sizes(n) {
                for even in [EvenBatches::Pad, EvenBatches::Drop] {
                    if even == EvenBatches::Drop && n < w {
                        continue;
                    }
                    let ctx = format!("n={n} b={b} w={w} {even:?}");
                    let ss = samplers(n, b, w, true, 1, even, true);
                    let all: Vec<_> = ss.iter().map(|s| s.batches().unwrap()).collect();
                    let m = match even {
                        EvenBatches::Pad => n.div_ceil(w),
                        EvenBatches::Drop => n / w,
                    };
                    for (r, batches) in all.iter().enumerate() {
                        assert_eq!(batches.len(), m / b, "{ctx}: rank {r} count");
                        assert!(batches.iter().all(|x| x.len() == b), "{ctx}: full batches");
                    }
                    // Padding counted only in yielded batches.
                    let yielded = (m / b) * b * w;
                    let padding = yielded.saturating_sub(n);
                    assert_eq!(ss[0].total_padding(), padding, "{ctx}: total_padding");
                    let sum_last: usize = ss.iter().map(|s| s.padding_in_last_batch()).sum();
                    assert_eq!(sum_last, padding, "{ctx}: sum padding_in_last_batch");
                }
            }
        }
    }
}

fn message(e: Error) -> String {
    e.to_string()
}

#[test]
fn errors_name_the_values() {
    let e = DistributedSampler::new(10, 2).shard(3, 3).unwrap_err();
    let msg = message(e);
    assert!(msg.contains("rank 3") && msg.contains('3'), "{msg}");
    assert!(msg.contains("num_replicas 3"), "{msg}");

    let e = DistributedSampler::new(10, 2).shard(7, 4).unwrap_err();
    let msg = message(e);
    assert!(
        msg.contains("rank 7") && msg.contains("num_replicas 4"),
        "{msg}"
    );

    let e = DistributedSampler::new(10, 2).shard(0, 0).unwrap_err();
    let msg = message(e);
    assert!(msg.contains("num_replicas is 0"), "{msg}");
    assert!(matches!(
        DistributedSampler::new(10, 2).shard(0, 0),
        Err(Error::InvalidArgument { .. })
    ));

    let e = DistributedSampler::new(0, 2).batches().unwrap_err();
    let msg = message(e);
    assert!(msg.contains("empty") && msg.contains("len 0"), "{msg}");
    assert_eq!(DistributedSampler::new(0, 2).num_batches(), 0);

    let e = DistributedSampler::new(10, 0).batches().unwrap_err();
    let msg = message(e);
    assert!(msg.contains("batch_size is 0"), "{msg}");

    let e = DistributedSampler::new(3, 1)
        .even_batches(EvenBatches::Drop)
        .shard(0, 4)
        .unwrap()
        .batches()
        .unwrap_err();
    let msg = message(e);
    assert!(
        msg.contains("smaller than the number of processes")
            && msg.contains("(3 samples)")
            && msg.contains("(4)"),
        "{msg}"
    );
}

/// The global batches (rank-major concatenation per batch index) of samplers made by `make` for
/// every rank of `w`, checking that every rank has the same number of equally sized batches.
fn global_batches(w: usize, make: impl Fn(usize) -> DistributedSampler) -> Vec<Vec<usize>> {
    let all: Vec<Vec<Vec<usize>>> = (0..w).map(|r| make(r).batches().unwrap()).collect();
    let nb = all[0].len();
    for (r, batches) in all.iter().enumerate() {
        assert_eq!(batches.len(), nb, "rank {r} of {w}: batch count");
        assert_eq!(make(r).num_batches(), nb, "rank {r} of {w}: num_batches");
        for (g, b) in batches.iter().enumerate() {
            assert_eq!(b.len(), all[0][g].len(), "rank {r} of {w}: batch {g} size");
        }
    }
    (0..nb)
        .map(|g| all.iter().flat_map(|rank| rank[g].clone()).collect())
        .collect()
}

#[test]
fn split_batches_gives_the_same_global_batches_at_any_world_size() {
    for n in lens() {
        for b in [4, 8, 12] {
            for shuffle in [false, true] {
                for drop_last in [false, true] {
                    for epoch in 0..2 {
                        let ctx = format!("n={n} b={b} shuffle={shuffle} drop_last={drop_last}");
                        let make = |w: usize| {
                            move |r: usize| {
                                let mut s = DistributedSampler::new(n, b)
                                    .shuffle(shuffle)
                                    .seed(SEED)
                                    .drop_last(drop_last)
                                    .split_batches(true)
                                    .shard(r, w)
                                    .unwrap();
                                s.set_epoch(epoch);
                                s
                            }
                        };
                        let one = global_batches(1, make(1));
                        // Every global batch is full (the last padded), or dropped with drop_last.
                        let order = expected_order(n, shuffle, SEED, epoch);
                        let expected: Vec<Vec<usize>> = if drop_last {
                            order.chunks_exact(b).map(|c| c.to_vec()).collect()
                        } else {
                            (0..n.div_ceil(b))
                                .map(|k| (k * b..(k + 1) * b).map(|p| order[p % n]).collect())
                                .collect()
                        };
                        assert_eq!(one, expected, "{ctx}: world 1");
                        for w in [2, 4] {
                            assert_eq!(global_batches(w, make(w)), one, "{ctx}: world {w}");
                            let s = make(w)(w - 1);
                            assert_eq!(s.local_batch_size(), b / w, "{ctx}");
                            assert_eq!(s.global_batch_size(), b, "{ctx}");
                            assert_eq!(s.total_padding(), make(1)(0).total_padding(), "{ctx}");
                        }
                        let padding = if drop_last { 0 } else { n.div_ceil(b) * b - n };
                        assert_eq!(make(1)(0).total_padding(), padding, "{ctx}");
                    }
                }
            }
        }
    }
}

#[test]
fn split_batches_drop_mode_cuts_only_the_last_batch() {
    for n in lens() {
        let b = 8;
        let one = global_batches(1, |r| {
            DistributedSampler::new(n, b)
                .split_batches(true)
                .even_batches(EvenBatches::Drop)
                .shard(r, 1)
                .unwrap()
        });
        for w in [2, 4] {
            if n < w {
                continue;
            }
            let got = global_batches(w, |r| {
                DistributedSampler::new(n, b)
                    .split_batches(true)
                    .even_batches(EvenBatches::Drop)
                    .shard(r, w)
                    .unwrap()
            });
            let full = n / b;
            assert_eq!(got[..full], one[..full], "n={n} w={w}");
            // No duplicates, and the last batch is the world-size multiple of the remainder.
            let flat: Vec<usize> = got.concat();
            assert_eq!(flat, (0..flat.len()).collect::<Vec<_>>(), "n={n} w={w}");
            assert_eq!(flat.len(), full * b + (n % b) / w * w, "n={n} w={w}");
        }
    }
}

#[test]
fn split_batches_needs_a_divisible_batch() {
    let e = DistributedSampler::new(20, 6)
        .split_batches(true)
        .shard(1, 4)
        .unwrap()
        .batches()
        .unwrap_err();
    let msg = message(e);
    assert!(
        msg.contains("split_batches") && msg.contains('6') && msg.contains('4'),
        "{msg}"
    );
    assert_eq!(
        DistributedSampler::new(20, 6)
            .split_batches(true)
            .shard(1, 4)
            .unwrap()
            .num_batches(),
        0
    );
    // Without split_batches, 6 per rank is fine.
    assert!(DistributedSampler::new(20, 6)
        .shard(1, 4)
        .unwrap()
        .batches()
        .is_ok());
}

/// Checks the DistributedSampler guarantees for a custom sampler on 1..=5 ranks: equal batch
/// counts and sizes, and the rank-major concatenation is the sampler's order (cycled for padding,
/// cut with EvenBatches::Drop).
fn check_custom_shards(sampler: Arc<dyn Sampler>, dataset_len: usize, epoch: u64) {
    let n = sampler.len();
    for w in 1..=5 {
        for b in [1, 3, 4] {
            for even in [EvenBatches::Pad, EvenBatches::Drop] {
                if even == EvenBatches::Drop && n < w {
                    continue;
                }
                let ctx = format!("n={n} w={w} b={b} {even:?} epoch={epoch}");
                let make = |r: usize| {
                    let mut s = DistributedSampler::new(dataset_len, b)
                        .even_batches(even)
                        .sampler(Arc::clone(&sampler))
                        .shard(r, w)
                        .unwrap();
                    s.set_epoch(epoch);
                    s
                };
                let order = make(0).order();
                assert_eq!(order, sampler.order(epoch, b * w), "{ctx}");
                let got: Vec<usize> = global_batches(w, make).concat();
                let total = match even {
                    EvenBatches::Pad => n.div_ceil(w) * w,
                    EvenBatches::Drop => n / w * w,
                };
                let expected: Vec<usize> = (0..total).map(|p| order[p % n]).collect();
                assert_eq!(got, expected, "{ctx}");
                assert_eq!(make(0).total_padding(), total.saturating_sub(n), "{ctx}");
            }
        }
    }
}

#[test]
fn weighted_sampler_shards_evenly_and_is_seeded_per_epoch() {
    // Samples 2 and 5 have weight 0 and are never drawn.
    let weights = vec![1.0, 2.0, 0.0, 0.5, 4.0, 0.0, 1.0];
    for num_samples in [1, 7, 23, 100] {
        let sampler = WeightedSampler::new(weights.clone(), num_samples)
            .unwrap()
            .seed(9);
        assert_eq!(sampler.len(), num_samples);
        assert_eq!(sampler.num_weights(), 7);
        for epoch in 0..3 {
            let order = sampler.order(epoch, 4);
            assert_eq!(order.len(), num_samples);
            assert!(
                order.iter().all(|&i| i < 7 && i != 2 && i != 5),
                "{order:?}"
            );
            // Same seed and epoch: same draws (on every rank); another seed: other draws.
            assert_eq!(order, sampler.clone().order(epoch, 99));
            check_custom_shards(Arc::new(sampler.clone()), 7, epoch);
        }
        if num_samples >= 23 {
            assert_ne!(sampler.order(0, 4), sampler.order(1, 4));
            assert_ne!(sampler.order(0, 4), sampler.clone().seed(10).order(0, 4));
        }
    }

    // Frequencies follow the weights.
    let sampler = WeightedSampler::new(vec![1.0, 3.0], 20_000).unwrap();
    let ones = sampler.order(0, 1).iter().filter(|&&i| i == 1).count();
    let share = ones as f64 / 20_000.0;
    assert!((share - 0.75).abs() < 0.02, "share of index 1: {share}");
}

#[test]
fn weighted_sampler_errors_name_the_problem() {
    let cases: Vec<(Vec<f64>, usize, &str)> = vec![
        (vec![], 4, "got none"),
        (vec![1.0, -2.0], 4, "weight 1 is -2"),
        (vec![1.0, f64::NAN], 4, "weight 1 is NaN"),
        (vec![1.0, f64::INFINITY], 4, "weight 1 is inf"),
        (vec![0.0, 0.0], 4, "all 2 weights are 0"),
        (vec![1.0], 0, "num_samples is 0"),
    ];
    for (weights, num_samples, want) in cases {
        let msg = message(WeightedSampler::new(weights.clone(), num_samples).unwrap_err());
        assert!(msg.contains(want), "{weights:?}: {msg}");
    }
    // Weights for 10 samples on a dataset of 4: the loader names the out-of-range index.
    let mut weights = vec![0.0; 10];
    weights[7] = 1.0;
    let sampler = Arc::new(WeightedSampler::new(weights, 3).unwrap());
    let msg = message(
        DistributedSampler::new(4, 2)
            .sampler(sampler)
            .batches()
            .unwrap_err(),
    );
    assert!(msg.contains("index 7") && msg.contains("len 4"), "{msg}");
}

#[test]
fn length_grouped_batches_hold_similar_lengths_in_shuffled_order() {
    // 101 samples with distinct lengths 0..=100 in scrambled order.
    let n = 101;
    let lengths: Vec<usize> = (0..n).map(|i| (i * 37) % n).collect();
    for w in 1..=4 {
        let b = 3;
        let g = b * w;
        // One group spanning the dataset: each full global batch is a run of consecutive lengths.
        let sampler = LengthGroupedSampler::new(lengths.clone())
            .unwrap()
            .group_factor(1000)
            .unwrap()
            .seed(5);
        let global = global_batches(w, |r| {
            DistributedSampler::new(n, b)
                .even_batches(EvenBatches::Drop)
                .sampler(Arc::new(sampler.clone()))
                .shard(r, w)
                .unwrap()
        });
        let full = n / g;
        assert_eq!(global.len(), full + usize::from((n % g) / w > 0), "w={w}");
        let mut firsts = Vec::new();
        for batch in &global[..full] {
            let ls: Vec<usize> = batch.iter().map(|&i| lengths[i]).collect();
            let (min, max) = (ls.iter().min().unwrap(), ls.iter().max().unwrap());
            assert_eq!(max - min, g - 1, "w={w}: {ls:?}");
            firsts.push(*max);
        }
        // The batch order is shuffled, not longest-first.
        let mut sorted = firsts.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        assert_ne!(firsts, sorted, "w={w}");
        // No sample twice (EvenBatches::Drop).
        let mut all: Vec<usize> = global.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), global.concat().len());
    }

    // Small groups: each global batch is sorted within its group only; still sharded evenly.
    let sampler = LengthGroupedSampler::new(lengths.clone())
        .unwrap()
        .group_factor(1)
        .unwrap();
    for epoch in 0..3 {
        check_custom_shards(Arc::new(sampler.clone()), n, epoch);
        let order = sampler.order(epoch, 4);
        for batch in order.chunks_exact(4) {
            let ls: Vec<usize> = batch.iter().map(|&i| lengths[i]).collect();
            assert!(ls.windows(2).all(|p| p[0] >= p[1]), "{ls:?}");
        }
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "a permutation");
    }
    assert_ne!(sampler.order(0, 4), sampler.order(1, 4));
    let default = LengthGroupedSampler::new(lengths.clone()).unwrap();
    check_custom_shards(Arc::new(default), n, 0);

    let msg = message(LengthGroupedSampler::new(vec![]).unwrap_err());
    assert!(msg.contains("lengths"), "{msg}");
    let msg = message(
        LengthGroupedSampler::new(vec![1])
            .unwrap()
            .group_factor(0)
            .unwrap_err(),
    );
    assert!(msg.contains("group_factor"), "{msg}");
}
