//! Learning-rate schedules.
//!
//! An [`LrScheduler`] maps an optimizer step count to a learning rate: [`Constant`],
//! [`LinearWarmupCosine`] and [`LinearDecay`] (both with a linear warmup from 0), or any closure
//! `Fn(u64) -> f64`. A [`Schedule`] drives one: call [`Schedule::step`] once right before each
//! optimizer step; it sets the optimizer's learning rate to `lr(k)` for the `k`-th step (from 0)
//! and advances.
//!
//! **Step the schedule once per optimizer step, whatever the world size.** The learning rate
//! depends only on how many optimizer steps were taken, and every rank takes the same steps, so
//! every rank computes the same value with no communication. Do not scale the step count (or
//! `total_steps`) by the number of processes: with data parallelism each rank's step *is* the
//! global step. With gradient accumulation, step it only when the optimizer actually steps.
//!
//! ```
//! use accelerate_rs::scheduler::{LinearWarmupCosine, LrScheduler, Schedule};
//! use candle_core::{DType, Device, Var};
//! use candle_nn::{Optimizer, SGD};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let w = Var::zeros(3, DType::F32, &Device::Cpu)?;
//! let mut opt = SGD::new(vec![w], 0.0)?;
//! let mut schedule = Schedule::new(LinearWarmupCosine::new(0.1, 10, 100, 0.0)?);
//! for _ in 0..20 {
//!     schedule.step(&mut opt); // lr for this optimizer step
//!     // opt.backward_step(&loss)?;
//! }
//! assert_eq!(schedule.current_step(), 20);
//! assert_eq!(opt.learning_rate(), schedule.scheduler().lr(19));
//! # Ok(())
//! # }
//! ```

use std::f64::consts::PI;

use crate::error::{Error, Result};
use crate::train::optimizer::TrainOptimizer;

/// A learning rate as a function of the optimizer step count (0 for the first step).
pub trait LrScheduler {
    /// The learning rate for optimizer step `step` (counted from 0).
    fn lr(&self, step: u64) -> f64;
}

impl<F: Fn(u64) -> f64> LrScheduler for F {
    fn lr(&self, step: u64) -> f64 {
        self(step)
    }
}

fn check_rate(name: &str, lr: f64) -> Result<()> {
    if !lr.is_finite() || lr < 0.0 {
        return Err(Error::invalid(
            name,
            format!("must be a finite number >= 0, got {lr}"),
        ));
    }
    Ok(())
}

fn check_steps(warmup_steps: u64, total_steps: u64) -> Result<()> {
    if total_steps < warmup_steps {
        return Err(Error::invalid(
            "total_steps",
            format!("must be >= warmup_steps ({warmup_steps}), got {total_steps}"),
        ));
    }
    Ok(())
}

/// Linear warmup from 0: `base_lr · step / warmup_steps`.
fn warmup(base_lr: f64, step: u64, warmup_steps: u64) -> f64 {
    base_lr * step as f64 / warmup_steps as f64
}

/// The same learning rate at every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Constant {
    lr: f64,
}

impl Constant {
    /// A constant `lr` (finite, >= 0).
    pub fn new(lr: f64) -> Result<Self> {
        check_rate("lr", lr)?;
        Ok(Constant { lr })
    }
}

impl LrScheduler for Constant {
    fn lr(&self, _step: u64) -> f64 {
        self.lr
    }
}

/// Linear warmup from 0 to `base_lr` over `warmup_steps`, then cosine decay from `base_lr` to
/// `min_lr` at `total_steps`, and `min_lr` after.
///
/// `lr(s) = base_lr·s/warmup_steps` for `s < warmup_steps`;
/// `min_lr + (base_lr − min_lr)·(1 + cos(π·(s − warmup_steps)/(total_steps − warmup_steps)))/2`
/// for `warmup_steps <= s < total_steps`; `min_lr` for `s >= total_steps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearWarmupCosine {
    base_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
    min_lr: f64,
}

impl LinearWarmupCosine {
    /// Checks the settings: learning rates finite and >= 0, `min_lr <= base_lr`,
    /// `total_steps >= warmup_steps`. Errors name the field.
    pub fn new(base_lr: f64, warmup_steps: u64, total_steps: u64, min_lr: f64) -> Result<Self> {
        check_rate("base_lr", base_lr)?;
        check_rate("min_lr", min_lr)?;
        if min_lr > base_lr {
            return Err(Error::invalid(
                "min_lr",
                format!("must be <= base_lr ({base_lr}), got {min_lr}"),
            ));
        }
        check_steps(warmup_steps, total_steps)?;
        Ok(LinearWarmupCosine {
            base_lr,
            warmup_steps,
            total_steps,
            min_lr,
        })
    }

