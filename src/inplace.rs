//! In-place access to tensor storage, through Candle's in-place custom ops (the storage's write
//! lock is held while the closure runs; Candle rejects a source that shares storage with the
//! destination, so a closure never sees aliased memory).
//!
//! Used by the fused optimizers ([`crate::optim`], CPU and CUDA) and the gradient buckets
//! ([`crate::params`]) to update tensors without allocating new ones.

use std::cell::RefCell;
use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, InplaceOp1, InplaceOp2, Layout, Storage, Tensor};
use half::{bf16, f16};

use crate::error::{Error, Result};

/// The storage of the tensor being updated, on its device.
pub(crate) enum DstMut<'a> {
    Cpu(&'a mut CpuStorage),
    Cuda(&'a mut CudaStorage),
}

/// The storage of a read-only source tensor, on its device.
pub(crate) enum Src<'a> {
    Cpu(&'a CpuStorage),
    Cuda(&'a CudaStorage),
}

/// The contiguous element range of `layout` in its storage, or an error naming `what`.
fn range_of(layout: &Layout, what: &str) -> Result<Range<usize>> {
    layout
        .contiguous_offsets()
        .map(|(a, b)| a..b)
        .ok_or_else(|| Error::invalid(what, "is not contiguous in memory; cannot update in place"))
}

type MutFn<'a> = Box<dyn FnOnce(DstMut<'_>, Range<usize>) -> Result<()> + 'a>;
type MutSrcFn<'a> =
    Box<dyn FnOnce(DstMut<'_>, Range<usize>, Src<'_>, Range<usize>) -> Result<()> + 'a>;

struct MutOp<'a> {
    what: &'a str,
    f: RefCell<Option<MutFn<'a>>>,
    out: RefCell<Option<Result<()>>>,
}

impl MutOp<'_> {
    fn run(&self, dst: DstMut<'_>, layout: &Layout) -> candle_core::Result<()> {
        let result = match self.f.borrow_mut().take() {
            Some(f) => range_of(layout, self.what).and_then(|r| f(dst, r)),
            None => Err(Error::invalid(self.what, "in-place update ran twice")),
        };
        *self.out.borrow_mut() = Some(result);
        Ok(())
    }
}

impl InplaceOp1 for MutOp<'_> {
    fn name(&self) -> &'static str {
        "accelerate-rs in-place update"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(DstMut::Cpu(storage), layout)
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        self.run(DstMut::Cuda(storage), layout)
    }
}

struct MutSrcOp<'a> {
    what: &'a str,
    f: RefCell<Option<MutSrcFn<'a>>>,
    out: RefCell<Option<Result<()>>>,
}

impl MutSrcOp<'_> {
    fn run(
        &self,
        dst: DstMut<'_>,
        dst_layout: &Layout,
        src: Src<'_>,
        src_layout: &Layout,
    ) -> candle_core::Result<()> {
        let result = match self.f.borrow_mut().take() {
            Some(f) => range_of(dst_layout, self.what).and_then(|d| {
                let s = range_of(src_layout, self.what)?;
                f(dst, d, src, s)
            }),
            None => Err(Error::invalid(self.what, "in-place update ran twice")),
        };
        *self.out.borrow_mut() = Some(result);
        Ok(())
    }
}

impl InplaceOp2 for MutSrcOp<'_> {
    fn name(&self) -> &'static str {
        "accelerate-rs in-place update"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_layout: &Layout,
        src: &CpuStorage,
        src_layout: &Layout,
    ) -> candle_core::Result<()> {
        self.run(DstMut::Cpu(dst), dst_layout, Src::Cpu(src), src_layout)
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_layout: &Layout,
        src: &CudaStorage,
        src_layout: &Layout,
    ) -> candle_core::Result<()> {
        self.run(DstMut::Cuda(dst), dst_layout, Src::Cuda(src), src_layout)
    }
}

fn did_not_run(what: &str) -> Error {
    Error::invalid(
        what,
        "the in-place update did not run (a device without in-place support?)",
    )
}

