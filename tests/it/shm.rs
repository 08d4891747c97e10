//! The same-host shared-memory transport of `TcpCollective`, with real processes on loopback:
//! results against a plain reference (world sizes 2, 3, 4, every dtype and reduction, odd lengths
//! and buffers spanning several slot-sized chunks), broadcast from every root, mismatches, a peer
//! that exits mid-run, the `ACCELERATE_RS_TRANSPORT` override and the segment's removal.
//!
//! The multi-process tests re-run this test binary (`std::env::current_exe()`) restricted to
//! [`worker_entry`], with `ACCEL_SHM_ROLE` naming what the worker does; without that variable
//! `worker_entry` returns at once. Nothing here asserts on timing: a wait that should end on a
//! dead peer runs under a 300 s collective timeout, and the test only checks that it ended with a
//! peer error well before the test's own (generous) deadline.

use std::fmt::Debug;
use std::io::{BufReader, Read};
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::elems::{reference, value, TestElem};
use crate::common::{free_port, on_each, reduce_ones, tcp_group, Children};
use accelerate_rs::collective::{
    Buffer, BufferMut, Collective, Element, TcpCollective, TcpOptions,
};
use accelerate_rs::Error;
use accelerate_rs::ReduceOp;
use half::{bf16, f16};

const ROLE_VAR: &str = "ACCEL_SHM_ROLE";
const TRANSPORT: &str = "ACCELERATE_RS_TRANSPORT";
const SECRET: &str = "shm-test-secret";
/// Bytes of one shared-memory slot (the chunk size of the transport, `SLOT_CAP` in `shm.rs`).
const SLOT: usize = 1 << 20;
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
/// How long a whole group of workers may take before the test kills it and fails.
const GROUP_DEADLINE: Duration = Duration::from_secs(240);

// ---------------------------------------------------------------------------------------------
// Reference values.

/// Odd lengths, lengths around the small/large switch, and buffers of several chunks (with a
/// last chunk shorter than the world size).
fn lengths<T: Element>() -> Vec<usize> {
    let per_slot = SLOT / std::mem::size_of::<T>();
    vec![
        0,
        1,
        2,
        3,
        5,
        13,
        4099,
        16_411,
        per_slot + 1,
        2 * per_slot + 3,
        700_001,
    ]
}

type Check = Result<(), String>;

/// Outside the generic functions, so that `Buffer::from` is not resolved against `T`.
fn byte_buffer(b: &[u8]) -> Buffer<'_> {
    Buffer::from(b)
}

fn all_reduce_suite<T: TestElem>(c: &TcpCollective) -> Check
where
    for<'a> BufferMut<'a>: From<&'a mut [T]>,
    for<'a> Buffer<'a>: From<&'a [T]>,
{
    let (rank, world) = (c.rank(), c.world_size());
    for op in OPS {
        for len in lengths::<T>() {
            let mut v: Vec<T> = (0..len).map(|i| T::of(value(rank, i))).collect();
            c.all_reduce(BufferMut::from(&mut v[..]), op)
                .map_err(|e| format!("all_reduce {op:?} {} x {len}: {e}", T::ELEM))?;
            for (i, got) in v.iter().enumerate() {
                let want = reference(op, world, i);
                if (got.f() - want).abs() > T::TOL * (1.0 + want.abs()) {
                    return Err(format!(
                        "rank {rank} world {world} {} {op:?} len {len} [{i}]: got {got:?}, want {want}",
                        T::ELEM
                    ));
                }
            }
            // Every rank must hold bit-identical results.
            let bytes: &[u8] = bytemuck::cast_slice(&v);
            let all = c
                .all_gather(byte_buffer(bytes))
                .map_err(|e| format!("all_gather: {e}"))?;
            if let Some(r) = all.iter().position(|b| b.bytes() != bytes) {
                return Err(format!(
                    "{} {op:?} len {len}: rank {r} differs from rank {rank}",
                    T::ELEM
                ));
            }
        }
    }
    Ok(())
}

