//! A `Linear` layer whose bias gradient is one pass of row sums (Candle's broadcast-add backward
//! reduces across rows with a strided loop: 13% of a Transformer LM training step on the CPU).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Module, Result, Shape, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use super::elem::{binary_float, slice, Elem};

/// Rows summed by one Rayon task in the bias gradient.
const ROWS_PER_TASK: usize = 64;

/// A fully connected layer, `y = x Wᵀ + b`: `candle_nn::Linear`'s constructor, accessors and
/// results, with the bias added by a fused op whose backward sums the incoming gradient's rows
/// in one contiguous pass (CPU, float dtypes; Candle's broadcast add elsewhere). Inputs of any
/// rank are flattened to rows for one matrix product.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// A layer of `weight` (`[out, in]`) and an optional `bias` (`[out]`).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias }
    }

    /// The weight, `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&k, lead)) = dims.split_last() else {
            candle_core::bail!("accelerate_rs::nn::Linear: a scalar input has no features");
        };
        let rows: usize = lead.iter().product();
        // One [rows, in] x [in, out] product (a copy first if the input is strided).
        let x2 = x.contiguous()?.reshape((rows, k))?;
        let y = x2.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => bias_add(&y, b)?,
            None => y,
        };
        let mut out = lead.to_vec();
        out.push(y.dim(1)?);
        y.reshape(out)
    }
}

/// A [`Linear`] with weight and bias from `vb` (`"weight"` `[out, in]`, `"bias"` `[out]`),
/// initialized as `candle_nn::linear` does.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), l.bias().cloned()))
}

/// A [`Linear`] without bias, initialized as `candle_nn::linear_no_bias` does.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), None))
}

/// `y + b` for `y` `[rows, out]` and `b` `[out]`: fused with a row-sum backward on the CPU.
fn bias_add(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    let fused = y.device().is_cpu()
        && b.device().is_cpu()
        && y.dtype() == b.dtype()
        && matches!(
            y.dtype(),
            DType::F32 | DType::F64 | DType::BF16 | DType::F16
        )
        && b.dims() == [y.dim(1)?];
    if !fused {
        return y.broadcast_add(b);
    }
    y.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

struct BiasAdd;

fn add_rows<T: Elem>(y: &[T], b: &[T]) -> Vec<T> {
    let d = b.len().max(1);
    let mut out = y.to_vec();
    out.par_chunks_mut(d * ROWS_PER_TASK).for_each(|rows| {
        for row in rows.chunks_mut(d) {
            for (o, bias) in row.iter_mut().zip(b) {
                *o = T::of(o.f() + bias.f());
            }
        }
    });
    out
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "accelerate-rs-bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = binary_float!(self.name(), s1, l1, s2, l2, add_rows);
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = grad.contiguous()?.apply_op1_no_bwd(&ColumnSums {
            cols: b.elem_count(),
        })?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// The sums of a contiguous `[rows, cols]` tensor's columns, `[cols]` (f32 accumulation; f64
/// for f64), rows added one after another so every read is contiguous.
struct ColumnSums {
    cols: usize,
}

fn column_sums<T: Elem>(g: &[T], d: usize) -> Vec<T> {
    let d = d.max(1);
    let sums = g
        .par_chunks(d * ROWS_PER_TASK)
        .map(|rows| {
            let mut acc = vec![0f32; d];
            for row in rows.chunks(d) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v.f();
                }
            }
            acc
        })
        .reduce(
            || vec![0f32; d],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(&b) {
                    *x += y;
                }
                a
            },
        );
    sums.into_iter().map(T::of).collect()
}

fn column_sums_f64(g: &[f64], d: usize) -> Vec<f64> {
    let d = d.max(1);
    g.par_chunks(d * ROWS_PER_TASK)
        .map(|rows| {
            let mut acc = vec![0f64; d];
            for row in rows.chunks(d) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
            acc
        })
        .reduce(
            || vec![0f64; d],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(&b) {
                    *x += y;
                }
                a
            },
        )
}

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "accelerate-rs-column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.cols;
        let out = match s {
            CpuStorage::F32(g) => CpuStorage::F32(column_sums(slice(g, l)?, d)),
            CpuStorage::F64(g) => CpuStorage::F64(column_sums_f64(slice(g, l)?, d)),
            CpuStorage::BF16(g) => CpuStorage::BF16(column_sums(slice(g, l)?, d)),
            CpuStorage::F16(g) => CpuStorage::F16(column_sums(slice(g, l)?, d)),
            _ => candle_core::bail!("{}: a float dtype expected", self.name()),
        };
        Ok((out, Shape::from(d)))
    }
}