/// Runs `f` on `t`'s storage and the element range `t` occupies in it, holding the storage's
/// write lock. `t` must be contiguous, on the CPU or a CUDA GPU; `what` names it in errors.
pub(crate) fn with_mut<'a>(
    t: &Tensor,
    what: &'a str,
    f: impl FnOnce(DstMut<'_>, Range<usize>) -> Result<()> + 'a,
) -> Result<()> {
    let op = MutOp {
        what,
        f: RefCell::new(Some(Box::new(f))),
        out: RefCell::new(None),
    };
    t.inplace_op1(&op)?;
    op.out
        .into_inner()
        .unwrap_or_else(|| Err(did_not_run(what)))
}

/// [`with_mut`] with a second, read-only tensor `src` on the same device (contiguous, not sharing
/// storage with `t`).
pub(crate) fn with_mut_src<'a>(
    t: &Tensor,
    src: &Tensor,
    what: &'a str,
    f: impl FnOnce(DstMut<'_>, Range<usize>, Src<'_>, Range<usize>) -> Result<()> + 'a,
) -> Result<()> {
    let op = MutSrcOp {
        what,
        f: RefCell::new(Some(Box::new(f))),
        out: RefCell::new(None),
    };
    t.inplace_op2(src, &op)?;
    op.out
        .into_inner()
        .unwrap_or_else(|| Err(did_not_run(what)))
}

fn not_cpu(what: &str, on_gpu: &CudaStorage) -> Error {
    Error::invalid(
        what,
        format!("is a CUDA {:?} tensor, not on the CPU", on_gpu.dtype()),
    )
}

/// [`with_mut`] for a CPU tensor.
pub(crate) fn with_cpu_mut<'a>(
    t: &Tensor,
    what: &'a str,
    f: impl FnOnce(&mut CpuStorage, Range<usize>) -> Result<()> + 'a,
) -> Result<()> {
    with_mut(t, what, |dst, r| match dst {
        DstMut::Cpu(s) => f(s, r),
        DstMut::Cuda(s) => Err(not_cpu(what, s)),
    })
}

/// [`with_mut_src`] for CPU tensors.
pub(crate) fn with_cpu_mut_src<'a>(
    t: &Tensor,
    src: &Tensor,
    what: &'a str,
    f: impl FnOnce(&mut CpuStorage, Range<usize>, &CpuStorage, Range<usize>) -> Result<()> + 'a,
) -> Result<()> {
    with_mut_src(t, src, what, |dst, d, src, s| match (dst, src) {
        (DstMut::Cpu(dst), Src::Cpu(src)) => f(dst, d, src, s),
        (DstMut::Cuda(gpu), _) => Err(not_cpu(what, gpu)),
        (_, Src::Cuda(gpu)) => Err(not_cpu(what, gpu)),
    })
}

/// A float element that the fused kernels read and write through an arithmetic type `C`
/// (`f32` for f32/bf16/f16 storage, `f64` for f64).
pub(crate) trait Elem<C>: Copy + Send + Sync {
    /// The value, widened to `C`.
    fn get(self) -> C;
    /// `c`, rounded to this type.
    fn put(c: C) -> Self;
}

impl Elem<f32> for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(c: f32) -> Self {
        c
    }
}

impl Elem<f64> for f64 {
    #[inline(always)]
    fn get(self) -> f64 {
        self
    }
    #[inline(always)]
    fn put(c: f64) -> Self {
        c
    }
}

impl Elem<f32> for bf16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn put(c: f32) -> Self {
        bf16::from_f32(c)
    }
}

impl Elem<f32> for f16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn put(c: f32) -> Self {
        f16::from_f32(c)
    }
}

