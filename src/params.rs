//! A model's parameters, ordered by name and grouped into buckets, and the three things done with
//! them across ranks: verify they agree, broadcast rank 0's values, average gradients.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use crate::collective::{Buffer, Collective, ReduceOp};
use crate::error::{Error, Result};

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

/// A run of consecutive parameters (in name order) of one dtype, moved by one collective.
#[derive(Clone, Debug)]
struct Bucket {
    members: Range<usize>,
}

/// The registered parameters of a prepared model.
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

    pub(crate) fn len(&self) -> usize {
        self.vars.len()
    }

    pub(crate) fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Checks that every rank registered the same names, shapes and dtypes; the error names the
    /// first differing parameter (in name order) and the two ranks.
    pub(crate) fn verify(&self, c: &dyn Collective) -> Result<()> {
        if c.world_size() == 1 {
            return Ok(());
        }
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
        if c.world_size() == 1 {
            return Ok(());
        }
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
    pub(crate) fn average_gradients(
        &self,
        c: &dyn Collective,
        grads: &mut GradStore,
    ) -> Result<()> {
        if c.world_size() == 1 {
            return Ok(());
        }
        for b in &self.buckets {
            let vars = &self.vars[b.members.clone()];
            let (dtype, device) = (vars[0].dtype(), vars[0].device().clone());
            let mut parts = Vec::with_capacity(vars.len() + 1);
            let mut present = Vec::with_capacity(vars.len());
            for v in vars {
                match grads.get(v.as_tensor()) {
                    Some(g) => {
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
                        parts.push(g.to_dtype(dtype)?.flatten_all()?);
                        present.push(1f64);
                    }
                    None => {
                        parts.push(Tensor::zeros(v.elem_count(), dtype, &device)?);
                        present.push(0f64);
                    }
                }
            }
            parts.push(Tensor::new(present.as_slice(), &device)?.to_dtype(dtype)?);
            let flat = Tensor::cat(&parts, 0)?;
            let mean = c.all_reduce_tensor(&flat, ReduceOp::Mean)?;
            let total: usize = vars.iter().map(|v| v.elem_count()).sum();
            let flags = mean
                .narrow(0, total, vars.len())?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?;
            let mut off = 0;
            for (v, flag) in vars.iter().zip(flags) {
                let n = v.elem_count();
                if flag > 0.0 {
                    grads.insert(v.as_tensor(), mean.narrow(0, off, n)?.reshape(v.shape())?);
                } else {
                    grads.remove(v.as_tensor());
                }
                off += n;
            }
        }
        Ok(())
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
        let mut sum = 0f64;
        for v in &self.vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                sum += g
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?;
            }
        }
        Ok(sum.sqrt())
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
mod tests {
    use super::*;
    use candle_core::Device;

    fn var(n: usize, dtype: DType) -> Var {
        Var::zeros(n, dtype, &Device::Cpu).unwrap()
    }

    #[test]
    fn buckets_follow_name_order_cap_and_dtype() {
        let named = vec![
            ("c".to_string(), var(10, DType::F32)),
            ("a".to_string(), var(10, DType::F32)),
            ("b".to_string(), var(10, DType::F32)),
            ("d".to_string(), var(100, DType::F32)),
            ("e".to_string(), var(4, DType::F64)),
        ];
        let p = ParamSet::new(named, 80).unwrap();
        assert_eq!(p.names, vec!["a", "b", "c", "d", "e"]);
        let b: Vec<_> = p.buckets.iter().map(|b| b.members.clone()).collect();
        // a+b = 80 bytes fit; c starts a new bucket; d is over the cap alone; e has another dtype.
        assert_eq!(b, vec![0..2, 2..3, 3..4, 4..5]);
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let named = vec![
            ("w".to_string(), var(1, DType::F32)),
            ("w".to_string(), var(1, DType::F32)),
        ];
        let err = ParamSet::new(named, 10).unwrap_err().to_string();
        assert!(err.contains("`w`"), "{err}");
    }
}
