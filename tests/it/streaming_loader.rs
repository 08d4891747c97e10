//! StreamingLoader behaviour: shard files, equal steps per rank, resume at another world size,
//! last-batch flags, prefetch, text-line options and errors, parallel decoding.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_rs::{Batch, DataLoader, EvenBatches, SamplePosition, StreamingLoader, TextLines};
use accelerate_rs::{Error, Result};
use candle_core::{Device, Tensor};

use crate::data_loader::{dataset_of, ids, seen, seen_batch, Seen, F};

/// Lines per shard file: uneven, one empty file; 22 samples in all.
const SHARDS: [usize; 6] = [5, 0, 1, 11, 3, 2];
const NS: usize = 22;

/// A directory of shard files `shard-k.txt` holding the sample ids 0..NS in order (one per
/// line), plus a hidden file and a subdirectory that are not shards.
fn shard_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut next = 0;
    for (k, &lines) in SHARDS.iter().enumerate() {
        let text: String = (next..next + lines).map(|i| format!("{i}\n")).collect();
        next += lines;
        std::fs::write(dir.path().join(format!("shard-{k}.txt")), text).unwrap();
    }
    std::fs::write(dir.path().join(".hidden"), "999\n").unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub").join("x.txt"), "998\n").unwrap();
    dir
}

/// Parses a line holding a sample id into `dataset()`'s sample of that id.
fn parse_id(line: &str) -> Result<Vec<Tensor>> {
    let i: usize = line
        .trim()
        .parse()
        .map_err(|e| Error::data(format!("not an id: {e}")))?;
    let x: Vec<f32> = (0..F).map(|f| (i * 10 + f) as f32).collect();
    Ok(vec![
        Tensor::from_vec(x, F, &Device::Cpu)?,
        Tensor::new(1000 + i as u32, &Device::Cpu)?,
    ])
}

type Lines = TextLines<fn(&str) -> Result<Vec<Tensor>>>;

fn lines(dir: &Path) -> Lines {
    TextLines::from_dir(dir, parse_id as fn(&str) -> Result<Vec<Tensor>>).unwrap()
}

fn stream_seen(loader: &StreamingLoader<Lines>) -> Vec<Seen> {
    loader
        .iter()
        .unwrap()
        .map(|b| seen_batch(&b.unwrap()))
        .collect()
}

#[test]
fn streaming_shards_give_equal_steps_and_match_the_map_style_loader() {
    let dir = shard_dir();
    let data = Arc::new(lines(dir.path()));
    assert_eq!(data.files().len(), SHARDS.len());
    // (even_batches, drop_last, split_batches)
    let modes = [
        (EvenBatches::Pad, false, false),
        (EvenBatches::Pad, true, false),
        (EvenBatches::Drop, false, false),
        (EvenBatches::Drop, true, false),
        (EvenBatches::Pad, false, true),
        (EvenBatches::Pad, true, true),
        (EvenBatches::Drop, false, true),
    ];
    for world in 1..=5 {
        for b in 1..=4 {
            for (even, drop_last, split) in modes {
                let batch = if split { b * world } else { b };
                let ctx = format!(
                    "world {world} batch {batch} {even:?} drop_last {drop_last} split {split}"
                );
                let per_rank: Vec<Vec<Seen>> = (0..world)
                    .map(|r| {
                        let stream = StreamingLoader::from_arc(Arc::clone(&data), batch)
                            .even_batches(even)
                            .drop_last(drop_last)
                            .split_batches(split)
                            .prefetch(r % 2 * 2)
                            .num_workers((r + b) % 4)
                            .shard(r, world)
                            .unwrap();
                        let map = DataLoader::new(dataset_of(NS), batch)
                            .even_batches(even)
                            .drop_last(drop_last)
                            .split_batches(split)
                            .shard(r, world)
                            .unwrap();
                        let got = stream_seen(&stream);
                        assert_eq!(got, seen(&map), "{ctx}: rank {r} same as map-style");
                        got
                    })
                    .collect();
                let nb = per_rank[0].len();
                assert!(per_rank.iter().all(|r| r.len() == nb), "{ctx}: equal steps");
                // Every sample exactly once, apart from the documented padding or dropping.
                let mut gathered: Vec<usize> = Vec::new();
                for g in 0..nb {
                    for rank in &per_rank {
                        gathered.extend(&rank[g].0);
                    }
                }
                let padding = per_rank[0].last().map_or(0, |l| l.3);
                gathered.truncate(gathered.len() - padding);
                let mut sorted = gathered.clone();
                sorted.sort_unstable();
                sorted.dedup();
                assert_eq!(sorted.len(), gathered.len(), "{ctx}: no repeats");
                assert_eq!(gathered, (0..gathered.len()).collect::<Vec<_>>(), "{ctx}");
                let global = batch * if split { 1 } else { world };
                let dropped = NS - gathered.len();
                match (even, drop_last) {
                    (EvenBatches::Pad, false) => assert_eq!(dropped, 0, "{ctx}"),
                    (EvenBatches::Drop, false) if !split => assert!(dropped < world, "{ctx}"),
                    _ => assert!(dropped < global, "{ctx}"),
                }
            }
        }
    }
}

