//! SiLU (`x σ(x)`) and the SwiGLU gate of Llama-style MLPs (`silu(gate) · up`), each one pass
//! forward and one pass backward. Candle differentiates `silu` through composed ops (its
//! backward builds the sigmoid again from `neg`, `exp`, `+ 1`, `recip`, then a chain of products),
//! and `silu(gate) * up` adds a product node and its two gradient products on top.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{
    binary_float, elementwise_pair, exp_f32, fused, multiversion, saved_tensor, slice, unary_float,
    Elem,
};

/// Elements per Rayon task.
const CHUNK: usize = 4096;

/// `σ(x) = 1 / (1 + e^{-x})` in f32, vectorizable (see [`exp_f32`]).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// `silu(g) · u`, one element of the SwiGLU gate.
#[inline(always)]
fn swiglu_value(g: f32, u: f32) -> f32 {
    g * sigmoid(g) * u
}

/// `(d gate, d up)` of one SwiGLU element for its output gradient `dy`.
#[inline(always)]
fn swiglu_grads(g: f32, u: f32, dy: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s)
}

multiversion! {
    /// `v = silu(v) · u` element by element, in place: one chunk of a SwiGLU forward pass.
    pub(super) fn swiglu_chunk<T: Elem>(v: &mut [T], u: &[T]) {
        for (v, u) in v.iter_mut().zip(u) {
            *v = T::of(swiglu_value(v.f(), u.f()));
        }
    }
}

multiversion! {
    /// The gate `g` and up `u` values of one chunk become their gradients for the output
    /// gradient `dy`, in place.
    pub(super) fn swiglu_grads_chunk<T: Elem>(g: &mut [T], u: &mut [T], dy: &[T]) {
        for ((g, u), dy) in g.iter_mut().zip(u.iter_mut()).zip(dy) {
            let (dg, du) = swiglu_grads(g.f(), u.f(), dy.f());
            (*g, *u) = (T::of(dg), T::of(du));
        }
    }
}

multiversion! {
    /// `v = silu(v)`, in place.
    fn silu_chunk<T: Elem>(v: &mut [T]) {
        for v in v {
            let x = v.f();
            *v = T::of(x * sigmoid(x));
        }
    }
}

multiversion! {
    /// `v = dy · silu'(v)`, in place.
    fn silu_grad_chunk<T: Elem>(v: &mut [T], dy: &[T]) {
        for (v, g) in v.iter_mut().zip(dy) {
            *v = T::of(g.f() * silu_grad(v.f()));
        }
    }
}

/// SiLU (swish): `x σ(x) = x / (1 + e^{-x})`, the same function as `candle_nn::ops::silu` /
/// `Tensor::silu` (and PyTorch's `silu`). Fused and differentiable with a one-pass backward on the
/// CPU (f32, f64, bf16, f16, computed in f32) and, in a `cuda` build, as CUDA kernels on a GPU
/// (proven on an H100); Candle's op elsewhere.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if !fused(x)? {
        return x.silu();
    }
    x.contiguous()?.apply_op1(SiluFwd)
}

/// The SwiGLU gate of Llama, Mistral and Qwen2 MLPs: `silu(gate) * up`, elementwise, for `gate`
/// and `up` of one shape and dtype (the `gate_proj` and `up_proj` outputs; the MLP is then
/// `down_proj(swiglu(gate_proj(x), up_proj(x)))`). The same values as
/// `(candle_nn::ops::silu(gate)? * up)?`, as one op with a one-pass backward giving both inputs'
/// gradients on the CPU (f32, f64, bf16, f16, computed in f32) and, in a `cuda` build, on a GPU
/// (CUDA kernels, proven on an H100); Candle's composed ops elsewhere.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor, Var};
/// let gate = Var::from_tensor(&Tensor::new(&[[0f32, 1.0, -2.0]], &Device::Cpu)?)?;
/// let up = Var::from_tensor(&Tensor::new(&[[3f32, 2.0, 1.0]], &Device::Cpu)?)?;
/// let y = accelerate_rs::nn::swiglu(&gate, &up)?;
/// let expected = (candle_nn::ops::silu(&gate)? * up.as_tensor())?;
/// let diff = (&y - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&gate).is_some() && grads.get(&up).is_some());
/// # Ok(()) }
/// ```
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        candle_core::bail!(
            "accelerate_rs::nn::swiglu: gate and up must have one shape, got {:?} and {:?}",
            gate.dims(),
            up.dims()
        );
    }
    if gate.dtype() != up.dtype() {
        candle_core::bail!(
            "accelerate_rs::nn::swiglu: gate and up must share one dtype, got {:?} and {:?}",
            gate.dtype(),
            up.dtype()
        );
    }
    if !fused(gate)? || !up.device().same_device(gate.device()) {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwigluFwd)
}

