//! A model's parameters, ordered by name and grouped into buckets, and the three things done with
//! them across ranks: verify they agree, broadcast rank 0's values, average gradients.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Mutex;

use candle_core::backprop::GradStore;
use candle_core::{DType, Storage, Tensor, Var};
use candle_nn::VarMap;

use crate::collective::{chunk_range, Buffer, Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::inplace::{buffer_mut, copy_cpu, fill_cpu, read_f64, storage_addr, with_cpu_mut};

/// Float dtypes whose CPU gradients take the flat, in-place bucket path.
fn fusable_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// Anything that can list a model's trainable parameters by name.
///
/// Parameters are always processed in name order: a `VarMap`'s iteration order differs between
/// processes, so it can never be used to pair up tensors across ranks.
pub trait Parameters {
    /// `(name, variable)` pairs; names must be unique. The maps' implementations return them
    /// sorted by name, so the order is the same in every process.
    fn named_parameters(&self) -> Vec<(String, Var)>;
}

fn sorted(mut named: Vec<(String, Var)>) -> Vec<(String, Var)> {
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

impl Parameters for VarMap {
    fn named_parameters(&self) -> Vec<(String, Var)> {
        let data = self.data().lock().unwrap_or_else(|p| p.into_inner());
        sorted(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

impl Parameters for [(String, Var)] {
    fn named_parameters(&self) -> Vec<(String, Var)> {
        self.to_vec()
    }
}

impl Parameters for Vec<(String, Var)> {
    fn named_parameters(&self) -> Vec<(String, Var)> {
        self.clone()
    }
}

impl Parameters for HashMap<String, Var> {
    fn named_parameters(&self) -> Vec<(String, Var)> {
        sorted(self.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

impl Parameters for BTreeMap<String, Var> {
    fn named_parameters(&self) -> Vec<(String, Var)> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// A rank's slice of one parameter under ZeRO sharding: elements `range` of the flattened
/// parameter. In each bucket, rank `r` owns [`chunk_range`](crate::collective::chunk_range) of
/// the bucket's elements (its parameters end to end, in name order).
#[derive(Clone, Debug)]
pub(crate) struct Shard {
    /// The parameter.
    pub(crate) var: Var,
    /// The elements of the flattened parameter this rank owns.
    pub(crate) range: Range<usize>,
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

/// A run of consecutive parameters (in name order) of one dtype, moved by one collective.
#[derive(Clone, Debug)]
struct Bucket {
    members: Range<usize>,
}

/// The registered parameters of a prepared model.
#[derive(Debug)]
pub(crate) struct ParamSet {
    names: Vec<String>,
    vars: Vec<Var>,
    buckets: Vec<Bucket>,
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

impl Clone for ParamSet {
    fn clone(&self) -> Self {
        ParamSet {
            names: self.names.clone(),
            vars: self.vars.clone(),
            buckets: self.buckets.clone(),
            flat: Mutex::new(vec![None; self.buckets.len()]),
            param_flat: Mutex::new(vec![None; self.buckets.len()]),
            grad_shard: Mutex::new(vec![None; self.buckets.len()]),
            overlap: self.overlap,
        }
    }
}

fn describe(v: &Var) -> String {
    format!("{:?}{:?}", v.dtype(), v.dims())
}

impl ParamSet {
    /// Sorts by name and groups into buckets of at most `cap_bytes` (a parameter larger than the
    /// cap gets a bucket of its own); `overlap`: see [`ParamSet::average_gradients`].
    pub(crate) fn new(
        mut named: Vec<(String, Var)>,
        cap_bytes: usize,
        overlap: bool,
    ) -> Result<Self> {
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::invalid(
                "model parameters",
                format!("the name `{}` is used twice", w[0].0),
            ));
        }
        let mut buckets = Vec::new();
        let (mut start, mut bytes, mut dtype) = (0usize, 0usize, None::<DType>);
        for (i, (_, v)) in named.iter().enumerate() {
            let size = v.elem_count() * v.dtype().size_in_bytes();
            let same_dtype = dtype.is_none_or(|d| d == v.dtype());
            if i > start && (!same_dtype || bytes + size > cap_bytes) {
                buckets.push(Bucket { members: start..i });
                start = i;
                bytes = 0;
            }
            bytes += size;
            dtype = Some(v.dtype());
        }
        if start < named.len() {
            buckets.push(Bucket {
                members: start..named.len(),
            });
        }
        let (names, vars) = named.into_iter().unzip();
        Ok(ParamSet {
            names,
            vars,
            flat: Mutex::new(vec![None; buckets.len()]),
            param_flat: Mutex::new(vec![None; buckets.len()]),
            grad_shard: Mutex::new(vec![None; buckets.len()]),
            buckets,
            overlap,
        })
    }

    /// The registered `(name, variable)` pairs, in name order.
    pub(crate) fn named(&self) -> Vec<(String, Var)> {
        self.names
            .iter()
            .cloned()
            .zip(self.vars.iter().cloned())
            .collect()
    }

    /// The registered names, in name order.
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    pub(crate) fn len(&self) -> usize {
        self.vars.len()
    }

    /// The names of the parameters that have no gradient in `grads`, in name order.
    pub(crate) fn without_grad(&self, grads: &GradStore) -> Vec<String> {
        self.names
            .iter()
            .zip(&self.vars)
            .filter(|(_, v)| grads.get(v.as_tensor()).is_none())
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub(crate) fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Checks that every rank registered the same names, shapes and dtypes; the error names the
    /// first differing parameter (in name order) and the two ranks.
    pub(crate) fn verify(&self, c: &dyn Collective) -> Result<()> {
        let mine: String = self
            .names
            .iter()
            .zip(&self.vars)
            .map(|(n, v)| format!("{n}\t{}\n", describe(v)))
            .collect();
        let all = c.all_gather(Buffer::from(mine.as_bytes()))?;
        let lists: Vec<Vec<(String, String)>> = all
            .iter()
            .map(|b| {
                String::from_utf8_lossy(b.bytes())
                    .lines()
                    .map(|l| {
                        let (n, d) = l.split_once('\t').unwrap_or((l, "?"));
                        (n.to_string(), d.to_string())
                    })
                    .collect()
            })
            .collect();
        let reference = &lists[0];
        for (r, list) in lists.iter().enumerate().skip(1) {
            if list == reference {
                continue;
            }
            let at = |l: &Vec<(String, String)>, i: usize| l.get(i).cloned();
            let i = (0..reference.len().max(list.len()))
                .find(|&i| at(reference, i) != at(list, i))
                .unwrap_or(0);
            let (param, a, b) = match (at(reference, i), at(list, i)) {
                (Some((na, da)), Some((nb, db))) if na == nb => (na, da, db),
                (Some((na, da)), Some((nb, _))) if na < nb => {
                    (na, da, "no such parameter".to_string())
                }
                (Some((_, _)), Some((nb, db))) => (nb, "no such parameter".to_string(), db),
                (Some((na, da)), None) => (na, da, "no such parameter".to_string()),
                (None, Some((nb, db))) => (nb, "no such parameter".to_string(), db),
                (None, None) => ("?".into(), "?".into(), "?".into()),
            };
            return Err(Error::ParamMismatch {
                rank: c.rank(),
                param,
                rank_a: 0,
                a,
                rank_b: r,
                b,
            });
        }
        Ok(())
    }

    /// Overwrites every rank's parameters with rank 0's, one collective per bucket.
    pub(crate) fn broadcast_from_main(&self, c: &dyn Collective) -> Result<()> {
        for b in &self.buckets {
            let vars = &self.vars[b.members.clone()];
            let flat: Vec<Tensor> = vars
                .iter()
                .map(|v| v.as_tensor().flatten_all())
                .collect::<candle_core::Result<_>>()?;
            let flat = Tensor::cat(&flat, 0)?;
            let got = c.broadcast_tensor(&flat, 0)?;
            let mut off = 0;
            for v in vars {
                let n = v.elem_count();
                v.set(&got.narrow(0, off, n)?.reshape(v.shape())?)?;
                off += n;
            }
        }
        Ok(())
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
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<()> {
        let mut slots = self.flat.lock().unwrap_or_else(|p| p.into_inner());
        let all_cpu = self.buckets.iter().all(|b| {
            let v = &self.vars[b.members.start];
            v.device().is_cpu() && fusable_dtype(v.dtype())
        });
        if all_cpu {
            return self.average_cpu(c, grads, &mut slots, self.overlap);
        }
        drop(slots);
        self.average_device(c, grads)
    }

    /// The device path of [`average_gradients`](Self::average_gradients) (GPU gradients, or
    /// dtypes the CPU buckets do not take): plain tensor ops and the tensor collective.
    fn average_device(&self, c: &dyn Collective, grads: &mut GradStore) -> Result<()> {
        // Every bucket flattened (its presence flags at its end), then all reduced as one batch:
        // NCCL queues them back to back and the host waits once per step, not once per bucket.
        let mut flats = Vec::with_capacity(self.buckets.len());
        for b in &self.buckets {
            let vars = &self.vars[b.members.clone()];
            let (dtype, device) = (vars[0].dtype(), vars[0].device().clone());
            let (mut parts, present) = self.bucket_grads_device(c, vars, grads)?;
            parts.push(Tensor::new(present.as_slice(), &device)?.to_dtype(dtype)?);
            flats.push(Tensor::cat(&parts, 0)?);
        }
        let means = c.all_reduce_tensors(&flats, ReduceOp::Mean)?;
        // All the buckets' presence flags, read back together (one read per device).
        let mut flag_parts = Vec::with_capacity(means.len());
        for (b, mean) in self.buckets.iter().zip(&means) {
            let total = self.bucket_elems(b);
            flag_parts.push(
                mean.narrow(0, total, b.members.len())?
                    .to_dtype(DType::F32)?,
            );
        }
        let one_device = flag_parts
            .iter()
            .all(|f| f.device().same_device(flag_parts[0].device()));
        let flags: Vec<f32> = if one_device && !flag_parts.is_empty() {
            Tensor::cat(&flag_parts, 0)?.to_vec1::<f32>()?
        } else {
            let mut all = Vec::new();
            for f in &flag_parts {
                all.extend(f.to_vec1::<f32>()?);
            }
            all
        };
        let mut next_flag = flags.into_iter();
        for (b, mean) in self.buckets.iter().zip(&means) {
            let vars = &self.vars[b.members.clone()];
            let mut off = 0;
            for v in vars {
                let n = v.elem_count();
                if next_flag.next().is_some_and(|f| f > 0.0) {
                    grads.insert(v.as_tensor(), mean.narrow(0, off, n)?.reshape(v.shape())?);
                } else {
                    grads.remove(v.as_tensor());
                }
                off += n;
            }
        }
        Ok(())
    }

    /// One bucket's gradients as flat tensors on the bucket's device, in the parameters' dtype
    /// (zeros for a parameter without one), and one presence flag per parameter (1 or 0).
    fn bucket_grads_device(
        &self,
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
                    self.check_grad_shape(c, v, g)?;
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
            self.check_grad_shape(c, v, g)?;
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
            c.all_reduce(buffer_mut(dst, range.clone())?, ReduceOp::Mean)?;
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
        c: &dyn Collective,
        grads: &mut GradStore,
        slots: &mut [Option<Tensor>],
        overlap: bool,
    ) -> Result<()> {
        let members = |b: &Bucket| &self.vars[b.members.clone()];
        if !overlap || self.buckets.len() < 2 {
            for (b, slot) in self.buckets.iter().zip(slots.iter_mut()) {
                let flat = self.flatten_bucket_cpu(c, members(b), grads, slot)?;
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
            let mut flats = Vec::with_capacity(self.buckets.len());
            let mut failed = None;
            for (b, slot) in self.buckets.iter().zip(slots.iter_mut()) {
                match self.flatten_bucket_cpu(c, members(b), grads, slot) {
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
        for ((b, flat), flags) in self.buckets.iter().zip(&flats).zip(&flags) {
            Self::install_bucket(members(b), flat, flags, grads)?;
        }
        Ok(())
    }

    fn check_grad_shape(&self, c: &dyn Collective, v: &Var, g: &Tensor) -> Result<()> {
        if g.dims() != v.dims() {
            return Err(Error::invalid(
                "gradient",
                format!(
                    "rank {}: gradient of `{}` has shape {:?}, the parameter {:?}",
                    c.rank(),
                    self.name_of(v),
                    g.dims(),
                    v.dims()
                ),
            ));
        }
        Ok(())
    }

    /// The bytes one averaging of the gradients hands to the collective: each bucket's
    /// gradient elements and one presence flag per parameter, in the bucket's dtype.
    pub(crate) fn reduced_bytes_per_sync(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| {
                let size = self.vars[b.members.start].dtype().size_in_bytes();
                ((self.bucket_elems(b) + b.members.len()) * size) as u64
            })
            .sum()
    }

    /// Elements of each bucket's parameters, without the presence flags.
    fn bucket_elems(&self, b: &Bucket) -> usize {
        self.vars[b.members.clone()]
            .iter()
            .map(|v| v.elem_count())
            .sum()
    }

    /// Checks that ZeRO sharding applies: parameters of a float dtype, all on one device.
    pub(crate) fn check_shardable(&self) -> Result<()> {
        if let Some(i) = self.vars.iter().position(|v| !fusable_dtype(v.dtype())) {
            return Err(Error::invalid(
                "zero_stage",
                format!(
                    "sharding needs parameters of a float dtype (f32, f64, bf16, f16); `{}` is {:?}",
                    self.names[i],
                    self.vars[i].dtype()
                ),
            ));
        }
        if let Some(first) = self.vars.first() {
            if let Some(i) = self
                .vars
                .iter()
                .position(|v| !v.device().same_device(first.device()))
            {
                return Err(Error::invalid(
                    "zero_stage",
                    format!(
                        "sharding needs every parameter on one device; `{}` is on {:?}, `{}` on {:?}",
                        self.names[0],
                        first.device(),
                        self.names[i],
                        self.vars[i].device()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether every registered parameter lives in CPU memory (the in-place flat-buffer paths).
    fn all_on_cpu(&self) -> bool {
        self.vars.iter().all(|v| v.device().is_cpu())
    }

    /// ZeRO on a GPU (or any non-CPU device): each bucket's parameters end to end in one flat
    /// tensor on the device, all-gathered (each rank's chunk from its owner) and set back.
    fn gather_params_device(&self, c: &dyn Collective) -> Result<()> {
        for b in &self.buckets {
            let vars = &self.vars[b.members.clone()];
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

    /// Rank `rank` of `world`'s [`Shard`]s, in name order.
    pub(crate) fn shards(&self, world: usize, rank: usize) -> Vec<Shard> {
        let mut out = Vec::new();
        for b in &self.buckets {
            let own = chunk_range(self.bucket_elems(b), world, rank);
            let mut off = 0;
            for v in &self.vars[b.members.clone()] {
                let n = v.elem_count();
                let (lo, hi) = (own.start.max(off), own.end.min(off + n));
                if lo < hi {
                    out.push(Shard {
                        var: v.clone(),
                        range: lo - off..hi - off,
                    });
                }
                off += n;
            }
        }
        out
    }

    /// ZeRO, after each rank updated its slice of the parameters: every bucket's parameters
    /// are copied into a flat tensor, all-gathered (each rank's chunk from its owner) and copied
    /// back, so that every rank holds the whole updated model.
    pub(crate) fn gather_params(&self, c: &dyn Collective) -> Result<()> {
        if !self.all_on_cpu() {
            return self.gather_params_device(c);
        }
        let mut slots = self.param_flat.lock().unwrap_or_else(|p| p.into_inner());
        for (b, slot) in self.buckets.iter().zip(slots.iter_mut()) {
            let vars = &self.vars[b.members.clone()];
            let dtype = vars[0].dtype();
            let total = self.bucket_elems(b);
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
                c.all_gather_into(buffer_mut(dst, range)?)
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
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<Vec<bool>> {
        let (n, me) = (c.world_size(), c.rank());
        if !self.all_on_cpu() {
            return self.reduce_scatter_gradients_device(c, grads);
        }
        let mut shards = self.grad_shard.lock().unwrap_or_else(|p| p.into_inner());
        let mut present = Vec::with_capacity(self.vars.len());
        for (b, shard_slot) in self.buckets.iter().zip(shards.iter_mut()) {
            let vars = &self.vars[b.members.clone()];
            let dtype = vars[0].dtype();
            let total = self.bucket_elems(b);
            let own = chunk_range(total, n, me);
            // The whole bucket lives only for this call: only the slice is kept.
            let mut transient = None;
            let flat = self.flatten_bucket_cpu(c, vars, grads, &mut transient)?;
            let mut flags = Vec::new();
            with_cpu_mut(&flat, "gradient bucket", |dst, range| {
                let params = range.start..range.start + total;
                c.reduce_scatter(buffer_mut(dst, params)?, ReduceOp::Mean)?;
                let fl = range.start + total..range.end;
                c.all_reduce(buffer_mut(dst, fl.clone())?, ReduceOp::Mean)?;
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
    fn reduce_scatter_gradients_device(
        &self,
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<Vec<bool>> {
        let (n, me) = (c.world_size(), c.rank());
        let mut present = Vec::with_capacity(self.vars.len());
        for b in &self.buckets {
            let vars = &self.vars[b.members.clone()];
            let (parts, mut flags) = self.bucket_grads_device(c, vars, grads)?;
            let flat = Tensor::cat(&parts, 0)?;
            let shard = c.reduce_scatter_tensor(&flat, ReduceOp::Mean)?;
            c.all_reduce((&mut flags[..]).into(), ReduceOp::Mean)?;
            let own = chunk_range(flat.elem_count(), n, me);
            keep_shard(vars, &own, &shard, &flags, grads, &mut present)?;
        }
        Ok(present)
    }

    /// The sum of squares of the registered parameters' gradients in `grads` (f64; read in
    /// place for contiguous CPU gradients). Gradients on a GPU are summed there, per parameter
    /// in f32 and over the parameters in f64, and read back once: one host synchronization per
    /// call, not one per parameter.
    pub(crate) fn grad_sq_sum(&self, grads: &GradStore) -> Result<f64> {
        let mut sum = 0f64;
        // Per-parameter sums still on their device, grouped by device.
        let mut on_device: Vec<Vec<Tensor>> = Vec::new();
        for v in &self.vars {
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            if let Some(s) = crate::optim::sq_sum(g) {
                sum += s;
                continue;
            }
            if g.device().is_cpu() {
                sum += g
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?;
                continue;
            }
            let part = g.to_dtype(DType::F32)?.sqr()?.sum_all()?;
            match on_device
                .iter_mut()
                .find(|parts| parts[0].device().same_device(g.device()))
            {
                Some(parts) => parts.push(part),
                None => on_device.push(vec![part]),
            }
        }
        for parts in on_device {
            sum += Tensor::stack(&parts, 0)?
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        Ok(sum)
    }

    /// The names of registered parameters whose `present` flag is false.
    pub(crate) fn names_where_absent(&self, present: &[bool]) -> Vec<String> {
        self.names
            .iter()
            .zip(present)
            .filter(|(_, p)| !**p)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The registered variables, in name order.
    pub(crate) fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// A new store holding the registered parameters' gradients of `grads` (shared tensors).
    pub(crate) fn copy_grads(&self, grads: &GradStore) -> GradStore {
        let mut out = GradStore::default();
        for v in &self.vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                out.insert(v.as_tensor(), g.clone());
            }
        }
        out
    }

    /// Multiplies every registered parameter's gradient by `factor` (keeping its dtype).
    pub(crate) fn scale_grads(&self, grads: &mut GradStore, factor: f64) -> Result<()> {
        for v in &self.vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                let scaled = g.affine(factor, 0.0)?;
                grads.insert(v.as_tensor(), scaled);
            }
        }
        Ok(())
    }

    /// Clamps every registered parameter's gradient to `[-clip, clip]`.
    pub(crate) fn clamp_grads(&self, grads: &mut GradStore, clip: f64) -> Result<()> {
        for v in &self.vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                let clamped = g.clamp(-clip, clip)?;
                grads.insert(v.as_tensor(), clamped);
            }
        }
        Ok(())
    }

    /// The L2 norm of all registered parameters' gradients together (computed in f64).
    pub(crate) fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        Ok(self.grad_sq_sum(grads)?.sqrt())
    }

    fn name_of(&self, v: &Var) -> &str {
        self.vars
            .iter()
            .position(|x| x.id() == v.id())
            .map(|i| self.names[i].as_str())
            .unwrap_or("?")
    }
}

#[cfg(test)]
#[path = "params_tests.rs"]
mod tests;
