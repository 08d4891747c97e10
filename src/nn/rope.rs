//! Rotary position embeddings (RoPE) with a backward pass: `candle_nn::rotary_emb::{rope, rope_i,
//! rope_thd}` are fused CPU/GPU kernels applied with no backward (Candle 0.11), so nothing before
//! them — a model's query and key projections — receives a gradient. These take the same
//! arguments, give the same values, and differentiate with respect to `xs`, `cos` and `sin`.
//!
//! Each row of `head_dim` features is turned pairwise: the pair `(a, b)` at angle `θ` (`cos θ`,
//! `sin θ` from the tables) becomes `(a cos θ − b sin θ, a sin θ + b cos θ)`. Its gradient is the
//! turn by `−θ` of the upstream gradient (the same kernel with `sin` negated), and the tables'
//! gradients are `Σ (g_a a + g_b b)` and `Σ (g_b a − g_a b)` over the rows that share a position.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{binary_float, fused, multiversion, slice, Elem};
use super::rope_geometry::{Geometry, Variant};

/// Elements per Rayon task (rows are grouped up to this size).
const CHUNK: usize = 8192;

/// Rotary embeddings on the two halves of each row: `xs` `[batch, heads, seq, head_dim]`, `cos`
/// and `sin` `[positions, head_dim / 2]` (the first `seq` positions are used) or
/// `[batch, positions, head_dim / 2]` (one table per sequence). Feature `i` pairs with feature
/// `i + head_dim / 2` (Llama's, Mistral's and Qwen2's `rotate_half` convention):
/// `y[i] = x[i] cos − x[i + D/2] sin`, `y[i + D/2] = x[i] sin + x[i + D/2] cos`.
///
/// `candle_nn::rotary_emb::rope`'s signature and values (within f32 rounding; bf16 and f16 are
/// computed in f32, f64 in f32 too as the other fused ops), but differentiable: `xs`, `cos` and
/// `sin` get gradients (the tables' summed over batch and heads). Inputs of any strides are
/// accepted (Candle's needs them contiguous). Fused on the CPU (f32, f64, bf16, f16) and, in a
/// `cuda` build, on a GPU (CUDA kernels, proven on an H100); Candle's composed, differentiable
/// ops elsewhere.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor, Var};
/// let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 3, 4), &Device::Cpu)?)?;
/// let cos = Tensor::ones((3, 2), candle_core::DType::F32, &Device::Cpu)?;
/// let sin = Tensor::zeros((3, 2), candle_core::DType::F32, &Device::Cpu)?;
/// // Angle 0 leaves the input as it is, and the projection before it now gets a gradient.
/// let y = accelerate_rs::nn::rope(&q, &cos, &sin)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, q.flatten_all()?.to_vec1::<f32>()?);
/// assert!(y.sum_all()?.backward()?.get(&q).is_some());
/// # Ok(()) }
/// ```
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply(Variant::Halves, xs, cos, sin)
}

/// Rotary embeddings on interleaved pairs: like [`rope`], but feature `2i` pairs with feature
/// `2i + 1` (the original RoPE paper's and GPT-J's convention). `candle_nn::rotary_emb::rope_i`'s
/// signature and values, differentiable with respect to `xs`, `cos` and `sin`.
pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply(Variant::Interleaved, xs, cos, sin)
}

/// Rotary embeddings for `xs` laid out `[batch, seq, heads, head_dim]` (no transpose needed after
/// the projection), pairs of halves as in [`rope`]. `candle_nn::rotary_emb::rope_thd`'s signature
/// and values, differentiable with respect to `xs`, `cos` and `sin`.
pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply(Variant::Thd, xs, cos, sin)
}

