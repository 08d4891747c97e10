//! Every backend's collectives against a plain reference: world sizes 2, 3, 4, lengths that do not
//! divide by the world size (including shorter than it), every dtype and reduction.

use std::time::{Duration, Instant};

use crate::common::elems::{reference, value, TestElem};
use crate::common::{free_port, on_each, tcp_group, tcp_options};
use accelerate_rs::collective::{
    chunk_range, Buffer, BufferMut, Collective, SingleProcess, TcpCollective, ThreadGroup,
};
use accelerate_rs::Error;
use accelerate_rs::ReduceOp;
use accelerate_rs::Transport;
use candle_core::{Device, Tensor};
use half::{bf16, f16};

const LENGTHS: &[usize] = &[0, 1, 2, 3, 5, 7, 13, 1000, 4099];
const OPS: &[ReduceOp] = &[ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
const TIMEOUT: Duration = Duration::from_secs(60);

fn byte_buffer(b: &[u8]) -> Buffer<'_> {
    Buffer::from(b)
}

fn all_reduce_suite<T, C>(c: &C)
where
    T: TestElem,
    C: Collective + ?Sized,
    for<'a> BufferMut<'a>: From<&'a mut [T]>,
    for<'a> Buffer<'a>: From<&'a [T]>,
{
    let (rank, world) = (c.rank(), c.world_size());
    for &op in OPS {
        for &len in LENGTHS {
            let mut v: Vec<T> = (0..len).map(|i| T::of(value(rank, i))).collect();
            c.all_reduce(BufferMut::from(&mut v[..]), op)
                .unwrap_or_else(|e| panic!("all_reduce {op:?} {} x {len}: {e}", T::ELEM));
            for (i, got) in v.iter().enumerate() {
                let want = reference(op, world, i);
                assert!(
                    (got.f() - want).abs() <= T::TOL * (1.0 + want.abs()),
                    "rank {rank} world {world} {} {op:?} len {len} [{i}]: got {got:?}, want {want}",
                    T::ELEM
                );
            }
            // Every rank must hold bit-identical results.
            let bytes: &[u8] = bytemuck::cast_slice(&v);
            let all = c.all_gather(byte_buffer(bytes)).expect("all_gather");
            for (r, b) in all.iter().enumerate() {
                assert_eq!(b.bytes(), bytes, "rank {r} differs from rank {rank}");
            }
        }
    }
}

fn broadcast_and_gather_suite<T, C>(c: &C)
where
    T: TestElem,
    C: Collective + ?Sized,
    for<'a> BufferMut<'a>: From<&'a mut [T]>,
    for<'a> Buffer<'a>: From<&'a [T]>,
{
    let (rank, world) = (c.rank(), c.world_size());
    for root in 0..world {
        for &len in LENGTHS {
            let mut v: Vec<T> = (0..len).map(|i| T::of(value(rank, i))).collect();
            c.broadcast(BufferMut::from(&mut v[..]), root)
                .unwrap_or_else(|e| panic!("broadcast root {root} len {len}: {e}"));
            let want: Vec<T> = (0..len).map(|i| T::of(value(root, i))).collect();
            assert_eq!(v, want, "rank {rank} broadcast from {root}, len {len}");
        }
    }
    for k in 0..4 {
        // Block sizes differ per rank, some are empty.
        let len_of = |r: usize| (r * 3 + k) % 5;
        let mine: Vec<T> = (0..len_of(rank)).map(|i| T::of(value(rank, i))).collect();
        let all = c.all_gather(Buffer::from(&mine[..])).expect("all_gather");
        assert_eq!(all.len(), world);
        for (r, b) in all.iter().enumerate() {
            let want: Vec<T> = (0..len_of(r)).map(|i| T::of(value(r, i))).collect();
            assert_eq!(
                b.as_slice::<T>().expect("typed view"),
                &want[..],
                "block of rank {r}"
            );
        }
    }
}

