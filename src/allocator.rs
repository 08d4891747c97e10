//! Allocator tuning for training loops on glibc (Linux).
//!
//! Candle's CPU backend allocates a fresh buffer for every op's output, so a training step
//! allocates and frees the same few large blocks (activations, gradients) over and over. glibc
//! serves blocks above its mmap threshold with `mmap` and gives them back with `munmap`, and trims
//! the heap top after large frees: every step then pays page faults and kernel zeroing for memory
//! it just released. [`tune`] raises the mmap threshold to 256 MiB, the trim threshold to 512 MiB
//! and the top padding to 64 MiB (glibc's `mallopt`), so that freed blocks stay in the process and
//! are reused, much as PyTorch's caching allocator keeps them.
//!
//! On the MLP 784-1024-1024-10 (batch 64, AdamW, one thread) this takes a CPU training step from
//! about 29 to 22 ms (`cargo bench --bench overhead -- --ddp-only` with and without
//! `ACCELERATE_RS_TUNE_MALLOC=0`, BENCHMARKS.md). The price is that memory freed by
//! the program stays reserved by the process (up to the thresholds above) instead of returning to
//! the system.
//!
//! [`Accelerator`](crate::Accelerator) calls it when built, unless turned off
//! ([`tune_malloc(false)`](crate::AcceleratorBuilder::tune_malloc),
//! `ACCELERATE_RS_TUNE_MALLOC=0` or `tune_malloc = false` in the config file). Settings from
//! glibc's own `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_` or
//! `GLIBC_TUNABLES` variables win: when any is set, nothing is changed. Other platforms and C
//! libraries: nothing to do.

use std::sync::Once;

/// Block size from which glibc uses `mmap` (instead of the heap).
pub const MMAP_THRESHOLD: usize = 256 << 20;
/// Free memory at the heap top that glibc keeps before trimming.
pub const TRIM_THRESHOLD: usize = 512 << 20;
/// Extra memory glibc asks for when it grows the heap.
pub const TOP_PAD: usize = 64 << 20;

static TUNE: Once = Once::new();

/// Applies the settings described in the [module docs](self), once per process. Returns whether
/// they are in force (false when the user set glibc's own variables, or off glibc).
pub fn tune() -> bool {
    if crate::settings::runtime::user_malloc_settings() {
        return false;
    }
    TUNE.call_once(apply);
    tuned()
}

static TUNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`tune`] changed the allocator's settings in this process.
pub fn tuned() -> bool {
    TUNED.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() {
    let settings = [
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (libc::M_TOP_PAD, TOP_PAD),
    ];
    let mut ok = true;
    for (param, value) in settings {
        let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
        // SAFETY: `mallopt` only adjusts allocator parameters under glibc's own arena lock; it
        // takes plain integers and touches no memory of ours, so any call is sound.
        ok &= unsafe { libc::mallopt(param, value) } == 1;
    }
    log::debug!("glibc malloc tuned for training: {ok}");
    TUNED.store(ok, std::sync::atomic::Ordering::Relaxed);
}

/// Not glibc: nothing to tune.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() {}

/// Gives the memory glibc keeps free (in every arena) back to the system (`malloc_trim(0)`):
/// what the process holds afterwards is what is live. For measurements (the resident set then
/// says what a program uses, not what the tuned allocator kept for reuse) and after a phase
/// that will not run again. Returns whether anything was given back; off glibc, false.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` walks glibc's own arenas under their locks and only releases
        // pages it manages as free; it takes an integer and touches no memory of ours.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tuning_is_idempotent() {
        let first = super::tune();
        assert_eq!(super::tune(), first);
        if cfg!(all(target_os = "linux", target_env = "gnu"))
            && !crate::settings::runtime::user_malloc_settings()
        {
            assert!(first, "mallopt refused the settings");
        }
    }
}