/// The arithmetic of the fused kernels.
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    /// `x` rounded to this type (as Candle rounds the scalars of `affine`).
    fn of(x: f64) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn of(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn of(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// The address of `t`'s storage: equal for tensors that share it (views, clones).
pub(crate) fn storage_addr(t: &Tensor) -> usize {
    let (guard, _) = t.storage_and_layout();
    std::ptr::from_ref::<Storage>(&guard) as usize
}

fn unsupported(op: &str, s: &CpuStorage) -> Error {
    Error::UnsupportedDType {
        op: op.to_string(),
        dtype: format!("{:?}", s.dtype()),
    }
}

/// Copies `src[sr]` into `dst[dr]` (same float dtype and length).
pub(crate) fn copy_cpu(
    dst: &mut CpuStorage,
    dr: Range<usize>,
    src: &CpuStorage,
    sr: Range<usize>,
) -> Result<()> {
    if dr.len() != sr.len() {
        return Err(Error::invalid(
            "gradient bucket",
            format!("copying {} elements into {}", sr.len(), dr.len()),
        ));
    }
    match (dst, src) {
        (CpuStorage::F32(d), CpuStorage::F32(s)) => d[dr].copy_from_slice(&s[sr]),
        (CpuStorage::F64(d), CpuStorage::F64(s)) => d[dr].copy_from_slice(&s[sr]),
        (CpuStorage::BF16(d), CpuStorage::BF16(s)) => d[dr].copy_from_slice(&s[sr]),
        (CpuStorage::F16(d), CpuStorage::F16(s)) => d[dr].copy_from_slice(&s[sr]),
        (d, _) => return Err(unsupported("gradient bucket copy", d)),
    }
    Ok(())
}

/// Sets `dst[dr]` to `value` (rounded to the storage's float dtype).
pub(crate) fn fill_cpu(dst: &mut CpuStorage, dr: Range<usize>, value: f64) -> Result<()> {
    match dst {
        CpuStorage::F32(d) => d[dr].fill(value as f32),
        CpuStorage::F64(d) => d[dr].fill(value),
        CpuStorage::BF16(d) => d[dr].fill(bf16::from_f64(value)),
        CpuStorage::F16(d) => d[dr].fill(f16::from_f64(value)),
        d => return Err(unsupported("gradient bucket fill", d)),
    }
    Ok(())
}

/// `src[sr]` widened to f64.
pub(crate) fn read_f64(src: &CpuStorage, sr: Range<usize>) -> Result<Vec<f64>> {
    Ok(match src {
        CpuStorage::F32(s) => s[sr].iter().map(|&x| f64::from(x)).collect(),
        CpuStorage::F64(s) => s[sr].to_vec(),
        CpuStorage::BF16(s) => s[sr].iter().map(|x| x.to_f64()).collect(),
        CpuStorage::F16(s) => s[sr].iter().map(|x| x.to_f64()).collect(),
        s => return Err(unsupported("gradient bucket read", s)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn updates_in_place_and_sees_the_source() {
        let t = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let alias = t.clone();
        let src = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap();
        with_cpu_mut_src(&t, &src, "t", |d, dr, s, sr| {
            let (CpuStorage::F32(d), CpuStorage::F32(s)) = (d, s) else {
                return Err(Error::invalid("t", "not f32"));
            };
            for (x, y) in d[dr].iter_mut().zip(&s[sr]) {
                *x = 2.0 * y;
            }
            Ok(())
        })
        .unwrap();
        // The same storage: a clone taken before sees the new values.
        assert_eq!(alias.to_vec1::<f32>().unwrap(), vec![2., 4., 6., 8.]);
    }

    #[test]
    fn narrow_views_get_their_own_range() {
        let t = Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap();
        let part = t.narrow(0, 2, 3).unwrap();
        with_cpu_mut(&part, "part", |s, r| {
            assert_eq!(r, 2..5);
            if let CpuStorage::F32(v) = s {
                v[r].fill(1.0);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(t.to_vec1::<f32>().unwrap(), vec![0., 0., 1., 1., 1., 0.]);
    }

    #[test]
    fn aliasing_and_strided_tensors_are_refused() {
        let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let e = with_cpu_mut_src(&t, &t, "t", |_, _, _, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("shares storage"), "{e}");
        let tt = t.t().unwrap();
        let e = with_cpu_mut(&tt, "transposed", |_, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("transposed"), "{e}");
    }

    #[test]
    fn errors_of_the_closure_come_back() {
        let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let e =
            with_cpu_mut(&t, "t", |_, _| Err(Error::invalid("thing", "went wrong"))).unwrap_err();
        assert!(e.to_string().contains("went wrong"), "{e}");
    }
}
