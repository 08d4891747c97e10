//! Fault injection with real sockets on loopback and real processes: rogue connections to the
//! rendezvous store, a peer killed in the middle of a collective, a worker failing under the
//! launcher.
//!
//! The multi-process tests re-run this test binary (`std::env::current_exe()`) restricted to
//! [`worker_entry`], with `ACCEL_FAULT_ROLE` naming what the worker does; without that variable
//! `worker_entry` returns at once.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::{free_port, on_each, reduce_ones, tcp_options, Children};
use accelerate_rs::collective::{BufferMut, Collective, TcpCollective, TcpOptions};
use accelerate_rs::ReduceOp;

const ROLE_VAR: &str = "ACCEL_FAULT_ROLE";
const READY_MARKER: &str = "ACCEL-FAULT-READY";
const SECRET: &[u8] = b"test-secret";

// ---------------------------------------------------------------------------------------------
// Rogue connections to the rendezvous store.

/// True when the server closes `s` (EOF or reset) within `within`; bytes it sends first (a
/// handshake acknowledgement) are skipped. False when the connection is still open.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 64];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}

/// A well-formed version-2 handshake of a store client (rank 1 of 3), as a rogue client would
/// write it: magic `ACRS`, version, role, padding, rank, world, secret length, secret (all
/// little-endian). The wire module's unit tests pin this layout.
fn hello(secret: &[u8]) -> Vec<u8> {
    let mut b = b"ACRS".to_vec();
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&[1, 0]);
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(secret.len() as u16).to_le_bytes());
    b.extend_from_slice(secret);
    b
}

fn rogue(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).expect("connect to the store")
}

/// Sends a handshake with the wrong secret; the store must hang up.
fn wrong_secret_is_dropped(port: u16) {
    let mut s = rogue(port);
    s.write_all(&hello(b"not-the-secret")).unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(5)),
        "the store kept a connection with the wrong secret open"
    );
}

/// Sends something that is not the protocol at all; the store must hang up.
fn garbage_is_dropped(port: u16) {
    let mut s = rogue(port);
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(5)),
        "the store kept a connection that sent HTTP open"
    );
}

