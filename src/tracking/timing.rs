//! Where a training step's time goes: [`StepTimer`] splits each step into data wait, forward
//! (with the rest of the loop body), backward, communication and optimizer, and turns tokens and
//! FLOPs per step into throughput, as metrics for the trackers.
//!
//! The gradient engine measures its own phases on a [`PhaseClock`] shared by the accelerator and
//! its optimizers (backward: `loss.backward()`; communication: averaging the gradients across
//! ranks, ZeRO's reduce-scatter and gather; optimizer: the wrapped optimizer's step with
//! clipping); the timer reads it at the start and the end of each step and calls the remainder
//! of the step "forward".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;

use crate::error::{Error, Result};

/// A phase the gradient engine measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// `loss.backward()`.
    Backward = 0,
    /// Gradients (or ZeRO's parameters) across ranks.
    Communication = 1,
    /// The optimizer's step (with clipping).
    Optimizer = 2,
}

const PHASES: usize = 3;

/// Time spent in each [`Phase`] since the engine was made, in nanoseconds. Phases nest (ZeRO's
/// gather runs inside the optimizer's step): each measurement counts only the time not already
/// counted by a phase measured inside it.
#[derive(Debug, Default)]
pub(crate) struct PhaseClock {
    nanos: [AtomicU64; PHASES],
    /// Set while a [`StepTimer`] times a GPU: its work is asynchronous, so every phase boundary
    /// waits for the device (only then).
    sync: Mutex<Option<Device>>,
}

impl PhaseClock {
    /// The nanoseconds counted so far, per phase.
    fn read(&self) -> [u64; PHASES] {
        std::array::from_fn(|i| self.nanos[i].load(Ordering::Relaxed))
    }

    fn synchronize(&self) {
        let device = self.sync.lock().map(|d| d.clone()).unwrap_or(None);
        if let Some(device) = device {
            if let Err(e) = device.synchronize() {
                log::debug!("step timer: synchronizing {device:?} failed: {e}");
            }
        }
    }

    /// Runs `f`, counting its time (less what phases inside it counted) as `phase`.
    pub(crate) fn measure<T>(&self, phase: Phase, f: impl FnOnce() -> T) -> T {
        self.synchronize();
        let before: u64 = self.read().iter().sum();
        let start = Instant::now();
        let out = f();
        self.synchronize();
        let elapsed = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let inner = self.read().iter().sum::<u64>().saturating_sub(before);
        self.nanos[phase as usize].fetch_add(elapsed.saturating_sub(inner), Ordering::Relaxed);
        out
    }
}

/// The time of one training step, by phase, and its throughput (see [`StepTimer`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// Waiting for the batch: from the previous [`StepTimer::stop`] to this step's
    /// [`StepTimer::start`] (zero for the first step).
    pub data: Duration,
    /// The forward pass and everything else in the step the engine did not measure (the loss,
    /// logging, `to_scalar`): the step's time less backward, communication and optimizer.
    pub forward: Duration,
    /// `loss.backward()` (all micro-steps of the step).
    pub backward: Duration,
    /// Averaging gradients across ranks (bucket copies included) and ZeRO's gathers.
    pub communication: Duration,
    /// The optimizer's step, clipping included.
    pub optimizer: Duration,
    /// From `start` to `stop`.
    pub step: Duration,
    /// Tokens (or samples) per second over all processes, from
    /// [`tokens_per_step`](StepTimer::tokens_per_step): this process's count times the world
    /// size, over the step's time with its data wait.
    pub tokens_per_sec: Option<f64>,
    /// Achieved FLOP/s over all processes, from [`flops_per_step`](StepTimer::flops_per_step),
    /// likewise.
    pub flops_per_sec: Option<f64>,
}

impl StepTimes {
    /// The times in milliseconds and the throughputs, named for a tracker: `time/data_ms`,
    /// `time/forward_ms`, `time/backward_ms`, `time/communication_ms`, `time/optimizer_ms`,
    /// `time/step_ms`, and `throughput/tokens_per_sec`, `throughput/flops_per_sec` when known.
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut m = vec![
            ("time/data_ms", ms(self.data)),
            ("time/forward_ms", ms(self.forward)),
            ("time/backward_ms", ms(self.backward)),
            ("time/communication_ms", ms(self.communication)),
            ("time/optimizer_ms", ms(self.optimizer)),
            ("time/step_ms", ms(self.step)),
        ];
        if let Some(t) = self.tokens_per_sec {
            m.push(("throughput/tokens_per_sec", t));
        }
        if let Some(f) = self.flops_per_sec {
            m.push(("throughput/flops_per_sec", f));
        }
        m
    }
}