struct SiluFwd;

fn silu_fwd<T: Elem>(x: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    out.par_chunks_mut(CHUNK)
        .inline_when_single()
        .for_each(silu_chunk);
    out
}

/// `silu'(x) = σ(x) (1 + x (1 − σ(x)))`.
#[inline(always)]
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// `(x, dy)` → `dy · silu'(x)`.
struct SiluBwd;

fn silu_bwd<T: Elem>(x: &[T], dy: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    out.par_chunks_mut(CHUNK)
        .inline_when_single()
        .zip(dy.par_chunks(CHUNK).inline_when_single())
        .for_each(|(o, g)| silu_grad_chunk(o, g));
    out
}

elementwise_pair!(
    SiluFwd = "accelerate-rs-silu" by silu_fwd,
    SiluBwd = "accelerate-rs-silu-backward" by silu_bwd,
    saved = input,
    cuda = (SiluFwd, SiluBwd),
);

/// `(gate, up)` → `silu(gate) · up`.
pub(super) struct SwigluFwd;

fn swiglu_fwd<T: Elem>(gate: &[T], up: &[T]) -> Vec<T> {
    let mut out = gate.to_vec();
    out.par_chunks_mut(CHUNK)
        .inline_when_single()
        .zip(up.par_chunks(CHUNK).inline_when_single())
        .for_each(|(o, u)| swiglu_chunk(o, u));
    out
}

impl CustomOp2 for SwigluFwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = binary_float!(self.name(), s1, l1, s2, l2, swiglu_fwd);
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::swiglu(&[(s1, l1), (s2, l2)])
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = gate.elem_count();
        let flat = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &SwigluBwd)?;
        let dgate = flat.narrow(0, 0, n)?.reshape(gate.shape())?;
        let dup = flat.narrow(0, n, n)?.reshape(up.shape())?;
        Ok((Some(dgate), Some(dup)))
    }
}

/// `(gate, up, dy)` → `[dgate = dy · up · silu'(gate), dup = dy · silu(gate)]`, flat.
pub(super) struct SwigluBwd;

fn swiglu_bwd<T: Elem>(gate: &[T], up: &[T], dy: &[T]) -> Vec<T> {
    let n = gate.len();
    // `[gate, up]`, turned into `[dgate, dup]` in place.
    let mut out = Vec::with_capacity(2 * n);
    out.extend_from_slice(gate);
    out.extend_from_slice(up);
    let (dgate, dup) = out.split_at_mut(n);
    dgate
        .par_chunks_mut(CHUNK)
        .inline_when_single()
        .zip(dup.par_chunks_mut(CHUNK).inline_when_single())
        .zip(dy.par_chunks(CHUNK).inline_when_single())
        .for_each(|((g, u), dy)| swiglu_grads_chunk(g, u, dy));
    out
}

impl CustomOp3 for SwigluBwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-swiglu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(a), CpuStorage::F32(b), CpuStorage::F32(g)) => {
                CpuStorage::F32(swiglu_bwd(slice(a, l1)?, slice(b, l2)?, slice(g, l3)?))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b), CpuStorage::F64(g)) => {
                CpuStorage::F64(swiglu_bwd(slice(a, l1)?, slice(b, l2)?, slice(g, l3)?))
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(swiglu_bwd(slice(a, l1)?, slice(b, l2)?, slice(g, l3)?))
            }
            (CpuStorage::F16(a), CpuStorage::F16(b), CpuStorage::F16(g)) => {
                CpuStorage::F16(swiglu_bwd(slice(a, l1)?, slice(b, l2)?, slice(g, l3)?))
            }
            _ => candle_core::bail!("{}: one float dtype expected", self.name()),
        };
        Ok((out, Shape::from(2 * l1.shape().elem_count())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::swiglu(&[(s1, l1), (s2, l2), (s3, l3)])
    }
}