/// `reduce_scatter` then `all_gather_into` against the reference: after the first, this rank's
/// chunk holds the reduction; after the second, every element holds its owner's value.
fn scatter_gather_suite<T, C>(c: &C)
where
    T: TestElem,
    C: Collective + ?Sized,
    for<'a> BufferMut<'a>: From<&'a mut [T]>,
    for<'a> Buffer<'a>: From<&'a [T]>,
{
    let (rank, world) = (c.rank(), c.world_size());
    for &op in OPS {
        for &len in LENGTHS {
            let mut v: Vec<T> = (0..len).map(|i| T::of(value(rank, i))).collect();
            c.reduce_scatter(BufferMut::from(&mut v[..]), op)
                .unwrap_or_else(|e| panic!("reduce_scatter {op:?} {} x {len}: {e}", T::ELEM));
            let mine = chunk_range(len, world, rank);
            for i in mine.clone() {
                let (got, want) = (v[i].f(), reference(op, world, i));
                assert!(
                    (got - want).abs() <= T::TOL * (1.0 + want.abs()),
                    "rank {rank} world {world} {} reduce_scatter {op:?} len {len} [{i}]: got {got}, want {want}",
                    T::ELEM
                );
            }
            // Gather: only this rank's chunk is meaningful going in.
            let mut g: Vec<T> = (0..len)
                .map(|i| {
                    T::of(if mine.contains(&i) {
                        value(rank, i)
                    } else {
                        99.0
                    })
                })
                .collect();
            c.all_gather_into(BufferMut::from(&mut g[..]))
                .unwrap_or_else(|e| panic!("all_gather_into {} x {len}: {e}", T::ELEM));
            for (i, got) in g.iter().enumerate() {
                let owner = (0..world)
                    .find(|&r| chunk_range(len, world, r).contains(&i))
                    .unwrap();
                assert_eq!(
                    got.f(),
                    T::of(value(owner, i)).f(),
                    "rank {rank} world {world} {} all_gather_into len {len} [{i}] (owner {owner})",
                    T::ELEM
                );
            }
        }
    }
}

/// The tensor forms (`reduce_scatter_tensor`, `all_gather_into_tensor`, what ZeRO uses on GPU
/// tensors) against the same reference, for every float dtype and odd lengths.
fn tensor_scatter_gather_suite<C: Collective + ?Sized>(c: &C) {
    use candle_core::DType;
    let (rank, world) = (c.rank(), c.world_size());
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for &len in &[1usize, 7, 13, 1001] {
            let x: Vec<f32> = (0..len).map(|i| value(rank, i) as f32).collect();
            let t = Tensor::from_vec(x, (len,), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("tensor");
            let mine = c
                .reduce_scatter_tensor(&t, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("reduce_scatter_tensor {dtype:?} x {len}: {e}"));
            let own = chunk_range(len, world, rank);
            let got = mine
                .to_dtype(DType::F64)
                .and_then(|t| t.to_vec1::<f64>())
                .expect("to_vec1");
            assert_eq!(
                got.len(),
                own.len(),
                "rank {rank} world {world} {dtype:?} len {len}"
            );
            let tol = if matches!(dtype, DType::F16 | DType::BF16) {
                2e-2
            } else {
                1e-5
            };
            for (k, i) in own.clone().enumerate() {
                let want = reference(ReduceOp::Sum, world, i);
                assert!(
                    (got[k] - want).abs() <= tol * (1.0 + want.abs()),
                    "rank {rank} world {world} {dtype:?} reduce_scatter_tensor len {len} [{i}]: got {}, want {want}",
                    got[k]
                );
            }
            let g: Vec<f32> = (0..len)
                .map(|i| if own.contains(&i) { rank as f32 } else { -7.0 })
                .collect();
            let g = Tensor::from_vec(g, (len,), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("tensor");
            let all = c
                .all_gather_into_tensor(&g)
                .and_then(|t| Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?))
                .unwrap_or_else(|e| panic!("all_gather_into_tensor {dtype:?} x {len}: {e}"));
            let want: Vec<f32> = (0..len)
                .map(|i| {
                    (0..world)
                        .find(|&r| chunk_range(len, world, r).contains(&i))
                        .unwrap() as f32
                })
                .collect();
            assert_eq!(
                all, want,
                "rank {rank} world {world} {dtype:?} all_gather_into_tensor len {len}"
            );
        }
    }
}

