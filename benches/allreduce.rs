//! All-reduce (sum, f32) latency and bandwidth between 2 processes, over TCP on loopback and
//! through the same-host shared-memory transport, and the in-process `ThreadGroup` (2 threads) for
//! comparison.
//!
//! `cargo bench --bench allreduce [-- --quick]`
//!
//! The bench process is rank 0 and does the timing; it re-runs itself with
//! `ACCEL_BENCH_ROLE=worker` (plus `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and
//! `ACCELERATE_RS_TRANSPORT`) for rank 1, which only participates. Unknown arguments (such as the `--bench` that cargo passes) are
//! ignored.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::collective::{BufferMut, Collective, TcpCollective, TcpOptions, ThreadGroup};
use accelerate_rs::ReduceOp;

const ROLE_VAR: &str = "ACCEL_BENCH_ROLE";
const TRANSPORT_VAR: &str = accelerate_rs::env::TRANSPORT;
const SECRET: &str = "allreduce-bench";
const KIB: usize = 1024;
const SIZES: [usize; 8] = [
    4 * KIB,
    16 * KIB,
    64 * KIB,
    256 * KIB,
    KIB * KIB,
    4 * KIB * KIB,
    16 * KIB * KIB,
    64 * KIB * KIB,
];

/// How long to time each size, and the iteration bounds.
#[derive(Clone, Copy)]
struct Plan {
    target: Duration,
    min_iters: usize,
    max_iters: usize,
    warmup: usize,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Plan {
                target: Duration::from_millis(50),
                min_iters: 3,
                max_iters: 200,
                warmup: 2,
            }
        } else {
            Plan {
                target: Duration::from_millis(300),
                min_iters: 10,
                max_iters: 5000,
                warmup: 5,
            }
        }
    }
}

struct Row {
    bytes: usize,
    iters: usize,
    mean_us: f64,
    p50_us: f64,
    gbps: f64,
}

fn fail(msg: String) -> ! {
    eprintln!("allreduce bench: {msg}");
    std::process::exit(1)
}

/// Runs every size on `c`; rank 0 returns the measurements.
fn run_sizes<C: Collective>(c: &C, plan: Plan) -> Vec<Row> {
    let mut rows = Vec::new();
    for &bytes in &SIZES {
        let count = bytes / 4;
        let mut buf = vec![1.0f32; count];
        let reduce = |buf: &mut [f32]| {
            c.all_reduce(BufferMut::from(buf), ReduceOp::Sum)
                .unwrap_or_else(|e| fail(e.to_string()))
        };
        // Correctness once, then zeros so that repeated sums stay finite.
        reduce(&mut buf);
        let want = c.world_size() as f32;
        if buf.iter().any(|&x| x != want) {
            fail(format!("wrong all_reduce result at {bytes} bytes"));
        }
        buf.fill(0.0);
        let start = Instant::now();
        for _ in 0..plan.warmup {
            reduce(&mut buf);
        }
        let per_iter = start.elapsed().as_secs_f64() / plan.warmup as f64;
        // Rank 0 picks the iteration count and tells the others.
        let mut iters = [(plan.target.as_secs_f64() / per_iter.max(1e-9))
            .clamp(plan.min_iters as f64, plan.max_iters as f64)
            .round()];
        c.broadcast(BufferMut::from(&mut iters[..]), 0)
            .unwrap_or_else(|e| fail(e.to_string()));
        let iters = iters[0] as usize;
        c.barrier().unwrap_or_else(|e| fail(e.to_string()));
        let mut times = Vec::with_capacity(iters);
        let block = Instant::now();
        for _ in 0..iters {
            let t = Instant::now();
            reduce(&mut buf);
            times.push(t.elapsed().as_secs_f64());
        }
        let total = block.elapsed().as_secs_f64();
        times.sort_by(f64::total_cmp);
        let mean = total / iters as f64;
        rows.push(Row {
            bytes,
            iters,
            mean_us: mean * 1e6,
            p50_us: times[iters / 2] * 1e6,
            gbps: bytes as f64 / mean / 1e9,
        });
    }
    rows
}

