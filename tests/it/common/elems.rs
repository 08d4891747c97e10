//! Element types for the collective tests: conversion to and from f64, tolerances and reference
//! values.

use std::fmt::Debug;

use accelerate_rs::collective::{Buffer, BufferMut, Element};
use accelerate_rs::ReduceOp;
use half::{bf16, f16};

/// A float element type the collectives move, with a tolerance for reduced results.
pub trait TestElem: Element + Debug + PartialEq
where
    for<'a> BufferMut<'a>: From<&'a mut [Self]>,
    for<'a> Buffer<'a>: From<&'a [Self]>,
{
    fn of(v: f64) -> Self;
    fn f(self) -> f64;
    const TOL: f64;
}
impl TestElem for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn f(self) -> f64 {
        self as f64
    }
    const TOL: f64 = 1e-6;
}
impl TestElem for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn f(self) -> f64 {
        self
    }
    const TOL: f64 = 1e-12;
}
impl TestElem for f16 {
    fn of(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn f(self) -> f64 {
        self.to_f64()
    }
    const TOL: f64 = 1e-3;
}
impl TestElem for bf16 {
    fn of(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn f(self) -> f64 {
        self.to_f64()
    }
    const TOL: f64 = 8e-3;
}

/// Small integers: exact in every dtype, so sums and maxima are exact too.
pub fn value(rank: usize, i: usize) -> f64 {
    ((rank * 7 + i * 3) % 11) as f64 - 5.0
}

/// What `op` over every rank's `value(rank, i)` gives.
pub fn reference(op: ReduceOp, world: usize, i: usize) -> f64 {
    let vals = (0..world).map(|r| value(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Mean => vals.sum::<f64>() / world as f64,
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.fold(f64::MAX, f64::min),
    }
}