pub(crate) fn scatter_gather_all_dtypes<C: Collective + ?Sized>(c: &C) {
    tensor_scatter_gather_suite(c);
    scatter_gather_suite::<f32, C>(c);
    scatter_gather_suite::<f64, C>(c);
    scatter_gather_suite::<f16, C>(c);
    scatter_gather_suite::<bf16, C>(c);
    // Chunks cover the buffer, in rank order, differing by at most one element.
    let world = c.world_size();
    for len in [0, 1, 7, 4099] {
        let chunks: Vec<_> = (0..world).map(|r| chunk_range(len, world, r)).collect();
        assert_eq!(chunks[0].start, 0);
        assert_eq!(chunks[world - 1].end, len);
        assert!(chunks.windows(2).all(|w| w[0].end == w[1].start));
        let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
    }
    // A large buffer streams through several shared-memory chunks and ring segments.
    let (rank, len) = (c.rank(), 1_000_003);
    let mut v: Vec<f32> = (0..len).map(|i| ((i * 7 + rank) % 13) as f32).collect();
    c.reduce_scatter(BufferMut::from(&mut v[..]), ReduceOp::Sum)
        .expect("big reduce_scatter");
    for i in chunk_range(len, world, rank).step_by(997) {
        let want: f32 = (0..world).map(|r| ((i * 7 + r) % 13) as f32).sum();
        assert_eq!(v[i], want, "[{i}]");
    }
    c.all_gather_into(BufferMut::from(&mut v[..]))
        .expect("big all_gather_into");
    for i in (0..len).step_by(991) {
        let want: f32 = (0..world).map(|r| ((i * 7 + r) % 13) as f32).sum();
        assert_eq!(v[i], want, "[{i}] after the gather");
    }
}

pub(crate) fn full_suite<C: Collective + ?Sized>(c: &C) {
    all_reduce_suite::<f32, C>(c);
    all_reduce_suite::<f64, C>(c);
    all_reduce_suite::<f16, C>(c);
    all_reduce_suite::<bf16, C>(c);
    broadcast_and_gather_suite::<f32, C>(c);
    broadcast_and_gather_suite::<f64, C>(c);
    broadcast_and_gather_suite::<f16, C>(c);
    broadcast_and_gather_suite::<bf16, C>(c);
    c.barrier().expect("barrier");
}

/// Pseudo-random floats, large enough to stream in several segments.
pub(crate) fn big_random_suite<C: Collective + ?Sized>(c: &C) {
    let (rank, world) = (c.rank(), c.world_size());
    let len = 300_007;
    let gen = |r: usize, i: usize| {
        let x = (r as u64 * 1_000_003 + i as u64).wrapping_mul(6364136223846793005) >> 40;
        (x % 20_000) as f64 / 1000.0 - 10.0
    };
    let mut v: Vec<f32> = (0..len).map(|i| gen(rank, i) as f32).collect();
    c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
        .expect("big all_reduce");
    for (i, got) in v.iter().enumerate() {
        let want: f64 = (0..world).map(|r| gen(r, i) as f32 as f64).sum();
        assert!((*got as f64 - want).abs() < 1e-4, "[{i}] {got} vs {want}");
    }
}

#[test]
fn tcp_ring_matches_reference_for_world_2_3_4() {
    for world in [2, 3, 4] {
        on_each(tcp_group(world, TIMEOUT), |c| {
            full_suite(c);
            big_random_suite(c);
        });
    }
}