#[test]
fn streaming_resume_is_sample_exact_at_another_world_size() {
    let dir = shard_dir();
    let data = Arc::new(lines(dir.path()));
    let loader = |world: usize, batch: usize, rank: usize| {
        StreamingLoader::from_arc(Arc::clone(&data), batch)
            .shard(rank, world)
            .unwrap()
    };
    // (world, batch, batches done) then (world, batch) to resume with.
    for ((w1, b1, done), (w2, b2)) in [
        ((4, 2, 1), (2, 3)),
        ((2, 2, 3), (3, 1)),
        ((4, 1, 4), (2, 2)),
        ((3, 2, 2), (3, 2)),
        ((1, 5, 2), (5, 1)),
    ] {
        let ctx = format!("{w1}x{b1} after {done} -> {w2}x{b2}");
        // The first run: every rank takes `done` batches and reports the same position.
        let mut first: Vec<usize> = Vec::new();
        let mut positions = Vec::new();
        let per_rank: Vec<Vec<Vec<usize>>> = (0..w1)
            .map(|r| {
                let mut it = loader(w1, b1, r).iter().unwrap();
                assert_eq!(it.position(), SamplePosition::default());
                let got: Vec<Vec<usize>> = (0..done)
                    .map(|_| ids(&it.next().unwrap().unwrap()))
                    .collect();
                positions.push(it.position());
                got
            })
            .collect();
        for g in 0..done {
            for rank in &per_rank {
                first.extend(&rank[g]);
            }
        }
        assert!(positions.iter().all(|p| *p == positions[0]), "{ctx}");
        let position = positions[0];
        assert_eq!(
            position.samples as usize,
            first.len(),
            "{ctx}: counted in samples"
        );
        // Through a checkpoint.
        let json = serde_json::to_string(&position).unwrap();
        let position: SamplePosition = serde_json::from_str(&json).unwrap();

        // The resumed run at another world size sees exactly the rest.
        let resumed: Vec<Vec<Seen>> = (0..w2)
            .map(|r| {
                let mut l = loader(w2, b2, r);
                l.resume_from(position);
                assert_eq!(l.start_position(), position);
                stream_seen(&l)
            })
            .collect();
        let nb = resumed[0].len();
        let mut rest: Vec<usize> = Vec::new();
        for g in 0..nb {
            for rank in &resumed {
                assert_eq!(rank.len(), nb, "{ctx}: equal steps");
                rest.extend(&rank[g].0);
            }
        }
        rest.truncate(rest.len() - resumed[0].last().map_or(0, |l| l.3));
        first.extend(rest);
        assert_eq!(first, (0..NS).collect::<Vec<_>>(), "{ctx}");

        if (w1, b1) == (w2, b2) {
            // Same world size: exactly the tail of the uninterrupted run, indices included.
            for (r, rank) in resumed.iter().enumerate() {
                let whole = stream_seen(&loader(w1, b1, r));
                assert_eq!(rank[..], whole[done..], "{ctx}: rank {r}");
            }
        }
    }

    // At the end of the epoch the position is the number of records; resuming there yields
    // nothing; past it is an error naming the position.
    let mut it = loader(2, 3, 1).iter().unwrap();
    let count = it.by_ref().count();
    assert_eq!(count, 4);
    let end = it.position();
    assert_eq!(
        end,
        SamplePosition {
            epoch: 0,
            samples: NS as u64
        }
    );
    let mut l = loader(3, 2, 0);
    l.resume_from(end);
    assert_eq!(l.iter().unwrap().count(), 0);
    l.resume_from(SamplePosition {
        epoch: 0,
        samples: 30,
    });
    let items: Vec<_> = l.iter().unwrap().collect();
    assert_eq!(items.len(), 1);
    let msg = items[0].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("30 samples") && msg.contains("past the end") && msg.contains("22"),
        "{msg}"
    );
    // Another epoch drops the resume position.
    l.set_epoch(1);
    assert_eq!(
        l.start_position(),
        SamplePosition {
            epoch: 1,
            samples: 0
        }
    );
}

