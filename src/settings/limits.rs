//! The range of every numeric setting, in one place: the parsers of the builder, the
//! environment, the config file and the launcher's flags all check against these, so an absurd
//! value (`1e300` seconds, `-1`, `NaN`, a world of `u64::MAX` ranks) is an error naming the
//! setting and its range, never a panic or an overflow deep inside.
//!
//! | setting | range |
//! |---|---|
//! | collective timeout (`collective_timeout_secs`, `ACCELERATE_RS_TIMEOUT_SECS`, `--collective-timeout-secs`) | above 0, at most [`MAX_TIMEOUT_SECS`] (a week) |
//! | launcher durations (`monitor_interval_secs`, `--monitor-interval`, `--grace-period`) | 0 (grace only) or above, at most [`MAX_TIMEOUT_SECS`] |
//! | gradient bucket cap (`bucket_cap_mb`) | above 0, at most [`MAX_BUCKET_CAP_MB`] |
//! | gradient accumulation steps | 1 to [`MAX_ACCUMULATION_STEPS`] |
//! | processes per machine (`num_processes`, `-n`) | 1 to [`MAX_PROCESSES`] |
//! | machines (`num_machines`) | 1 to [`MAX_MACHINES`] |
//! | world size, ranks (`WORLD_SIZE`, `RANK`, ...) | world size 1 to [`MAX_WORLD_SIZE`], rank below it |
//! | DP replicas (`data_parallel`) | 1 to [`MAX_PROCESSES`] |
//! | restarts (`max_restarts`) | 0 to [`MAX_RESTARTS`] |
//! | ports | 0 to 65535 (0: pick a free one, where allowed) |
//! | ZeRO stage | 0, 1, 2 or 3 |

use std::time::{Duration, Instant};

/// The longest timeout or launcher interval, in seconds: a week.
pub const MAX_TIMEOUT_SECS: f64 = 7.0 * 24.0 * 3600.0;
/// The largest gradient bucket cap, in MiB (64 GiB).
pub const MAX_BUCKET_CAP_MB: f64 = 65536.0;
/// The most micro-steps per optimizer step.
pub const MAX_ACCUMULATION_STEPS: usize = 1 << 20;
/// The most processes (or DP replicas) per machine.
pub const MAX_PROCESSES: usize = 1024;
/// The most machines in a run.
pub const MAX_MACHINES: usize = 1 << 16;
/// The largest world size.
pub const MAX_WORLD_SIZE: usize = 1 << 24;

/// The largest size a model's configuration may give (a width, a vocabulary, a number of heads
/// or positions), and the largest batch size, sequence length or LoRA rank a memory estimate
/// takes: 2^26 = 67,108,864, far above any real model's (vocabularies reach 2^18, widths 2^16,
/// context lengths 2^24). A larger value is a damaged or hostile file, refused before anything
/// is computed or allocated from it.
pub const MAX_MODEL_SIZE: usize = 1 << 26;

/// The most layers a model's configuration may give: 4,096 (the deepest real models have a few
/// hundred).
pub const MAX_MODEL_LAYERS: usize = 4096;
/// The most restarts of a worker group.
pub const MAX_RESTARTS: usize = 10_000;

/// `secs` as a duration if it is a finite number in `(0, MAX_TIMEOUT_SECS]` (or `[0, ...]`
/// with `zero_ok`), else what is wrong with it.
pub fn checked_secs(secs: f64, zero_ok: bool) -> std::result::Result<Duration, String> {
    let low_ok = if zero_ok { secs >= 0.0 } else { secs > 0.0 };
    if !(secs.is_finite() && low_ok && secs <= MAX_TIMEOUT_SECS) {
        return Err(format!(
            "expected a number of seconds {} 0 and at most {MAX_TIMEOUT_SECS} (a week), got {secs}",
            if zero_ok { "from" } else { "above" }
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `Instant::now() + d`, saturating far in the future instead of overflowing.
pub(crate) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_outside_the_range_are_refused_with_the_range() {
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            1e19,
            1e300,
            MAX_TIMEOUT_SECS * 1.01,
        ] {
            let e = checked_secs(bad, false).unwrap_err();
            assert!(e.contains("at most 604800"), "{e}");
        }
        assert_eq!(checked_secs(0.0, true).unwrap(), Duration::ZERO);
        assert!(checked_secs(-0.5, true).is_err());
        assert_eq!(
            checked_secs(1.5, false).unwrap(),
            Duration::from_millis(1500)
        );
        assert!(checked_secs(MAX_TIMEOUT_SECS, false).is_ok());
    }

    #[test]
    fn deadlines_saturate() {
        let far = deadline_after(Duration::MAX);
        assert!(far > Instant::now() + Duration::from_secs(3600));
        let soon = deadline_after(Duration::from_secs(1));
        assert!(soon <= Instant::now() + Duration::from_secs(1));
    }
}
