//! An embedding lookup as one differentiable op, on the CPU and (with the trial kernels of a
//! `cuda` build, `ACCELERATE_RS_CUDA_TRIAL=1`) on a GPU. Candle's `index_select` backward
//! scatters the rows' gradients into a zero-filled table and then, like every op's gradient,
//! adds that table into a second zero-filled one in its gradient store: for a language model's
//! vocabulary two table-sized fills and a table-sized addition per step. On a GPU its
//! `index_add` kernel also gives each column of the table one thread that walks every lookup in
//! turn: one block of the device for the whole scatter. Here the lookups are grouped by table
//! row on the host while the ids are read anyway ([`Plan`]); the backward pass zero-fills one
//! table and sums each looked-up row's gradients into it (on a GPU one block per such row), and
//! hands it straight to our backward pass ([`backward`](super::backward)) when it is running.
//! The same sums in the same order as Candle's, in f32.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::elem::slice;

/// The rows `ids` (any shape of integer ids) of `table` `[n, dim]`, as `[.., dim]`:
/// `table.index_select(ids, 0)` reshaped, differentiable with respect to the table. On the CPU
/// in f32, and on a GPU with the trial kernels on (`ACCELERATE_RS_CUDA_TRIAL=1`), one op
/// whose gradient is the rows' gradients summed into a table; elsewhere Candle's
/// `index_select`. An id outside the table, or ids of a float dtype, are an error naming them.
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
    // A host read, counted (`accelerate_rs::host_reads`) unless it cannot wait for a device: ids
    // in host memory for a table on a GPU (what the models hand over).
    let rows = match ids.device().is_cpu() && !table.device().is_cpu() {
        true => checked_rows(ids, n)?,
        false => crate::readback::counted(|| checked_rows(ids, n))?,
    };
    let mut dims = ids.dims().to_vec();
    dims.push(dim);
    // A strided table (a transposed view) is read through a contiguous copy, a graph node whose
    // backward pass hands the gradient on to the view.
    let table = &table.contiguous()?;
    let count = rows.len();
    let out = if dim > 0 && table.device().is_cpu() && table.dtype() == DType::F32 {
        table.apply_op1(Lookup(Arc::new(Plan::new(rows))))?
    } else if dim > 0 && super::elem::trial_kernels(table)? {
        let mut plan = Plan::new(rows);
        let packed = plan.packed();
        let len = packed.len();
        plan.on_device = Some(Tensor::from_vec(packed, len, table.device())?);
        table.apply_op1(Lookup(Arc::new(plan)))?
    } else {
        let ids = Tensor::from_vec(rows, count, table.device())?;
        table.index_select(&ids, 0)?
    };
    out.reshape(dims)
}

/// The ids as rows of a table of `n`: integer ids inside `0..n`, else an error naming the first
/// that is not.
fn checked_rows(ids: &Tensor, n: usize) -> Result<Vec<u32>> {
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
    Ok(rows)
}

/// The lookups (`rows`, checked to lie in the table), and the same grouped by table row for the
/// gradient: `uniq` the rows looked up (ascending), the lookups of `uniq[u]` being the positions
/// `order[starts[u]..starts[u + 1]]`, in the order they were made.
struct Plan {
    rows: Vec<u32>,
    order: Vec<u32>,
    starts: Vec<u32>,
    uniq: Vec<u32>,
    /// On a GPU: [`Plan::packed`] in the device's memory.
    on_device: Option<Tensor>,
}

impl Plan {
    fn new(rows: Vec<u32>) -> Plan {
        let mut order: Vec<u32> = (0..rows.len() as u32).collect();
        // Stable: each row's lookups keep their order.
        order.sort_by_key(|&p| rows[p as usize]);
        let (mut starts, mut uniq) = (Vec::new(), Vec::new());
        for (i, &p) in order.iter().enumerate() {
            let r = rows[p as usize];
            if uniq.last() != Some(&r) {
                uniq.push(r);
                starts.push(i as u32);
            }
        }
        starts.push(order.len() as u32);
        Plan {
            rows,
            order,
            starts,
            uniq,
            on_device: None,
        }
    }

    /// An error unless every row looked up lies in a table of `n` rows (checked when the ids
    /// were read; checked again before a kernel indexes memory with them).
    fn check(&self, n: usize, op: &str) -> Result<()> {
        match self.uniq.last() {
            Some(&r) if r as usize >= n => {
                candle_core::bail!("{op}: row {r} of a {n}-row table")
            }
            _ => Ok(()),
        }
    }

