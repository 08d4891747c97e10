//! An embedding lookup as one differentiable op on the CPU. Candle's `index_select` backward
//! scatters the rows' gradients into a zero-filled table and then, like every op's gradient, adds
//! that table into a second zero-filled one in its gradient store: for a language model's
//! vocabulary two table-sized fills and a table-sized addition per step. Here the backward pass
//! scatters once into one zero-filled table and hands it straight to our backward pass
//! ([`backward`](super::backward)) when it is running; the same sums, in the same order.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor};

use super::elem::slice;

/// The rows `ids` (any shape of integer ids) of `table` `[n, dim]`, as `[.., dim]`:
/// `table.index_select(ids, 0)` reshaped, differentiable with respect to the table. On the CPU
/// in f32 one op whose gradient is the rows' gradients scattered into a table; elsewhere
/// Candle's `index_select`. An id outside the table, or ids of a float dtype, are an error
/// naming them.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::embedding;
/// use candle_core::{Device, Tensor, Var};
/// let table = Var::from_tensor(&Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((4, 3))?)?;
/// let ids = Tensor::new(&[[3u32, 0], [3, 1]], &Device::Cpu)?;
/// let rows = embedding(&table, &ids)?;
/// assert_eq!(rows.dims(), &[2, 2, 3]);
/// assert_eq!(rows.get(0)?.get(0)?.to_vec1::<f32>()?, vec![9.0, 10.0, 11.0]);
/// let grads = accelerate_rs::nn::backward(&rows.sum_all()?)?;
/// let d = grads.get(&table).expect("the table's gradient").to_vec2::<f32>()?;
/// assert_eq!(d, vec![vec![1.0; 3], vec![1.0; 3], vec![0.0; 3], vec![2.0; 3]]);
/// # Ok(()) }
/// ```
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (n, dim) = table.dims2()?;
    let flat = ids.flatten_all()?;
    if flat.dtype().is_float() {
        candle_core::bail!(
            "accelerate_rs::nn::embedding: ids of dtype {:?}: integer ids are expected",
            flat.dtype()
        );
    }
    let values = match flat.dtype() {
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        _ => flat.to_dtype(DType::I64)?.to_vec1::<i64>()?,
    };
    let mut rows = Vec::with_capacity(values.len());
    for (i, &v) in values.iter().enumerate() {
        match u32::try_from(v) {
            Ok(id) if (id as usize) < n => rows.push(id),
            _ => candle_core::bail!(
                "accelerate_rs::nn::embedding: id {v} at position {i} is outside the table's \
                 {n} rows (0..{n})"
            ),
        }
    }
    let mut dims = ids.dims().to_vec();
    dims.push(dim);
    // A strided table (a transposed view) is read through a contiguous copy, a graph node whose
    // backward pass hands the gradient on to the view.
    let table = &table.contiguous()?;
    let out = if table.device().is_cpu() && table.dtype() == DType::F32 && dim > 0 {
        table.apply_op1(Lookup { rows })?
    } else {
        let ids = Tensor::from_vec(rows, values.len(), table.device())?;
        table.index_select(&ids, 0)?
    };
    out.reshape(dims)
}

/// The op: the table's rows `rows` (checked to lie in the table).
struct Lookup {
    rows: Vec<u32>,
}