/// Checks the shapes (with errors naming the function and the shapes), cuts the tables to the
/// first `seq` positions and applies the fused op, or the composed ops off the CPU.
fn apply(variant: Variant, xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let name = variant.name();
    let [b, x1, x2, d] = match *xs.dims() {
        [b, x1, x2, d] => [b, x1, x2, d],
        _ => candle_core::bail!(
            "{name}: xs must be {}, got shape {:?}",
            variant.layout(),
            xs.dims()
        ),
    };
    let t = if variant == Variant::Thd { x1 } else { x2 };
    if cos.rank() != sin.rank() || !matches!(cos.rank(), 2 | 3) {
        candle_core::bail!(
            "{name}: cos and sin must both be [positions, head_dim / 2] or both \
             [batch, positions, head_dim / 2], got cos {:?} and sin {:?}",
            cos.dims(),
            sin.dims()
        );
    }
    for (what, cs) in [("cos", cos), ("sin", sin)] {
        let dims = cs.dims();
        let (positions, half) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        if dims.len() == 3 && dims[0] != b {
            candle_core::bail!(
                "{name}: {what} of shape {dims:?} has a batch of {}, xs {:?} a batch of {b}",
                dims[0],
                xs.dims()
            );
        }
        if half * 2 != d {
            candle_core::bail!(
                "{name}: {what} of shape {dims:?} has a last dimension of {half}, expected \
                 head_dim / 2 = {} for xs {:?} (head_dim must be even)",
                d as f64 / 2.0,
                xs.dims()
            );
        }
        if positions < t {
            candle_core::bail!(
                "{name}: {what} of shape {dims:?} has {positions} positions for a sequence of \
                 {t} (xs {:?})",
                xs.dims()
            );
        }
    }
    if xs.dtype() != cos.dtype() || xs.dtype() != sin.dtype() {
        candle_core::bail!(
            "{name}: xs, cos and sin must share one dtype, got {:?}, {:?} and {:?}",
            xs.dtype(),
            cos.dtype(),
            sin.dtype()
        );
    }
    // The first `t` positions (of each sequence's table); a narrow's gradient is zero-padded.
    let pos = cos.rank() - 2;
    let cos = cos.narrow(pos, 0, t)?;
    let sin = sin.narrow(pos, 0, t)?;
    let same = |t: &Tensor| t.device().same_device(xs.device());
    if !fused(xs)? || !same(&cos) || !same(&sin) {
        return composed(variant, xs, &cos, &sin);
    }
    if xs.elem_count() == 0 {
        // Nothing to turn; the same (empty) values, still on the graph of `xs`.
        return xs.contiguous();
    }
    let op = RopeFwd { variant, sign: 1.0 };
    xs.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// Candle's composed, differentiable ops (other devices): the halves (or interleaved pairs)
/// narrowed out, turned by broadcast products and concatenated. `cos`/`sin` are cut to `seq`.
fn composed(variant: Variant, xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dims = xs.dims();
    let (b, t, half) = (dims[0], cos.dim(cos.rank() - 2)?, dims[3] / 2);
    let batch = if cos.rank() == 3 { b } else { 1 };
    // Shapes that broadcast against xs (and, interleaved, against its `[.., half, 1]` pairs).
    let cs_shape: Vec<usize> = match variant {
        Variant::Thd => vec![batch, t, 1, half],
        Variant::Halves => vec![batch, 1, t, half],
        Variant::Interleaved => vec![batch, 1, t, half, 1],
    };
    let (c, s) = (cos.reshape(cs_shape.clone())?, sin.reshape(cs_shape)?);
    let turn = |a: &Tensor, b: &Tensor| -> Result<(Tensor, Tensor)> {
        let ya = (a.broadcast_mul(&c)? - b.broadcast_mul(&s)?)?;
        let yb = (a.broadcast_mul(&s)? + b.broadcast_mul(&c)?)?;
        Ok((ya, yb))
    };
    if variant.interleaved() {
        let pairs = xs.reshape((dims[0], dims[1], dims[2], half, 2))?;
        let (ya, yb) = turn(&pairs.narrow(4, 0, 1)?, &pairs.narrow(4, 1, 1)?)?;
        Tensor::cat(&[ya, yb], 4)?.reshape(dims)
    } else {
        let (ya, yb) = turn(&xs.narrow(3, 0, half)?, &xs.narrow(3, half, half)?)?;
        Tensor::cat(&[ya, yb], 3)
    }
}

multiversion! {
    /// One row turned: `y = (a c − σ b s, σ a s + b c)` for each pair `(a, b)` of `x` (halves or
    /// interleaved) and the row's `c = cos`, `s = sin`.
    fn turn_row<T: Elem>(
        y: &mut [T],
        x: &[T],
        c: &[T],
        s: &[T],
        interleaved: bool,
        sign: f32,
    ) {
        let half = c.len();
        if interleaved {
            for (((y, x), c), s) in y
                .chunks_exact_mut(2)
                .zip(x.chunks_exact(2))
                .zip(c)
                .zip(s)
            {
                let (a, b, c, s) = (x[0].f(), x[1].f(), c.f(), sign * s.f());
                y[0] = T::of(a * c - b * s);
                y[1] = T::of(a * s + b * c);
            }
        } else {
            let (ya, yb) = y.split_at_mut(half);
            let (xa, xb) = x.split_at(half);
            for ((((ya, yb), (a, b)), c), s) in
                ya.iter_mut().zip(yb).zip(xa.iter().zip(xb)).zip(c).zip(s)
            {
                let (a, b, c, s) = (a.f(), b.f(), c.f(), sign * s.f());
                *ya = T::of(a * c - b * s);
                *yb = T::of(a * s + b * c);
            }
        }
    }
}

/// `(xs, cos, sin)` → the turned rows. With `sign = −1` it turns the other way: the backward of
/// `xs`.
pub(super) struct RopeFwd {
    pub(super) variant: Variant,
    pub(super) sign: f32,
}

fn fwd<T: Elem>(x: &[T], cos: &[T], sin: &[T], g: Geometry, sign: f32) -> Vec<T> {
    let (d, half) = (g.d, g.d / 2);
    let mut out = vec![T::of(0.0); x.len()];
    let interleaved = g.variant.interleaved();
    out.par_chunks_mut(d)
        .inline_when_single()
        .zip(x.par_chunks(d).inline_when_single())
        .enumerate()
        .with_min_len((CHUNK / d.max(1)).max(1))
        .for_each(|(r, (y, x))| {
            let p = g.table_row(r) * half;
            let (c, s) = (&cos[p..p + half], &sin[p..p + half]);
            turn_row(y, x, c, s, interleaved, sign);
        });
    out
}

impl CustomOp3 for RopeFwd {
    fn name(&self) -> &'static str {
        match self.variant {
            Variant::Halves => "accelerate-rs-rope",
            Variant::Interleaved => "accelerate-rs-rope-i",
            Variant::Thd => "accelerate-rs-rope-thd",
        }
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
        let g = Geometry::new(self.variant, l1, l2)?;
        let sign = self.sign;
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(c), CpuStorage::F32(s)) => {
                CpuStorage::F32(fwd(slice(x, l1)?, slice(c, l2)?, slice(s, l3)?, g, sign))
            }
            (CpuStorage::F64(x), CpuStorage::F64(c), CpuStorage::F64(s)) => {
                CpuStorage::F64(fwd(slice(x, l1)?, slice(c, l2)?, slice(s, l3)?, g, sign))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(c), CpuStorage::BF16(s)) => {
                CpuStorage::BF16(fwd(slice(x, l1)?, slice(c, l2)?, slice(s, l3)?, g, sign))
            }
            (CpuStorage::F16(x), CpuStorage::F16(c), CpuStorage::F16(s)) => {
                CpuStorage::F16(fwd(slice(x, l1)?, slice(c, l2)?, slice(s, l3)?, g, sign))
            }
            _ => candle_core::bail!(
                "{}: xs, cos and sin must share one float dtype",
                self.name()
            ),
        };
        Ok((out, l1.shape().clone()))
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
        let g = Geometry::new(self.variant, l1, l2)?;
        super::cuda::rope((s1, l1), (s2, l2), (s3, l3), g, self.sign)
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let back = RopeFwd {
            variant: self.variant,
            sign: -self.sign,
        };
        let dx = grad.apply_op3_no_bwd(cos, sin, &back)?;
        // The tables' gradients only when something upstream of them trains (usually they are
        // constants computed once).
        if !cos.track_op() && !sin.track_op() {
            return Ok((Some(dx), None, None));
        }
        let n = cos.elem_count();
        let tables = x.apply_op2_no_bwd(
            &grad,
            &TablesBwd {
                variant: self.variant,
                sign: self.sign,
                batched: cos.rank() == 3,
            },
        )?;
        let dcos = tables.narrow(0, 0, n)?.reshape(cos.shape())?;
        let dsin = tables.narrow(0, n, n)?.reshape(sin.shape())?;
        Ok((Some(dx), Some(dcos), Some(dsin)))
    }
}