/// Resident and peak resident memory of this process, in KiB (Linux).
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[test]
fn store_rejects_bad_connections_while_the_run_goes_on() {
    const WORLD: usize = 3;
    const LEN: usize = 1000;
    let port = free_port();
    let timeout = Duration::from_secs(30);

    // Rank 0 first: it hosts the store and then waits for the others.
    let rank0 =
        std::thread::spawn(move || TcpCollective::connect(&tcp_options(0, WORLD, port, timeout)));
    let up_by = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < up_by, "the store never came up");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Rogue connections before the other ranks join.
    wrong_secret_is_dropped(port);
    garbage_is_dropped(port);
    let others: Vec<_> = (1..WORLD)
        .map(|r| {
            std::thread::spawn(move || {
                TcpCollective::connect(&tcp_options(r, WORLD, port, timeout))
            })
        })
        .collect();
    let mut ranks = vec![rank0.join().unwrap().expect("rank 0 connect")];
    for h in others {
        ranks.push(h.join().unwrap().expect("connect"));
    }

    // Every rank loops on all_reduce until rank 0 raises the stop flag; the flag travels in
    // element 0 of the reduced buffer so that all ranks stop after the same iteration.
    let stop = Arc::new(AtomicBool::new(false));
    let iterations = Arc::new(AtomicUsize::new(0));
    let workers: Vec<JoinHandle<Result<usize, String>>> = ranks
        .into_iter()
        .map(|c| {
            let (stop, iterations) = (stop.clone(), iterations.clone());
            std::thread::spawn(move || {
                let r = c.rank();
                let mut it = 0usize;
                loop {
                    let flag = if r == 0 && stop.load(Ordering::SeqCst) {
                        1.0
                    } else {
                        0.0
                    };
                    let mut v: Vec<f32> = (0..LEN)
                        .map(|i| ((r + 1) * (i % 7 + 1) + it % 5) as f32)
                        .collect();
                    v[0] = flag;
                    c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)
                        .map_err(|e| format!("iteration {it}: {e}"))?;
                    for (i, &x) in v.iter().enumerate().skip(1) {
                        // sum over r of (r + 1) * (i % 7 + 1) + it % 5
                        let want = (6 * (i % 7 + 1) + 3 * (it % 5)) as f32;
                        if x != want {
                            return Err(format!(
                                "rank {r} iteration {it}: element {i} is {x}, want {want}"
                            ));
                        }
                    }
                    it += 1;
                    if r == 0 {
                        iterations.store(it, Ordering::SeqCst);
                    }
                    if v[0] != 0.0 {
                        return Ok(it);
                    }
                }
            })
        })
        .collect();
    let wait_for_progress = |at_least: usize| {
        let by = Instant::now() + Duration::from_secs(10);
        while iterations.load(Ordering::SeqCst) < at_least {
            assert!(
                Instant::now() < by,
                "the collectives stopped making progress"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_for_progress(3);
    let before = iterations.load(Ordering::SeqCst);
    let (rss_before, _) = rss_kib();

    // (a) wrong secret, (b) garbage.
    wrong_secret_is_dropped(port);
    garbage_is_dropped(port);

    // (c) a correct handshake, then a SET whose key claims 4 GiB.
    let mut s = rogue(port);
    s.write_all(&hello(SECRET)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)
        .expect("the store did not acknowledge a correct handshake");
    let mut frame = vec![1u8]; // STORE_SET
    frame.extend_from_slice(&0xFFFF_FFFFu32.to_le_bytes());
    frame.extend_from_slice(b"some key bytes");
    s.write_all(&frame).unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(5)),
        "the store kept a connection that announced a 4 GiB key open"
    );
    let (rss_after, peak) = rss_kib();
    assert!(
        rss_after < rss_before + 256 * 1024 && peak < rss_before + 512 * 1024,
        "memory grew from {rss_before} KiB to {rss_after} KiB (peak {peak} KiB) after a 4 GiB key length"
    );

    // (d) a correct handshake, then silence: the store keeps the connection and it still works.
    let mut idle = rogue(port);
    idle.write_all(&hello(SECRET)).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    idle.read_exact(&mut ack)
        .expect("the store did not acknowledge a correct handshake");
    assert_eq!(ack[0], 0);
    let mid = iterations.load(Ordering::SeqCst);
    assert!(
        !closed_within(&mut idle, Duration::from_millis(1500)),
        "the store dropped an authenticated but idle connection"
    );
    // ... and after the silence it still answers a request.
    let mut set = vec![1u8];
    set.extend_from_slice(&5u32.to_le_bytes());
    set.extend_from_slice(b"rogue");
    set.extend_from_slice(&2u32.to_le_bytes());
    set.extend_from_slice(b"ok");
    idle.write_all(&set).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reply = [0u8; 5];
    idle.read_exact(&mut reply)
        .expect("no reply from the store after an idle period");
    assert_eq!(reply, [0, 0, 0, 0, 0], "status OK and an empty value");

    // The collectives kept running during all of this.
    let during = iterations.load(Ordering::SeqCst);
    assert!(
        during > before && during > mid,
        "no collective completed while rogue connections were open ({before} -> {mid} -> {during})"
    );
    wait_for_progress(during + 3);
    stop.store(true, Ordering::SeqCst);
    let done: Vec<usize> = workers
        .into_iter()
        .map(|h| h.join().unwrap().unwrap_or_else(|e| panic!("{e}")))
        .collect();
    assert!(done.iter().all(|&n| n == done[0]), "{done:?}");
    drop(idle);
}

/// Connections that open a handshake and then trickle it one byte at a time (issue 12, item 5):
/// a per-read timeout never fires on them. `senders` of them are opened to the store at `port`;
/// a thread sends each one more byte every `every` until `stop` is raised.
fn slow_senders(
    port: u16,
    senders: usize,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> (Vec<TcpStream>, JoinHandle<()>) {
    let bytes = hello(b"whatever");
    let streams: Vec<TcpStream> = (0..senders)
        .map(|_| {
            let mut s = rogue(port);
            s.write_all(&bytes[..1]).unwrap();
            s
        })
        .collect();
    let clones: Vec<TcpStream> = streams.iter().map(|s| s.try_clone().unwrap()).collect();
    let keeper = std::thread::spawn(move || {
        let mut next = 1;
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(every);
            for mut s in &clones {
                // A dropped connection fails the write; that is what the test wants.
                let _ = s.write_all(&bytes[next % bytes.len()..][..1]);
            }
            next += 1;
        }
    });
    (streams, keeper)
}

