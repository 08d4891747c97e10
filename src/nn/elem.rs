//! The element types the fused CPU kernels take (computed in f32) and a contiguous view helper.

use candle_core::{DType, Layout, Result, Tensor};
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

/// `e^x` in f32 without a library call, so that loops over it vectorize: `x = n ln 2 + r` with
/// `|r| <= ln 2 / 2`, `e^r` by its degree-6 Taylor polynomial (relative error below 2e-7), and
/// `2^n` built in the exponent bits. Below -87 it is 0 (no denormals; `-inf` gives 0), above 88
/// it stays at `e^88` (no infinities); NaN stays NaN.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(-87.0, 88.0);
    let t = c * LOG2E + ROUND;
    let n = t - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // n is in [-126, 127] here, so the biased exponent n + 127 is in [1, 254]. `t` lies in
    // [2^23, 2^24), where one unit of the last place is 1: its bits are ROUND's plus n. Taken from
    // the bits rather than by `n as i32` (a saturating conversion, which LLVM does not vectorize:
    // it went one lane at a time), the same integer.
    let biased = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let e = f32::from_bits(biased << 23) * p;
    if x < -87.0 {
        0.0
    } else {
        e
    }
}

/// `tanh(x)` through [`exp_f32`]: `sign(x) (1 - 2 / (e^{2|x|} + 1))`, absolute error below 3e-7
/// (tested against `f32::tanh`), and vectorizable.
#[inline(always)]
pub(super) fn tanh_f32(x: f32) -> f32 {
    // Beyond 10, 1 - tanh is below f32's resolution; written as a select so that NaN stays NaN.
    let a = x.abs();
    let a = if a > 10.0 { 10.0 } else { a };
    let e = exp_f32(2.0 * a);
    (1.0 - 2.0 / (e + 1.0)).copysign(x)
}

/// `sum f(x)` over `xs` in 8 independent partial sums, so that the loop vectorizes (a plain
/// serial float sum does not); the rounding differs from a serial sum's.
#[inline(always)]
pub(super) fn sum_by<T: Elem>(xs: &[T], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += f(v.f());
        }
    }
    rest.iter().map(|v| f(v.f())).sum::<f32>() + acc.iter().sum::<f32>()
}

/// `sum f(a, b)` over two slices of one length, like [`sum_by`].
#[inline(always)]
pub(super) fn sum2_by<A: Elem, B: Elem>(a: &[A], b: &[B], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| f(x.f(), y.f()))
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((acc, x), y) in acc.iter_mut().zip(x).zip(y) {
            *acc += f(x.f(), y.f());
        }
    }
    rest + acc.iter().sum::<f32>()
}

/// The largest `f(x)` over `xs` (`-inf` for none), in 8 lanes like [`sum_by`]. A NaN anywhere
/// makes the result NaN: a row of a softmax or a loss that holds a NaN must give NaN, never be
/// taken for a fully masked row (all `-inf`).
#[inline(always)]
pub(super) fn max_by<T: Elem>(xs: &[T], f: impl Fn(f32) -> f32) -> f32 {
    // `m` stays NaN once it is: `v > NaN` is false and `v != v` only for a NaN `v`.
    #[allow(clippy::eq_op)]
    fn pick(m: f32, v: f32) -> f32 {
        if v > m || v != v {
            v
        } else {
            m
        }
    }
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = pick(*a, f(v.f()));
        }
    }
    rest.iter()
        .map(|v| f(v.f()))
        .chain(acc)
        .fold(f32::NEG_INFINITY, pick)
}

/// Defines `fn $name<T: Elem>(args) -> ret` whose body is compiled twice: for the crate's target
/// (x86-64's baseline has 4-lane SSE2 only) and with AVX2 and FMA enabled, the latter picked at
/// run time when the CPU has them, so the row loops (exp, sums, maxima) run 8 lanes wide. Both
/// compute the same operations in the same order, so they give the same bits.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$t:ident: Elem>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name<$t: Elem>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: `avx2` is `portable` compiled with AVX2 and FMA enabled, and this CPU
                // was just found to have both.
                return unsafe { $name::avx2::<$t>($($arg),*) };
            }
            $name::portable::<$t>($($arg),*)
        }

        /// The two builds of the function of the same name.
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            /// For the crate's target.
            #[inline(always)]
            pub(super) fn portable<$t: Elem>($($arg: $ty),*) $(-> $ret)? $body

            /// With AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            pub(super) unsafe fn avx2<$t: Elem>($($arg: $ty),*) $(-> $ret)? {
                portable::<$t>($($arg),*)
            }
        }
    };
}