#[test]
fn streaming_last_batch_flags_and_prefetch() {
    let dir = shard_dir();
    let data = Arc::new(lines(dir.path()));
    for prefetch in [0, 1, 3] {
        // 22 records, batch 4 on 2 ranks: global batches 8, 8, 6 -> 3 steps, last one 3 each.
        let l = StreamingLoader::from_arc(Arc::clone(&data), 4)
            .prefetch(prefetch)
            .shard(1, 2)
            .unwrap();
        let batches: Vec<Batch> = l.iter().unwrap().map(|b| b.unwrap()).collect();
        assert_eq!(batches.len(), 3);
        assert_eq!(
            batches.iter().map(|b| b.is_last()).collect::<Vec<_>>(),
            vec![false, false, true]
        );
        assert_eq!(batches[2].num_batches(), 3);
        assert_eq!(ids(&batches[2]), vec![19, 20, 21]);
        // Dropping an iterator early stops its thread.
        let mut it = l.iter().unwrap();
        it.next().unwrap().unwrap();
        drop(it);
    }
    // Full global batches only: the last full one knows it is last.
    let l = StreamingLoader::from_arc(Arc::clone(&data), 11)
        .shard(0, 2)
        .unwrap();
    let batches: Vec<Batch> = l.iter().unwrap().map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 1);
    assert!(batches[0].is_last());
}

#[test]
fn text_lines_options_and_errors_name_the_problem() {
    let dir = shard_dir();
    let parse = parse_id as fn(&str) -> Result<Vec<Tensor>>;
    // Shuffled file order: differs per epoch, the same for every rank, still every sample once.
    let data = Arc::new(lines(dir.path()).shuffle_files(3));
    assert_ne!(data.files_for_epoch(0), data.files_for_epoch(1));
    for epoch in 0..3 {
        let run = |rank: usize| {
            let mut l = StreamingLoader::from_arc(Arc::clone(&data), 2)
                .shard(rank, 2)
                .unwrap();
            l.set_epoch(epoch);
            collect_stream(&l)
        };
        let (r0, r1) = (run(0), run(1));
        let mut all: Vec<usize> = r0.iter().chain(&r1).flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..NS).collect::<Vec<_>>(), "epoch {epoch}");
        assert_eq!(run(0), r0, "epoch {epoch}: deterministic");
    }

    let msg = TextLines::new(Vec::<PathBuf>::new(), parse)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("files") && msg.contains("at least one"),
        "{msg}"
    );
    let missing = dir.path().join("nope");
    let msg = TextLines::from_dir(&missing, parse)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("nope"), "{msg}");
    let empty = tempfile::tempdir().unwrap();
    let msg = TextLines::from_dir(empty.path(), parse)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("holds no files"), "{msg}");

    // A missing file is named when reached; a bad line is named by file and line.
    let l = StreamingLoader::new(
        TextLines::new(vec![dir.path().join("shard-0.txt"), missing.clone()], parse).unwrap(),
        2,
    );
    let items: Vec<_> = l.iter().unwrap().collect();
    let msg = items.last().unwrap().as_ref().unwrap_err().to_string();
    assert!(msg.contains("cannot open") && msg.contains("nope"), "{msg}");
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, "0\n1\n\nx2\n").unwrap();
    let items: Vec<_> = StreamingLoader::new(TextLines::new(vec![bad.clone()], parse).unwrap(), 1)
        .prefetch(0)
        .iter()
        .unwrap()
        .collect();
    assert_eq!(
        items.len(),
        3,
        "two good lines, then the error ends the epoch"
    );
    let msg = items[2].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("bad.txt:3") && msg.contains("not an id"),
        "{msg}"
    );
    // Skipping blank lines, the bad line is line 4.
    let items: Vec<_> = StreamingLoader::new(
        TextLines::new(vec![bad.clone()], parse)
            .unwrap()
            .skip_empty_lines(true),
        1,
    )
    .iter()
    .unwrap()
    .collect();
    let msg = items.last().unwrap().as_ref().unwrap_err().to_string();
    assert!(msg.contains("bad.txt:4"), "{msg}");
    // Invalid UTF-8 is a read error naming the line.
    std::fs::write(&bad, b"0\n\xff\xfe\n").unwrap();
    let items: Vec<_> = StreamingLoader::new(TextLines::new(vec![bad], parse).unwrap(), 1)
        .iter()
        .unwrap()
        .collect();
    let msg = items.last().unwrap().as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("bad.txt:2") && msg.contains("cannot read"),
        "{msg}"
    );

    // Settings errors.
    let msg = StreamingLoader::new(lines(dir.path()), 0)
        .iter()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("batch_size is 0"), "{msg}");
    let msg = StreamingLoader::new(lines(dir.path()), 6)
        .split_batches(true)
        .shard(0, 4)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("6 does not divide by 4"), "{msg}");
}

