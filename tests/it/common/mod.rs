//! Helpers shared by the integration tests.

pub mod elems;
#[allow(dead_code)]
pub mod llama;
pub mod tiny;

use std::net::TcpListener;
use std::time::Duration;

use std::sync::Arc;

use accelerate_rs::collective::{BufferMut, Collective, TcpCollective, TcpOptions, ThreadGroup};
use accelerate_rs::ReduceOp;
use accelerate_rs::{Accelerator, AcceleratorBuilder};

/// The `accelerate-rs` binary of this build, `target/<profile>/accelerate-rs`: the command line
/// is a crate of its own (`cli/`), built by `cargo test` from the workspace root.
pub fn launcher() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    let bin = dir.join(format!("accelerate-rs{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run `cargo test` from the workspace root (it builds the command line too), or `cargo build -p accelerate-rs-cli` first",
        bin.display()
    );
    bin
}

/// A port that was free a moment ago on loopback.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// Options for rank `rank` of `world` on loopback.
pub fn tcp_options(rank: usize, world: usize, port: u16, timeout: Duration) -> TcpOptions {
    TcpOptions {
        rank,
        world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: b"test-secret".to_vec(),
        timeout,
        transport: None,
    }
}

/// Forms a TCP group of `world` ranks inside this process (one thread per rank, real sockets).
pub fn tcp_group(world: usize, timeout: Duration) -> Vec<TcpCollective> {
    let port = free_port();
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                TcpCollective::connect(&tcp_options(r, world, port, timeout))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .expect("rank thread panicked")
                .expect("connect failed")
        })
        .collect()
}

/// Runs `f` on every rank in its own thread and returns the results in rank order.
pub fn on_each<C, R, F>(ranks: Vec<C>, f: F) -> Vec<R>
where
    C: Send + 'static,
    R: Send + 'static,
    F: Fn(&C) -> R + Send + Sync + 'static,
{
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = ranks
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(&c))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Ends a worker process (a test binary re-run under `accelerate-rs launch`): exit 0 on `Ok`,
/// otherwise `worker failed: <error>` on stderr (tests look for it) and exit 1.
pub fn exit_worker(result: accelerate_rs::Result<()>) -> ! {
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("worker failed: {e}");
            std::process::exit(1);
        }
    }
}

/// Runs `f` on `n` in-process ranks sharing a thread-group collective (30 s timeout), each with
/// the accelerator `builder` makes from its collective. Results in rank order.
pub fn in_process_with<R: Send + 'static>(
    n: usize,
    builder: impl Fn(Arc<dyn Collective>) -> AcceleratorBuilder,
    f: impl Fn(Accelerator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = ThreadGroup::new(n, Duration::from_secs(30))
        .unwrap()
        .into_iter()
        .map(|c| {
            let b = builder(Arc::new(c));
            let f = f.clone();
            std::thread::spawn(move || f(b.build().unwrap()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// One CPU process on its own (rank 0 of 1), for the tests of saving and loading.
pub fn single() -> Accelerator {
    Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .build()
        .unwrap()
}

/// [`in_process_with`] with a plain builder.
pub fn in_process<R: Send + 'static>(
    n: usize,
    f: impl Fn(Accelerator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    in_process_with(n, |c| Accelerator::builder().collective(c), f)
}

/// One all_reduce of `len` ones; checks the result.
pub fn reduce_ones(c: &TcpCollective, len: usize) -> accelerate_rs::Result<()> {
    let mut v = vec![1.0f32; len];
    c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)?;
    let want = c.world_size() as f32;
    if let Some(i) = v.iter().position(|&x| x != want) {
        eprintln!("element {i} is {}, want {want}", v[i]);
        std::process::exit(3);
    }
    Ok(())
}

/// Kills and reaps every child on drop, so that no failure path leaves processes behind.
#[derive(Default)]
pub struct Children(pub Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
