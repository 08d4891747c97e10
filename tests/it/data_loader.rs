//! DataLoader behaviour: collation, prefetching, early drop, errors, sharding, epochs, device.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_rs::{
    Batch, DataLoader, Dataset, EvenBatches, LengthGroupedSampler, SamplePosition, TensorDataset,
    WeightedSampler,
};
use accelerate_rs::{Error, Result};
use candle_core::{DType, Device, Tensor};

pub(crate) const N: usize = 23;
pub(crate) const F: usize = 4;

/// x[i] = [i*10, i*10+1, i*10+2, i*10+3], y[i] = 1000 + i.
pub(crate) fn dataset() -> TensorDataset {
    dataset_of(N)
}

/// `dataset()` with `n` samples.
pub(crate) fn dataset_of(n: usize) -> TensorDataset {
    let x: Vec<f32> = (0..n * F).map(|k| ((k / F) * 10 + k % F) as f32).collect();
    let y: Vec<u32> = (0..n as u32).map(|i| 1000 + i).collect();
    let x = Tensor::from_vec(x, (n, F), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(y, n, &Device::Cpu).unwrap();
    TensorDataset::new(vec![x, y]).unwrap()
}

/// Reads the sample ids out of a batch, checking that features and labels agree.
pub(crate) fn ids(batch: &Batch) -> Vec<usize> {
    let x = batch[0].to_vec2::<f32>().unwrap();
    let y = batch[1].to_vec1::<u32>().unwrap();
    assert_eq!(x.len(), y.len());
    x.iter()
        .zip(&y)
        .map(|(row, &label)| {
            let i = (label - 1000) as usize;
            let expected: Vec<f32> = (0..F).map(|f| (i * 10 + f) as f32).collect();
            assert_eq!(row, &expected, "features follow label {label}");
            i
        })
        .collect()
}

pub(crate) fn collect(loader: &DataLoader) -> Vec<Vec<usize>> {
    loader.iter().unwrap().map(|b| ids(&b.unwrap())).collect()
}

#[test]
fn tensor_dataset_collates_selected_rows() {
    let ds = dataset();
    assert_eq!(ds.len(), N);
    let batch = ds.get_batch(&[5, 0, 22, 5]).unwrap();
    assert_eq!(batch[0].dims(), &[4, F]);
    assert_eq!(batch[1].dims(), &[4]);
    assert_eq!(
        batch[1].to_vec1::<u32>().unwrap(),
        vec![1005, 1000, 1022, 1005]
    );
    assert_eq!(
        batch[0].to_vec2::<f32>().unwrap()[2],
        vec![220.0, 221.0, 222.0, 223.0]
    );
    let sample = ds.get(3).unwrap();
    assert_eq!(
        sample[0].to_vec1::<f32>().unwrap(),
        vec![30.0, 31.0, 32.0, 33.0]
    );
    assert_eq!(sample[1].to_scalar::<u32>().unwrap(), 1003);

    // The loader yields the plan's rows, in order, with labels following features.
    let loader = DataLoader::new(ds.clone(), 5).shuffle(true).seed(7);
    let got = collect(&loader);
    assert_eq!(got, loader.sampler().batches().unwrap());
    assert_eq!(got.len(), loader.len());
    assert_eq!(got.len(), 5);
    assert_eq!(got[4].len(), 3);

    let plain = DataLoader::new(ds, 5);
    let got: Vec<usize> = collect(&plain).concat();
    assert_eq!(got, (0..N).collect::<Vec<_>>());
}

#[test]
fn tensor_dataset_errors() {
    let x = Tensor::zeros((5, 2), DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap();
    let msg = TensorDataset::new(vec![x.clone(), y])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("tensor 1") && msg.contains('4') && msg.contains('5'),
        "{msg}"
    );
    let msg = TensorDataset::new(vec![]).unwrap_err().to_string();
    assert!(msg.contains("at least one tensor"), "{msg}");

    let ds = TensorDataset::new(vec![x]).unwrap();
    let msg = ds.get_batch(&[1, 9]).unwrap_err().to_string();
    assert!(msg.contains("index 9") && msg.contains("len 5"), "{msg}");
    let msg = ds.get(5).unwrap_err().to_string();
    assert!(msg.contains("index 5") && msg.contains("len 5"), "{msg}");
}

/// A dataset whose samples are built one by one (default `get_batch`), optionally slow, failing
/// at one index, or with a ragged sample.
struct Synthetic {
    len: usize,
    delay: Duration,
    fail_at: Option<usize>,
    ragged_at: Option<usize>,
    gets: Arc<AtomicUsize>,
}

impl Synthetic {
    fn new(len: usize) -> Self {
        Synthetic {
            len,
            delay: Duration::ZERO,
            fail_at: None,
            ragged_at: None,
            gets: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl Dataset for Synthetic {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        if self.fail_at == Some(index) {
            return Err(Error::data(format!("cannot read sample {index}")));
        }
        let width = if self.ragged_at == Some(index) { 3 } else { 2 };
        let x = Tensor::full(index as f32, width, &Device::Cpu)?;
        let y = Tensor::new(index as u32, &Device::Cpu)?;
        Ok(vec![x, y])
    }
}

#[test]
fn default_get_batch_stacks_and_names_bad_samples() {
    let ds = Synthetic::new(10);
    let b = ds.get_batch(&[3, 1]).unwrap();
    assert_eq!(b[0].dims(), &[2, 2]);
    assert_eq!(b[1].to_vec1::<u32>().unwrap(), vec![3, 1]);

    let mut ds = Synthetic::new(10);
    ds.ragged_at = Some(6);
    let msg = ds.get_batch(&[2, 6]).unwrap_err().to_string();
    assert!(
        msg.contains("sample 6") && msg.contains("[3]") && msg.contains("[2]"),
        "{msg}"
    );
}

#[test]
fn prefetch_matches_synchronous() {
    for prefetch in [1, 2, 8] {
        for world in 1..=3 {
            for rank in 0..world {
                let base = DataLoader::new(dataset(), 4)
                    .shuffle(true)
                    .seed(3)
                    .shard(rank, world)
                    .unwrap();
                let sync: Vec<_> = base
                    .clone()
                    .prefetch(0)
                    .iter()
                    .unwrap()
                    .map(|b| {
                        let b = b.unwrap();
                        (ids(&b), b.index(), b.padding(), b.is_last())
                    })
                    .collect();
                let pre: Vec<_> = base
                    .prefetch(prefetch)
                    .iter()
                    .unwrap()
                    .map(|b| {
                        let b = b.unwrap();
                        (ids(&b), b.index(), b.padding(), b.is_last())
                    })
                    .collect();
                assert_eq!(sync, pre, "prefetch {prefetch} rank {rank}/{world}");
                assert!(sync.last().unwrap().3);
            }
        }
    }
}

#[test]
fn early_dropped_iterator_does_not_hang() {
    let start = Instant::now();
    for round in 0..50 {
        let mut ds = Synthetic::new(1000);
        ds.delay = Duration::from_millis(1);
        let gets = Arc::clone(&ds.gets);
        let loader = DataLoader::new(ds, 2).prefetch(2);
        let mut it = loader.iter().unwrap();
        assert_eq!(it.len(), 500);
        if round % 2 == 0 {
            let first = it.next().unwrap().unwrap();
            assert_eq!(first.index(), 0);
            assert_eq!(it.len(), 499);
        }
        drop(it);
        // The producer stopped: no more gets after the drop returned.
        let after_drop = gets.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(gets.load(Ordering::SeqCst), after_drop, "round {round}");
        assert!(after_drop <= 2 * 5, "round {round}: {after_drop} gets");
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn dataset_error_surfaces_and_ends_the_epoch() {
    for prefetch in [0, 2] {
        let mut ds = Synthetic::new(20);
        ds.fail_at = Some(13);
        let loader = DataLoader::new(ds, 4).prefetch(prefetch);
        let items: Vec<_> = loader.iter().unwrap().collect();
        // Batches 0..=2 are fine; batch 3 (indices 12..16) fails; nothing after it.
        assert_eq!(items.len(), 4, "prefetch {prefetch}");
        assert!(items[..3].iter().all(|b| b.is_ok()));
        let msg = items[3].as_ref().unwrap_err().to_string();
        assert!(msg.contains("13"), "prefetch {prefetch}: {msg}");
    }
}

#[test]
fn iter_validates() {
    let msg = DataLoader::new(dataset(), 0)
        .iter()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("batch_size is 0"), "{msg}");
    let msg = DataLoader::new(Synthetic::new(0), 2)
        .iter()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("empty"), "{msg}");
    let msg = DataLoader::new(dataset(), 2)
        .shard(2, 2)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("rank 2") && msg.contains("num_replicas 2"),
        "{msg}"
    );
    let msg = DataLoader::new(Synthetic::new(3), 2)
        .even_batches(EvenBatches::Drop)
        .shard(0, 4)
        .unwrap()
        .iter()
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("smaller than the number of processes"),
        "{msg}"
    );
}

#[test]
fn sharded_loader_covers_the_dataset() {
    let world = 2;
    let loaders: Vec<DataLoader> = (0..world)
        .map(|r| {
            DataLoader::new(dataset(), 4)
                .shuffle(true)
                .seed(11)
                .shard(r, world)
                .unwrap()
        })
        .collect();
    let per_rank: Vec<Vec<Vec<usize>>> = loaders.iter().map(collect).collect();
    assert_eq!(per_rank[0].len(), per_rank[1].len());
    assert_eq!(loaders[0].len(), per_rank[0].len());
    assert_eq!(loaders[1].rank(), 1);
    assert_eq!(loaders[1].world_size(), 2);
    // N = 23 over 2 ranks: 12 each, one padding sample, on rank 1's last batch.
    assert_eq!(loaders[0].total_padding(), 1);
    assert_eq!(loaders[0].padding_in_last_batch(), 0);
    assert_eq!(loaders[1].padding_in_last_batch(), 1);
    let mut gathered: Vec<usize> = Vec::new();
    for (b0, b1) in per_rank[0].iter().zip(&per_rank[1]) {
        gathered.extend(b0);
        gathered.extend(b1);
    }
    gathered.truncate(gathered.len() - loaders[0].total_padding());
    let mut sorted = gathered.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..N).collect::<Vec<_>>());

    let last = loaders[1].iter().unwrap().last().unwrap().unwrap();
    assert!(last.is_last());
    assert_eq!(last.padding(), 1);
}

