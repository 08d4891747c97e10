//! Properties of the per-rank batch plan over many (len, world, batch size, shuffle, epoch) cases.

use std::collections::HashMap;

use accelerate_rs::Error;
use accelerate_rs::{DistributedSampler, EvenBatches};
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
