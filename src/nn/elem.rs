//! The element types the fused CPU kernels take (computed in f32) and a contiguous view helper.

use candle_core::{Layout, Result};
use half::{bf16, f16};

/// Elements computed in f32.
pub(super) trait Elem: Copy + Send + Sync + 'static {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
}
impl Elem for f32 {
    fn f(self) -> f32 {
        self
    }
    fn of(v: f32) -> Self {
        v
    }
}
impl Elem for f64 {
    fn f(self) -> f32 {
        self as f32
    }
    fn of(v: f32) -> Self {
        v as f64
    }
}
impl Elem for bf16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Elem for f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// A contiguous CPU slice of `layout`.
pub(super) fn slice<'a, T>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("accelerate_rs::nn: the input must be contiguous"),
    }
}