/// One line for a log: `4.6 ms (forward 1.9, backward 2.5, communication 0.2, optimizer 0.0,
/// data 0.0), 218398 tokens/s, 59.25 GFLOP/s` (the throughputs when known).
impl std::fmt::Display for StepTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "{:.1} ms (forward {:.1}, backward {:.1}, communication {:.1}, optimizer {:.1}, \
             data {:.1})",
            ms(self.step),
            ms(self.forward),
            ms(self.backward),
            ms(self.communication),
            ms(self.optimizer),
            ms(self.data)
        )?;
        if let Some(t) = self.tokens_per_sec {
            write!(f, ", {t:.0} tokens/s")?;
        }
        if let Some(flops) = self.flops_per_sec {
            write!(f, ", {:.2} GFLOP/s", flops / 1e9)?;
        }
        Ok(())
    }
}

/// Times training steps by phase, for the trackers: made by
/// [`Accelerator::step_timer`](crate::Accelerator::step_timer), driven with [`start`](Self::start)
/// once the step's batch is at hand and [`stop`](Self::stop) after the optimizer step.
///
/// ```no_run
/// # fn main() -> accelerate_rs::Result<()> {
/// # let accelerator = accelerate_rs::Accelerator::new()?;
/// # let mut trackers = accelerate_rs::tracking::trackers(&accelerator);
/// # let batches: Vec<u64> = vec![];
/// let mut timer = accelerator.step_timer().tokens_per_step(8 * 128).flops_per_step(2.5e9);
/// for (step, _batch) in batches.iter().enumerate() {
///     timer.start();
///     // forward, opt.backward_step(&loss)?
///     let times = timer.stop()?;
///     trackers.log(&times.metrics(), step as u64)?;
/// }
/// # Ok(()) }
/// ```
///
/// On a GPU the timer makes every phase boundary wait for the device (otherwise a phase would be
/// credited with the time of work queued before it): a small cost, paid only while a timer
/// exists. With mixed precision ([`MixedPrecisionOptimizer`](crate::MixedPrecisionOptimizer))
/// the backward pass is counted in `forward`.
#[derive(Debug)]
pub struct StepTimer {
    clock: Arc<PhaseClock>,
    world_size: usize,
    gpu: bool,
    tokens: Option<f64>,
    flops: Option<f64>,
    started: Option<(Instant, [u64; PHASES])>,
    last_stop: Option<Instant>,
}

impl StepTimer {
    /// A timer over `clock`, for a run of `world_size` processes on `device`.
    pub(crate) fn new(clock: Arc<PhaseClock>, world_size: usize, device: &Device) -> Self {
        let gpu = !matches!(device, Device::Cpu);
        if gpu {
            if let Ok(mut sync) = clock.sync.lock() {
                *sync = Some(device.clone());
            }
        }
        StepTimer {
            clock,
            world_size: world_size.max(1),
            gpu,
            tokens: None,
            flops: None,
            started: None,
            last_stop: None,
        }
    }

    /// Tokens (or samples) this process handles per step: reported as tokens per second over
    /// all processes.
    pub fn tokens_per_step(mut self, tokens: u64) -> Self {
        self.tokens = Some(tokens as f64);
        self
    }

    /// Floating-point operations this process does per step (forward and backward; e.g. about
    /// `6 * parameters * tokens` for a transformer, plus attention): reported as achieved FLOP/s
    /// over all processes.
    pub fn flops_per_step(mut self, flops: f64) -> Self {
        self.flops = Some(flops);
        self
    }

    /// Marks the start of a step's computation (after its batch arrived).
    pub fn start(&mut self) {
        if self.gpu {
            self.clock.synchronize();
        }
        self.started = Some((Instant::now(), self.clock.read()));
    }