#[test]
fn slow_senders_neither_lock_out_a_rank_nor_stay_forever() {
    let port = free_port();
    let timeout = Duration::from_secs(30);
    let rank0 =
        std::thread::spawn(move || TcpCollective::connect(&tcp_options(0, 2, port, timeout)));
    let up_by = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < up_by, "the store never came up");
        std::thread::sleep(Duration::from_millis(10));
    }
    // More trickling connections than the store serves at once, one byte every 2 s.
    let stop = Arc::new(AtomicBool::new(false));
    let (mut streams, keeper) = slow_senders(port, 600, Duration::from_secs(2), stop.clone());
    let newest_at = &Instant::now();
    std::thread::sleep(Duration::from_millis(500));

    // A real rank still gets in, promptly.
    let joined = Instant::now();
    let rank1 = TcpCollective::connect(&tcp_options(1, 2, port, Duration::from_secs(20)));
    let took = joined.elapsed();
    let rank1 = rank1.unwrap_or_else(|e| panic!("rank 1 was locked out by slow senders: {e}"));
    let rank0 = rank0.join().unwrap().expect("rank 0 connect");
    assert!(
        took < Duration::from_secs(10),
        "rank 1 took {took:?} to join"
    );
    let both = on_each(vec![rank0, rank1], |c| reduce_ones(c, 1000));
    assert!(both.iter().all(Result::is_ok), "{both:?}");

    // The newest trickling connection (never pushed out to make room) is dropped when the
    // handshake's 10 s are up, although it keeps sending.
    let (mut newest, newest_opened) = (streams.pop().unwrap(), *newest_at);
    let closed = closed_within(
        &mut newest,
        (newest_opened + Duration::from_secs(16)).saturating_duration_since(Instant::now()),
    );
    let after = newest_opened.elapsed();
    stop.store(true, Ordering::SeqCst);
    keeper.join().unwrap();
    assert!(
        closed,
        "a connection trickling its handshake was still open {after:?} after it was opened"
    );
}