/// Whether an op on `x` takes this module's fused ops: on the CPU ([`fused_cpu`]), or on a GPU
/// with the CUDA kernels of a `cuda` build (switched on and loaded).
pub(super) fn fused(x: &Tensor) -> candle_core::Result<bool> {
    if fused_cpu(x) {
        return Ok(true);
    }
    #[cfg(feature = "cuda")]
    {
        super::cuda::use_kernels(x)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(false)
    }
}

/// Whether an op on `x` takes this module's trial CUDA kernels (written and checked on the CPU's
/// emulation of CUDA, not yet proven on a GPU): the kernels of [`fused`] on a GPU, and
/// `ACCELERATE_RS_CUDA_TRIAL=1`. Always `false` without the `cuda` feature.
pub(super) fn trial_kernels(x: &Tensor) -> candle_core::Result<bool> {
    if x.device().is_cpu()
        || !crate::settings::runtime::cuda_trial().map_err(candle_core::Error::wrap)?
    {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    {
        super::cuda::use_kernels(x)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(false)
    }
}

/// Whether the fused CPU kernels take `x`: on the CPU, in a float dtype (f32, f64, bf16, f16).
pub(super) fn fused_cpu(x: &Tensor) -> bool {
    x.device().is_cpu() && float_dtype(x.dtype())
}

/// Whether the fused ops compute in `dtype`: f32, f64, bf16 or f16.
pub(super) fn float_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
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

/// The `saved` tensor of [`elementwise_pair`]'s backward: the op's `input` or its `output`.
macro_rules! saved_tensor {
    (input, $x:expr, $res:expr) => {{
        let _ = $res;
        $x
    }};
    (output, $x:expr, $res:expr) => {{
        let _ = $x;
        $res
    }};
}

/// Candle's custom-op traits for a fused elementwise function with a one-pass backward:
/// `$fwd_ty` (`CustomOp1` named `$fwd_name`, `$fwd(x)` on the CPU) whose backward applies
/// `$bwd_ty` (`CustomOp2` named `$bwd_name`, `$bwd(saved, dy)`) to the op's `input` or `output`
/// (`saved = ...`) and the incoming gradient. With `cuda = (F, B)`, a `cuda` build runs
/// them with the kernels `Elementwise::F` and `Elementwise::B`.
macro_rules! elementwise_pair {
    (
        $fwd_ty:ident = $fwd_name:literal by $fwd:ident,
        $bwd_ty:ident = $bwd_name:literal by $bwd:ident,
        saved = $saved:ident
        $(, cuda = ($kf:ident, $kb:ident))? $(,)?
    ) => {
        impl CustomOp1 for $fwd_ty {
            fn name(&self) -> &'static str {
                $fwd_name
            }

            fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
                let out = unary_float!(self.name(), s, l, $fwd);
                Ok((out, l.shape().clone()))
            }

            $(
                #[cfg(feature = "cuda")]
                fn cuda_fwd(
                    &self,
                    s: &candle_core::CudaStorage,
                    l: &Layout,
                ) -> Result<(candle_core::CudaStorage, Shape)> {
                    super::cuda::elementwise(super::cuda::Elementwise::$kf, (s, l), None)
                }
            )?

            fn bwd(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
                let saved: &Tensor = saved_tensor!($saved, x, res);
                Ok(Some(saved.apply_op2_no_bwd(&grad.contiguous()?, &$bwd_ty)?))
            }
        }

        impl CustomOp2 for $bwd_ty {
            fn name(&self) -> &'static str {
                $bwd_name
            }

            fn cpu_fwd(
                &self,
                s1: &CpuStorage,
                l1: &Layout,
                s2: &CpuStorage,
                l2: &Layout,
            ) -> Result<(CpuStorage, Shape)> {
                let out = binary_float!(self.name(), s1, l1, s2, l2, $bwd);
                Ok((out, l1.shape().clone()))
            }

            $(
                #[cfg(feature = "cuda")]
                fn cuda_fwd(
                    &self,
                    s1: &candle_core::CudaStorage,
                    l1: &Layout,
                    s2: &candle_core::CudaStorage,
                    l2: &Layout,
                ) -> Result<(candle_core::CudaStorage, Shape)> {
                    super::cuda::elementwise(
                        super::cuda::Elementwise::$kb,
                        (s1, l1),
                        Some((s2, l2)),
                    )
                }
            )?
        }
    };
}

pub(super) use {binary_float, elementwise_pair, multiversion, saved_tensor, unary_float};

/// The largest absolute difference between two f32 tensors of one shape (for tests).
#[cfg(test)]
pub(super) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .unwrap_or(f32::INFINITY)
}