#[test]
fn threads_match_reference_for_world_2_3_4() {
    for world in [2, 3, 4] {
        on_each(ThreadGroup::new(world, TIMEOUT).unwrap(), |c| {
            full_suite(c);
            big_random_suite(c);
        });
    }
}

#[test]
fn reduce_scatter_and_all_gather_into_match_reference_on_every_backend_for_world_1_to_5() {
    for world in 1..=5 {
        for transport in [Transport::Tcp, Transport::Shm] {
            let port = free_port();
            let ranks: Vec<TcpCollective> = (0..world)
                .map(|r| {
                    std::thread::spawn(move || {
                        let mut o = tcp_options(r, world, port, TIMEOUT);
                        o.transport = Some(transport);
                        TcpCollective::connect(&o)
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect();
            on_each(ranks, scatter_gather_all_dtypes);
        }
        on_each(ThreadGroup::new(world, TIMEOUT).unwrap(), |c| {
            scatter_gather_all_dtypes(c);
            // The threads backend's all_reduce shares its two phases: check it too.
            full_suite(c);
        });
    }
    scatter_gather_all_dtypes(&SingleProcess);
}

#[test]
fn mismatched_reduce_scatter_lengths_are_reported() {
    let ranks = tcp_group(2, Duration::from_secs(10));
    let res = on_each(ranks, |c| {
        let mut v = vec![1f32; 10 + c.rank()];
        c.reduce_scatter(BufferMut::from(&mut v[..]), ReduceOp::Sum)
            .map(|_| ())
    });
    for r in res {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("reduce_scatter"), "{e}");
    }
    let ranks = ThreadGroup::new(2, Duration::from_secs(10)).unwrap();
    let res = on_each(ranks, |c| {
        let mut v = vec![1f32; 10 + c.rank()];
        c.all_gather_into(BufferMut::from(&mut v[..]))
    });
    for r in res {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("all_gather_into"), "{e}");
    }
}

#[test]
fn single_process_is_identity() {
    let c = SingleProcess;
    let mut v = vec![1.5f32, -2.0];
    c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Mean)
        .unwrap();
    assert_eq!(v, vec![1.5, -2.0]);
    c.broadcast(BufferMut::from(&mut v[..]), 0).unwrap();
    assert!(c.broadcast(BufferMut::from(&mut v[..]), 1).is_err());
    let g = c.all_gather(Buffer::from(&v[..])).unwrap();
    assert_eq!(g[0].as_slice::<f32>().unwrap(), &v[..]);
    c.barrier().unwrap();
}

#[test]
fn tensor_helpers_gather_uneven_first_dims() {
    let results = on_each(tcp_group(3, TIMEOUT), |c| {
        let r = c.rank();
        let rows = r + 1; // 1, 2, 3 rows
        let t = Tensor::full(r as f32, (rows, 2), &Device::Cpu).unwrap();
        let g = c.all_gather_tensor(&t).unwrap();
        let s = c.all_reduce_tensor(&t.sum_all().unwrap().reshape(1).unwrap(), ReduceOp::Sum);
        let b = c
            .broadcast_tensor(&Tensor::new(&[r as f64, 7.0], &Device::Cpu).unwrap(), 2)
            .unwrap();
        // Trailing dims differ on rank 1: every rank must get an error listing all shapes.
        let bad = Tensor::zeros(
            (1, if r == 1 { 3 } else { 2 }),
            candle_core::DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let err = c.all_gather_tensor(&bad).unwrap_err().to_string();
        (
            g.to_vec2::<f32>().unwrap(),
            s.unwrap().to_vec1::<f32>().unwrap(),
            b.to_vec1::<f64>().unwrap(),
            err,
        )
    });
    for (g, s, b, err) in results {
        assert_eq!(
            g,
            vec![
                vec![0.0, 0.0],
                vec![1.0, 1.0],
                vec![1.0, 1.0],
                vec![2.0; 2],
                vec![2.0; 2],
                vec![2.0; 2]
            ]
        );
        assert_eq!(s, vec![0.0 + 4.0 + 12.0]);
        assert_eq!(b, vec![2.0, 7.0]);
        assert!(
            err.contains("rank 0: f32[1, 2]") && err.contains("rank 1: f32[1, 3]"),
            "{err}"
        );
    }
}

#[test]
fn mismatched_calls_are_reported_not_garbled() {
    for backend in ["tcp", "threads"] {
        let ranks: Vec<Box<dyn Collective>> = if backend == "tcp" {
            tcp_group(2, TIMEOUT)
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        } else {
            ThreadGroup::new(2, TIMEOUT)
                .unwrap()
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        };
        let errs = on_each(ranks, |c| {
            let mut v = vec![1.0f32; 10 + c.rank()];
            let err = c
                .all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
                .unwrap_err();
            // The communicator refuses further work instead of exchanging garbage.
            let again = c.barrier().unwrap_err();
            (err, again)
        });
        for (err, again) in errs {
            assert!(matches!(err, Error::Mismatch { .. }), "{backend}: {err}");
            let msg = err.to_string();
            assert!(msg.contains("all_reduce"), "{backend}: {msg}");
            assert!(
                matches!(again, Error::Broken { .. } | Error::Peer { .. }),
                "{backend}: {again}"
            );
        }
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let timeout = Duration::from_millis(700);
    for backend in ["tcp", "threads"] {
        let ranks: Vec<Box<dyn Collective>> = if backend == "tcp" {
            tcp_group(3, timeout)
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        } else {
            ThreadGroup::new(3, timeout)
                .unwrap()
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        };
        let results = on_each(ranks, |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_secs(3));
                return None;
            }
            let start = Instant::now();
            let mut v = [1.0f32; 8];
            let err = c
                .all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
                .unwrap_err();
            Some((err, start.elapsed()))
        });
        for (rank, res) in results.into_iter().enumerate().take(2) {
            let (err, took) = res.unwrap();
            assert!(
                took < Duration::from_secs(3),
                "{backend} rank {rank} took {took:?}"
            );
            let msg = err.to_string();
            assert!(msg.contains(&format!("rank {rank}")), "{backend}: {msg}");
            assert!(
                msg.contains("timed out")
                    || msg.contains("rank 2")
                    || matches!(err, Error::Peer { .. }),
                "{backend}: {msg}"
            );
        }
    }
}