#[test]
fn set_epoch_changes_the_order() {
    let mut loader = DataLoader::new(dataset(), 4).shuffle(true).seed(5);
    let e0 = collect(&loader);
    assert_eq!(collect(&loader), e0, "same epoch, same order");
    loader.set_epoch(1);
    assert_eq!(loader.epoch(), 1);
    let e1 = collect(&loader);
    assert_ne!(e0, e1);
    let mut flat = e1.concat();
    flat.sort_unstable();
    assert_eq!(flat, (0..N).collect::<Vec<_>>());
}

#[test]
fn device_is_honoured() {
    let device = Device::Cpu;
    let loader = DataLoader::new(Arc::new(dataset()), 8).device(&device);
    assert!(loader.target_device().same_device(&device));
    for batch in loader.iter().unwrap() {
        let batch = batch.unwrap();
        for t in batch.iter() {
            assert!(t.device().same_device(&device));
        }
        let tensors = batch.into_tensors();
        assert_eq!(tensors.len(), 2);
    }
    let shared: Arc<dyn Dataset> = Arc::new(dataset());
    let loader = DataLoader::from_arc(Arc::clone(&shared), 8);
    assert_eq!(loader.dataset().len(), N);
    assert_eq!(loader.batch_size(), 8);
}

/// `dataset()` whose batches take uneven times to build (later batches often finish first).
struct Jittery(TensorDataset);

