//! Learning-rate schedules.
//!
//! An [`LrScheduler`] maps an optimizer step count to a learning rate: [`Constant`],
//! [`LinearWarmupCosine`] and [`LinearDecay`] (both with a linear warmup from 0, or from a
//! fraction of the peak with `with_start_factor`, like PyTorch's `LinearLR`), or any closure
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

/// Checks a warmup start factor: finite, in `[0, 1]`.
fn check_start_factor(start_factor: f64) -> Result<()> {
    if !start_factor.is_finite() || !(0.0..=1.0).contains(&start_factor) {
        return Err(Error::invalid(
            "start_factor",
            format!(
                "must be a finite number in [0, 1] (the fraction of base_lr the warmup starts \
                 from), got {start_factor}"
            ),
        ));
    }
    Ok(())
}

/// Linear warmup from `start_factor · base_lr` (PyTorch `LinearLR`):
/// `base_lr · (start_factor + (1 − start_factor) · step / warmup_steps)`.
fn warmup(base_lr: f64, start_factor: f64, step: u64, warmup_steps: u64) -> f64 {
    let fraction = step as f64 / warmup_steps as f64;
    base_lr * (start_factor + (1.0 - start_factor) * fraction)
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

/// Linear warmup from 0 (or from `start_factor · base_lr`, see
/// [`with_start_factor`](Self::with_start_factor)) to `base_lr` over `warmup_steps`, then cosine
/// decay from `base_lr` to `min_lr` at `total_steps`, and `min_lr` after.
///
/// `lr(s) = base_lr·(f + (1 − f)·s/warmup_steps)` for `s < warmup_steps`, where `f` is the start
/// factor (0 by default);
/// `min_lr + (base_lr − min_lr)·(1 + cos(π·(s − warmup_steps)/(total_steps − warmup_steps)))/2`
/// for `warmup_steps <= s < total_steps`; `min_lr` for `s >= total_steps`.
pub type LinearWarmupCosine = WarmupDecay<Cosine>;

/// Linear warmup from 0 (or from `start_factor · base_lr`, see
/// [`with_start_factor`](WarmupDecay::with_start_factor)) to `base_lr` over `warmup_steps`, then
/// linear decay from `base_lr` to `end_lr` at `total_steps`, and `end_lr` after.
///
/// `lr(s) = base_lr·(f + (1 − f)·s/warmup_steps)` for `s < warmup_steps`, where `f` is the start
/// factor (0 by default);
/// `base_lr + (end_lr − base_lr)·(s − warmup_steps)/(total_steps − warmup_steps)` for
/// `warmup_steps <= s < total_steps`; `end_lr` for `s >= total_steps`.
pub type LinearDecay = WarmupDecay<Linear>;

/// The shape of a [`WarmupDecay`]'s decay after the warmup: [`Cosine`] or [`Linear`].
pub trait Decay: Copy + std::fmt::Debug + PartialEq {
    /// The name of the final rate's argument (`min_lr`, `end_lr`), for errors.
    const FINAL: &'static str;
    /// The rate at `progress` (0 to 1) of the decay from `base_lr` to `final_lr`.
    fn at(base_lr: f64, final_lr: f64, progress: f64) -> f64;
}

/// Cosine decay ([`LinearWarmupCosine`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cosine;

impl Decay for Cosine {
    const FINAL: &'static str = "min_lr";
    fn at(base_lr: f64, final_lr: f64, progress: f64) -> f64 {
        final_lr + (base_lr - final_lr) * 0.5 * (1.0 + (PI * progress).cos())
    }
}

/// Linear decay ([`LinearDecay`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Linear;

impl Decay for Linear {
    const FINAL: &'static str = "end_lr";
    fn at(base_lr: f64, final_lr: f64, progress: f64) -> f64 {
        base_lr + (final_lr - base_lr) * progress
    }
}

/// A linear warmup to `base_lr`, then a decay `D` to a final rate at `total_steps`, and the
/// final rate after: [`LinearWarmupCosine`] and [`LinearDecay`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmupDecay<D> {
    base_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
    final_lr: f64,
    start_factor: f64,
    decay: D,
}

impl<D: Decay> WarmupDecay<D> {
    fn build(
        decay: D,
        base_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
        final_lr: f64,
    ) -> Result<Self> {
        check_rate("base_lr", base_lr)?;
        check_rate(D::FINAL, final_lr)?;
        if final_lr > base_lr {
            return Err(Error::invalid(
                D::FINAL,
                format!("must be <= base_lr ({base_lr}), got {final_lr}"),
            ));
        }
        check_steps(warmup_steps, total_steps)?;
        Ok(WarmupDecay {
            base_lr,
            warmup_steps,
            total_steps,
            final_lr,
            start_factor: 0.0,
            decay,
        })
    }