    /// The peak learning rate, reached at the end of the warmup.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// Steps of linear warmup.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// The step at which `min_lr` is reached.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// The final learning rate.
    pub fn min_lr(&self) -> f64 {
        self.min_lr
    }
}

impl LrScheduler for LinearWarmupCosine {
    fn lr(&self, step: u64) -> f64 {
        if step >= self.total_steps {
            self.min_lr
        } else if step < self.warmup_steps {
            warmup(self.base_lr, step, self.warmup_steps)
        } else {
            let progress =
                (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
            self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + (PI * progress).cos())
        }
    }
}

/// Linear warmup from 0 to `base_lr` over `warmup_steps`, then linear decay from `base_lr` to
/// `end_lr` at `total_steps`, and `end_lr` after.
///
/// `lr(s) = base_lr·s/warmup_steps` for `s < warmup_steps`;
/// `base_lr + (end_lr − base_lr)·(s − warmup_steps)/(total_steps − warmup_steps)` for
/// `warmup_steps <= s < total_steps`; `end_lr` for `s >= total_steps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearDecay {
    base_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
    end_lr: f64,
}

impl LinearDecay {
    /// Checks the settings: learning rates finite and >= 0, `end_lr <= base_lr`,
    /// `total_steps >= warmup_steps`. Errors name the field.
    pub fn new(base_lr: f64, warmup_steps: u64, total_steps: u64, end_lr: f64) -> Result<Self> {
        check_rate("base_lr", base_lr)?;
        check_rate("end_lr", end_lr)?;
        if end_lr > base_lr {
            return Err(Error::invalid(
                "end_lr",
                format!("must be <= base_lr ({base_lr}), got {end_lr}"),
            ));
        }
        check_steps(warmup_steps, total_steps)?;
        Ok(LinearDecay {
            base_lr,
            warmup_steps,
            total_steps,
            end_lr,
        })
    }

    /// The peak learning rate, reached at the end of the warmup.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// Steps of linear warmup.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// The step at which `end_lr` is reached.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// The final learning rate.
    pub fn end_lr(&self) -> f64 {
        self.end_lr
    }
}

impl LrScheduler for LinearDecay {
    fn lr(&self, step: u64) -> f64 {
        if step >= self.total_steps {
            self.end_lr
        } else if step < self.warmup_steps {
            warmup(self.base_lr, step, self.warmup_steps)
        } else {
            let progress =
                (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
            self.base_lr + (self.end_lr - self.base_lr) * progress
        }
    }
}

/// Drives an [`LrScheduler`]: holds the optimizer step count and sets the learning rate.
///
/// Call [`step`](Self::step) once per optimizer step (right before it), on every rank, whatever
/// the world size: never scale by the number of processes (see the [module docs](self)). To
/// resume, [`set_step`](Self::set_step) to the restored optimizer's step count.
#[derive(Clone, Debug)]
pub struct Schedule<S> {
    scheduler: S,
    step: u64,
}

impl<S: LrScheduler> Schedule<S> {
    /// Starts `scheduler` at step 0.
    pub fn new(scheduler: S) -> Self {
        Schedule { scheduler, step: 0 }
    }

    /// Sets `opt`'s learning rate to `lr(current_step)` and advances by one. Returns the rate set.
    /// `opt` is any Candle optimizer or either wrapper ([`TrainOptimizer`]).
    pub fn step(&mut self, opt: &mut impl TrainOptimizer) -> f64 {
        let lr = self.scheduler.lr(self.step);
        opt.set_lr(lr);
        self.step += 1;
        lr
    }

    /// The learning rate the next [`step`](Self::step) will set.
    pub fn next_lr(&self) -> f64 {
        self.scheduler.lr(self.step)
    }

    /// How many times [`step`](Self::step) was called (or the value given to
    /// [`set_step`](Self::set_step)).
    pub fn current_step(&self) -> u64 {
        self.step
    }

    /// Moves to `step`, e.g. the step count of a restored optimizer when resuming.
    pub fn set_step(&mut self, step: u64) {
        self.step = step
    }

    /// The scheduler.
    pub fn scheduler(&self) -> &S {
        &self.scheduler
    }
}