impl Dataset for Jittery {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        self.0.get(index)
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        let first = indices.first().copied().unwrap_or(0);
        std::thread::sleep(Duration::from_micros(((first * 7919) % 5) as u64 * 400));
        self.0.get_batch(indices)
    }
}

pub(crate) type Seen = (Vec<usize>, usize, usize, usize, bool);

/// What a test compares of a batch: its sample ids, index, padding, global padding and
/// last-batch flag.
pub(crate) fn seen_batch(b: &Batch) -> Seen {
    (
        ids(b),
        b.index(),
        b.padding(),
        b.global_padding(),
        b.is_last(),
    )
}

pub(crate) fn seen(loader: &DataLoader) -> Vec<Seen> {
    loader
        .iter()
        .unwrap()
        .map(|b| seen_batch(&b.unwrap()))
        .collect()
}

#[test]
fn workers_yield_the_same_batches_as_one_worker() {
    for world in 1..=3 {
        for rank in 0..world {
            let base = DataLoader::new(Jittery(dataset()), 2)
                .shuffle(true)
                .seed(17)
                .shard(rank, world)
                .unwrap();
            assert_eq!(base.workers(), 1);
            let one = seen(&base);
            assert_eq!(one.len(), base.len());
            let mut resumed_one = base.clone();
            resumed_one.resume_at(0, 2);
            let resumed_one = seen(&resumed_one);
            assert_eq!(resumed_one[..], one[2..]);
            for workers in [0, 2, 3, 5, 16] {
                for prefetch in [0, 1, 4] {
                    let ctx = format!("rank {rank}/{world} workers {workers} prefetch {prefetch}");
                    let loader = base.clone().num_workers(workers).prefetch(prefetch);
                    assert_eq!(seen(&loader), one, "{ctx}");
                    let mut resumed = loader.clone();
                    resumed.resume_at(0, 2);
                    assert_eq!(seen(&resumed), resumed_one, "{ctx}: resumed");
                }
            }
        }
    }
}

