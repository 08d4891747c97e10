//! A model's parameters ([`Parameters`]), and the registry of a prepared model ([`ParamSet`]):
//! ordered by name, grouped into buckets, verified across ranks, broadcast from rank 0, and cut
//! into ZeRO shards. Moving gradients is the [`Reducer`]'s job (`reducer.rs`); gradient
//! arithmetic (norms, clipping) is `clip.rs`'s.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use crate::collective::{chunk_range, Buffer, Collective};
use crate::error::{Error, Result};
use crate::optim::Shard;
use crate::train::pieces::ShardedParameters;

/// Float dtypes whose CPU gradients take the flat, in-place bucket path.
pub(super) fn fusable_dtype(dtype: DType) -> bool {
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

    /// ZeRO-3: the parameters sharded over the ranks, when they are
    /// ([`ShardedModel`](crate::ShardedModel) at stage 3): checkpoints then write and read
    /// each rank's pieces and model folders are streamed one unit at a time. `None` for every
    /// other model (the default).
    fn sharded_parameters(&self) -> Option<&dyn ShardedParameters> {
        None
    }
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

/// A run of consecutive parameters (in name order) of one dtype, moved by one collective.
#[derive(Clone, Debug)]
pub(crate) struct Bucket {
    /// The bucket's parameters: indices into the name-ordered list.
    pub(super) members: Range<usize>,
}

/// The registered parameters of a prepared model: names and variables in name order, grouped into
/// buckets (what the engine's [`Reducer`](crate::train::reducer::Reducer) moves, one collective
/// per bucket).
#[derive(Clone, Debug)]
pub(crate) struct ParamSet {
    names: Vec<String>,
    vars: Vec<Var>,
    buckets: Vec<Bucket>,
}

fn describe(v: &Var) -> String {
    format!("{:?}{:?}", v.dtype(), v.dims())
}

impl ParamSet {
    /// Sorts by name and groups into buckets of at most `cap_bytes` (a parameter larger than the
    /// cap gets a bucket of its own).
    pub(crate) fn new(mut named: Vec<(String, Var)>, cap_bytes: usize) -> Result<Self> {
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
            buckets,
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
    pub(super) fn bucket_elems(&self, b: &Bucket) -> usize {
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
    pub(super) fn all_on_cpu(&self) -> bool {
        self.vars.iter().all(|v| v.device().is_cpu())
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

    pub(super) fn name_of(&self, v: &Var) -> &str {
        self.vars
            .iter()
            .position(|x| x.id() == v.id())
            .map(|i| self.names[i].as_str())
            .unwrap_or("?")
    }

    /// The buckets: runs of consecutive parameters of one dtype, moved by one collective each.
    pub(crate) fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }
}

/// Parameters as a name → tensor map, checking that names are unique.
pub(crate) fn named_tensors(model: &dyn Parameters) -> Result<Vec<(String, Tensor)>> {
    let mut named: Vec<(String, Tensor)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::invalid(
            "model parameters",
            format!("the name `{}` is used twice", w[0].0),
        ));
    }
    Ok(named)
}

#[cfg(test)]
#[path = "params_tests.rs"]
mod tests;
