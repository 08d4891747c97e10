//! Settings read where they are used rather than resolved into [`ProcessState`](super::ProcessState):
//! the fused-optimizer default (read when an optimizer is created), the trial CUDA kernels'
//! switch, the store socket the launcher hands down, the host name, NCCL's host id, glibc's own
//! allocator variables, the test-only crash hook, and the process environment that the facade
//! hands to the resolver. Every read of the environment stays in this floor.

use super::env;
use super::parse::process_env;
use crate::error::Result;

/// Whether new optimizers use the fused kernels: `ACCELERATE_RS_FUSED_OPTIM` (a flag, default
/// on); a value that is not a flag is an error naming it.
pub(crate) fn fused_optim_default() -> Result<bool> {
    Ok(process_env(env::FUSED_OPTIM)?.unwrap_or(true))
}

/// Whether the trial CUDA kernels run: `ACCELERATE_RS_CUDA_TRIAL` (a flag, default off), read
/// once per process; a value that is not a flag is an error naming it (each time it is asked).
/// Trial kernels are checked on the CPU's emulation of CUDA but not yet on a GPU.
pub(crate) fn cuda_trial() -> Result<bool> {
    static TRIAL: once_cell::sync::OnceCell<bool> = once_cell::sync::OnceCell::new();
    TRIAL
        .get_or_try_init(|| Ok(process_env(env::CUDA_TRIAL)?.unwrap_or(false)))
        .copied()
}

/// The descriptor of the store's listening socket that `accelerate-rs launch` handed to this
/// process ([`env::STORE_FD`]): `None` when unset, and (with a warning) when it is not a
/// descriptor number above the standard streams.
pub(crate) fn store_fd() -> Option<i32> {
    let value = std::env::var(env::STORE_FD).ok()?;
    match value.trim().parse() {
        Ok(fd) if fd > 2 => Some(fd),
        _ => {
            log::warn!(
                "{}={value:?} is not a file descriptor; binding the store's port instead",
                env::STORE_FD
            );
            None
        }
    }
}

/// This machine's name: `/proc/sys/kernel/hostname`, else `$HOSTNAME`; `None` when neither says.
pub(crate) fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
}

/// Test-only ([`env::TEST_CRASH_AFTER`]): whether the main process should exit right after
/// writing checkpoint file `file`, as a kill would.
pub(crate) fn crash_after(file: &str) -> bool {
    matches!(process_env::<String>(env::TEST_CRASH_AFTER), Ok(Some(v)) if v == file)
}

/// One variable of this process's environment (`None` when unset or not Unicode): the source the
/// facade hands to the settings resolver, so that tests can hand it another.
pub(crate) fn process_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Whether `name` is set in this process's environment (to anything, even non-Unicode).
pub(crate) fn process_var_is_set(name: &str) -> bool {
    std::env::var_os(name).is_some()
}

/// NCCL's `NCCL_HOSTID` (how NCCL tells hosts apart when set), as set; `None` when unset.
pub(crate) fn nccl_host_id() -> Option<String> {
    process_var("NCCL_HOSTID")
}

/// glibc's own allocator variables, whose settings take precedence over accelerate-rs's tuning.
pub(crate) const GLIBC_MALLOC_VARS: [&str; 4] = [
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
];

/// Whether the user set any of [`GLIBC_MALLOC_VARS`] (then the allocator is left as they set it).
pub(crate) fn user_malloc_settings() -> bool {
    GLIBC_MALLOC_VARS.iter().any(|v| process_var_is_set(v))
}

/// Candle's CPU backend asks for its thread count at every matrix product and, when
/// `RAYON_NUM_THREADS` is unset, counts the physical cores by reading `/proc/cpuinfo` each time
/// (thousands of reads in a short run). Sets `RAYON_NUM_THREADS` to that same count, computed
/// once, when the user (or the launcher, which sets it for its workers) has not: the same
/// threads, one read. Called once per process, when the first accelerator is built (usually the
/// first thing `main` does, before other threads exist).
pub(crate) fn pin_cpu_threads() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        if std::env::var_os(env::RAYON_NUM_THREADS).is_none() {
            let n = num_cpus::get_physical().max(1);
            // Setting the environment races with other threads reading it (glibc's getenv);
            // this runs once, at the start of the program, as the docs above say.
            std::env::set_var(env::RAYON_NUM_THREADS, n.to_string());
        }
    });
}