#[test]
fn workers_surface_errors_at_the_same_batch_and_stop_on_drop() {
    for workers in [1, 2, 3, 8] {
        let mut ds = Synthetic::new(40);
        ds.fail_at = Some(13);
        let loader = DataLoader::new(ds, 4).num_workers(workers).prefetch(4);
        let items: Vec<_> = loader.iter().unwrap().collect();
        assert_eq!(items.len(), 4, "workers {workers}");
        assert!(items[..3].iter().all(|b| b.is_ok()));
        let msg = items[3].as_ref().unwrap_err().to_string();
        assert!(msg.contains("13"), "workers {workers}: {msg}");
    }
    for round in 0..10 {
        let mut ds = Synthetic::new(1000);
        ds.delay = Duration::from_millis(1);
        let gets = Arc::clone(&ds.gets);
        let loader = DataLoader::new(ds, 2).num_workers(4).prefetch(4);
        let mut it = loader.iter().unwrap();
        if round % 2 == 0 {
            assert_eq!(it.next().unwrap().unwrap().index(), 0);
        }
        drop(it);
        let after_drop = gets.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(gets.load(Ordering::SeqCst), after_drop, "round {round}");
        assert!(
            after_drop <= 2 * (4 + 4 + 1),
            "round {round}: {after_drop} gets"
        );
    }
}

