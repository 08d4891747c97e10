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
    /// Element-wise maximum. A NaN on any rank makes the result NaN (as `torch.max`).
    Max,
    /// Element-wise minimum. A NaN on any rank makes the result NaN (as `torch.min`).
    Min,
}

impl ReduceOp {
    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Mean => 2,
            ReduceOp::Max => 3,
            ReduceOp::Min => 4,
        }
    }

    /// The operation that combines partial results: `Mean` accumulates a sum (divided once at
    /// the end, see [`finish_mean`]); the others accumulate themselves.
    pub(crate) fn accumulating(self) -> ReduceOp {
        match self {
            ReduceOp::Mean => ReduceOp::Sum,
            other => other,
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

fn fmin32(a: f32, b: f32) -> f32 {
    // NaN wins, like torch.min.
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else if b < a {
        b
    } else {
        a
    }
}

fn fmin64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if b < a {
        b
    } else {
        a
    }
}

/// `dst = dst (op) src` element-wise. `Mean` accumulates a sum; call [`finish_mean`] once at the end.
pub(crate) fn reduce_into(elem: ElemType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
    fn half<T: Copy>(
        d: &mut [T],
        s: &[T],
        op: ReduceOp,
        to: impl Fn(T) -> f32,
        from: impl Fn(f32) -> T,
    ) {
        match op {
            ReduceOp::Max => combine(d, s, |a, b| from(fmax32(to(a), to(b)))),
            ReduceOp::Min => combine(d, s, |a, b| from(fmin32(to(a), to(b)))),
            ReduceOp::Sum | ReduceOp::Mean => combine(d, s, |a, b| from(to(a) + to(b))),
        }
    }
    match elem {
        ElemType::F32 => {
            let (d, s) = (view_mut::<f32>(dst, "f32")?, view::<f32>(src, "f32")?);
            match op {
                ReduceOp::Max => combine(d, s, fmax32),
                ReduceOp::Min => combine(d, s, fmin32),
                ReduceOp::Sum | ReduceOp::Mean => combine(d, s, |a, b| a + b),
            }
        }
        ElemType::F64 => {
            let (d, s) = (view_mut::<f64>(dst, "f64")?, view::<f64>(src, "f64")?);
            match op {
                ReduceOp::Max => combine(d, s, fmax64),
                ReduceOp::Min => combine(d, s, fmin64),
                ReduceOp::Sum | ReduceOp::Mean => combine(d, s, |a, b| a + b),
            }
        }
        ElemType::F16 => {
            let (d, s) = (view_mut::<f16>(dst, "f16")?, view::<f16>(src, "f16")?);
            half(d, s, op, f16::to_f32, f16::from_f32)
        }
        ElemType::BF16 => {
            let (d, s) = (view_mut::<bf16>(dst, "bf16")?, view::<bf16>(src, "bf16")?);
            half(d, s, op, bf16::to_f32, bf16::from_f32)
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

/// `dst = f(dst, src)` element by element (as `T`, named `what` in errors), the result also
/// written to `copy` when given: [`reduce_last`]'s one pass.
fn combine_and_copy<T: bytemuck::Pod>(
    dst: &mut [u8],
    src: &[u8],
    copy: Option<&mut [u8]>,
    what: &str,
    f: impl Fn(T, T) -> T,
) -> Result<()> {
    let (d, s) = (view_mut::<T>(dst, what)?, view::<T>(src, what)?);
    match copy {
        Some(c) => {
            let c = view_mut::<T>(c, what)?;
            for ((d, s), c) in d.iter_mut().zip(s).zip(c.iter_mut()) {
                let v = f(*d, *s);
                *d = v;
                *c = v;
            }
        }
        None => combine(d, s, f),
    }
    Ok(())
}

/// The last [`reduce_into`] of a reduction with everything after it in the same pass:
/// `dst = dst (op) src`, divided by `world_size` when `op` is `Mean` (as [`finish_mean`] would,
/// with the same roundings, so the same bits), and the result also written to `copy` when given
/// (same length as `dst`). One pass over the data instead of up to three.
pub(crate) fn reduce_last(
    elem: ElemType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
    copy: Option<&mut [u8]>,
    world_size: usize,
) -> Result<()> {
    if copy.as_ref().is_some_and(|c| c.len() != dst.len()) || src.len() != dst.len() {
        return Err(Error::invalid(
            "reduction buffers",
            format!(
                "of {} (destination), {} (source) and {:?} (copy) bytes; they must be equal",
                dst.len(),
                src.len(),
                copy.map(|c| c.len())
            ),
        ));
    }
    let n = world_size as f64;
    match (elem, op) {
        (ElemType::F32, ReduceOp::Sum) => {
            combine_and_copy(dst, src, copy, "f32", |a: f32, b| a + b)
        }
        (ElemType::F32, ReduceOp::Mean) => {
            let n = n as f32;
            combine_and_copy(dst, src, copy, "f32", |a: f32, b| (a + b) / n)
        }
        (ElemType::F32, ReduceOp::Max) => combine_and_copy(dst, src, copy, "f32", fmax32),
        (ElemType::F32, ReduceOp::Min) => combine_and_copy(dst, src, copy, "f32", fmin32),
        (ElemType::F64, ReduceOp::Sum) => {
            combine_and_copy(dst, src, copy, "f64", |a: f64, b| a + b)
        }
        (ElemType::F64, ReduceOp::Mean) => {
            combine_and_copy(dst, src, copy, "f64", |a: f64, b| (a + b) / n)
        }
        (ElemType::F64, ReduceOp::Max) => combine_and_copy(dst, src, copy, "f64", fmax64),
        (ElemType::F64, ReduceOp::Min) => combine_and_copy(dst, src, copy, "f64", fmin64),
        (ElemType::F16, _) => reduce_last_half::<f16>(op, dst, src, copy, n, "f16"),
        (ElemType::BF16, _) => reduce_last_half::<bf16>(op, dst, src, copy, n, "bf16"),
        (ElemType::U8, _) => Err(Error::UnsupportedDType {
            op: format!("all_reduce({})", op.name()),
            dtype: elem.name().to_string(),
        }),
    }
}

/// The 16-bit floats, computed in f32 and rounded once (a `Mean` divides the rounded sum in
/// f64 and rounds again, as [`finish_mean`] does after a plain sum).
trait Half: bytemuck::Pod {
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn from_f32(x: f32) -> Self;
    fn from_f64(x: f64) -> Self;
}

macro_rules! half_float {
    ($t:ty) => {
        impl Half for $t {
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
        }
    };
}
half_float!(f16);
half_float!(bf16);

/// [`reduce_last`] for f16 and bf16.
fn reduce_last_half<T: Half>(
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
    copy: Option<&mut [u8]>,
    n: f64,
    what: &str,
) -> Result<()> {
    let sum = |a: T, b: T| T::from_f32(a.to_f32() + b.to_f32());
    match op {
        ReduceOp::Sum => combine_and_copy(dst, src, copy, what, sum),
        ReduceOp::Mean => combine_and_copy(dst, src, copy, what, |a: T, b: T| {
            T::from_f64(sum(a, b).to_f64() / n)
        }),
        ReduceOp::Max => combine_and_copy(dst, src, copy, what, |a: T, b: T| {
            T::from_f32(fmax32(a.to_f32(), b.to_f32()))
        }),
        ReduceOp::Min => combine_and_copy(dst, src, copy, what, |a: T, b: T| {
            T::from_f32(fmin32(a.to_f32(), b.to_f32()))
        }),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of `n` values of `elem` (varied, with negative values and ties).
    fn bytes(elem: ElemType, n: usize, salt: usize) -> Vec<u8> {
        let v = |i: usize| ((i * 37 + salt * 11) % 23) as f64 * 0.37 - 3.0;
        match elem {
            ElemType::F32 => (0..n).flat_map(|i| (v(i) as f32).to_ne_bytes()).collect(),
            ElemType::F64 => (0..n).flat_map(|i| v(i).to_ne_bytes()).collect(),
            ElemType::F16 => (0..n)
                .flat_map(|i| f16::from_f64(v(i)).to_ne_bytes())
                .collect(),
            ElemType::BF16 => (0..n)
                .flat_map(|i| bf16::from_f64(v(i)).to_ne_bytes())
                .collect(),
            ElemType::U8 => (0..n).map(|i| i as u8).collect(),
        }
    }

    /// Owned, aligned storage for `b` (the views need alignment).
    fn aligned(b: &[u8]) -> Vec<u64> {
        let mut v = vec![0u64; b.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..b.len()].copy_from_slice(b);
        v
    }

    #[test]
    fn fused_last_step_equals_reduce_then_mean_then_copy() -> Result<()> {
        let elems = [ElemType::F32, ElemType::F64, ElemType::F16, ElemType::BF16];
        for elem in elems {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                for (n, world) in [(1usize, 2usize), (7, 3), (1001, 5)] {
                    let len = n * elem.size();
                    let (d0, s0) = (aligned(&bytes(elem, n, 1)), aligned(&bytes(elem, n, 2)));
                    // Reference: the three passes.
                    let mut want = d0.clone();
                    let want_b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut want)[..len];
                    let src = &bytemuck::cast_slice::<u64, u8>(&s0)[..len];
                    reduce_into(elem, op.accumulating(), want_b, src)?;
                    if op == ReduceOp::Mean {
                        finish_mean(elem, want_b, world)?;
                    }
                    // Fused, with and without the copy.
                    let (mut got, mut copy) = (d0.clone(), vec![0u64; d0.len()]);
                    let got_b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut got)[..len];
                    let copy_b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut copy)[..len];
                    reduce_last(elem, op, got_b, src, Some(copy_b), world)?;
                    assert_eq!(got_b, want_b, "{elem:?} {op:?} n {n}");
                    assert_eq!(copy_b, want_b, "{elem:?} {op:?} n {n} (copy)");
                    let mut alone = d0.clone();
                    let alone_b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut alone)[..len];
                    reduce_last(elem, op, alone_b, src, None, world)?;
                    assert_eq!(alone_b, want_b, "{elem:?} {op:?} n {n} (no copy)");
                }
            }
        }
        let (mut d, s, mut c) = (vec![0u8; 8], vec![0u8; 8], vec![0u8; 4]);
        let err = reduce_last(ElemType::F32, ReduceOp::Sum, &mut d, &s, Some(&mut c), 2);
        assert!(err.is_err());
        Ok(())
    }
}
