//! The self-launch: a program started on its own with `processes(n)` (or
//! `ACCELERATE_RS_NUM_PROCESSES=n`) becomes a small launcher for `n` copies of itself, so that
//! running one's own program on several processes needs no `accelerate-rs` binary (and no second
//! build of Candle). In the spirit of `torch.multiprocessing.spawn` and Lightning Fabric's
//! `launch()`.
//!
//! The parent starts the current executable again with the same arguments, `n` times, each with the
//! launcher's environment contract ([`CommonEnv`](crate::env::CommonEnv): `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, a free `MASTER_PORT` whose socket rank 0 inherits, a fresh secret, threads per
//! worker), so each copy joins the run as a worker when it builds its accelerator. The parent
//! prints the workers' lines prefixed with `[rank i]`; when one fails it stops the others (SIGTERM,
//! SIGKILL after 3 s), reprints the failed rank's last lines (its error line included) and exits
//! with its code (128 + signal when killed by one); SIGINT, SIGTERM and SIGHUP stop the workers the
//! same way (a second one kills them at once) and exit with 128 + the signal. On Linux the workers
//! get SIGKILL when the parent dies, however it dies. It never returns once the workers are
//! running.

mod launch;
mod output;

pub(crate) use launch::run;