#[test]
fn split_batches_gives_the_same_global_batches_at_world_sizes_1_2_4() {
    for drop_last in [false, true] {
        let run = |world: usize| -> Vec<(Vec<usize>, usize, bool)> {
            let loaders: Vec<DataLoader> = (0..world)
                .map(|r| {
                    DataLoader::new(dataset(), 8)
                        .shuffle(true)
                        .seed(21)
                        .drop_last(drop_last)
                        .split_batches(true)
                        .shard(r, world)
                        .unwrap()
                })
                .collect();
            let per_rank: Vec<Vec<Seen>> = loaders.iter().map(seen).collect();
            let nb = per_rank[0].len();
            (0..nb)
                .map(|g| {
                    let mut global = Vec::new();
                    for rank in &per_rank {
                        assert_eq!(rank.len(), nb, "world {world}: equal batch counts");
                        assert_eq!(rank[g].0.len(), 8 / world, "world {world}: batch {g}");
                        assert_eq!(rank[g].3, per_rank[0][g].3, "same global padding");
                        global.extend(&rank[g].0);
                    }
                    (global, per_rank[0][g].3, per_rank[0][g].4)
                })
                .collect()
        };
        let one = run(1);
        // N = 23, global batch 8: 3 batches, the last padded by 1 (or 2 full ones).
        assert_eq!(one.len(), if drop_last { 2 } else { 3 });
        if !drop_last {
            assert_eq!(one[2].1, 1, "global padding of the last batch");
            let mut flat: Vec<usize> = one.iter().flat_map(|b| b.0.clone()).collect();
            flat.truncate(N);
            flat.sort_unstable();
            assert_eq!(flat, (0..N).collect::<Vec<_>>());
        }
        assert!(one.last().unwrap().2);
        assert_eq!(run(2), one, "world 2, drop_last {drop_last}");
        assert_eq!(run(4), one, "world 4, drop_last {drop_last}");
    }

    let loader = DataLoader::new(dataset(), 8).split_batches(true);
    assert!(loader.is_split_batches());
    let loader = loader.shard(1, 4).unwrap();
    assert_eq!(loader.batch_size(), 8);
    assert_eq!(loader.local_batch_size(), 2);
    assert_eq!(loader.global_batch_size(), 8);
    assert_eq!(
        DataLoader::new(dataset(), 8)
            .shard(1, 4)
            .unwrap()
            .global_batch_size(),
        32
    );

    // A batch that does not divide by the world size is named, at shard or at iter.
    let msg = DataLoader::new(dataset(), 6)
        .split_batches(true)
        .shard(0, 4)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("split_batches") && msg.contains("6 does not divide by 4"),
        "{msg}"
    );
    let msg = DataLoader::new(dataset(), 6)
        .shard(0, 4)
        .unwrap()
        .split_batches(true)
        .iter()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("6 does not divide by 4"), "{msg}");
}

#[test]
fn custom_samplers_through_the_loader() {
    // Weighted: only samples with weight are drawn, on every rank the same number of batches,
    // with several workers in the same order as one.
    let mut weights = vec![0.0; N];
    for w in weights.iter_mut().step_by(3) {
        *w = 1.0;
    }
    for world in 1..=3 {
        let loaders: Vec<DataLoader> = (0..world)
            .map(|r| {
                DataLoader::new(dataset(), 3)
                    .with_sampler(WeightedSampler::new(weights.clone(), 20).unwrap().seed(4))
                    .shard(r, world)
                    .unwrap()
            })
            .collect();
        let per_rank: Vec<Vec<Vec<usize>>> = loaders.iter().map(collect).collect();
        for (r, batches) in per_rank.iter().enumerate() {
            assert_eq!(batches.len(), per_rank[0].len(), "rank {r}/{world}");
            assert!(batches.iter().flatten().all(|i| i % 3 == 0));
            let parallel = collect(&loaders[r].clone().num_workers(3));
            assert_eq!(&parallel, batches, "rank {r}/{world}: workers");
        }
        let mut flat: Vec<usize> = Vec::new();
        for g in 0..per_rank[0].len() {
            for rank in &per_rank {
                flat.extend(&rank[g]);
            }
        }
        let order = loaders[0].sampler().order();
        assert_eq!(flat[..20], order[..], "world {world}");
    }

    // Length-grouped over the loader: the per-rank batches of one global batch have close lengths.
    let lengths: Vec<usize> = (0..N).map(|i| (i * 5) % N).collect();
    let loader = DataLoader::new(dataset(), 2)
        .with_sampler(LengthGroupedSampler::new(lengths.clone()).unwrap())
        .even_batches(EvenBatches::Drop)
        .shard(0, 2)
        .unwrap();
    for batch in collect(&loader) {
        let ls: Vec<usize> = batch.iter().map(|&i| lengths[i]).collect();
        assert!(ls.windows(2).all(|p| p[0] >= p[1]), "{ls:?}");
    }
    // A sampler for another dataset is refused with the index.
    let msg = DataLoader::new(dataset(), 2)
        .with_sampler(LengthGroupedSampler::new(vec![1; N + 5]).unwrap())
        .iter()
        .unwrap_err()
        .to_string();
    assert!(msg.contains(&format!("len {N}")), "{msg}");
}