/// `(xs, dy)` → `[dcos, dsin]` flat: per table row, the sums over the rows that use it of
/// `g_a a + g_b b` and `σ (g_b a − g_a b)`.
struct TablesBwd {
    variant: Variant,
    sign: f32,
    batched: bool,
}

fn tables_bwd<T: Elem>(x: &[T], dy: &[T], g: Geometry, sign: f32) -> Vec<T> {
    let (d, half) = (g.d, g.d / 2);
    let n = g.table_rows() * half;
    let mut out = vec![T::of(0.0); 2 * n];
    let (dcos, dsin) = out.split_at_mut(n);
    let interleaved = g.variant.interleaved();
    // One task per table row: no partial sums to add up (table rows are few and rows many, so
    // this is parallel enough except for a single position, as in one-token decoding).
    dcos.par_chunks_mut(half.max(1))
        .inline_when_single()
        .zip(dsin.par_chunks_mut(half.max(1)).inline_when_single())
        .enumerate()
        .for_each_init(
            || (vec![0f32; half], vec![0f32; half]),
            |(acc_c, acc_s), (p, (dc, ds))| {
                acc_c.fill(0.0);
                acc_s.fill(0.0);
                for r in g.rows_of(p) {
                    let (xr, gr) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d]);
                    accumulate_tables(acc_c, acc_s, xr, gr, interleaved);
                }
                for ((dc, ds), (c, s)) in dc
                    .iter_mut()
                    .zip(ds.iter_mut())
                    .zip(acc_c.iter().zip(acc_s.iter()))
                {
                    *dc = T::of(*c);
                    *ds = T::of(sign * *s);
                }
            },
        );
    out
}

