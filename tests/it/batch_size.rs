//! `find_executable_batch_size`: the ranks agree on the next batch size when only some of them
//! run out of memory, wherever that happens (before `prepare`, in a forward pass, between the
//! gradient averaging and a ZeRO gather, before a user collective), in the same processes; the
//! retried run equals a run started at the final size. A failure after the probing phase is a
//! fatal error naming the rank and nobody hangs; another error while probing stops every rank
//! naming the failed one.
//!
//! In-process ranks (threads) inject `Error::OutOfMemory` from the training closure; the
//! multi-process test runs 3 ranks over loopback where one of them has the simulated memory
//! limit `ACCELERATE_RS_TEST_MEMORY_LIMIT` (its backward pass fails at large batches).

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::common::tiny::{dataset, forward, max_abs_diff, params, snapshot, HIDDEN};
use crate::common::{free_port, in_process_with, Children};
use accelerate_rs::collective::{fallback, Buffer, BufferMut, Collective, Gate, OwnedBuffer};
use accelerate_rs::optim::{Sgd, SgdConfig};
use accelerate_rs::{Accelerator, BatchSizeSearch, DataLoader, Error, ReduceOp};
use candle_core::Tensor;
use candle_nn::{loss, Optimizer};

/// Where a training attempt can fail: before `prepare`, before a step's forward pass, or
/// between the gradient averaging and the optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    Start,
    Forward(usize),
    Step(usize),
}

/// Decides, for (rank, batch size, point), whether to fail there and how.
type Inject = Arc<dyn Fn(usize, usize, Point) -> Option<Error> + Send + Sync>;

fn oom() -> Error {
    Error::OutOfMemory {
        rank: None,
        device: "cpu".into(),
        requested: Some(1 << 30),
        limit: None,
        detail: "injected by the test".into(),
    }
}

/// Rows of the data set: 4 steps per epoch per rank at batch 32 over 3 ranks.
const ROWS: usize = 3 * 32 * 4;

/// One attempt: the tiny MLP (ranks start from different values; `prepare` broadcasts rank
/// 0's), SGD with momentum, one epoch, a user `reduce` of the loss each step. Returns the batch
/// size, the final parameters and the errors the closure saw from the library.
fn attempt(
    acc: &Accelerator,
    bs: usize,
    inject: &Inject,
) -> accelerate_rs::Result<(usize, HashMap<String, Tensor>)> {
    let r = acc.rank();
    if let Some(e) = inject(r, bs, Point::Start) {
        return Err(e);
    }
    let p = params(0.1 * r as f32, HIDDEN);
    let vars = p.iter().map(|(_, v)| v.clone()).collect();
    let opt = Sgd::new(vars, SgdConfig::new(0.05).momentum(0.9))?;
    let (mut opt, loader) = acc.prepare(&p, opt, DataLoader::new(dataset(ROWS), bs))?;
    for (step, b) in loader.iter()?.enumerate() {
        let b = b?;
        if let Some(e) = inject(r, bs, Point::Forward(step)) {
            return Err(e);
        }
        let l = loss::cross_entropy(&forward(&p, &b[0])?, &b[1])?;
        acc.reduce(&l.reshape(1)?, ReduceOp::Mean)?;
        let grads = acc.backward(&l)?;
        if let Some(e) = inject(r, bs, Point::Step(step)) {
            return Err(e);
        }
        if let Some(g) = grads {
            opt.step(&g)?;
        }
    }
    Ok((bs, snapshot(&p)))
}

/// What each rank got: the search's result and the errors its attempts returned.
type Outcome = (
    accelerate_rs::Result<(usize, HashMap<String, Tensor>)>,
    Vec<String>,
);

/// `world` in-process ranks at ZeRO `stage`, each running the search.
fn search(world: usize, stage: usize, s: BatchSizeSearch, inject: Inject) -> Vec<Outcome> {
    in_process_with(
        world,
        move |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(stage),
        move |acc| {
            let mut seen = Vec::new();
            let res = acc.find_executable_batch_size_with(s, |bs| {
                let r = attempt(&acc, bs, &inject);
                if let Err(e) = &r {
                    seen.push(e.to_string());
                }
                r
            });
            (res, seen)
        },
    )
}

/// The search's parameters are those of a plain run at the size it settled on, on every rank.
fn assert_like_a_run_at(outcomes: Vec<Outcome>, world: usize, stage: usize, size: usize) {
    let reference = search(
        world,
        stage,
        BatchSizeSearch::new(size),
        Arc::new(|_, _, _| None),
    );
    let want = reference[0].0.as_ref().unwrap().1.clone();
    for (r, (res, seen)) in outcomes.into_iter().enumerate() {
        let (bs, got) = res.unwrap_or_else(|e| panic!("rank {r}: {e} (saw {seen:?})"));
        assert_eq!(bs, size, "rank {r}");
        assert_eq!(
            max_abs_diff(&got, &want),
            0.0,
            "rank {r} differs from a run at {size}"
        );
    }
}