#[test]
fn map_style_resume_in_samples_is_exact_at_another_world_size() {
    // (world, batch, split) for the saved run, batches done, then (world, batch, split) resumed.
    let cases = [
        ((4, 2, false), 2, (2, 3, false)),
        ((2, 3, false), 1, (3, 1, false)),
        ((1, 4, false), 3, (4, 1, false)),
        ((4, 8, true), 1, (2, 8, true)),
        ((2, 4, false), 2, (2, 4, false)),
        ((3, 2, false), 4, (5, 1, false)),
    ];
    let make = |(world, batch, split): (usize, usize, bool), rank: usize| {
        let mut l = DataLoader::new(dataset(), batch)
            .shuffle(true)
            .seed(8)
            .split_batches(split)
            .shard(rank, world)
            .unwrap();
        l.set_epoch(2);
        l
    };
    for (saved, done, resumed) in cases {
        let ctx = format!("{saved:?} after {done} -> {resumed:?}");
        let order = make(saved, 0).sampler().order();
        let mut seen_ids: Vec<usize> = Vec::new();
        let per_rank: Vec<Vec<Vec<usize>>> = (0..saved.0)
            .map(|r| collect(&make(saved, r)).into_iter().take(done).collect())
            .collect();
        for g in 0..done {
            for rank in &per_rank {
                seen_ids.extend(&rank[g]);
            }
        }
        let position = make(saved, 0).sample_position(done);
        for r in 1..saved.0 {
            assert_eq!(make(saved, r).sample_position(done), position, "{ctx}");
        }
        assert_eq!(position.epoch, 2);
        // Counted in samples, without the padding of a finished epoch's last batch.
        assert_eq!(position.samples as usize, seen_ids.len().min(N), "{ctx}");
        seen_ids.truncate(N);
        let position: SamplePosition =
            serde_json::from_str(&serde_json::to_string(&position).unwrap()).unwrap();

        let loaders: Vec<DataLoader> = (0..resumed.0)
            .map(|r| {
                let mut l = make(resumed, r);
                l.set_epoch(0);
                l.resume_from(position);
                assert_eq!(l.epoch(), 2);
                l
            })
            .collect();
        let rest: Vec<Vec<Seen>> = loaders.iter().map(seen).collect();
        let nb = rest[0].len();
        assert!(rest.iter().all(|r| r.len() == nb), "{ctx}: equal steps");
        for g in 0..nb {
            for rank in &rest {
                seen_ids.extend(&rank[g].0);
            }
        }
        seen_ids.truncate(seen_ids.len() - rest[0].last().map_or(0, |l| l.3));
        assert_eq!(
            seen_ids, order,
            "{ctx}: every sample once, in the epoch's order"
        );
        assert_eq!(loaders[0].sample_position(nb).samples as usize, N, "{ctx}");
        if saved == resumed {
            let mut by_batches = make(saved, 0);
            by_batches.resume_at(2, done);
            assert_eq!(rest[0], seen(&by_batches), "{ctx}: same as resume_at");
        }
    }

    // Past the end: an error naming the position; at the end: nothing.
    let mut l = make((2, 2, false), 0);
    l.resume_from(SamplePosition {
        epoch: 2,
        samples: N as u64,
    });
    assert_eq!(l.iter().unwrap().count(), 0);
    l.resume_from(SamplePosition {
        epoch: 2,
        samples: 40,
    });
    let msg = l.iter().unwrap_err().to_string();
    assert!(
        msg.contains("40 samples") && msg.contains("past the end"),
        "{msg}"
    );
    l.set_epoch(3);
    assert_eq!(l.iter().unwrap().count(), l.len());
}