    /// Marks the end of the step (after the optimizer step) and returns its times.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when [`start`](Self::start) was not called since the last
    /// `stop`.
    pub fn stop(&mut self) -> Result<StepTimes> {
        let Some((start, before)) = self.started.take() else {
            return Err(Error::invalid(
                "StepTimer::stop",
                "called without `start` since the last `stop`: call `timer.start()` when the step's batch is at hand",
            ));
        };
        if self.gpu {
            self.clock.synchronize();
        }
        let now = Instant::now();
        let after = self.clock.read();
        let phase =
            |p: Phase| Duration::from_nanos(after[p as usize].saturating_sub(before[p as usize]));
        let (backward, communication, optimizer) = (
            phase(Phase::Backward),
            phase(Phase::Communication),
            phase(Phase::Optimizer),
        );
        let step = now - start;
        let data = self
            .last_stop
            .map_or(Duration::ZERO, |t| start.saturating_duration_since(t));
        self.last_stop = Some(now);
        let period = (step + data).as_secs_f64();
        let rate = |per_step: Option<f64>| {
            per_step
                .filter(|_| period > 0.0)
                .map(|n| n * self.world_size as f64 / period)
        };
        Ok(StepTimes {
            data,
            forward: step.saturating_sub(backward + communication + optimizer),
            backward,
            communication,
            optimizer,
            step,
            tokens_per_sec: rate(self.tokens),
            flops_per_sec: rate(self.flops),
        })
    }
}

impl Drop for StepTimer {
    fn drop(&mut self) {
        if self.gpu {
            if let Ok(mut sync) = self.clock.sync.lock() {
                *sync = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_prints_as_one_log_line() {
        let ms = Duration::from_millis;
        let mut t = StepTimes {
            data: ms(1),
            forward: ms(2),
            backward: ms(3),
            communication: ms(4),
            optimizer: ms(5),
            step: ms(15),
            tokens_per_sec: None,
            flops_per_sec: None,
        };
        let plain =
            "15.0 ms (forward 2.0, backward 3.0, communication 4.0, optimizer 5.0, data 1.0)";
        assert_eq!(t.to_string(), plain);
        t.tokens_per_sec = Some(1234.4);
        t.flops_per_sec = Some(5.678e9);
        assert_eq!(
            t.to_string(),
            format!("{plain}, 1234 tokens/s, 5.68 GFLOP/s")
        );
    }

    #[test]
    fn nested_phases_are_counted_once() {
        let clock = Arc::new(PhaseClock::default());
        let mut timer = StepTimer::new(clock.clone(), 2, &Device::Cpu).tokens_per_step(100);
        timer.start();
        clock.measure(Phase::Backward, || {
            std::thread::sleep(Duration::from_millis(20))
        });
        let outer = Instant::now();
        clock.measure(Phase::Optimizer, || {
            std::thread::sleep(Duration::from_millis(10));
            clock.measure(Phase::Communication, || {
                std::thread::sleep(Duration::from_millis(30))
            });
        });
        let outer = outer.elapsed();
        std::thread::sleep(Duration::from_millis(15));
        let t = timer.stop().unwrap();
        assert!(t.backward >= Duration::from_millis(20), "{t:?}");
        assert!(t.communication >= Duration::from_millis(30), "{t:?}");
        // The optimizer's own time only: with the communication inside it counted twice, the
        // two would add up to more than the optimizer's wall time (whatever the machine's load).
        assert!(t.optimizer >= Duration::from_millis(10), "{t:?}");
        assert!(t.optimizer + t.communication <= outer, "{t:?} {outer:?}");
        assert!(t.forward >= Duration::from_millis(15), "{t:?}");
        let sum = t.forward + t.backward + t.communication + t.optimizer;
        assert!(sum <= t.step + Duration::from_micros(1), "{t:?}");
        assert_eq!(t.data, Duration::ZERO);
        // 100 tokens on each of 2 processes per step.
        let tps = t.tokens_per_sec.unwrap();
        assert!(
            (tps - 200.0 / t.step.as_secs_f64()).abs() < 1e-6 * tps,
            "{tps}"
        );
        assert_eq!(t.flops_per_sec, None);
        let names: Vec<&str> = t.metrics().iter().map(|m| m.0).collect();
        assert!(
            names.contains(&"time/communication_ms")
                && names.contains(&"throughput/tokens_per_sec")
        );

        // The wait between steps is data time and counts in the throughput's period.
        std::thread::sleep(Duration::from_millis(10));
        timer.start();
        let t = timer.stop().unwrap();
        assert!(t.data >= Duration::from_millis(10), "{t:?}");
        assert_eq!(t.backward, Duration::ZERO);
        let e = timer.stop().unwrap_err().to_string();
        assert!(e.contains("without `start`"), "{e}");
    }
}
