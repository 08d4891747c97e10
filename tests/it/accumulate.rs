//! Gradient accumulation and clipping: equivalence with one large-batch step (in-process ranks
//! and real processes under `accelerate-rs launch`), no communication on non-sync micro-steps,
//! optimizer steps only at sync steps, clipping after the average.
//!
//! The multi-process test re-runs this test binary as the workers: `accumulate_worker` does
//! nothing unless `ACCEL_TEST_ROLE` is set.

use crate::common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::tiny::{self, forward, max_abs_diff, snapshot, HIDDEN, LR};
use accelerate_rs::collective::Collective;
use accelerate_rs::collective::{Buffer, BufferMut, Gate, OwnedBuffer};
use accelerate_rs::ReduceOp;
use accelerate_rs::{Accelerator, DataLoader, Error, TensorDataset};
use candle_core::{Device, Tensor, Var};
use candle_nn::{loss, Optimizer, SGD};

const B: usize = 4; // per-rank micro-batch
const M: usize = 5; // micro-batches per rank per epoch: not a multiple of 2 or 3
const EPOCHS: u64 = 2;

fn params(offset: f32) -> Vec<(String, Var)> {
    tiny::params(offset, HIDDEN)
}

/// `2 * B * M` samples: M full micro-batches of B per rank on 2 ranks.
fn dataset() -> TensorDataset {
    tiny::dataset(2 * B * M)
}

/// Plain Candle, one process: batch `2 * n * B` (the last batch of an epoch is shorter).
fn reference(n: usize) -> HashMap<String, Tensor> {
    let p = params(0.0);
    let mut opt = SGD::new(p.iter().map(|(_, v)| v.clone()).collect(), LR).unwrap();
    let loader = DataLoader::new(dataset(), 2 * n * B);
    for _ in 0..EPOCHS {
        for b in loader.iter().unwrap() {
            let b = b.unwrap();
            let loss = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
            opt.backward_step(&loss).unwrap();
        }
    }
    snapshot(&p)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// `opt.backward_step_batch(&loss, &batch)`
    Wrapper,
    /// `if let Some(grads) = accelerator.backward_batch(&loss, &batch)? { opt.step(&grads)? }`
    Explicit,
    /// `opt.backward_step(&loss)` then `opt.flush()` after the epoch
    Flush,
}

/// Trains EPOCHS epochs of micro-batch B; returns how many steps were sync steps.
fn train(acc: &Accelerator, p: &[(String, Var)], path: Path) -> accelerate_rs::Result<usize> {
    let opt = SGD::new(p.iter().map(|(_, v)| v.clone()).collect(), LR)?;
    let (mut opt, loader) = acc.prepare(p, opt, DataLoader::new(dataset(), B))?;
    let mut syncs = 0;
    for _ in 0..EPOCHS {
        for b in loader.iter()? {
            let b = b?;
            let loss = loss::cross_entropy(&forward(p, &b[0])?, &b[1])?;
            match path {
                Path::Wrapper => opt.backward_step_batch(&loss, &b)?,
                Path::Explicit => {
                    // `None` on non-sync micro-steps: nothing to apply.
                    if let Some(grads) = acc.backward_batch(&loss, &b)? {
                        opt.step(&grads)?;
                    }
                }
                Path::Flush => opt.backward_step(&loss)?,
            }
            syncs += opt.is_sync_step() as usize;
        }
        if path == Path::Flush {
            syncs += opt.flush()? as usize;
        }
        assert_eq!(acc.pending_micro_steps(), 0);
    }
    Ok(syncs)
}

/// Runs `f` on `n` in-process ranks with `steps` accumulation steps; `wrap` may wrap each rank's
/// collective.
fn in_process<R: Send + 'static>(
    n: usize,
    steps: usize,
    wrap: impl Fn(Arc<dyn Collective>) -> Arc<dyn Collective>,
    f: impl Fn(Accelerator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    common::in_process_with(
        n,
        |c| {
            Accelerator::builder()
                .collective(wrap(c))
                .gradient_accumulation_steps(steps)
        },
        f,
    )
}

