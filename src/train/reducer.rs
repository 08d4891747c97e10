//! The bucketed reducer (PyTorch's `Reducer`): moves a [`ParamSet`]'s gradients and parameters
//! across ranks, one collective per bucket. CPU gradients are flattened into reusable buffers
//! and reduced in place (on a communication thread while the next bucket is flattened); GPU
//! gradients go to the collective back to back with one wait. Under ZeRO it reduce-scatters
//! gradients (stage 2) and all-gathers the updated parameters.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{DType, Storage, Tensor, Var};

use crate::collective::{chunk_range, BufferMut, Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::inplace::{copy_cpu, fill_cpu, read_f64, storage_addr, with_cpu_mut};

use super::params::{fusable_dtype, Bucket, ParamSet};

/// The reusable buffers of a [`ParamSet`]'s collectives, one slot per bucket.
#[derive(Debug)]
pub(crate) struct Reducer {
    /// One flat host tensor per bucket, allocated on first use and reused by every
    /// [`average_gradients`](Self::average_gradients) (CPU gradients only).
    flat: Mutex<Vec<Option<Tensor>>>,
    /// ZeRO: one flat tensor of parameters per bucket, reused by every
    /// [`gather_params`](Self::gather_params).
    param_flat: Mutex<Vec<Option<Tensor>>>,
    /// ZeRO stage 2: this rank's slice of each bucket's averaged gradients, reused by every
    /// [`reduce_scatter_gradients`](Self::reduce_scatter_gradients).
    grad_shard: Mutex<Vec<Option<Tensor>>>,
    /// Whether CPU buckets are reduced on a communication thread while the next ones are
    /// flattened (`ACCELERATE_RS_OVERLAP`).
    overlap: bool,
}

/// A copy starts with empty buffers (DP replicas clone the registered set).
impl Clone for Reducer {
    fn clone(&self) -> Self {
        let n = self
            .flat
            .lock()
            .map(|v| v.len())
            .unwrap_or_else(|p| p.into_inner().len());
        Reducer::new(n, self.overlap)
    }
}

/// ZeRO stage 2, one bucket: puts into `grads`, for each of `vars` overlapping this rank's
/// chunk `own` of the bucket, its averaged elements (a view of `shard`, the chunk), and removes
/// the others; pushes each parameter's presence (some rank had a gradient) onto `present`.
fn keep_shard(
    vars: &[Var],
    own: &Range<usize>,
    shard: &Tensor,
    flags: &[f64],
    grads: &mut GradStore,
    present: &mut Vec<bool>,
) -> Result<()> {
    let mut off = 0;
    for (v, flag) in vars.iter().zip(flags) {
        let n_el = v.elem_count();
        let (lo, hi) = (own.start.max(off), own.end.min(off + n_el));
        if *flag > 0.0 && lo < hi {
            grads.insert(v.as_tensor(), shard.narrow(0, lo - own.start, hi - lo)?);
        } else {
            grads.remove(v.as_tensor());
        }
        present.push(*flag > 0.0);
        off += n_el;
    }
    Ok(())
}

impl Reducer {
    /// Empty buffers for `buckets` buckets.
    pub(crate) fn new(buckets: usize, overlap: bool) -> Self {
        Reducer {
            flat: Mutex::new(vec![None; buckets]),
            param_flat: Mutex::new(vec![None; buckets]),
            grad_shard: Mutex::new(vec![None; buckets]),
            overlap,
        }
    }

    /// Replaces every gradient in `grads` by its mean over the ranks, one collective per bucket.
    ///
    /// A parameter without a gradient on this rank contributes zeros; it gets the averaged
    /// gradient if any rank had one, and stays without one only if no rank had one (so that
    /// optimizers skip it everywhere alike).
    ///
    /// CPU gradients are copied once into the bucket's reusable flat tensor and reduced there in
    /// place; the averaged gradients are views into it, valid until the next call.
    pub(crate) fn average_gradients(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<()> {
        let mut slots = self.flat.lock().unwrap_or_else(|p| p.into_inner());
        let all_cpu = p.buckets().iter().all(|b| {
            let v = &p.vars()[b.members.start];
            v.device().is_cpu() && fusable_dtype(v.dtype())
        });
        if all_cpu {
            return self.average_cpu(p, c, grads, &mut slots, self.overlap);
        }
        drop(slots);
        self.average_device(p, c, grads)
    }

    /// The device path of [`average_gradients`](Self::average_gradients) (GPU gradients, or
    /// dtypes the CPU buckets do not take): plain tensor ops and the tensor collective.
    pub(crate) fn average_device(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<()> {
        // Every bucket flattened (its presence flags at its end), then all reduced as one batch:
        // NCCL queues them back to back and the host waits once per step, not once per bucket.
        let mut flats = Vec::with_capacity(p.buckets().len());
        for b in p.buckets() {
            let vars = &p.vars()[b.members.clone()];
            let (dtype, device) = (vars[0].dtype(), vars[0].device().clone());
            let (mut parts, present) = self.bucket_grads_device(p, c, vars, grads)?;
            parts.push(Tensor::new(present.as_slice(), &device)?.to_dtype(dtype)?);
            flats.push(Tensor::cat(&parts, 0)?);
        }
        let means = c.all_reduce_tensors(&flats, ReduceOp::Mean)?;
        // All the buckets' presence flags, read back together (one read per device).
        let mut flag_parts = Vec::with_capacity(means.len());
        for (b, mean) in p.buckets().iter().zip(&means) {
            let total = p.bucket_elems(b);
            flag_parts.push(
                mean.narrow(0, total, b.members.len())?
                    .to_dtype(DType::F32)?,
            );
        }
        let one_device = flag_parts
            .iter()
            .all(|f| f.device().same_device(flag_parts[0].device()));
        let flags: Vec<f32> = if one_device && !flag_parts.is_empty() {
            crate::readback::counted(|| Tensor::cat(&flag_parts, 0)?.to_vec1::<f32>())?
        } else {
            let mut all = Vec::new();
            for f in &flag_parts {
                all.extend(f.to_vec1::<f32>()?);
            }
            all
        };
        // The buckets' flags are back to back, one per member.
        let flags: Vec<f64> = flags.into_iter().map(f64::from).collect();
        let mut rest = flags.as_slice();
        for (b, mean) in p.buckets().iter().zip(&means) {
            let vars = &p.vars()[b.members.clone()];
            let (mine, tail) = rest.split_at(vars.len().min(rest.len()));
            Self::install_bucket(vars, mean, mine, grads)?;
            rest = tail;
        }
        Ok(())
    }

    /// One bucket's gradients as flat tensors on the bucket's device, in the parameters' dtype
    /// (zeros for a parameter without one), and one presence flag per parameter (1 or 0).
    fn bucket_grads_device(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        vars: &[Var],
        grads: &GradStore,
    ) -> Result<(Vec<Tensor>, Vec<f64>)> {
        let (dtype, device) = (vars[0].dtype(), vars[0].device().clone());
        let mut parts = Vec::with_capacity(vars.len() + 1);
        let mut present = Vec::with_capacity(vars.len());
        for v in vars {
            match grads.get(v.as_tensor()) {
                Some(g) => {
                    self.check_grad_shape(p, c, v, g)?;
                    parts.push(g.to_dtype(dtype)?.flatten_all()?);
                    present.push(1f64);
                }
                None => {
                    parts.push(Tensor::zeros(v.elem_count(), dtype, &device)?);
                    present.push(0f64);
                }
            }
        }
        Ok((parts, present))
    }

    /// One bucket of CPU gradients copied into its reusable flat tensor `slot` (followed by one
    /// presence flag per parameter, 1 or 0); returns the flat tensor, ready to be reduced.
    fn flatten_bucket_cpu(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        vars: &[Var],
        grads: &GradStore,
        slot: &mut Option<Tensor>,
    ) -> Result<Tensor> {
        let dtype = vars[0].dtype();
        let total: usize = vars.iter().map(|v| v.elem_count()).sum();
        let len = total + vars.len();
        let flat = match slot {
            Some(t) if t.dtype() == dtype && t.elem_count() == len => t.clone(),
            _ => {
                let t = Tensor::zeros(len, dtype, &candle_core::Device::Cpu)?;
                *slot = Some(t.clone());
                t
            }
        };
        let flat_addr = storage_addr(&flat);
        let mut sources = Vec::with_capacity(vars.len());
        for v in vars {
            let Some(g) = grads.get(v.as_tensor()) else {
                sources.push(None);
                continue;
            };
            self.check_grad_shape(p, c, v, g)?;
            let mut g = g.to_dtype(dtype)?;
            // A contiguous CPU tensor not sharing the bucket's storage (a gradient handed back
            // from an earlier call would otherwise be read while being overwritten).
            if !g.is_contiguous() || !g.device().is_cpu() || storage_addr(&g) == flat_addr {
                g = g.to_device(&candle_core::Device::Cpu)?.copy()?;
            }
            sources.push(Some(g));
        }
        with_cpu_mut(&flat, "gradient bucket", |dst, range| {
            let mut off = range.start;
            for (v, g) in vars.iter().zip(&sources) {
                let n = v.elem_count();
                match g {
                    Some(g) => {
                        let (src, layout) = g.storage_and_layout();
                        let Storage::Cpu(src) = &*src else {
                            return Err(Error::invalid("gradient", "is not on the CPU"));
                        };
                        let start = layout.start_offset();
                        copy_cpu(dst, off..off + n, src, start..start + n)?;
                    }
                    None => fill_cpu(dst, off..off + n, 0.0)?,
                }
                off += n;
            }
            for (i, g) in sources.iter().enumerate() {
                let flag = if g.is_some() { 1.0 } else { 0.0 };
                fill_cpu(dst, off + i..off + i + 1, flag)?;
            }
            Ok(())
        })?;
        Ok(flat)
    }

    /// Averages a flat bucket across ranks in place; returns its `members` presence flags
    /// (averaged: > 0 when some rank had the gradient).
    fn reduce_bucket_cpu(c: &dyn Collective, flat: &Tensor, members: usize) -> Result<Vec<f64>> {
        let mut flags = Vec::new();
        with_cpu_mut(flat, "gradient bucket", |dst, range| {
            c.all_reduce(BufferMut::of_cpu(dst, range.clone())?, ReduceOp::Mean)?;
            flags = read_f64(dst, range.end - members..range.end)?;
            Ok(())
        })?;
        Ok(flags)
    }

    /// Puts the averaged gradients of one bucket (views into `flat`) into `grads`, or removes
    /// those no rank had.
    fn install_bucket(
        vars: &[Var],
        flat: &Tensor,
        flags: &[f64],
        grads: &mut GradStore,
    ) -> Result<()> {
        let mut off = 0;
        for (v, flag) in vars.iter().zip(flags) {
            let n = v.elem_count();
            if *flag > 0.0 {
                grads.insert(v.as_tensor(), flat.narrow(0, off, n)?.reshape(v.shape())?);
            } else {
                grads.remove(v.as_tensor());
            }
            off += n;
        }
        Ok(())
    }

    /// The CPU path of [`average_gradients`](Self::average_gradients) when every bucket is on the
    /// CPU. With several buckets and `overlap`, a communication thread reduces bucket `k` while
    /// this thread flattens bucket `k + 1`.
    fn average_cpu(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        grads: &mut GradStore,
        slots: &mut [Option<Tensor>],
        overlap: bool,
    ) -> Result<()> {
        let members = |b: &Bucket| &p.vars()[b.members.clone()];
        if !overlap || p.buckets().len() < 2 {
            for (b, slot) in p.buckets().iter().zip(slots.iter_mut()) {
                let flat = self.flatten_bucket_cpu(p, c, members(b), grads, slot)?;
                let flags = Self::reduce_bucket_cpu(c, &flat, b.members.len())?;
                Self::install_bucket(members(b), &flat, &flags, grads)?;
            }
            return Ok(());
        }
        let (flats, flags) = std::thread::scope(|s| -> Result<_> {
            let (tx, rx) = std::sync::mpsc::channel::<(Tensor, usize)>();
            let comm = s.spawn(move || -> Result<Vec<Vec<f64>>> {
                rx.into_iter()
                    .map(|(flat, n)| Self::reduce_bucket_cpu(c, &flat, n))
                    .collect()
            });
            let mut flats = Vec::with_capacity(p.buckets().len());
            let mut failed = None;
            for (b, slot) in p.buckets().iter().zip(slots.iter_mut()) {
                match self.flatten_bucket_cpu(p, c, members(b), grads, slot) {
                    Ok(flat) => {
                        // A send fails only when the thread has stopped on an error: joined below.
                        let _ = tx.send((flat.clone(), b.members.len()));
                        flats.push(flat);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            drop(tx);
            let reduced = comm.join().map_err(|p| Error::ThreadPanicked {
                rank: c.rank(),
                thread: "the gradient communication thread".into(),
                message: crate::error::panic_message(p.as_ref()),
            })?;
            match failed {
                Some(e) => Err(e),
                None => Ok((flats, reduced?)),
            }
        })?;
        for ((b, flat), flags) in p.buckets().iter().zip(&flats).zip(&flags) {
            Self::install_bucket(members(b), flat, flags, grads)?;
        }
        Ok(())
    }

    fn check_grad_shape(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        v: &Var,
        g: &Tensor,
    ) -> Result<()> {
        if g.dims() != v.dims() {
            return Err(Error::invalid(
                "gradient",
                format!(
                    "rank {}: gradient of `{}` has shape {:?}, the parameter {:?}",
                    c.rank(),
                    p.name_of(v),
                    g.dims(),
                    v.dims()
                ),
            ));
        }
        Ok(())
    }

    /// ZeRO on a GPU (or any non-CPU device): each bucket's parameters end to end in one flat
    /// tensor on the device, all-gathered (each rank's chunk from its owner) and set back.
    pub(crate) fn gather_params_device(&self, p: &ParamSet, c: &dyn Collective) -> Result<()> {
        for b in p.buckets() {
            let vars = &p.vars()[b.members.clone()];
            let parts = vars
                .iter()
                .map(|v| v.as_tensor().flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            let got = c.all_gather_into_tensor(&Tensor::cat(&parts, 0)?)?;
            let mut off = 0;
            for v in vars {
                let n = v.elem_count();
                v.set(&got.narrow(0, off, n)?.reshape(v.shape())?)?;
                off += n;
            }
        }
        Ok(())
    }

    /// ZeRO, after each rank updated its slice of the parameters: every bucket's parameters
    /// are copied into a flat tensor, all-gathered (each rank's chunk from its owner) and copied
    /// back, so that every rank holds the whole updated model.
    pub(crate) fn gather_params(&self, p: &ParamSet, c: &dyn Collective) -> Result<()> {
        if !p.all_on_cpu() {
            return self.gather_params_device(p, c);
        }
        let mut slots = self.param_flat.lock().unwrap_or_else(|p| p.into_inner());
        for (b, slot) in p.buckets().iter().zip(slots.iter_mut()) {
            let vars = &p.vars()[b.members.clone()];
            let dtype = vars[0].dtype();
            let total = p.bucket_elems(b);
            let flat = match slot {
                Some(t) if t.dtype() == dtype && t.elem_count() == total => t.clone(),
                _ => {
                    let t = Tensor::zeros(total, dtype, &candle_core::Device::Cpu)?;
                    *slot = Some(t.clone());
                    t
                }
            };
            // Parameters into the flat tensor.
            with_cpu_mut(&flat, "ZeRO parameter gather", |dst, range| {
                let mut off = range.start;
                for v in vars {
                    let n = v.elem_count();
                    let (src, layout) = v.storage_and_layout();
                    let Storage::Cpu(src) = &*src else {
                        return Err(Error::invalid(
                            "zero_stage",
                            "a parameter is not on the CPU",
                        ));
                    };
                    let start = layout.start_offset();
                    copy_cpu(dst, off..off + n, src, start..start + n)?;
                    off += n;
                }
                c.all_gather_into(BufferMut::of_cpu(dst, range)?)
            })?;
            // And back.
            let (src, layout) = flat.storage_and_layout();
            let Storage::Cpu(src) = &*src else {
                return Err(Error::invalid(
                    "zero_stage",
                    "the parameter buffer is not on the CPU",
                ));
            };
            let mut off = layout.start_offset();
            for v in vars {
                let n = v.elem_count();
                with_cpu_mut(v.as_tensor(), "ZeRO parameter gather", |dst, range| {
                    copy_cpu(dst, range, src, off..off + n)
                })?;
                off += n;
            }
        }
        Ok(())
    }

    /// ZeRO stage 2: averages the gradients with one reduce-scatter per bucket and keeps only
    /// this rank's slice. `grads` then holds, for each parameter overlapping this rank's chunks,
    /// a 1-D tensor of the averaged elements in its [`Shard::range`], and nothing for the
    /// others. Returns, per registered parameter, whether some rank had a gradient for it.
    pub(crate) fn reduce_scatter_gradients(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<Vec<bool>> {
        let (n, me) = (c.world_size(), c.rank());
        if !p.all_on_cpu() {
            return self.reduce_scatter_gradients_device(p, c, grads);
        }
        let mut shards = self.grad_shard.lock().unwrap_or_else(|p| p.into_inner());
        let mut present = Vec::with_capacity(p.vars().len());
        for (b, shard_slot) in p.buckets().iter().zip(shards.iter_mut()) {
            let vars = &p.vars()[b.members.clone()];
            let dtype = vars[0].dtype();
            let total = p.bucket_elems(b);
            let own = chunk_range(total, n, me);
            // The whole bucket lives only for this call: only the slice is kept.
            let mut transient = None;
            let flat = self.flatten_bucket_cpu(p, c, vars, grads, &mut transient)?;
            let mut flags = Vec::new();
            with_cpu_mut(&flat, "gradient bucket", |dst, range| {
                let params = range.start..range.start + total;
                c.reduce_scatter(BufferMut::of_cpu(dst, params)?, ReduceOp::Mean)?;
                let fl = range.start + total..range.end;
                c.all_reduce(BufferMut::of_cpu(dst, fl.clone())?, ReduceOp::Mean)?;
                flags = read_f64(dst, fl)?;
                Ok(())
            })?;
            let shard = match shard_slot {
                Some(t) if t.dtype() == dtype && t.elem_count() == own.len() => t.clone(),
                _ => {
                    let t = Tensor::zeros(own.len(), dtype, &candle_core::Device::Cpu)?;
                    *shard_slot = Some(t.clone());
                    t
                }
            };
            {
                let (src, layout) = flat.storage_and_layout();
                let Storage::Cpu(src) = &*src else {
                    return Err(Error::invalid("gradient", "the bucket is not on the CPU"));
                };
                let base = layout.start_offset();
                with_cpu_mut(&shard, "gradient shard", |dst, range| {
                    copy_cpu(dst, range, src, base + own.start..base + own.end)
                })?;
            }
            keep_shard(vars, &own, &shard, &flags, grads, &mut present)?;
        }
        Ok(present)
    }

    /// [`reduce_scatter_gradients`](Self::reduce_scatter_gradients) for parameters on a GPU
    /// (or any non-CPU device): each bucket's gradients end to end in one flat tensor on the
    /// device, reduce-scattered there; the presence flags go through the host.
    pub(crate) fn reduce_scatter_gradients_device(
        &self,
        p: &ParamSet,
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<Vec<bool>> {
        let (n, me) = (c.world_size(), c.rank());
        let mut present = Vec::with_capacity(p.vars().len());
        for b in p.buckets() {
            let vars = &p.vars()[b.members.clone()];
            let (parts, mut flags) = self.bucket_grads_device(p, c, vars, grads)?;
            let flat = Tensor::cat(&parts, 0)?;
            let shard = c.reduce_scatter_tensor(&flat, ReduceOp::Mean)?;
            c.all_reduce((&mut flags[..]).into(), ReduceOp::Mean)?;
            let own = chunk_range(flat.elem_count(), n, me);
            keep_shard(vars, &own, &shard, &flags, grads, &mut present)?;
        }
        Ok(present)
    }
}
