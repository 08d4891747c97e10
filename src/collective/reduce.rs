//! Element-wise reduction kernels shared by every host-side backend.

use half::{bf16, f16};

use super::buffer::ElemType;
use crate::error::{Error, Result};

/// How [`all_reduce`](super::Collective::all_reduce) combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (sum divided by the world size).
    Mean,
    /// Element-wise maximum.
    Max,
}

impl ReduceOp {
    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
        }
    }
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Mean => 2,
            ReduceOp::Max => 3,
        }
    }
}

fn view<'a, T: bytemuck::Pod>(bytes: &'a [u8], what: &str) -> Result<&'a [T]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| {
        Error::invalid(
            what.to_string(),
            format!("misaligned reduction buffer: {e}"),
        )
    })
}

fn view_mut<'a, T: bytemuck::Pod>(bytes: &'a mut [u8], what: &str) -> Result<&'a mut [T]> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| {
        Error::invalid(
            what.to_string(),
            format!("misaligned reduction buffer: {e}"),
        )
    })
}

fn combine<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

fn fmax32(a: f32, b: f32) -> f32 {
    // NaN wins, like torch.max: a NaN anywhere makes the result NaN.
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else if b > a {
        b
    } else {
        a
    }
}

fn fmax64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if b > a {
        b
    } else {
        a
    }
}

/// `dst = dst (op) src` element-wise. `Mean` accumulates a sum; call [`finish_mean`] once at the end.
pub(crate) fn reduce_into(elem: ElemType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
    let max = op == ReduceOp::Max;
    match elem {
        ElemType::F32 => {
            let (d, s) = (view_mut::<f32>(dst, "f32")?, view::<f32>(src, "f32")?);
            if max {
                combine(d, s, fmax32)
            } else {
                combine(d, s, |a, b| a + b)
            }
        }
        ElemType::F64 => {
            let (d, s) = (view_mut::<f64>(dst, "f64")?, view::<f64>(src, "f64")?);
            if max {
                combine(d, s, fmax64)
            } else {
                combine(d, s, |a, b| a + b)
            }
        }
        ElemType::F16 => {
            let (d, s) = (view_mut::<f16>(dst, "f16")?, view::<f16>(src, "f16")?);
            if max {
                combine(d, s, |a, b| f16::from_f32(fmax32(a.to_f32(), b.to_f32())))
            } else {
                combine(d, s, |a, b| f16::from_f32(a.to_f32() + b.to_f32()))
            }
        }
        ElemType::BF16 => {
            let (d, s) = (view_mut::<bf16>(dst, "bf16")?, view::<bf16>(src, "bf16")?);
            if max {
                combine(d, s, |a, b| bf16::from_f32(fmax32(a.to_f32(), b.to_f32())))
            } else {
                combine(d, s, |a, b| bf16::from_f32(a.to_f32() + b.to_f32()))
            }
        }
        ElemType::U8 => {
            return Err(Error::UnsupportedDType {
                op: format!("all_reduce({})", op.name()),
                dtype: elem.name().to_string(),
            })
        }
    }
    Ok(())
}

/// Divides every element by `world_size` (the last step of a `Mean`).
pub(crate) fn finish_mean(elem: ElemType, buf: &mut [u8], world_size: usize) -> Result<()> {
    let n = world_size as f64;
    match elem {
        ElemType::F32 => view_mut::<f32>(buf, "f32")?
            .iter_mut()
            .for_each(|v| *v /= n as f32),
        ElemType::F64 => view_mut::<f64>(buf, "f64")?
            .iter_mut()
            .for_each(|v| *v /= n),
        ElemType::F16 => view_mut::<f16>(buf, "f16")?
            .iter_mut()
            .for_each(|v| *v = f16::from_f64(v.to_f64() / n)),
        ElemType::BF16 => view_mut::<bf16>(buf, "bf16")?
            .iter_mut()
            .for_each(|v| *v = bf16::from_f64(v.to_f64() / n)),
        ElemType::U8 => {
            return Err(Error::UnsupportedDType {
                op: "all_reduce(mean)".to_string(),
                dtype: elem.name().to_string(),
            })
        }
    }
    Ok(())
}

/// Checks that `op` can run on `elem` before any byte moves.
pub(crate) fn check_reducible(elem: ElemType, op: ReduceOp) -> Result<()> {
    if elem == ElemType::U8 {
        return Err(Error::UnsupportedDType {
            op: format!("all_reduce({})", op.name()),
            dtype: elem.name().to_string(),
        });
    }
    Ok(())
}