#[test]
fn n_micro_steps_on_two_ranks_equal_one_step_of_2nb_on_one_rank() {
    for n in 1..=3 {
        let single = reference(n);
        let init = snapshot(&params(0.0));
        assert!(max_abs_diff(&init, &single) > 1e-3, "training must move");
        if n > 1 {
            // Accumulating would be wrong if it equalled plain per-micro-batch stepping.
            assert!(max_abs_diff(&reference(1), &single) > 1e-4);
        }
        for path in [Path::Wrapper, Path::Explicit, Path::Flush] {
            let results = in_process(
                2,
                n,
                |c| c,
                move |acc| {
                    let p = params(acc.rank() as f32);
                    let syncs = train(&acc, &p, path).unwrap();
                    (snapshot(&p), syncs)
                },
            );
            for (r, syncs) in &results {
                let diff = max_abs_diff(r, &single);
                assert!(diff <= 1e-5, "N={n} {path:?}: max abs diff {diff}");
                assert_eq!(max_abs_diff(r, &results[0].0), 0.0, "ranks must agree");
                assert_eq!(*syncs, EPOCHS as usize * M.div_ceil(n), "N={n} {path:?}");
            }
        }
    }
}

#[test]
fn world_size_one_accumulates_the_same_way() {
    for n in [2, 3] {
        let acc = Accelerator::builder()
            .rank(0)
            .world_size(1)
            .gradient_accumulation_steps(n)
            .build()
            .unwrap();
        assert_eq!(acc.gradient_accumulation_steps(), n);
        let p = params(0.0);
        let opt = SGD::new(p.iter().map(|(_, v)| v.clone()).collect(), LR).unwrap();
        // One rank with micro-batch 2B sees the same global batches as two ranks with B.
        let (mut opt, loader) = acc
            .prepare(&p, opt, DataLoader::new(dataset(), 2 * B))
            .unwrap();
        for _ in 0..EPOCHS {
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let loss = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                opt.backward_step_batch(&loss, &b).unwrap();
            }
        }
        let diff = max_abs_diff(&snapshot(&p), &reference(n));
        assert!(diff <= 1e-5, "N={n}: max abs diff {diff}");
    }
}

#[test]
fn zero_accumulation_steps_are_rejected() {
    let err = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .gradient_accumulation_steps(0)
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("gradient_accumulation_steps"), "{err}");
}

/// Per-rank call and byte counters of [`Counting`] (only one test uses it).
static CALLS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
static BYTES: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Forwards to another collective, counting calls and bytes into `CALLS` / `BYTES`.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Collective>,
    /// Whether calls are counted (not in the forwarding check, which runs beside the test that
    /// reads the counters).
    counted: bool,
}

impl Counting {
    fn count(&self, bytes: usize) {
        if !self.counted {
            return;
        }
        CALLS[self.rank()].fetch_add(1, Ordering::SeqCst);
        BYTES[self.rank()].fetch_add(bytes, Ordering::SeqCst);
    }
}