#[test]
fn three_ranks_agree_when_one_runs_out_before_prepare_and_in_a_forward_pass() {
    // Rank 2 fails at 32 before `prepare` (the others are in its collectives), at 16 in its
    // second forward pass (the others are in the user `reduce`), and fits at 8.
    let inject: Inject = Arc::new(|r, bs, at| {
        (r == 2 && ((bs == 32 && at == Point::Start) || (bs == 16 && at == Point::Forward(1))))
            .then(oom)
    });
    let out = search(3, 0, BatchSizeSearch::new(32), inject);
    for (r, (res, seen)) in out.iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {res:?}");
        // Every rank gave up two attempts: rank 2 out of memory, the others told by a collective.
        assert_eq!(seen.len(), 2, "rank {r}: {seen:?}");
        if r == 2 {
            assert!(
                seen.iter().all(|e| e.contains("out of memory on cpu")),
                "{seen:?}"
            );
        } else {
            assert!(
                seen[0].contains("rank 2 ran out of memory at batch size 32")
                    && seen[0].contains("retries with batch size 16")
                    && seen[1].contains("rank 2 ran out of memory at batch size 16"),
                "rank {r}: {seen:?}"
            );
        }
    }
    assert_like_a_run_at(out, 3, 0, 8);
}

#[test]
fn zero_2_agrees_when_a_rank_runs_out_between_the_averaging_and_the_gather() {
    // Under ZeRO-2 the gradients are reduce-scattered in `backward`, and the optimizer step
    // gathers the parameters: rank 1 fails in between (at its third step), the others reach
    // the gather.
    let inject: Inject = Arc::new(|r, bs, at| (r == 1 && bs > 8 && at == Point::Step(2)).then(oom));
    let out = search(3, 2, BatchSizeSearch::new(32), inject);
    assert_like_a_run_at(out, 3, 2, 8);
}

#[test]
fn running_out_after_the_probing_phase_is_fatal_naming_the_rank_and_nobody_hangs() {
    // One probed sync step; rank 1 fails in its third forward pass (the others are in the
    // collectives of that step, without an agreement).
    let inject: Inject = Arc::new(|r, _bs, at| (r == 1 && at == Point::Forward(2)).then(oom));
    let start = Instant::now();
    let out = search(3, 0, BatchSizeSearch::new(32).probe_steps(1), inject);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(20), "took {took:?}");
    for (r, (res, _)) in out.into_iter().enumerate() {
        let e = res.err().unwrap_or_else(|| panic!("rank {r} succeeded"));
        if r == 1 {
            match &e {
                Error::OutOfMemory { rank, .. } => assert_eq!(*rank, Some(1), "{e}"),
                other => panic!("rank 1: {other}"),
            }
            assert!(
                e.to_string().starts_with("rank 1: out of memory on cpu"),
                "{e}"
            );
        } else {
            // The collective that waited for rank 1 failed, naming it.
            assert!(e.to_string().contains("rank 1"), "rank {r}: {e}");
        }
    }
}

#[test]
fn another_error_while_probing_stops_every_rank_naming_the_failed_one() {
    let inject: Inject = Arc::new(|r, _bs, at| {
        (r == 0 && at == Point::Forward(1)).then(|| Error::data("a corrupt record"))
    });
    let out = search(3, 0, BatchSizeSearch::new(32), inject);
    for (r, (res, _)) in out.into_iter().enumerate() {
        match (r, res) {
            (0, Err(Error::Data { reason })) => assert_eq!(reason, "a corrupt record"),
            (
                _,
                Err(Error::PeerFailed {
                    rank,
                    peer: 0,
                    batch_size: 32,
                }),
            ) => assert_eq!(rank, r),
            (r, other) => panic!("rank {r}: {:?}", other.map(|o| o.0)),
        }
    }
}

#[test]
fn running_out_at_every_size_ends_the_search_on_every_rank() {
    let inject: Inject = Arc::new(|r, _bs, at| (r == 1 && at == Point::Forward(0)).then(oom));
    let out = search(3, 0, BatchSizeSearch::new(8).min_batch_size(2), inject);
    for (r, (res, seen)) in out.into_iter().enumerate() {
        match res {
            Err(Error::NoExecutableBatchSize {
                rank,
                tried,
                oom_rank: 1,
                min_batch_size: 2,
            }) => {
                assert_eq!((rank, tried), (r, vec![8, 4, 2]));
                assert_eq!(seen.len(), 3, "{seen:?}");
            }
            other => panic!("rank {r}: {:?}", other.map(|o| o.0)),
        }
    }
}