    /// Starts the warmup at `start_factor · base_lr` instead of 0, like PyTorch's
    /// `LinearLR(start_factor=…, end_factor=1.0, total_iters=warmup_steps)`: the rate at step `s`
    /// of the warmup is `base_lr · (start_factor + (1 − start_factor) · s / warmup_steps)`.
    /// The default, 0, is a warmup from 0. Fails unless `start_factor` is finite and in `[0, 1]`.
    pub fn with_start_factor(mut self, start_factor: f64) -> Result<Self> {
        check_start_factor(start_factor)?;
        self.start_factor = start_factor;
        Ok(self)
    }

    /// The fraction of `base_lr` the warmup starts from (0 unless set by
    /// [`with_start_factor`](Self::with_start_factor)).
    pub fn start_factor(&self) -> f64 {
        self.start_factor
    }

    /// The peak learning rate, reached at the end of the warmup.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// Steps of linear warmup.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// The step at which the final rate is reached.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }
}

impl WarmupDecay<Cosine> {
    /// Checks the settings: learning rates finite and >= 0, `min_lr <= base_lr`,
    /// `total_steps >= warmup_steps`. Errors name the field.
    pub fn new(base_lr: f64, warmup_steps: u64, total_steps: u64, min_lr: f64) -> Result<Self> {
        Self::build(Cosine, base_lr, warmup_steps, total_steps, min_lr)
    }

    /// The final learning rate.
    pub fn min_lr(&self) -> f64 {
        self.final_lr
    }
}

impl WarmupDecay<Linear> {
    /// Checks the settings: learning rates finite and >= 0, `end_lr <= base_lr`,
    /// `total_steps >= warmup_steps`. Errors name the field.
    pub fn new(base_lr: f64, warmup_steps: u64, total_steps: u64, end_lr: f64) -> Result<Self> {
        Self::build(Linear, base_lr, warmup_steps, total_steps, end_lr)
    }

    /// The final learning rate.
    pub fn end_lr(&self) -> f64 {
        self.final_lr
    }
}

impl<D: Decay> LrScheduler for WarmupDecay<D> {
    fn lr(&self, step: u64) -> f64 {
        if step >= self.total_steps {
            self.final_lr
        } else if step < self.warmup_steps {
            warmup(self.base_lr, self.start_factor, step, self.warmup_steps)
        } else {
            let progress =
                (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
            D::at(self.base_lr, self.final_lr, progress)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn start_factor_warms_up_from_a_fraction_of_the_peak() {
        // PyTorch LinearLR(start_factor=0.25, total_iters=4) on lr 0.1: 0.025, 0.04375, 0.0625,
        // 0.08125, then the peak.
        let s = LinearWarmupCosine::new(0.1, 4, 14, 0.01)
            .unwrap()
            .with_start_factor(0.25)
            .unwrap();
        assert_eq!(s.start_factor(), 0.25);
        for (step, want) in [
            (0, 0.025),
            (1, 0.04375),
            (2, 0.0625),
            (3, 0.08125),
            (4, 0.1),
        ] {
            assert!(
                close(s.lr(step), want),
                "step {step}: {} != {want}",
                s.lr(step)
            );
        }
        // The cosine part is unchanged: halfway through the decay, the midpoint; then min_lr.
        assert!(close(s.lr(9), 0.055), "{}", s.lr(9));
        assert_eq!(s.lr(14), 0.01);
        assert_eq!(s.lr(1000), 0.01);

        let d = LinearDecay::new(1.0, 2, 4, 0.0)
            .unwrap()
            .with_start_factor(0.5)
            .unwrap();
        let got: Vec<f64> = (0..5).map(|k| d.lr(k)).collect();
        assert_eq!(got, vec![0.5, 0.75, 1.0, 0.5, 0.0]);
    }

    #[test]
    fn start_factor_defaults_keep_the_old_schedule() {
        let old = LinearWarmupCosine::new(0.1, 10, 100, 0.0).unwrap();
        assert_eq!(old.start_factor(), 0.0);
        assert_eq!(old.lr(0), 0.0);
        assert!(close(old.lr(5), 0.05));
        let zero = old.with_start_factor(0.0).unwrap();
        assert_eq!(zero, old);
        // start_factor 1 is no warmup at all.
        let flat = old.with_start_factor(1.0).unwrap();
        assert!((0..10).all(|k| flat.lr(k) == 0.1));
    }

    #[test]
    fn start_factor_out_of_range_is_named() {
        let s = LinearWarmupCosine::new(0.1, 10, 100, 0.0).unwrap();
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let e = s.with_start_factor(bad).unwrap_err().to_string();
            assert!(e.contains("start_factor"), "{e}");
            assert!(e.contains("[0, 1]"), "{e}");
        }
        let e = LinearDecay::new(0.1, 10, 100, 0.0)
            .unwrap()
            .with_start_factor(2.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("start_factor") && e.contains('2'), "{e}");
    }
}