fn broadcast_suite<T: Element + Debug + PartialEq>(
    c: &TcpCollective,
    of: impl Fn(f64) -> T,
) -> Check
where
    for<'a> BufferMut<'a>: From<&'a mut [T]>,
{
    let (rank, world) = (c.rank(), c.world_size());
    for root in 0..world {
        for len in lengths::<T>() {
            let mut v: Vec<T> = (0..len).map(|i| of(value(rank, i))).collect();
            c.broadcast(BufferMut::from(&mut v[..]), root)
                .map_err(|e| format!("broadcast {} root {root} len {len}: {e}", T::ELEM))?;
            if let Some(i) = (0..len).find(|&i| v[i] != of(value(root, i))) {
                return Err(format!(
                    "rank {rank}: broadcast {} from {root}, len {len}: [{i}] is {:?}",
                    T::ELEM,
                    v[i]
                ));
            }
        }
    }
    Ok(())
}

fn full_suite(c: &TcpCollective) -> Check {
    all_reduce_suite::<f32>(c)?;
    all_reduce_suite::<f64>(c)?;
    all_reduce_suite::<f16>(c)?;
    all_reduce_suite::<bf16>(c)?;
    // u8 cannot be reduced; the refusal happens before anything moves.
    let mut b = [1u8; 10];
    match c.all_reduce(BufferMut::from(&mut b[..]), ReduceOp::Sum) {
        Err(Error::UnsupportedDType { .. }) => {}
        other => return Err(format!("u8 all_reduce: {other:?}")),
    }
    broadcast_suite::<u8>(c, |v| (v + 5.0) as u8)?;
    broadcast_suite::<f32>(c, |v| v as f32)?;
    broadcast_suite::<f64>(c, |v| v)?;
    broadcast_suite::<f16>(c, f16::from_f64)?;
    broadcast_suite::<bf16>(c, bf16::from_f64)?;
    c.barrier().map_err(|e| format!("barrier: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Worker processes.

fn env_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn options_from_env() -> TcpOptions {
    TcpOptions {
        rank: env_var("RANK").parse().unwrap(),
        world_size: env_var("WORLD_SIZE").parse().unwrap(),
        master_addr: env_var("MASTER_ADDR"),
        master_port: env_var("MASTER_PORT").parse().unwrap(),
        secret: env_var("ACCELERATE_RS_SECRET").into_bytes(),
        // Long: failures must be noticed from the peers, not by timing out.
        timeout: Duration::from_secs(300),
        transport: None,
    }
}

fn worker_fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("worker failed: {msg}");
    std::process::exit(1)
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let c = match TcpCollective::connect(&options_from_env()) {
        Ok(c) => c,
        Err(e) => worker_fail(format!("connect: {e}")),
    };
    let r = c.rank();
    println!("transport={}", c.transport());
    match role.as_str() {
        "suite" => {
            if c.transport() != "shm" {
                worker_fail(format!("auto picked {} on one host", c.transport()));
            }
            if let Err(e) = full_suite(&c) {
                worker_fail(e);
            }
        }
        "transport" => {
            if let Err(e) = reduce_ones(&c, 70_000) {
                worker_fail(e);
            }
        }
        "unlinked" => {
            // The segment is gone from the file system as soon as everyone has mapped it.
            let prefix = format!("accelerate-rs-{}-", std::process::id());
            for dir in [std::path::PathBuf::from("/dev/shm"), std::env::temp_dir()] {
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for e in entries.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&prefix) {
                        worker_fail(format!("{} still exists", e.path().display()));
                    }
                }
            }
            if let Err(e) = reduce_ones(&c, 1000) {
                worker_fail(e);
            }
        }
        "hold" => {
            // Stay connected until killed.
            let _ = std::io::Write::flush(&mut std::io::stdout());
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        "dead" => {
            if let Err(e) = reduce_ones(&c, 1024) {
                worker_fail(e);
            }
            if r == 2 {
                // Exit while the others are (or are about to be) inside the next all_reduce.
                std::thread::sleep(Duration::from_millis(200));
                std::process::exit(0);
            }
            match reduce_ones(&c, 3 << 20) {
                Ok(()) => {
                    eprintln!("rank {r}: the all_reduce unexpectedly succeeded");
                    std::process::exit(2);
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    let kind = match e {
                        Error::Peer { peer, .. } => format!("peer {peer}"),
                        Error::Timeout { .. } => "timeout".into(),
                        _ => "other".into(),
                    };
                    println!("kind={kind}");
                    std::process::exit(1);
                }
            }
        }
        _ => panic!("unknown {ROLE_VAR} {role:?}"),
    }
    std::process::exit(0);
}

/// What one worker did.
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

fn drain(r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(r).read_to_string(&mut s);
        s
    })
}