    /// `rows`, `order`, `starts` and `uniq` one after the other: what a GPU's kernels read
    /// (`super::cuda::embedding_rows` and `embedding_grad`).
    fn packed(&self) -> Vec<u32> {
        [&self.rows, &self.order, &self.starts, &self.uniq]
            .into_iter()
            .flatten()
            .copied()
            .collect()
    }
}

/// The op: the table's rows `plan.rows`.
struct Lookup(Arc<Plan>);

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
        self.0.check(n, self.name())?;
        let rows = &self.0.rows;
        let mut out = Vec::with_capacity(rows.len() * dim);
        for &r in rows {
            let r = r as usize;
            out.extend_from_slice(&table[r * dim..(r + 1) * dim]);
        }
        Ok((CpuStorage::F32(out), Shape::from((rows.len(), dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, _) = l.shape().dims2()?;
        self.0.check(n, self.name())?;
        let on_device = device_plan(&self.0, self.name())?;
        super::cuda::embedding_rows((s, l), on_device, self.0.rows.len())
    }

    fn bwd(&self, table: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (n, dim) = table.dims2()?;
        let grad = grad.to_dtype(table.dtype())?.contiguous()?;
        if grad.elem_count() != self.0.rows.len() * dim {
            candle_core::bail!(
                "accelerate-rs-embedding: a gradient of {} elements for {} rows of {dim}",
                grad.elem_count(),
                self.0.rows.len()
            );
        }
        let d = grad.apply_op1_no_bwd(&Scatter {
            plan: self.0.clone(),
            n,
            dim,
        })?;
        super::grad_frames::deposit(table, d)
    }
}

/// The packed plan on the GPU (built with it by [`embedding`]).
#[cfg(feature = "cuda")]
fn device_plan<'a>(plan: &'a Plan, op: &str) -> Result<&'a Tensor> {
    plan.on_device
        .as_ref()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: no lookup plan on the GPU")))
}

/// The table's gradient `[n, dim]` from the rows' gradients `[rows, dim]`: each looked-up row
/// the sum of its lookups' gradients, in the order they were made; the other rows zero.
struct Scatter {
    plan: Arc<Plan>,
    n: usize,
    dim: usize,
}

impl CustomOp1 for Scatter {
    fn name(&self) -> &'static str {
        "accelerate-rs-embedding-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(g) = s else {
            candle_core::bail!("{}: expects an f32 gradient", self.name());
        };
        self.plan.check(self.n, self.name())?;
        let (g, dim, p) = (slice(g, l)?, self.dim, &self.plan);
        if g.len() != p.rows.len() * dim {
            candle_core::bail!("{}: a gradient of {} elements", self.name(), g.len());
        }
        let mut d = vec![0f32; self.n * dim];
        for (u, &r) in p.uniq.iter().enumerate() {
            let dst = &mut d[r as usize * dim..(r as usize + 1) * dim];
            for &pos in &p.order[p.starts[u] as usize..p.starts[u + 1] as usize] {
                let src = &g[pos as usize * dim..(pos as usize + 1) * dim];
                for (a, b) in dst.iter_mut().zip(src) {
                    *a += b;
                }
            }
        }
        Ok((CpuStorage::F32(d), Shape::from((self.n, dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.plan.check(self.n, self.name())?;
        let on_device = device_plan(&self.plan, self.name())?;
        let (count, uniq) = (self.plan.rows.len(), self.plan.uniq.len());
        super::cuda::embedding_grad((s, l), on_device, (count, uniq), self.n, self.dim)
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
    fn the_plan_groups_the_lookups_by_row_in_their_order() {
        let p = Plan::new(vec![3, 1, 3, 0, 1, 3]);
        assert_eq!(p.uniq, vec![0, 1, 3]);
        assert_eq!(p.starts, vec![0, 1, 3, 6]);
        assert_eq!(p.order, vec![3, 1, 4, 0, 2, 5]);
        let packed = p.packed();
        assert_eq!(packed.len(), 2 * 6 + 2 * 3 + 1);
        assert_eq!(packed[..6], [3, 1, 3, 0, 1, 3]);
        assert_eq!(packed[12..16], [0, 1, 3, 6]);
        assert_eq!(packed[16..], [0, 1, 3]);
        assert!(p.check(4, "op").is_ok());
        let err = p.check(3, "op").err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("row 3 of a 3-row table")));
        let empty = Plan::new(Vec::new());
        assert_eq!((empty.uniq.len(), empty.starts), (0, vec![0]));
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