#[test]
fn a_dropped_rank_fails_the_others_quickly() {
    for backend in ["tcp", "threads"] {
        let ranks: Vec<Box<dyn Collective>> = if backend == "tcp" {
            tcp_group(3, TIMEOUT)
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        } else {
            ThreadGroup::new(3, TIMEOUT)
                .unwrap()
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        };
        let results = on_each(ranks, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(200));
                return None; // `c` is dropped by on_each's thread right after this
            }
            let start = Instant::now();
            let mut v = vec![1.0f32; 100_000];
            let err = c
                .all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
                .unwrap_err();
            Some((err.to_string(), start.elapsed()))
        });
        for res in results.into_iter().flatten() {
            let (msg, took) = res;
            assert!(
                took < Duration::from_secs(10),
                "{backend}: took {took:?}: {msg}"
            );
            assert!(msg.contains("all_reduce"), "{backend}: {msg}");
        }
    }
}

#[test]
fn unsupported_dtype_and_bad_root_are_rejected_up_front() {
    on_each(tcp_group(2, TIMEOUT), |c| {
        let mut b = [1u8; 4];
        let err = c
            .all_reduce(BufferMut::from(&mut b[..]), ReduceOp::Sum)
            .unwrap_err();
        assert!(err.to_string().contains("u8"), "{err}");
        let err = c.broadcast(BufferMut::from(&mut b[..]), 5).unwrap_err();
        assert!(err.to_string().contains("root 5"), "{err}");
        // Still usable: nothing was sent.
        c.barrier().unwrap();
    });
}