/// This test binary restricted to [`worker_entry`] as rank `rank` of `world` in `role`, output
/// piped.
fn worker(role: &str, rank: usize, world: usize, port: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "shm::worker_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_VAR, role)
    .env_remove("RUST_LOG")
    .env_remove(TRANSPORT)
    .env("RANK", rank.to_string())
    .env("WORLD_SIZE", world.to_string())
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", port)
    .env("ACCELERATE_RS_SECRET", SECRET)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    cmd
}

/// Runs `world` workers in `role`, rank `r` with the extra variables `env(r)`, and waits for all
/// of them (failing the test if any is still running after [`GROUP_DEADLINE`]).
fn run_group(
    role: &str,
    world: usize,
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Outcome> {
    let port = free_port().to_string();
    let mut children = Children(Vec::new());
    let mut pipes = Vec::new();
    for rank in 0..world {
        let mut child = worker(role, rank, world, &port)
            .envs(env(rank))
            .spawn()
            .unwrap();
        pipes.push((
            drain(child.stdout.take().unwrap()),
            drain(child.stderr.take().unwrap()),
        ));
        children.0.push(child);
    }
    let deadline = Instant::now() + GROUP_DEADLINE;
    let mut codes = vec![None; world];
    let mut done = vec![false; world];
    while done.iter().any(|d| !d) {
        for (r, c) in children.0.iter_mut().enumerate() {
            if !done[r] {
                if let Some(st) = c.try_wait().unwrap() {
                    codes[r] = st.code();
                    done[r] = true;
                }
            }
        }
        if Instant::now() >= deadline {
            drop(children);
            let outs: Vec<String> = pipes
                .into_iter()
                .enumerate()
                .map(|(r, (o, e))| format!("rank {r}:\n{}{}", o.join().unwrap(), e.join().unwrap()))
                .collect();
            panic!(
                "{role}: workers still running after {GROUP_DEADLINE:?} (a hang):\n{}",
                outs.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    pipes
        .into_iter()
        .zip(codes)
        .map(|((o, e), code)| Outcome {
            code,
            stdout: o.join().unwrap(),
            stderr: e.join().unwrap(),
        })
        .collect()
}

fn no_env(_: usize) -> Vec<(String, String)> {
    Vec::new()
}

fn transport_env(v: &'static str) -> impl Fn(usize) -> Vec<(String, String)> {
    move |_| vec![(TRANSPORT.to_string(), v.to_string())]
}

fn assert_all_ok(what: &str, outs: &[Outcome]) {
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.code, Some(0), "{what}: rank {r} failed: {o}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
fn shm_matches_reference_for_world_2_3_4() {
    for world in [2, 3, 4] {
        let outs = run_group("suite", world, no_env);
        assert_all_ok(&format!("world {world}"), &outs);
    }
}

#[test]
fn transport_variable_picks_the_data_path() {
    for (value, want) in [("tcp", "tcp"), ("shm", "shm"), ("auto", "shm"), ("", "shm")] {
        let outs = run_group("transport", 2, transport_env(value));
        assert_all_ok(&format!("{TRANSPORT}={value:?}"), &outs);
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.stdout.contains(&format!("transport={want}\n")),
                "{TRANSPORT}={value:?}: rank {r} should use {want}: {o}"
            );
        }
    }
    // Unset: auto.
    let outs = run_group("transport", 3, no_env);
    assert_all_ok("unset", &outs);
    assert!(outs.iter().all(|o| o.stdout.contains("transport=shm\n")));
}

#[test]
fn bad_or_conflicting_transport_values_are_errors_naming_the_variable() {
    let outs = run_group("transport", 2, transport_env("infiniband"));
    for o in &outs {
        assert_eq!(o.code, Some(1), "{o}");
        assert!(
            o.stderr.contains(TRANSPORT) && o.stderr.contains("infiniband"),
            "{o}"
        );
    }
    let outs = run_group("transport", 2, |r| {
        vec![(TRANSPORT.into(), if r == 0 { "tcp" } else { "shm" }.into())]
    });
    for o in &outs {
        assert_eq!(o.code, Some(1), "{o}");
        assert!(
            o.stderr.contains(TRANSPORT) && o.stderr.contains("disagree"),
            "{o}"
        );
    }
}

#[test]
fn the_segment_is_removed_once_every_rank_has_mapped_it() {
    let outs = run_group("unlinked", 3, no_env);
    assert_all_ok("unlinked", &outs);
    assert!(outs[0].stdout.contains("transport=shm\n"), "{}", outs[0]);
}

/// Issue 12, item 7: rank 0 killed -9 between creating the segment and every rank mapping it
/// left a 4 MiB file in `/dev/shm` for good. The segment must never have a name: this watches
/// `/dev/shm` and the temp dir for a file rank 0 creates, kills rank 0 the moment one appears
/// (or once set-up is done) and checks that nothing is left.
#[test]
fn killing_rank_0_during_setup_leaves_no_segment() {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use std::io::BufRead;
    use std::path::PathBuf;

    let dirs: Vec<PathBuf> = [PathBuf::from("/dev/shm"), std::env::temp_dir()]
        .into_iter()
        .filter(|d| d.is_dir())
        .collect();
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).unwrap();
    let watches: Vec<_> = dirs
        .iter()
        .map(|d| inotify.add_watch(d, AddWatchFlags::IN_CREATE).unwrap())
        .collect();
    let port = free_port().to_string();
    let mut children = Children(Vec::new());
    let mut stderrs = Vec::new();
    let mut rank0_stdout = None;
    for rank in 0..2 {
        let mut child = worker("hold", rank, 2, &port).spawn().unwrap();
        stderrs.push(drain(child.stderr.take().unwrap()));
        let out = child.stdout.take().unwrap();
        if rank == 0 {
            rank0_stdout = Some(out);
        } else {
            drain(out);
        }
        children.0.push(child);
    }
    let pid0 = children.0[0].id() as i32;
    let prefix = format!("accelerate-rs-{pid0}-");
    let (tx, rx) = std::sync::mpsc::channel();
    let out0 = rank0_stdout.unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out0).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut named = None;
    let mut transport = None;
    while named.is_none() && transport.is_none() {
        if let Ok(events) = inotify.read_events() {
            for e in events {
                let Some(name) = e.name.as_ref().map(|n| n.to_string_lossy().into_owned()) else {
                    continue;
                };
                if name.starts_with(&prefix) && named.is_none() {
                    let _ = kill(Pid::from_raw(pid0), Signal::SIGKILL);
                    let dir = watches.iter().position(|w| *w == e.wd).unwrap_or(0);
                    named = Some(dirs[dir].join(name));
                }
            }
        }
        if let Ok(line) = rx.try_recv() {
            // The test harness prints `test worker_entry ... ` before it on the same line.
            if let Some((_, t)) = line.split_once("transport=") {
                transport = Some(t.trim().to_string());
            }
        }
        assert!(
            Instant::now() < deadline,
            "set-up neither created a file nor finished within 60 s"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    // Set-up done without a named file: the crash comes now.
    let _ = kill(Pid::from_raw(pid0), Signal::SIGKILL);
    let _ = children.0[0].wait();
    drop(children);
    let left: Vec<PathBuf> = dirs
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|entries| entries.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    for p in &left {
        let _ = std::fs::remove_file(p);
    }
    assert!(
        named.is_none() && left.is_empty(),
        "rank 0's segment had a name ({named:?}); after rank 0 was killed -9 these were left: \
         {left:?}"
    );
    assert_eq!(
        transport.as_deref(),
        Some("shm"),
        "the ranks did not use shared memory; rank 1 said:\n{}",
        stderrs.pop().unwrap().join().unwrap()
    );
}

#[test]
fn a_peer_that_exits_mid_run_fails_the_others_naming_it() {
    for world in [3, 4] {
        let outs = run_group("dead", world, no_env);
        assert_eq!(outs[2].code, Some(0), "the exiting rank: {}", outs[2]);
        for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != 2) {
            assert_eq!(o.code, Some(1), "world {world} rank {r}: {o}");
            assert!(
                o.stdout.contains("kind=peer 2\n"),
                "world {world} rank {r} should blame rank 2: {o}"
            );
            assert!(
                o.stderr
                    .contains(&format!("rank {r}: all_reduce failed talking to rank 2")),
                "world {world} rank {r}: {o}"
            );
        }
    }
}

/// Mismatches, in one process (threads with real sockets, the same segment mapped once per
/// rank): every rank gets an error, none exchanges garbage, none hangs.
#[test]
fn mismatched_calls_are_reported_not_garbled() {
    let timeout = Duration::from_secs(120);
    type Call = fn(&TcpCollective) -> accelerate_rs::Result<()>;
    let cases: [(&str, Call); 4] = [
        ("sizes", |c| {
            let mut v = vec![1.0f32; 10 + 70_000 * c.rank()];
            c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
        }),
        ("dtypes", |c| {
            if c.rank() == 0 {
                let mut v = vec![1.0f32; 64];
                c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
            } else {
                let mut v = vec![1.0f64; 64];
                c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
            }
        }),
        ("ops", |c| {
            let mut v = vec![1.0f32; 64];
            if c.rank() == 0 {
                c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Max)
            } else {
                c.broadcast(BufferMut::from(&mut v[..]), 0)
            }
        }),
        ("shm vs tcp", |c| {
            if c.rank() == 0 {
                c.barrier()
            } else {
                let mut v = vec![1.0f32; 64];
                c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
            }
        }),
    ];
    for (what, call) in cases {
        let ranks = tcp_group(2, timeout);
        assert!(ranks.iter().all(|c| c.transport() == "shm"));
        let errs = on_each(ranks, move |c| {
            let err = call(c).expect_err("a mismatched call succeeded");
            // The communicator refuses further work instead of exchanging garbage.
            let mut v = [1.0f32; 4];
            let again = c
                .all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
                .expect_err("a broken communicator worked");
            (err, again)
        });
        assert!(
            errs.iter()
                .any(|(e, _)| matches!(e, Error::Mismatch { .. })),
            "{what}: no rank reported a mismatch: {errs:?}"
        );
        for (rank, (err, again)) in errs.iter().enumerate() {
            assert!(
                matches!(err, Error::Mismatch { .. } | Error::Peer { .. }),
                "{what}: rank {rank}: {err}"
            );
            assert!(!matches!(err, Error::Timeout { .. }), "{what}: {err}");
            if let Error::Mismatch { detail, .. } = err {
                assert!(
                    detail.contains("rank 0") && detail.contains("rank 1"),
                    "{what}: {err}"
                );
            }
            assert!(
                matches!(again, Error::Broken { .. } | Error::Peer { .. }),
                "{what}: rank {rank}: {again}"
            );
        }
    }
}

/// Timeouts name the rank waited for, also on the shared-memory path.
#[test]
fn a_rank_that_never_arrives_times_out_naming_it() {
    let ranks = tcp_group(3, Duration::from_millis(700));
    assert!(ranks.iter().all(|c| c.transport() == "shm"));
    let results = on_each(ranks, |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        let mut v = vec![1.0f32; 1000];
        Some(
            c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
                .unwrap_err(),
        )
    });
    for (rank, err) in results.into_iter().enumerate().take(2) {
        let err = err.unwrap();
        let msg = err.to_string();
        assert!(msg.contains(&format!("rank {rank}")), "{msg}");
        assert!(msg.contains("rank 2"), "{msg}");
        assert!(
            matches!(
                err,
                Error::Timeout { peer: 2, .. } | Error::Peer { peer: 2, .. }
            ),
            "{msg}"
        );
    }
}