#[test]
fn streaming_workers_decode_in_parallel_yield_in_order_and_end_on_errors() {
    let dir = shard_dir();
    // Which threads decoded: worker k takes batches k, k + n, ...
    let threads = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let seen_by = Arc::clone(&threads);
    let data = Arc::new(
        TextLines::from_dir(dir.path(), move |line: &str| {
            let name = std::thread::current().name().unwrap_or("?").to_string();
            seen_by.lock().unwrap().insert(name);
            parse_id(line)
        })
        .unwrap(),
    );
    let positions = |workers: usize, resume: u64| {
        let mut l = StreamingLoader::from_arc(Arc::clone(&data), 2)
            .num_workers(workers)
            .shard(1, 2)
            .unwrap();
        l.resume_from(SamplePosition {
            epoch: 0,
            samples: resume,
        });
        let mut it = l.iter().unwrap();
        let mut out = Vec::new();
        while let Some(b) = it.next() {
            out.push((ids(&b.unwrap()), it.position()));
        }
        out
    };
    for resume in [0, 4, 7] {
        let one = positions(1, resume);
        assert!(one.len() >= 3, "resume {resume}: {} batches", one.len());
        for workers in [2, 3, 5] {
            assert_eq!(
                positions(workers, resume),
                one,
                "{workers} workers, resume {resume}"
            );
        }
    }
    let names = threads.lock().unwrap().clone();
    let workers: Vec<_> = names
        .iter()
        .filter(|n| n.starts_with("accelerate-stream-worker-"))
        .collect();
    assert!(workers.len() >= 3, "decoded by {names:?}");

    // A bad line: the same good batches, then one error naming it, then the end.
    let bad = dir.path().join("bad.txt");
    let text: String = (0..9).map(|i| format!("{i}\n")).collect::<String>() + "x9\n10\n";
    std::fs::write(&bad, text).unwrap();
    let parse = parse_id as fn(&str) -> Result<Vec<Tensor>>;
    let run = |workers: usize| {
        let l = StreamingLoader::new(TextLines::new(vec![bad.clone()], parse).unwrap(), 2)
            .num_workers(workers);
        l.iter()
            .unwrap()
            .map(|b| b.map(|b| ids(&b)).map_err(|e| e.to_string()))
            .collect::<Vec<_>>()
    };
    let one = run(1);
    assert_eq!(one.len(), 5, "{one:?}");
    let msg = one[4].as_ref().unwrap_err();
    assert!(
        msg.contains("bad.txt:10") && msg.contains("not an id"),
        "{msg}"
    );
    for workers in [2, 3, 4] {
        assert_eq!(run(workers), one, "{workers} workers");
    }

    // A decoder that panics is an error naming the worker, not a hang.
    let panicky = TextLines::new(vec![bad.clone()], |line: &str| {
        if line.starts_with('x') {
            panic!("test decoder panics on {line}");
        }
        parse_id(line)
    })
    .unwrap();
    let items: Vec<_> = StreamingLoader::new(panicky, 2)
        .num_workers(3)
        .iter()
        .unwrap()
        .collect();
    assert_eq!(items.len(), 5, "four good batches, then the error");
    let msg = items[4].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("worker 1") && msg.contains("panicked"),
        "{msg}"
    );

    // Dropping the iterator mid-epoch stops every thread (the test would hang otherwise).
    let l = StreamingLoader::from_arc(Arc::clone(&data), 1)
        .num_workers(4)
        .prefetch(1);
    let mut it = l.iter().unwrap();
    it.next().unwrap().unwrap();
    drop(it);
}

fn collect_stream(loader: &StreamingLoader<Lines>) -> Vec<Vec<usize>> {
    loader.iter().unwrap().map(|b| ids(&b.unwrap())).collect()
}