multiversion! {
    /// Adds one row's `g_a a + g_b b` to `acc_c` and `g_b a − g_a b` to `acc_s`, pair by pair.
    fn accumulate_tables<T: Elem>(
        acc_c: &mut [f32],
        acc_s: &mut [f32],
        x: &[T],
        g: &[T],
        interleaved: bool,
    ) {
        let half = acc_c.len();
        if interleaved {
            for (((acc_c, acc_s), x), g) in acc_c
                .iter_mut()
                .zip(acc_s.iter_mut())
                .zip(x.chunks_exact(2))
                .zip(g.chunks_exact(2))
            {
                let (a, b, ga, gb) = (x[0].f(), x[1].f(), g[0].f(), g[1].f());
                *acc_c += ga * a + gb * b;
                *acc_s += gb * a - ga * b;
            }
        } else {
            let (xa, xb) = x.split_at(half);
            let (ga, gb) = g.split_at(half);
            for (((acc_c, acc_s), (a, b)), (ga, gb)) in acc_c
                .iter_mut()
                .zip(acc_s.iter_mut())
                .zip(xa.iter().zip(xb))
                .zip(ga.iter().zip(gb))
            {
                let (a, b, ga, gb) = (a.f(), b.f(), ga.f(), gb.f());
                *acc_c += ga * a + gb * b;
                *acc_s += gb * a - ga * b;
            }
        }
    }
}