impl Collective for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> accelerate_rs::Result<()> {
        self.count(buf.bytes().len());
        self.inner.all_reduce(buf, op)
    }
    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> accelerate_rs::Result<()> {
        self.count(buf.bytes().len());
        self.inner.broadcast(buf, root)
    }
    fn all_gather(&self, buf: Buffer<'_>) -> accelerate_rs::Result<Vec<OwnedBuffer>> {
        self.count(buf.bytes().len());
        self.inner.all_gather(buf)
    }
    fn barrier(&self) -> accelerate_rs::Result<()> {
        self.count(0);
        self.inner.barrier()
    }
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> accelerate_rs::Result<Tensor> {
        self.count(t.elem_count() * t.dtype().size_in_bytes());
        self.inner.all_reduce_tensor(t, op)
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> accelerate_rs::Result<Tensor> {
        self.count(t.elem_count() * t.dtype().size_in_bytes());
        self.inner.broadcast_tensor(t, root)
    }
    fn all_gather_tensor(&self, t: &Tensor) -> accelerate_rs::Result<Tensor> {
        self.count(t.elem_count() * t.dtype().size_in_bytes());
        self.inner.all_gather_tensor(t)
    }
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> accelerate_rs::Result<()> {
        self.count(buf.bytes().len());
        self.inner.reduce_scatter(buf, op)
    }
    fn all_gather_into(&self, buf: BufferMut<'_>) -> accelerate_rs::Result<()> {
        self.count(buf.bytes().len());
        self.inner.all_gather_into(buf)
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> accelerate_rs::Result<Tensor> {
        self.count(t.elem_count() * t.dtype().size_in_bytes());
        self.inner.reduce_scatter_tensor(t, op)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> accelerate_rs::Result<Tensor> {
        self.count(t.elem_count() * t.dtype().size_in_bytes());
        self.inner.all_gather_into_tensor(t)
    }
    fn all_reduce_tensors(
        &self,
        ts: &[Tensor],
        op: ReduceOp,
    ) -> accelerate_rs::Result<Vec<Tensor>> {
        for t in ts {
            self.count(t.elem_count() * t.dtype().size_in_bytes());
        }
        self.inner.all_reduce_tensors(ts, op)
    }
    fn check_peers(&self) -> accelerate_rs::Result<()> {
        self.inner.check_peers()
    }
    fn set_run_outcome(&self, finished: bool) {
        self.inner.set_run_outcome(finished)
    }
    fn add_gate(&self, gate: std::sync::Weak<dyn Gate>) {
        self.inner.add_gate(gate)
    }
}

#[test]
fn the_counting_wrapper_forwards_every_method() {
    accelerate_rs::collective::forwarding::check_wrapper("Counting", |inner| {
        Arc::new(Counting {
            inner,
            counted: false,
        })
    })
    .unwrap();
}

#[test]
fn non_sync_micro_steps_exchange_nothing_and_do_not_step() {
    const N: usize = 3;
    let results = in_process(
        2,
        N,
        |c| {
            let counting: Arc<dyn Collective> = Arc::new(Counting {
                inner: c,
                counted: true,
            });
            counting
        },
        |acc| {
            let p = params(0.0);
            let opt = SGD::new(p.iter().map(|(_, v)| v.clone()).collect(), LR).unwrap();
            let (mut opt, loader) = acc.prepare(&p, opt, DataLoader::new(dataset(), B)).unwrap();
            let r = acc.rank();
            assert!(CALLS[r].load(Ordering::SeqCst) > 0, "prepare communicates");
            let mut log = Vec::new();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let (calls, bytes) = (
                    CALLS[r].load(Ordering::SeqCst),
                    BYTES[r].load(Ordering::SeqCst),
                );
                let before = snapshot(&p);
                let loss = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                opt.backward_step_batch(&loss, &b).unwrap();
                let calls = CALLS[r].load(Ordering::SeqCst) - calls;
                let sent = BYTES[r].load(Ordering::SeqCst) - bytes;
                let moved = max_abs_diff(&before, &snapshot(&p)) > 0.0;
                log.push((opt.is_sync_step(), acc.sync_gradients(), calls, sent, moved));
            }
            log
        },
    );
    for log in results {
        assert_eq!(log.len(), M);
        for (i, &(sync, sync_acc, calls, sent, moved)) in log.iter().enumerate() {
            let expect_sync = (i + 1) % N == 0 || i + 1 == M;
            assert_eq!(sync, expect_sync, "micro-step {i}");
            assert_eq!(sync_acc, expect_sync, "micro-step {i}");
            assert_eq!(calls > 0, expect_sync, "micro-step {i}: {calls} calls");
            assert_eq!(sent > 0, expect_sync, "micro-step {i}: {sent} bytes");
            assert_eq!(moved, expect_sync, "micro-step {i}: parameters moved");
        }
    }
}

/// `w` of 3 elements; rank r's micro-step i has loss `sum(w * x(r, i))`, so its gradient is x.
fn x(rank: usize, i: usize) -> [f32; 3] {
    let r = rank as f32;
    let i = i as f32;
    [3.0 + r + i, -4.0 * (r + 1.0), 0.5 * i - r]
}

/// The averaged gradient after 2 micro-steps (N = 2) on 2 ranks, by hand.
fn expected_grad() -> [f64; 3] {
    let mut g = [0f64; 3];
    for r in 0..2 {
        for i in 0..2 {
            for (k, v) in x(r, i).iter().enumerate() {
                g[k] += *v as f64 / 2.0 / 2.0; // 1/N loss scaling, mean over 2 ranks
            }
        }
    }
    g
}

fn norm(g: &[f64]) -> f64 {
    g.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn tiny(acc: &Accelerator) -> Var {
    let w = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
    acc.prepare_model(&vec![("w".to_string(), w.clone())])
        .unwrap();
    w
}

fn tiny_loss(w: &Var, rank: usize, i: usize) -> Tensor {
    let x = Tensor::new(&x(rank, i), &Device::Cpu).unwrap();
    (w.as_tensor() * x).unwrap().sum_all().unwrap()
}

#[test]
fn clip_grad_norm_uses_the_averaged_gradients_and_agrees_on_every_rank() {
    let expected = expected_grad();
    let n = norm(&expected);
    let max = n / 4.0;
    let results = in_process(
        2,
        2,
        |c| c,
        move |acc| {
            let w = tiny(&acc);
            let r = acc.rank();
            assert!(acc.backward(&tiny_loss(&w, r, 0)).unwrap().is_none());
            assert!(!acc.sync_gradients());
            let mut grads = acc.backward(&tiny_loss(&w, r, 1)).unwrap().unwrap();
            assert!(acc.sync_gradients());
            let got = acc.clip_grad_norm(&mut grads, max).unwrap();
            let clipped = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
            // A norm below max_norm leaves the gradients alone.
            assert!(acc.backward(&tiny_loss(&w, r, 0)).unwrap().is_none());
            let mut grads = acc.backward(&tiny_loss(&w, r, 1)).unwrap().unwrap();
            let same = acc.clip_grad_norm(&mut grads, n * 2.0).unwrap();
            let unclipped = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
            (got, clipped, same, unclipped)
        },
    );
    for (got, clipped, same, unclipped) in &results {
        assert!((got - n).abs() < 1e-5 * n, "norm {got}, by hand {n}");
        assert_eq!(got.to_bits(), results[0].0.to_bits(), "ranks must agree");
        assert_eq!(same.to_bits(), got.to_bits());
        let coef = max / (n + 1e-6);
        for k in 0..3 {
            assert!((clipped[k] as f64 - expected[k] * coef).abs() < 1e-5);
            assert!((unclipped[k] as f64 - expected[k]).abs() < 1e-5);
        }
        let clipped_norm = norm(&clipped.iter().map(|v| *v as f64).collect::<Vec<_>>());
        assert!((clipped_norm - max).abs() < 1e-4, "{clipped_norm} vs {max}");
    }
}

#[test]
fn optimizer_clipping_happens_in_the_sync_step() {
    let expected = expected_grad();
    let n = norm(&expected);
    let max = n / 3.0;
    let results = in_process(
        2,
        2,
        |c| c,
        move |acc| {
            let w = tiny(&acc);
            let r = acc.rank();
            let mut opt = acc.prepare_optimizer(SGD::new(vec![w.clone()], 1.0).unwrap());
            opt.set_clip_grad_norm(Some(max));
            opt.backward_step(&tiny_loss(&w, r, 0)).unwrap();
            assert_eq!(opt.last_grad_norm(), None, "no norm before a sync step");
            let unchanged = w.as_tensor().to_vec1::<f32>().unwrap();
            opt.backward_step(&tiny_loss(&w, r, 1)).unwrap();
            (
                unchanged,
                w.as_tensor().to_vec1::<f32>().unwrap(),
                opt.last_grad_norm(),
            )
        },
    );
    let coef = max / (n + 1e-6);
    for (unchanged, after, last) in results {
        assert_eq!(unchanged, vec![1.0, 2.0, 3.0]);
        let last = last.unwrap();
        assert!((last - n).abs() < 1e-5 * n, "{last} vs {n}");
        for (k, init) in [1.0f64, 2.0, 3.0].iter().enumerate() {
            let want = init - expected[k] * coef; // SGD, lr 1
            assert!((after[k] as f64 - want).abs() < 1e-5, "{after:?}");
        }
    }
}

#[test]
fn clip_grad_value_clamps_every_gradient() {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    let w = tiny(&acc);
    let mut grads = acc.backward(&tiny_loss(&w, 1, 1)).unwrap().unwrap(); // x = [5, -8, -0.5]
    acc.clip_grad_value(&mut grads, 2.0).unwrap();
    let g = grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(g, vec![2.0, -2.0, -0.5]);
    assert!(acc.clip_grad_value(&mut grads, -1.0).is_err());
    assert!(acc.clip_grad_norm(&mut grads, f64::NAN).is_err());
}

fn worker(role: &str) -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    match role {
        "equivalence" => {
            let p = params(acc.rank() as f32 * 0.25);
            train(&acc, &p, Path::Wrapper)?;
            if acc.is_main_process() {
                let out = std::env::var("ACCEL_TEST_OUT")
                    .map_err(|_| Error::invalid("ACCEL_TEST_OUT", "unset"))?;
                candle_core::safetensors::save(&snapshot(&p), out)?;
            }
            Ok(())
        }
        other => Err(Error::invalid("ACCEL_TEST_ROLE", other.to_string())),
    }
}

#[test]
fn accumulate_worker() {
    let Ok(role) = std::env::var("ACCEL_TEST_ROLE") else {
        return;
    };
    match worker(&role) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("worker failed: {e}");
            std::process::exit(1);
        }
    }
}

#[test]
fn two_processes_accumulating_3_steps_equal_one_process_with_batch_6b() {
    const N: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("params.safetensors");
    let exe = std::env::current_exe().unwrap();
    let res = Command::new(crate::common::launcher())
        .args(["launch", "--cpu", "-n", "2"])
        .arg(exe)
        .args([
            "--exact",
            "accumulate::accumulate_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_ROLE", "equivalence")
        .env("ACCEL_TEST_OUT", &out)
        // The environment variable, not the builder, sets N here.
        .env("ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS", N.to_string())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(res.status.success(), "launch failed:\n{text}");
    let ddp = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    let diff = max_abs_diff(&ddp, &reference(N));
    assert!(diff <= 1e-5, "max abs diff {diff}");
}
