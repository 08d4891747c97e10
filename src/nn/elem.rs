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

/// `$f(x, args...)` on a float CPU storage's contiguous data (`x: &[T]`, computed for each
/// element type), giving a storage of the same dtype; any other dtype is an error naming `$name`.
macro_rules! unary_float {
    ($name:expr, $s:expr, $l:expr, $f:ident $(, $arg:expr)*) => {
        match $s {
            CpuStorage::F32(x) => CpuStorage::F32($f(slice(x, $l)? $(, $arg)*)),
            CpuStorage::F64(x) => CpuStorage::F64($f(slice(x, $l)? $(, $arg)*)),
            CpuStorage::BF16(x) => CpuStorage::BF16($f(slice(x, $l)? $(, $arg)*)),
            CpuStorage::F16(x) => CpuStorage::F16($f(slice(x, $l)? $(, $arg)*)),
            _ => candle_core::bail!("{}: a float dtype is expected", $name),
        }
    };
}

/// [`unary_float`] for two storages of one float dtype: `$f(a, b, args...)`.
macro_rules! binary_float {
    ($name:expr, $s1:expr, $l1:expr, $s2:expr, $l2:expr, $f:ident $(, $arg:expr)*) => {
        match ($s1, $s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::F32($f(slice(a, $l1)?, slice(b, $l2)? $(, $arg)*))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                CpuStorage::F64($f(slice(a, $l1)?, slice(b, $l2)? $(, $arg)*))
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                CpuStorage::BF16($f(slice(a, $l1)?, slice(b, $l2)? $(, $arg)*))
            }
            (CpuStorage::F16(a), CpuStorage::F16(b)) => {
                CpuStorage::F16($f(slice(a, $l1)?, slice(b, $l2)? $(, $arg)*))
            }
            _ => candle_core::bail!("{}: one float dtype is expected", $name),
        }
    };
}

pub(super) use {binary_float, unary_float};
