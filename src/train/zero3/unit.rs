//! One ZeRO-3 unit at run time: this rank's shard of its flat vector, the all-gather that
//! materialises its parameters, and the reduce-scatter of their gradients. On the CPU both run
//! in place in one flat buffer of the unit's size; on other devices through the collective's
//! tensor operations.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, TensorId, Var};

use crate::collective::{BufferMut, Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::inplace::{copy_cpu, read_f64, with_cpu_mut, with_cpu_mut_src};

use super::layout::UnitLayout;

/// A unit: its layout, this rank's shard, and the gathers waiting for their gradients.
#[derive(Debug)]
pub(crate) struct Unit {
    pub(crate) layout: UnitLayout,
    /// This rank's chunk of the flat vector (1-D, `own.len()` elements): the masters the
    /// optimizer steps.
    pub(crate) shard: Var,
    /// The elements of the flat vector the shard holds.
    pub(crate) own: Range<usize>,
    /// Whether the unit's parameters get gradients (false: a frozen base under LoRA).
    trainable: AtomicBool,
    /// Offload: the shard in the compute dtype on the accelerator's device, what gathers read;
    /// the shard itself (the masters the optimizer steps) then lives in host memory. Refreshed
    /// after every step and load ([`refresh`](Self::refresh)).
    device_copy: Option<Var>,
    /// Held gathers ([`ShardedModel::gather`](super::ShardedModel::gather)) whose gradients
    /// are collected when the backward pass ends: the ids of their variables, member by member.
    pub(crate) held: Mutex<Vec<Vec<TensorId>>>,
    /// Per member, whether some rank gave it a gradient since the presence was last read.
    pub(crate) present: Mutex<Vec<bool>>,
}

impl Unit {
    /// A unit over `shard` (this rank's chunk `own`); `device_copy`: see the field.
    pub(crate) fn new(
        layout: UnitLayout,
        shard: Var,
        own: Range<usize>,
        trainable: bool,
        device_copy: Option<Var>,
    ) -> Self {
        let members = layout.members.len();
        Unit {
            layout,
            shard,
            own,
            device_copy,
            trainable: AtomicBool::new(trainable),
            held: Mutex::new(Vec::new()),
            present: Mutex::new(vec![false; members]),
        }
    }

    /// Whether the unit's parameters get gradients.
    pub(crate) fn trainable(&self) -> bool {
        self.trainable.load(Ordering::Relaxed)
    }

    /// Stops computing and reducing gradients for the unit (a base frozen under LoRA).
    pub(crate) fn freeze(&self) {
        self.trainable.store(false, Ordering::Relaxed);
    }

    /// Where the unit is gathered and its gradients reduced: the device copy's device
    /// (offload), else the shard's.
    fn device(&self) -> &Device {
        self.device_copy
            .as_ref()
            .map_or(self.shard.device(), |c| c.device())
    }

    /// Offload: copies the shard (the masters, in host memory) into the device copy, in its
    /// dtype; nothing to do otherwise.
    pub(crate) fn refresh(&self) -> Result<()> {
        if let Some(copy) = &self.device_copy {
            let t = self.shard.as_tensor().to_dtype(copy.dtype())?;
            copy.set(&t.to_device(copy.device())?)?;
        }
        Ok(())
    }

    /// The whole flat vector in `dtype`: every rank's chunk, gathered from the masters (the
    /// shards, for saving) or for computing (offload: from the device copies, on the device).
    pub(crate) fn gather_flat(
        &self,
        c: &dyn Collective,
        dtype: DType,
        masters: bool,
    ) -> Result<Tensor> {
        let len = self.layout.len;
        let source = match &self.device_copy {
            Some(copy) if !masters => copy,
            _ => &self.shard,
        };
        let device = source.device().clone();
        let mine = source.as_tensor().to_dtype(dtype)?.contiguous()?;
        if c.world_size() == 1 {
            return Ok(mine.copy()?);
        }
        if !device.is_cpu() {
            let full = Tensor::zeros(len, dtype, &device)?;
            if !self.own.is_empty() {
                full.slice_set(&mine, 0, self.own.start)?;
            }
            return c.all_gather_into_tensor(&full);
        }
        let flat = Tensor::zeros(len, dtype, &Device::Cpu)?;
        let own = self.own.clone();
        if own.is_empty() {
            with_cpu_mut(&flat, "ZeRO-3 gather", |dst, range| {
                c.all_gather_into(BufferMut::of_cpu(dst, range)?)
            })?;
        } else {
            with_cpu_mut_src(&flat, &mine, "ZeRO-3 gather", |dst, range, src, sr| {
                let at = range.start + own.start..range.start + own.end;
                copy_cpu(dst, at, src, sr)?;
                c.all_gather_into(BufferMut::of_cpu(dst, range)?)
            })?;
        }
        Ok(flat)
    }

    /// The unit's parameters, gathered in `dtype`, by name: fresh variables when `for_grads`
    /// and the unit is trainable (their gradients are this unit's), else views of one flat
    /// buffer (no copy: the first pass of a recomputed block needs no gradient).
    pub(crate) fn gather(
        &self,
        c: &dyn Collective,
        dtype: DType,
        for_grads: bool,
    ) -> Result<Vec<(String, Tensor)>> {
        let flat = self.gather_flat(c, dtype, false)?;
        let mut out = Vec::with_capacity(self.layout.members.len());
        for m in &self.layout.members {
            let view = flat
                .narrow(0, m.offset, m.len)?
                .reshape(m.shape.as_slice())?;
            let t = if for_grads && self.trainable() {
                Var::from_tensor(&view)?.into_inner()
            } else {
                view
            };
            out.push((m.name.clone(), t));
        }
        Ok(out)
    }

    /// Reduce-scatters the members' gradients (`grads`, member by member, `None` for a member
    /// without one on this rank): each is cast to the shard's dtype and divided by `divide`
    /// (an f16 loss scale), zeros standing in for a missing one. Returns this rank's chunk of
    /// their mean over the ranks (1-D, like the shard), and per member whether any rank had a
    /// gradient (also recorded in [`present`](Self::present)).
    pub(crate) fn reduce(
        &self,
        c: &dyn Collective,
        grads: Vec<Option<Tensor>>,
        divide: f64,
    ) -> Result<Tensor> {
        let (dtype, device) = (self.shard.dtype(), self.device().clone());
        // The members' gradients end to end (zeros for a missing one), and this rank's flags.
        let mut pieces = Vec::with_capacity(grads.len() + 1);
        let mut flags = Vec::with_capacity(grads.len());
        for (m, g) in self.layout.members.iter().zip(grads) {
            let Some(g) = g else {
                pieces.push(Tensor::zeros(m.len, dtype, &device)?);
                flags.push(0f64);
                continue;
            };
            if g.dims() != m.shape.as_slice() {
                return Err(Error::invalid(
                    "gradient",
                    format!(
                        "rank {}: the gradient of `{}` has shape {:?}, the parameter {:?}",
                        c.rank(),
                        m.name,
                        g.dims(),
                        m.shape
                    ),
                ));
            }
            let g = g.to_dtype(dtype)?;
            let g = if divide != 1.0 {
                g.affine(1.0 / divide, 0.0)?
            } else {
                g
            };
            pieces.push(g.flatten_all()?.to_device(&device)?);
            flags.push(1f64);
        }
        let (chunk, flags) = if device.is_cpu() {
            self.reduce_cpu(c, pieces, flags)?
        } else {
            self.reduce_device(c, pieces, flags)?
        };
        // Offload: the shard's gradient goes to host memory, where the optimizer steps.
        let chunk = chunk.to_device(self.shard.device())?;
        let mut present = self.present.lock().unwrap_or_else(|p| p.into_inner());
        for (p, f) in present.iter_mut().zip(flags) {
            *p |= f > 0.0;
        }
        Ok(chunk)
    }

    /// [`reduce`](Self::reduce) on the CPU: one flat buffer (the gradients, then the presence
    /// flags, concatenated: written once, never zero-filled first), reduce-scattered and
    /// flag-reduced in place; this rank's chunk copied out.
    fn reduce_cpu(
        &self,
        c: &dyn Collective,
        mut pieces: Vec<Tensor>,
        flags: Vec<f64>,
    ) -> Result<(Tensor, Vec<f64>)> {
        let len = self.layout.len;
        let n = flags.len();
        pieces.push(Tensor::from_vec(flags, n, &Device::Cpu)?.to_dtype(self.shard.dtype())?);
        let flat = Tensor::cat(&pieces, 0)?;
        drop(pieces);
        let mut flags = Vec::new();
        with_cpu_mut(&flat, "ZeRO-3 gradients", |dst, range| {
            let fl = range.start + len..range.end;
            c.reduce_scatter(
                BufferMut::of_cpu(dst, range.start..range.start + len)?,
                ReduceOp::Mean,
            )?;
            c.all_reduce(BufferMut::of_cpu(dst, fl.clone())?, ReduceOp::Mean)?;
            flags = read_f64(dst, fl)?;
            Ok(())
        })?;
        // A compact copy: `Tensor::copy` of a view would clone the whole flat buffer.
        let chunk = flat
            .narrow(0, self.own.start, self.own.len())?
            .force_contiguous()?;
        Ok((chunk, flags))
    }

    /// [`reduce`](Self::reduce) elsewhere: the gradients end to end in one flat tensor on the
    /// device, reduce-scattered there; the flags through the host.
    fn reduce_device(
        &self,
        c: &dyn Collective,
        pieces: Vec<Tensor>,
        mut flags: Vec<f64>,
    ) -> Result<(Tensor, Vec<f64>)> {
        let flat = Tensor::cat(&pieces, 0)?;
        drop(pieces);
        // Compact: a backend may hand back a view of the whole reduced buffer.
        let chunk = c
            .reduce_scatter_tensor(&flat, ReduceOp::Mean)?
            .force_contiguous()?;
        c.all_reduce((&mut flags[..]).into(), ReduceOp::Mean)?;
        Ok((chunk, flags))
    }

    /// Per member, whether some rank gave it a gradient since the last call (then cleared).
    pub(crate) fn take_present(&self) -> Vec<bool> {
        let mut p = self.present.lock().unwrap_or_else(|p| p.into_inner());
        let out = p.clone();
        p.iter_mut().for_each(|x| *x = false);
        out
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use candle_core::{DType, Device, Storage, Tensor, Var};

    use super::Unit;
    use crate::collective::{Collective, ThreadGroup};
    use crate::train::weights::ParamSpec;
    use crate::train::zero3::layout::{ShardLayout, WrapPolicy};

    /// Elements in the storage behind `t` (not just its view).
    fn storage_len(t: &Tensor) -> usize {
        let (s, _) = t.storage_and_layout();
        match &*s {
            Storage::Cpu(c) => c.as_slice::<f32>().map_or(0, |v| v.len()),
            _ => 0,
        }
    }

    /// A reduced gradient keeps only this rank's chunk in memory (a view of the whole flat
    /// buffer would keep every unit's whole gradient alive on every rank), and every rank's
    /// chunk is the mean over the ranks.
    #[test]
    fn reduced_chunks_are_compact_means() {
        let spec = |n: &str, s: &[usize]| ParamSpec {
            name: n.into(),
            shape: s.to_vec(),
            dtype: DType::F32,
        };
        let layout = ShardLayout::new(
            &[spec("a", &[5, 3]), spec("b", &[4])],
            &WrapPolicy::one_unit(),
        )
        .unwrap()
        .units
        .remove(0);
        let handles: Vec<_> = ThreadGroup::new(3, Duration::from_secs(20))
            .unwrap()
            .into_iter()
            .map(|c| {
                let layout = layout.clone();
                std::thread::spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let own = layout.own(3, c.rank());
                    let shard = Var::zeros(own.len(), DType::F32, &Device::Cpu).unwrap();
                    let unit = Unit::new(layout, shard, own.clone(), true, None);
                    let r = c.rank() as f64;
                    let g = |s: &[usize]| {
                        (Tensor::ones(s, DType::F32, &Device::Cpu).unwrap() * r).unwrap()
                    };
                    let chunk = unit
                        .reduce(c.as_ref(), vec![Some(g(&[5, 3])), None], 1.0)
                        .unwrap();
                    assert_eq!(storage_len(&chunk), own.len());
                    // Mean of 0, 1, 2 for `a`'s 15 elements; `b` had no gradient: zeros.
                    let want: Vec<f32> = own.map(|i| if i < 15 { 1.0 } else { 0.0 }).collect();
                    assert_eq!(chunk.to_vec1::<f32>().unwrap(), want);
                    unit.take_present()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![true, false]);
        }
    }
}