/// `Min` and `Max` against a plain reference with NaNs sprinkled in: a NaN on any rank makes
/// that element NaN on every rank (as `torch.min` / `torch.max`); the others are the exact
/// extremes. Every dtype, odd lengths, `all_reduce` and `reduce_scatter`.
fn nan_extremes_suite<T, C>(c: &C)
where
    T: TestElem,
    C: Collective + ?Sized,
    for<'a> BufferMut<'a>: From<&'a mut [T]>,
    for<'a> Buffer<'a>: From<&'a [T]>,
{
    let (rank, world) = (c.rank(), c.world_size());
    // Rank r holds a NaN where i % 7 == r (so ranks 5 and 6 would hold none; the worlds here
    // have at most 5 ranks, so some elements are NaN-free).
    let at = |r: usize, i: usize| {
        if i % 7 == r {
            f64::NAN
        } else {
            value(r, i)
        }
    };
    for op in [ReduceOp::Min, ReduceOp::Max] {
        let want = |i: usize| {
            let vals: Vec<f64> = (0..world).map(|r| at(r, i)).collect();
            if vals.iter().any(|v| v.is_nan()) {
                f64::NAN
            } else if op == ReduceOp::Min {
                vals.into_iter().fold(f64::MAX, f64::min)
            } else {
                vals.into_iter().fold(f64::MIN, f64::max)
            }
        };
        for len in [1usize, 2, 3, 5, 7, 13, 1001] {
            let fresh = || -> Vec<T> { (0..len).map(|i| T::of(at(rank, i))).collect() };
            let mut v = fresh();
            c.all_reduce(BufferMut::from(&mut v[..]), op)
                .unwrap_or_else(|e| panic!("all_reduce {op:?} {} x {len}: {e}", T::ELEM));
            let mut s = fresh();
            c.reduce_scatter(BufferMut::from(&mut s[..]), op)
                .unwrap_or_else(|e| panic!("reduce_scatter {op:?} {} x {len}: {e}", T::ELEM));
            let mine = chunk_range(len, world, rank);
            for i in 0..len {
                let w = want(i);
                let mut got = vec![("all_reduce", v[i].f())];
                if mine.contains(&i) {
                    got.push(("reduce_scatter", s[i].f()));
                }
                for (what, g) in got {
                    assert!(
                        (w.is_nan() && g.is_nan()) || g == w,
                        "rank {rank} world {world} {} {what} {op:?} len {len} [{i}]: got {g}, want {w}",
                        T::ELEM
                    );
                }
            }
        }
    }
}

fn nan_extremes_all_dtypes<C: Collective + ?Sized>(c: &C) {
    nan_extremes_suite::<f32, C>(c);
    nan_extremes_suite::<f64, C>(c);
    nan_extremes_suite::<f16, C>(c);
    nan_extremes_suite::<bf16, C>(c);
}

#[test]
fn min_and_max_propagate_nan_on_every_backend_for_world_1_to_5() {
    for world in 1..=5 {
        for transport in [Transport::Tcp, Transport::Shm] {
            let port = free_port();
            let ranks: Vec<TcpCollective> = (0..world)
                .map(|r| {
                    std::thread::spawn(move || {
                        let mut o = tcp_options(r, world, port, TIMEOUT);
                        o.transport = Some(transport);
                        TcpCollective::connect(&o)
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect();
            on_each(ranks, |c| {
                nan_extremes_all_dtypes(c);
                // The plain reference suite (Min included) at every world size, not only 2-4.
                full_suite(c);
            });
        }
        on_each(
            ThreadGroup::new(world, TIMEOUT).unwrap(),
            nan_extremes_all_dtypes,
        );
    }
    nan_extremes_all_dtypes(&SingleProcess);
}