/// `y` and the gradients of `vars` of `sum(y * up)`, by Candle's backward pass (for tests of
/// one-node ops against their composed forms); a variable without a gradient is an error.
#[cfg(test)]
pub(super) fn output_and_grads(
    y: Tensor,
    up: &Tensor,
    vars: &[&candle_core::Var],
) -> Result<Vec<Tensor>> {
    let grads = (&y * up)?.sum_all()?.backward()?;
    let mut out = vec![y];
    for v in vars {
        match grads.get(v.as_tensor()) {
            Some(g) => out.push(g.clone()),
            None => candle_core::bail!("no gradient"),
        }
    }
    Ok(out)
}

/// Asserts that `ours` and `want` agree tensor by tensor: shapes, then values compared in f32
/// within `tol` times the larger of 1 and `want`'s largest magnitude (so a low-precision case
/// with large random values is judged by its own scale, not by luck); `what` names the case.
#[cfg(test)]
pub(super) fn assert_close(ours: &[Tensor], want: &[Tensor], tol: f32, what: &str) -> Result<()> {
    assert_eq!(ours.len(), want.len(), "{what}");
    for (i, (a, b)) in ours.iter().zip(want).enumerate() {
        assert_eq!(a.dims(), b.dims(), "{what}: output {i}");
        let b = b.to_dtype(DType::F32)?;
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
        let d = max_diff(&a.to_dtype(DType::F32)?, &b) / scale;
        assert!(
            d < tol,
            "{what}: output {i} differs by {d} of its scale {scale}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_and_tanh_match_the_library() {
        let mut worst = (0f32, 0f32);
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4; // [-20, 20]
            let e = (exp_f32(x) as f64 - (x as f64).exp()).abs() / (x as f64).exp();
            let t = (tanh_f32(x) as f64 - (x as f64).tanh()).abs();
            worst = (worst.0.max(e as f32), worst.1.max(t as f32));
        }
        assert!(worst.0 < 4e-7, "exp relative error {}", worst.0);
        assert!(worst.1 < 3e-7, "tanh absolute error {}", worst.1);
        assert_eq!(tanh_f32(0.0), 0.0);
        assert_eq!(tanh_f32(-30.0), -1.0);
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(exp_f32(-1000.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(1000.0).is_finite() && exp_f32(f32::NAN).is_nan());
    }

    /// The integer part read from the rounded value's bits equals `n as i32`: every `x` whose
    /// exponent is in range, on a grid over [-90, 90] and at its edges, gives the same bits as
    /// the scaling by `n as i32` (the form before the bits; it did not vectorize).
    #[test]
    fn fast_exp_scales_by_the_same_power_of_two_as_a_conversion() {
        let by_conversion = |x: f32| -> f32 {
            let c = x.clamp(-87.0, 88.0);
            let n = (c * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            let r = c - n * 0.693_359_4 - n * -2.121_944_4e-4;
            let p = 1.0
                + r * (1.0
                    + r * (0.5
                        + r * (1.0 / 6.0
                            + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
            let e = f32::from_bits(((n as i32 + 127) << 23) as u32) * p;
            if x < -87.0 {
                0.0
            } else {
                e
            }
        };
        let edges = [
            -87.0f32, -86.99, 88.0, 87.99, 0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5,
        ];
        let grid = (-900_000..=900_000).map(|i| i as f32 * 1e-4);
        for x in grid.chain(edges) {
            assert_eq!(exp_f32(x).to_bits(), by_conversion(x).to_bits(), "x = {x}");
        }
    }

    #[test]
    fn lane_reductions_match_serial_ones() {
        for n in [0usize, 1, 7, 8, 9, 63, 1000] {
            let xs: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
            let ys: Vec<f32> = (0..n).map(|i| ((i * 13) % 7) as f32 * 0.5).collect();
            let serial: f32 = xs.iter().map(|v| v * v).sum();
            assert_eq!(sum_by(&xs, |v| v * v), serial, "n {n}");
            let dot: f32 = xs.iter().zip(&ys).map(|(a, b)| a * b).sum();
            assert_eq!(sum2_by(&xs, &ys, |a, b| a * b), dot, "n {n}");
            let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_by(&xs, |v| v), max, "n {n}");
        }
        assert!(max_by(&[1.0f32, f32::NAN, 3.0], |v| v).is_nan());
        assert!(max_by(&[f32::NAN; 11], |v| v).is_nan());
        let mut lanes = [0.5f32; 17];
        lanes[9] = f32::NAN;
        assert!(max_by(&lanes, |v| v).is_nan());
        assert!(tanh_f32(f32::NAN).is_nan() && exp_f32(f32::NAN).is_nan());
    }
}