impl CustomOp1 for Lookup {
    fn name(&self) -> &'static str {
        "accelerate-rs-embedding"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(table) = s else {
            candle_core::bail!("accelerate-rs-embedding: expects an f32 table");
        };
        let (n, dim) = l.shape().dims2()?;
        let table = slice(table, l)?;
        let mut out = Vec::with_capacity(self.rows.len() * dim);
        for &r in &self.rows {
            let r = r as usize;
            if r >= n {
                candle_core::bail!("accelerate-rs-embedding: row {r} of a {n}-row table");
            }
            out.extend_from_slice(&table[r * dim..(r + 1) * dim]);
        }
        Ok((CpuStorage::F32(out), Shape::from((self.rows.len(), dim))))
    }

    fn bwd(&self, table: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (n, dim) = table.dims2()?;
        let grad = grad.contiguous()?;
        let (storage, layout) = grad.storage_and_layout();
        let Storage::Cpu(CpuStorage::F32(g)) = &*storage else {
            candle_core::bail!("accelerate-rs-embedding: expects an f32 CPU gradient");
        };
        let g = slice(g, layout)?;
        if g.len() != self.rows.len() * dim {
            candle_core::bail!(
                "accelerate-rs-embedding: a gradient of {} elements for {} rows of {dim}",
                g.len(),
                self.rows.len()
            );
        }
        // In the order of the lookups, as Candle's `index_add` sums them.
        let mut d = vec![0f32; n * dim];
        for (&r, src) in self.rows.iter().zip(g.chunks_exact(dim)) {
            let r = r as usize;
            for (a, b) in d[r * dim..(r + 1) * dim].iter_mut().zip(src) {
                *a += b;
            }
        }
        drop(storage);
        let d = Tensor::from_vec(d, (n, dim), table.device())?;
        super::grad_frames::deposit(table, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The table's gradient through `f`, by our backward pass (`frame`) or Candle's.
    fn table_grad(
        table: &Var,
        frame: bool,
        w: &Tensor,
        f: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let y = f(table.as_tensor())?;
        let loss = (&y * w)?.sum_all()?;
        let grads = match frame {
            true => crate::nn::backward(&loss)?,
            false => loss.backward()?,
        };
        let g = grads.get(table.as_tensor()).cloned();
        Ok((
            y,
            g.ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?,
        ))
    }

    #[test]
    fn rows_and_gradient_equal_index_select_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let table = Var::from_tensor(&Tensor::randn(0f32, 1.0, (11, 7), &dev)?)?;
        // Repeated ids (their gradients summed), an id never looked up (a zero row), 2-D ids.
        let ids = Tensor::new(&[[3u32, 10, 3], [0, 3, 5]], &dev)?;
        let w = Tensor::randn(0f32, 1.0, (2, 3, 7), &dev)?;
        for frame in [true, false] {
            let (y, g) = table_grad(&table, frame, &w, |t| embedding(t, &ids))?;
            let (y0, g0) = table_grad(&table, frame, &w, |t| {
                t.index_select(&ids.flatten_all()?, 0)?.reshape((2, 3, 7))
            })?;
            assert_eq!(y.dims(), &[2, 3, 7]);
            assert_eq!(
                y.flatten_all()?.to_vec1::<f32>()?,
                y0.flatten_all()?.to_vec1::<f32>()?
            );
            assert_eq!(g.to_vec2::<f32>()?, g0.to_vec2::<f32>()?, "frame {frame}");
            assert_eq!(g.get(1)?.to_vec1::<f32>()?, vec![0f32; 7]);
        }
        Ok(())
    }

    #[test]
    fn other_dtypes_id_types_and_strided_tables_give_index_selects_rows() -> Result<()> {
        let dev = Device::Cpu;
        let t64 = Tensor::randn(0f64, 1.0, (5, 3), &dev)?;
        let ids = Tensor::new(&[4i64, 0, 4], &dev)?;
        let got = embedding(&t64, &ids)?.to_vec2::<f64>()?;
        let want = t64.index_select(&ids, 0)?.to_vec2::<f64>()?;
        assert_eq!(got, want);
        let t32 = t64.to_dtype(DType::F32)?;
        let got = embedding(&t32, &ids)?.to_vec2::<f32>()?;
        assert_eq!(got, t32.index_select(&ids, 0)?.to_vec2::<f32>()?);
        // A strided f32 table (a transposed view), which Candle's `index_select` refuses.
        let strided = t32.t()?;
        let ids = Tensor::new(&[2u32, 0], &dev)?;
        let got = embedding(&strided, &ids)?.to_vec2::<f32>()?;
        let want = strided.contiguous()?.index_select(&ids, 0)?;
        assert_eq!(got, want.to_vec2::<f32>()?);
        Ok(())
    }

    #[test]
    fn an_id_outside_the_table_is_named() -> Result<()> {
        let dev = Device::Cpu;
        let table = Tensor::zeros((4, 2), DType::F32, &dev)?;
        for (ids, bad) in [
            (Tensor::new(&[1u32, 4], &dev)?, "id 4 at position 1"),
            (Tensor::new(&[-1i64], &dev)?, "id -1 at position 0"),
            (Tensor::new(&[f32::NAN], &dev)?, "ids of dtype F32"),
        ] {
            let err = embedding(&table, &ids).err().map(|e| e.to_string());
            assert!(err.as_deref().is_some_and(|e| e.contains(bad)), "{err:?}");
        }
        Ok(())
    }
}