fn size_label(bytes: usize) -> String {
    if bytes >= KIB * KIB {
        format!("{} MiB", bytes / (KIB * KIB))
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

fn print_table(title: &str, rows: &[Row]) {
    println!("\n{title}");
    println!(
        "{:>8} | {:>6} | {:>12} | {:>12} | {:>10}",
        "size", "iters", "mean (µs)", "p50 (µs)", "algbw GB/s"
    );
    println!("{}", "-".repeat(60));
    for r in rows {
        println!(
            "{:>8} | {:>6} | {:>12.1} | {:>12.1} | {:>10.3}",
            size_label(r.bytes),
            r.iters,
            r.mean_us,
            r.p50_us,
            r.gbps
        );
    }
}

fn tcp_options(rank: usize, port: u16) -> TcpOptions {
    TcpOptions {
        rank,
        world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: SECRET.as_bytes().to_vec(),
        timeout: Duration::from_secs(120),
        // Each table's transport comes from ACCELERATE_RS_TRANSPORT, set per worker.
        transport: None,
    }
}

fn worker(plan: Plan) {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| fail(format!("{name} unset")));
    let rank: usize = var("RANK")
        .parse()
        .unwrap_or_else(|_| fail("bad RANK".into()));
    let port: u16 = var("MASTER_PORT")
        .parse()
        .unwrap_or_else(|_| fail("bad MASTER_PORT".into()));
    let c =
        TcpCollective::connect(&tcp_options(rank, port)).unwrap_or_else(|e| fail(e.to_string()));
    run_sizes(&c, plan);
}

/// Rank 0 of a 2-process run whose `all_reduce` uses `transport` (`tcp` or `shm`).
fn two_processes(transport: &str, quick: bool, plan: Plan) -> Vec<Row> {
    // Read by `TcpCollective::connect` here and in the worker; no other thread runs yet.
    std::env::set_var(TRANSPORT_VAR, transport);
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| fail(format!("no free port: {e}")));
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(e.to_string()));
    let mut child = Command::new(exe)
        .args(quick.then_some("--quick"))
        .env(ROLE_VAR, "worker")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env(TRANSPORT_VAR, transport)
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| fail(format!("cannot start rank 1: {e}")));
    let c = TcpCollective::connect(&tcp_options(0, port)).unwrap_or_else(|e| {
        let _ = child.kill();
        fail(e.to_string())
    });
    if c.transport() != transport {
        let _ = child.kill();
        fail(format!("asked for {transport}, got {}", c.transport()));
    }
    let rows = run_sizes(&c, plan);
    drop(c);
    let status = child.wait().unwrap_or_else(|e| fail(e.to_string()));
    if !status.success() {
        fail(format!("rank 1 ({transport}) {status}"));
    }
    rows
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let plan = Plan::new(quick);
    if std::env::var_os(ROLE_VAR).is_some() {
        worker(plan);
        return;
    }

    let tcp = two_processes("tcp", quick, plan);
    let shm = two_processes("shm", quick, plan);

    let threads =
        ThreadGroup::new(2, Duration::from_secs(120)).unwrap_or_else(|e| fail(e.to_string()));
    let mut handles: Vec<_> = threads
        .into_iter()
        .map(|c| std::thread::spawn(move || run_sizes(&c, plan)))
        .collect();
    let others: Vec<_> = handles.split_off(1);
    let thread_rows = handles
        .pop()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| fail("rank 0 thread panicked".into()))
        })
        .unwrap_or_default();
    for h in others {
        let _ = h.join();
    }

    println!(
        "all_reduce (sum, f32), world size 2{}",
        if quick { " (--quick)" } else { "" }
    );
    print_table("tcp: 2 processes on loopback", &tcp);
    print_table("shm: 2 processes, shared-memory transport", &shm);
    print_table(
        "threads: ThreadGroup, 2 threads in one process",
        &thread_rows,
    );
}