impl CustomOp2 for TablesBwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-rope-tables-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = self.geometry(l1)?;
        let out = binary_float!(self.name(), s1, l1, s2, l2, tables_bwd, g, self.sign);
        Ok((out, Shape::from(2 * g.table_rows() * (g.d / 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = self.geometry(l1)?;
        super::cuda::rope_tables((s1, l1), (s2, l2), g, self.sign)
    }
}

impl TablesBwd {
    /// The geometry of `xs` (layout `l`).
    fn geometry(&self, l: &Layout) -> Result<Geometry> {
        let (b, a, c, d) = l.shape().dims4()?;
        let (h, t) = if self.variant == Variant::Thd {
            (c, a)
        } else {
            (a, c)
        };
        Ok(Geometry {
            variant: self.variant,
            b,
            h,
            t,
            d,
            batched: self.batched,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::elem::max_diff;
    use candle_core::{Device, Var};

    fn det(shape: &[usize], salt: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + salt * 104729) % 1013) as f32 / 1013.0 - 0.5) * 3.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The composed path (what other devices run) equals the fused one, values and the
    /// gradients of xs, cos and sin, for the three layouts and both table shapes.
    #[test]
    fn the_composed_fallback_equals_the_fused_op() {
        for variant in [Variant::Halves, Variant::Interleaved, Variant::Thd] {
            for batched in [false, true] {
                let (b, h, t, d, positions) = (2, 3, 5, 8, 7);
                let xs_shape = if variant == Variant::Thd {
                    [b, t, h, d]
                } else {
                    [b, h, t, d]
                };
                let cs_shape: Vec<usize> = if batched {
                    vec![b, positions, d / 2]
                } else {
                    vec![positions, d / 2]
                };
                let run = |fused: bool| {
                    let x = Var::from_tensor(&det(&xs_shape, 1)).unwrap();
                    let c = Var::from_tensor(&det(&cs_shape, 2)).unwrap();
                    let s = Var::from_tensor(&det(&cs_shape, 3)).unwrap();
                    let y = if fused {
                        apply(variant, &x, &c, &s).unwrap()
                    } else {
                        let pos = c.rank() - 2;
                        let (cn, sn) = (c.narrow(pos, 0, t).unwrap(), s.narrow(pos, 0, t).unwrap());
                        composed(variant, &x, &cn, &sn).unwrap()
                    };
                    let g = (&y * det(y.dims(), 4))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let grad = |v: &Var| g.get(v).expect("a gradient").clone();
                    [y.clone(), grad(&x), grad(&c), grad(&s)]
                };
                let (f, c) = (run(true), run(false));
                for (i, (f, c)) in f.iter().zip(&c).enumerate() {
                    assert_eq!(f.dims(), c.dims());
                    let diff = max_diff(f, c);
                    assert!(
                        diff < 1e-5,
                        "{variant:?} batched {batched} output {i}: {diff}"
                    );
                }
                // The positions past `seq` get no gradient.
                let dc = f[2].narrow(cs_shape.len() - 2, t, positions - t).unwrap();
                assert_eq!(
                    dc.abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap(),
                    0.0
                );
            }
        }
    }

    #[test]
    fn both_builds_of_the_row_kernels_give_the_same_bits() {
        for interleaved in [false, true] {
            let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
            let c: Vec<f32> = (0..32).map(|i| (i as f32 * 0.11).cos()).collect();
            let s: Vec<f32> = (0..32).map(|i| (i as f32 * 0.11).sin()).collect();
            let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
            turn_row(&mut a, &x, &c, &s, interleaved, -1.0);
            turn_row::portable(&mut b, &x, &c, &s, interleaved, -1.0);
            assert_eq!(a, b);
            let (mut c1, mut s1, mut c2, mut s2) = (
                vec![0f32; 32],
                vec![0f32; 32],
                vec![0f32; 32],
                vec![0f32; 32],
            );
            accumulate_tables(&mut c1, &mut s1, &x, &a, interleaved);
            accumulate_tables::portable(&mut c2, &mut s2, &x, &a, interleaved);
            assert_eq!((c1, s1), (c2, s2));
        }
    }
}