#[test]
fn a_rank_turned_away_by_a_busy_store_says_so() {
    // A stand-in for a store that is serving too many connections: it answers every handshake
    // with "busy".
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    listener.set_nonblocking(true).unwrap();
    let server = std::thread::spawn(move || {
        while !stop2.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    let mut head = [0u8; 18];
                    let _ = s.read_exact(&mut head);
                    let _ = s.write_all(&[2]); // STATUS_BUSY
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    let started = Instant::now();
    let err = TcpCollective::connect(&tcp_options(1, 2, port, Duration::from_secs(2)))
        .expect_err("a busy store let the rank in");
    stop.store(true, Ordering::SeqCst);
    server.join().unwrap();
    let text = err.to_string();
    assert!(
        text.contains("too many connections") && text.contains("rank 1"),
        "the error does not say the store was busy: {text}"
    );
    assert!(
        !text.contains("SECRET"),
        "the error blames the secret: {text}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

// ---------------------------------------------------------------------------------------------
// Worker processes.

/// Reads a pipe to the end in a thread.
fn drain(r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(r).read_to_string(&mut s);
        s
    })
}

/// Polls `child` until it exits or `deadline` passes.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This test binary restricted to [`worker_entry`].
fn worker_command(role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "faults::worker_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_VAR, role)
    .env_remove("RUST_LOG")
    .stdin(Stdio::null());
    cmd
}

fn env_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// Options from the launcher's variables; the timeout is `ACCELERATE_RS_TIMEOUT_SECS` when set,
/// else `timeout`.
fn options_from_env(timeout: Duration) -> TcpOptions {
    let timeout = std::env::var("ACCELERATE_RS_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(timeout, Duration::from_secs_f64);
    TcpOptions {
        rank: env_var("RANK").parse().unwrap(),
        world_size: env_var("WORLD_SIZE").parse().unwrap(),
        master_addr: env_var("MASTER_ADDR"),
        master_port: env_var("MASTER_PORT").parse().unwrap(),
        secret: std::env::var("ACCELERATE_RS_SECRET")
            .unwrap_or_default()
            .into_bytes(),
        timeout,
        transport: None,
    }
}

fn sleep_forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    if role == "accelerator" {
        // The settings as a program sees them: Accelerator::new() and one all-reduce.
        let result = accelerate_rs::Accelerator::new().and_then(|acc| {
            let mut v = [1f32; 4];
            acc.collective()
                .all_reduce((&mut v[..]).into(), accelerate_rs::ReduceOp::Sum)
        });
        crate::common::exit_worker(result);
    }
    if role == "slow0" && std::env::var("RANK").as_deref() == Ok("0") {
        // Rank 0 starts late: a window in which another launch could take the port.
        std::thread::sleep(Duration::from_millis(1500));
    }
    // A long timeout: failures must be detected from the sockets, not by timing out.
    let c = match TcpCollective::connect(&options_from_env(Duration::from_secs(300))) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let r = c.rank();
    if role == "late-error" {
        if r == 1 {
            // The real error, then a slow exit (clean-up): its sockets close first, so its peers'
            // collectives fail and they exit before it does.
            let _ = signal_hook::flag::register(
                signal_hook::consts::SIGTERM,
                std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
            );
            eprintln!("Error: data: shard 7 of the training set is truncated");
            drop(c);
            std::thread::sleep(Duration::from_millis(1500));
            std::process::exit(4);
        }
        match reduce_ones(&c, 4 << 20) {
            Ok(()) => std::process::exit(2),
            Err(e) => {
                eprintln!("worker failed: {e}");
                std::process::exit(1);
            }
        }
    }
    let rounds = if role == "launch" { 3 } else { 1 };
    for _ in 0..rounds {
        if let Err(e) = reduce_ones(&c, 1024) {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
    match (role.as_str(), r) {
        ("killed", 1) => {
            println!("{READY_MARKER}");
            std::io::stdout().flush().unwrap();
            sleep_forever();
        }
        ("launch", 2) => {
            // Give ranks 0 and 1 time to be blocked inside their next all_reduce.
            std::thread::sleep(Duration::from_millis(500));
            std::process::exit(7)
        }
        ("slow0", _) => std::process::exit(0),
        ("killed", _) | ("launch", _) => {
            if role == "launch" {
                // The launcher SIGTERMs the survivors as soon as rank 2 exits; keep running until
                // the error is printed (SIGKILL still comes after the grace period).
                let _ = signal_hook::flag::register(
                    signal_hook::consts::SIGTERM,
                    std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
                );
            }
            match reduce_ones(&c, 4 << 20) {
                Ok(()) => {
                    eprintln!("rank {r}: the all_reduce unexpectedly succeeded");
                    std::process::exit(2);
                }
                Err(e) => eprintln!("{e}"),
            }
            if role == "launch" {
                // Linger, as a real program cleaning up would, so the launcher sees rank 2's
                // exit first (it polls every 20 ms) and has to stop this one itself.
                std::thread::sleep(Duration::from_secs(30));
            }
            std::process::exit(1);
        }
        _ => panic!("unknown {ROLE_VAR} {role:?}"),
    }
}

#[test]
fn survivor_errors_within_10s_when_peer_is_killed_mid_collective() {
    let port = free_port().to_string();
    let mut children = Children::default();
    let mut outputs = Vec::new();
    for rank in 0..2 {
        let mut child = worker_command("killed")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("ACCELERATE_RS_SECRET", "killed-peer-secret")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let stderr = drain(child.stderr.take().unwrap());
        outputs.push((stdout, stderr));
        children.0.push(child);
    }
    let (out1, err1) = outputs.pop().unwrap();
    let (out0, err0) = outputs.pop().unwrap();
    let out0 = drain(out0);

    // Rank 1's stdout, line by line.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out1).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let ready_by = Instant::now() + Duration::from_secs(15);
    loop {
        let left = ready_by.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(READY_MARKER) => break,
            Ok(_) => {}
            Err(_) => {
                drop(children);
                panic!(
                    "rank 1 never became ready; its stderr:\n{}",
                    err1.join().unwrap()
                );
            }
        }
    }
    // Let rank 0 get well inside its second all_reduce.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        children.0[0].try_wait().unwrap().is_none(),
        "rank 0 exited before rank 1 was killed"
    );
    children.0[1].kill().unwrap();
    let killed_at = Instant::now();
    children.0[1].wait().unwrap();

    let status = wait_until(&mut children.0[0], killed_at + Duration::from_secs(10));
    let elapsed = killed_at.elapsed();
    let Some(status) = status else {
        drop(children);
        panic!("rank 0 was still running 10 s after rank 1 was killed");
    };
    let text = format!("{}{}", err0.join().unwrap(), out0.join().unwrap());
    assert!(
        !status.success(),
        "rank 0 exited successfully: {status}\n{text}"
    );
    assert_eq!(status.code(), Some(1), "{text}");
    for needle in ["all_reduce", "rank 0", "rank 1"] {
        assert!(
            text.contains(needle),
            "rank 0's output does not mention `{needle}`:\n{text}"
        );
    }
    eprintln!("rank 0 failed {elapsed:?} after rank 1 was killed");
}

/// `accelerate-rs launch --cpu <launch_args> <this test binary>` whose workers run
/// [`worker_entry`] in `role`; stdout and stderr are piped.
fn launch_workers(launch_args: &[&str], role: &str) -> Command {
    let mut cmd = Command::new(crate::common::launcher());
    cmd.args(["launch", "--cpu"])
        .args(launch_args)
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "faults::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, role)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Spawns `cmd` and drains its output: the child and the threads collecting stdout and stderr.
fn spawn_drained(mut cmd: Command) -> (Child, JoinHandle<String>, JoinHandle<String>) {
    let mut child = cmd.spawn().unwrap();
    let out = drain(child.stdout.take().unwrap());
    let err = drain(child.stderr.take().unwrap());
    (child, out, err)
}

/// Runs `cmd` to its end (killed, and the test failed, if it runs past `limit`): its status,
/// stdout and stderr.
fn run_to_end(cmd: Command, limit: Duration) -> (ExitStatus, String, String) {
    let (child, out, err) = spawn_drained(cmd);
    let mut children = Children::default();
    children.0.push(child);
    let Some(status) = wait_until(&mut children.0[0], Instant::now() + limit) else {
        drop(children);
        panic!("the launcher was still running after {limit:?}");
    };
    (status, out.join().unwrap(), err.join().unwrap())
}

#[test]
fn launch_exits_nonzero_naming_the_failed_worker_in_a_real_collective_run() {
    let start = Instant::now();
    let (status, out, err) = run_to_end(
        launch_workers(&["-n", "3"], "launch"),
        Duration::from_secs(20),
    );
    let text = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(status.code(), Some(7), "{text}");
    assert!(
        err.contains("accelerate-rs: rank 2"),
        "the launcher did not name rank 2:\n{text}"
    );
    // The survivors saw the failure in their collective before being stopped.
    assert!(
        err.lines()
            .any(|l| l.starts_with("[rank 0]") && l.contains("all_reduce failed")),
        "rank 0 did not report a failed all_reduce:\n{text}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn the_launcher_blames_the_rank_with_the_real_error_not_the_first_to_exit() {
    let (status, out, err) = run_to_end(
        launch_workers(&["-n", "3", "--grace-period", "5"], "late-error"),
        Duration::from_secs(30),
    );
    let text = format!("stdout:\n{out}\nstderr:\n{err}");
    // Rank 1's own code, and rank 1 named as the failed rank with its error in the report.
    assert_eq!(status.code(), Some(4), "{text}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("accelerate-rs: rank 1 (pid")),
        "the launcher did not blame rank 1:\n{text}"
    );
    assert!(err.contains("exited first"), "{text}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("  [rank 1]") && l.contains("shard 7")),
        "rank 1's error is not in the report:\n{text}"
    );
}

#[test]
fn absurd_timeouts_are_range_errors_not_panics_in_a_real_run() {
    for (how, value) in [
        ("env", "1e19"),
        ("env", "1e300"),
        ("flag", "1e19"),
        ("env", "NaN"),
    ] {
        let mut cmd = if how == "flag" {
            launch_workers(
                &["-n", "2", "--collective-timeout-secs", value],
                "accelerator",
            )
        } else {
            launch_workers(&["-n", "2"], "accelerator")
        };
        if how == "env" {
            cmd.env("ACCELERATE_RS_TIMEOUT_SECS", value);
        }
        let (status, out, err) = run_to_end(cmd, Duration::from_secs(30));
        let text = format!("{how} {value}:\nstdout:\n{out}\nstderr:\n{err}");
        assert!(!status.success(), "{text}");
        assert!(!text.contains("panicked"), "{text}");
        assert!(text.contains("604800"), "{text}");
        if how == "env" {
            assert!(text.contains("ACCELERATE_RS_TIMEOUT_SECS"), "{text}");
        } else {
            assert!(text.contains("--collective-timeout-secs"), "{text}");
        }
    }
    // The longest valid timeout runs (no deadline overflows).
    let mut cmd = launch_workers(&["-n", "2"], "accelerator");
    cmd.env("ACCELERATE_RS_TIMEOUT_SECS", "604800");
    let (status, out, err) = run_to_end(cmd, Duration::from_secs(30));
    assert!(status.success(), "stdout:\n{out}\nstderr:\n{err}");
}

#[test]
fn a_tiny_collective_timeout_is_called_too_short_not_a_missing_store() {
    let (status, out, err) = run_to_end(
        launch_workers(
            &["-n", "2", "--collective-timeout-secs", "0.000001"],
            "launch",
        ),
        Duration::from_secs(20),
    );
    let text = format!("stdout:\n{out}\nstderr:\n{err}");
    assert!(!status.success(), "{text}");
    assert!(
        err.contains("too short") && err.contains("collective timeout"),
        "the start-up error does not say the timeout is too short:\n{text}"
    );
    assert!(
        !err.contains("did not come up"),
        "the error blames rank 0's store:\n{text}"
    );
}

/// Issue 12, item 6: two launches given the same `--main-process-port` both found it free, and
/// one run failed (its rank 0 could not bind; its rank 1 reached the other run's store). The
/// launcher now binds the port itself and hands the socket to rank 0: the second launch sees it
/// taken and moves to a free port, and both runs succeed.
#[test]
fn two_launches_given_the_same_port_both_run() {
    let port = free_port().to_string();
    let launch = || {
        let mut cmd = launch_workers(&["-n", "2", "--main-process-port", &port], "slow0");
        cmd.env_remove("ACCELERATE_RS_SECRET");
        spawn_drained(cmd)
    };
    let mut children = Children::default();
    let (a, a_out, a_err) = launch();
    children.0.push(a);
    // Inside the window of the first launch (its rank 0 binds 1.5 s after starting).
    std::thread::sleep(Duration::from_millis(300));
    let (b, b_out, b_err) = launch();
    children.0.push(b);
    let deadline = Instant::now() + Duration::from_secs(30);
    let a_status = wait_until(&mut children.0[0], deadline);
    let b_status = wait_until(&mut children.0[1], deadline);
    if a_status.is_none() || b_status.is_none() {
        drop(children);
        panic!("a launcher was still running after 30 s");
    }
    let text = format!(
        "first launch:\n{}{}\nsecond launch:\n{}{}",
        a_out.join().unwrap(),
        a_err.join().unwrap(),
        b_out.join().unwrap(),
        b_err.join().unwrap()
    );
    assert!(
        a_status.is_some_and(|s| s.success()) && b_status.is_some_and(|s| s.success()),
        "({a_status:?}, {b_status:?}):\n{text}"
    );
    assert!(text.contains("already in use"), "{text}");
}

/// A rank that reaches another run's store (different secret) is told so.
#[test]
fn a_rank_reaching_another_runs_store_is_told_so() {
    let port = free_port();
    let timeout = Duration::from_secs(5);
    let other_run =
        std::thread::spawn(move || TcpCollective::connect(&tcp_options(0, 2, port, timeout)));
    let mut ours = tcp_options(1, 2, port, timeout);
    ours.secret = b"a-different-run".to_vec();
    let up_by = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < up_by, "the store never came up");
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = TcpCollective::connect(&ours).expect_err("joined another run");
    let text = err.to_string();
    assert!(text.contains("another run"), "{text}");
    // The other run's rank 0 times out waiting for its own rank 1.
    assert!(other_run.join().unwrap().is_err());
}

/// Issue 12, item 4: a program that installs no logger still shows on stderr that its store
/// dropped a wrong secret and garbage.
#[test]
fn rejections_reach_stderr_without_a_logger() {
    let port = free_port();
    // Rank 0 of 2 alone: it hosts the store and waits for a rank 1 that never comes.
    let mut child = worker_command("store")
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ACCELERATE_RS_SECRET", "the-real-secret")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut children = Children::default();
    children.0.push(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let up_by = Instant::now() + Duration::from_secs(15);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < up_by, "the store never came up");
        std::thread::sleep(Duration::from_millis(10));
    }
    wrong_secret_is_dropped(port);
    garbage_is_dropped(port);
    let mut seen = Vec::new();
    let by = Instant::now() + Duration::from_secs(10);
    let wanted = |seen: &[String], what: &str| seen.iter().any(|l| l.contains(what));
    while !(wanted(&seen, "wrong secret") && wanted(&seen, "not an accelerate-rs connection")) {
        let left = by.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => {
                drop(children);
                panic!(
                    "rank 0's stderr does not report the rejected connections:\n{}",
                    seen.join("\n")
                );
            }
        }
    }
}