#[test]
fn one_process_retries_and_different_starts_are_refused() {
    let inject: Inject = Arc::new(|_, bs, at| (bs > 4 && at == Point::Forward(3)).then(oom));
    let out = search(1, 0, BatchSizeSearch::new(16), inject);
    assert_like_a_run_at(out, 1, 0, 4);

    let out = in_process_with(
        2,
        |c: Arc<dyn Collective>| Accelerator::builder().collective(c),
        |acc| {
            let start = 16 << acc.rank();
            acc.find_executable_batch_size(start, Ok)
        },
    );
    for res in out {
        let e = res.unwrap_err().to_string();
        assert!(e.contains("starting batch sizes from 16 to 32"), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Running out of memory inside a collective, for its output buffers (NCCL allocates them before
// queueing anything and passes the accelerator's gate in between).

/// The batch size each rank's attempt runs at, for [`Allocating`] (only one test uses it).
static BATCH: [AtomicUsize; 3] = [
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
];

/// A backend that allocates the output of `all_reduce_tensor` before communicating, as NCCL
/// does, and passes its gate in between: rank 1's allocation fails above batch size 8. Every
/// other method is the thread group's.
#[derive(Debug)]
struct Allocating {
    inner: Arc<dyn Collective>,
    gate: Mutex<Option<Weak<dyn Gate>>>,
}

impl Allocating {
    fn pass_gate(&self, failure: Option<&Error>) -> accelerate_rs::Result<()> {
        let gate = self.gate.lock().unwrap().as_ref().and_then(Weak::upgrade);
        gate.map_or(Ok(()), |g| g.pass("all_reduce", failure))
    }
}

impl Collective for Allocating {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> &'static str {
        "allocating"
    }
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> accelerate_rs::Result<()> {
        self.inner.all_reduce(buf, op)
    }
    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> accelerate_rs::Result<()> {
        self.inner.broadcast(buf, root)
    }
    fn all_gather(&self, buf: Buffer<'_>) -> accelerate_rs::Result<Vec<OwnedBuffer>> {
        self.inner.all_gather(buf)
    }
    fn barrier(&self) -> accelerate_rs::Result<()> {
        self.inner.barrier()
    }
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> accelerate_rs::Result<()> {
        self.inner.reduce_scatter(buf, op)
    }
    fn all_gather_into(&self, buf: BufferMut<'_>) -> accelerate_rs::Result<()> {
        self.inner.all_gather_into(buf)
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> accelerate_rs::Result<Tensor> {
        self.inner.reduce_scatter_tensor(t, op)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> accelerate_rs::Result<Tensor> {
        self.inner.all_gather_into_tensor(t)
    }
    fn check_peers(&self) -> accelerate_rs::Result<()> {
        self.inner.check_peers()
    }
    fn set_run_outcome(&self, finished: bool) {
        self.inner.set_run_outcome(finished)
    }
    fn add_gate(&self, gate: Weak<dyn Gate>) {
        *self.gate.lock().unwrap() = Some(gate);
    }
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> accelerate_rs::Result<Tensor> {
        let me = self.rank();
        // "Allocate" the output, then pass the gate, then communicate.
        let failure =
            (me == 1 && BATCH[me].load(Ordering::SeqCst) > 8).then(|| Error::OutOfMemory {
                rank: None,
                device: "cuda:0".into(),
                requested: Some(1 << 20),
                limit: None,
                detail: "the output of all_reduce (injected by the test)".into(),
            });
        let passed = self.pass_gate(failure.as_ref());
        if let Some(e) = failure {
            return Err(e);
        }
        passed?;
        self.inner.all_reduce_tensor(t, op)
    }
    fn all_reduce_tensors(
        &self,
        ts: &[Tensor],
        op: ReduceOp,
    ) -> accelerate_rs::Result<Vec<Tensor>> {
        fallback::all_reduce_tensors(self, ts, op)
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> accelerate_rs::Result<Tensor> {
        self.inner.broadcast_tensor(t, root)
    }
    fn all_gather_tensor(&self, t: &Tensor) -> accelerate_rs::Result<Tensor> {
        self.inner.all_gather_tensor(t)
    }
}

#[test]
fn running_out_for_a_collectives_outputs_is_agreed_at_its_gate_and_every_rank_retries() {
    // Rank 1 runs out allocating the output of the user `reduce` at 32 and 16, while ranks 0
    // and 2 are about to send theirs: without the gate they would wait in the collective for a
    // rank that left it (until the timeout); with it, every rank abandons the attempt together.
    let no_inject: Inject = Arc::new(|_, _, _| None);
    let start = Instant::now();
    let out = in_process_with(
        3,
        |c: Arc<dyn Collective>| {
            let backend: Arc<dyn Collective> = Arc::new(Allocating {
                inner: c,
                gate: Mutex::new(None),
            });
            Accelerator::builder().collective(backend)
        },
        move |acc| {
            let mut seen = Vec::new();
            let res = acc.find_executable_batch_size(32, |bs| {
                BATCH[acc.rank()].store(bs, Ordering::SeqCst);
                let r = attempt(&acc, bs, &no_inject);
                if let Err(e) = &r {
                    seen.push(e.to_string());
                }
                r
            });
            (res, seen)
        },
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    for (r, (res, seen)) in out.iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {res:?}");
        assert_eq!(seen.len(), 2, "rank {r}: {seen:?}");
        if r == 1 {
            assert!(
                seen.iter().all(|e| e.contains("out of memory on cuda:0")),
                "{seen:?}"
            );
        } else {
            assert!(
                seen[0].contains("rank 1 ran out of memory at batch size 32")
                    && seen[1].contains("rank 1 ran out of memory at batch size 16"),
                "rank {r}: {seen:?}"
            );
        }
    }
    assert_like_a_run_at(out, 3, 0, 8);
}

// ---------------------------------------------------------------------------------------------
// Three processes over loopback, the simulated memory limit on one of them.

const ROLE_VAR: &str = "ACCEL_BATCH_SIZE_ROLE";

/// The tiny MLP's graph holds about 400 bytes per row of a batch plus 780 (f32 activations,
/// views counted in full): 5 KiB lets batch 8 (3980 bytes) through and stops 16 (7180).
const LIMIT: &str = "5KiB";

#[test]
fn three_processes_agree_when_the_memory_limit_hits_one_rank() {
    let port = free_port().to_string();
    let mut children = Children(Vec::new());
    for rank in 0..3 {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "batch_size::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "search")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .env("ACCELERATE_RS_SECRET", "batch-size-test")
        .env("ACCELERATE_RS_TRANSPORT", "tcp")
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("ACCELERATE_RS_TEST_MEMORY_LIMIT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        if rank == 1 {
            cmd.env("ACCELERATE_RS_TEST_MEMORY_LIMIT", LIMIT);
        }
        children.0.push(cmd.spawn().unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut outputs = Vec::new();
    for c in children.0.iter_mut() {
        while c.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "a worker hung");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut failed = false;
    for c in std::mem::take(&mut children.0) {
        let out = c.wait_with_output().unwrap();
        failed |= !out.status.success();
        outputs.push(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    assert!(
        !failed,
        "a worker failed:\n{}",
        outputs
            .iter()
            .enumerate()
            .map(|(r, t)| format!("--- rank {r}:\n{t}"))
            .collect::<String>()
    );
    // Every rank settled on 8 after 32 and 16 failed on rank 1, with the same parameters.
    let lines: Vec<&str> = outputs
        .iter()
        .map(|t| {
            t.lines()
                .find(|l| l.starts_with("settled "))
                .unwrap_or_else(|| panic!("no result in:\n{t}"))
        })
        .collect();
    for l in &lines {
        assert!(l.starts_with("settled 8 tried [32, 16, 8] "), "{l}");
        assert_eq!(
            l.rsplit(' ').next(),
            lines[0].rsplit(' ').next(),
            "{lines:?}"
        );
    }
    assert!(
        outputs[1].contains("attempt 16: out of memory on cpu (asked for 7.0 KiB")
            && outputs[1].contains("ACCELERATE_RS_TEST_MEMORY_LIMIT"),
        "{}",
        outputs[1]
    );
    assert!(
        outputs[0].contains("rank 1 ran out of memory at batch size 16"),
        "{}",
        outputs[0]
    );
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    let acc = Accelerator::new().unwrap();
    let none: Inject = Arc::new(|_, _, _| None);
    let mut tried = Vec::new();
    let res = acc.find_executable_batch_size(32, |bs| {
        tried.push(bs);
        let r = attempt(&acc, bs, &none);
        if let Err(e) = &r {
            println!("attempt {bs}: {e}");
        }
        r
    });
    match res {
        Ok((bs, p)) => {
            // A checksum of the parameters, identical on every rank.
            let mut keys: Vec<_> = p.keys().cloned().collect();
            keys.sort();
            let sum: Vec<String> = keys
                .iter()
                .map(|k| {
                    let v = p[k].flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    format!(
                        "{:08x}",
                        v.iter().fold(0u32, |h, x| h.rotate_left(5) ^ x.to_bits())
                    )
                })
                .collect();
            println!("settled {bs} tried {tried:?} {}", sum.join(""));
        }
        Err(e) => {
            eprintln!("worker failed: {e}");
            std::process::exit(1);
        }
    }
}
