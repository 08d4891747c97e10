//! [`ShardedModel`], the handle a script holds on a ZeRO-3 model: running and gathering units,
//! the parameters as the checkpoint and the optimizer see them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarBuilder;

use crate::error::{Error, Result};
use crate::train::weights::ParamSpec;

use super::fill;
use super::fill::Build;
use super::fill::Parts;
use super::fill::ShardSource;
use super::inner::{lock, Inner};
use crate::train::params::Parameters;
use crate::train::pieces::{ShardedParameters, UnitSpec};

/// A model cut into ZeRO-3 units, made by
/// [`Accelerator::prepare_sharded`](crate::Accelerator::prepare_sharded) (from a model's
/// variables) or [`Accelerator::shard_model`](crate::Accelerator::shard_model) (from its
/// parameter list and a [`ShardSource`], without ever holding the whole model). Cheap to clone
/// (shared).
///
/// At `zero_stage = 3` each rank keeps its 1/N of every unit, and the model's blocks are built,
/// at every forward, from the parameters the unit's gather gives them:
///
/// ```no_run
/// # use accelerate_rs::{Accelerator, ShardedModel};
/// # use candle_core::{Module, Tensor};
/// # fn f(acc: &Accelerator, model: &ShardedModel, x: &Tensor) -> accelerate_rs::Result<()> {
/// let h = model.run("layers.0", x, |vb, x| {
///     candle_nn::linear(64, 64, vb.pp("layers.0"))?.forward(x)?.relu()
/// })?;
/// # Ok(()) }
/// ```
///
/// [`run`](Self::run) gathers the unit, runs the closure, drops the gathered parameters and
/// keeps only `x`; the backward pass gathers the unit again, runs the closure again, and
/// reduce-scatters the unit's gradients right after its backward pass (Candle's backward is
/// one synchronous call: the collective of a unit runs between the backward of that unit and
/// the next). [`gather`](Self::gather) keeps a unit for parts of a model used outside one block
/// (embeddings tied to an output layer); its gradients are reduce-scattered when the backward
/// pass ends.
///
/// Below stage 3 the same code runs on the model's own variables: nothing is gathered and the
/// gradients go through the stages' usual averaging, so a script written this way runs at
/// every stage.
#[derive(Clone)]
pub struct ShardedModel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel")
            .field("units", &self.units())
            .field("sharded", &self.is_sharded())
            .field("compute_dtype", &self.inner.compute)
            .finish()
    }
}

impl ShardedModel {
    pub(crate) fn from_inner(inner: Inner) -> Self {
        ShardedModel {
            inner: Arc::new(inner),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// Whether the parameters are sharded (stage 3 with several ranks or one): false below
    /// stage 3, where the model's own variables are used.
    pub fn is_sharded(&self) -> bool {
        !self.inner.units.is_empty()
    }

    /// The units' names, in order (the root unit is `""`).
    pub fn units(&self) -> Vec<String> {
        self.inner
            .layout
            .units
            .iter()
            .map(|u| u.name.clone())
            .collect()
    }

    /// The unit holding parameter `name`, if the model has it.
    pub fn unit_of(&self, name: &str) -> Option<String> {
        let (u, _) = self.inner.layout.find(name)?;
        Some(self.inner.layout.units[u].name.clone())
    }

    /// Every parameter, in name order (whole shapes).
    pub fn parameter_specs(&self) -> Vec<ParamSpec> {
        self.inner.layout.specs()
    }

    /// The dtype the units are gathered in and the blocks compute in.
    pub fn compute_dtype(&self) -> DType {
        self.inner.compute
    }

    /// Bytes of parameters this rank keeps: its shards (stage 3) or the whole model.
    pub fn resident_bytes(&self) -> usize {
        if self.is_sharded() {
            self.inner
                .units
                .iter()
                .map(|u| u.shard.elem_count() * u.shard.dtype().size_in_bytes())
                .sum()
        } else {
            self.inner
                .whole
                .values()
                .map(|v| v.elem_count() * v.dtype().size_in_bytes())
                .sum()
        }
    }

    /// Every parameter, whole, in name order, on every rank: the model as it is at stage 0.
    /// A collective at stage 3 (every rank must call it; the units are all-gathered one at a
    /// time) that holds the whole model: for evaluation, tests and small models (to save a
    /// model use [`Accelerator::save_model_sharded`](crate::Accelerator::save_model_sharded),
    /// which streams one unit at a time through rank 0).
    pub fn full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        if !self.is_sharded() {
            for (n, v) in self.inner.whole_named() {
                out.push((n, v.as_tensor().copy()?));
            }
            return Ok(out);
        }
        for u in &self.inner.units {
            out.extend(self.inner.gather_unit_whole(u)?);
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// fp16 mixed precision (units gathered in f16): the dynamic loss scale the next backward
    /// pass multiplies the loss by; `None` in f32 and bf16.
    pub fn loss_scale(&self) -> Option<f64> {
        self.inner.loss_scale()
    }

    /// fp16: the optimizer steps skipped so far because some rank's gradients overflowed (every
    /// rank skips together, and the loss scale is halved).
    pub fn skipped_steps(&self) -> u64 {
        self.inner.skipped_steps()
    }

    /// Freezes every unit: no gradient is computed or reduced for the model from now on (the
    /// base under LoRA adapters, which are trained replicated beside it). Call it before the
    /// optimizer is prepared.
    pub fn freeze(&self) {
        for u in &self.inner.units {
            u.freeze();
        }
    }

    /// Parameters (by name) an optimizer built over no parameters does not decay (see
    /// [`Accelerator::prepare_sharded_optimizer`](crate::Accelerator::prepare_sharded_optimizer));
    /// an optimizer built over the model's variables keeps its own flags.
    pub fn no_weight_decay_on(&self, names: impl IntoIterator<Item = impl Into<String>>) {
        lock(&self.inner.no_decay).extend(names.into_iter().map(Into::into));
    }

    /// Runs `block` on `x` with the parameters of `unit`: `block` gets a [`VarBuilder`] over
    /// them (by their full names: `vb.pp(unit)` reaches the unit's own) and builds and runs the
    /// unit's layers. At stage 3 the unit is all-gathered for the call and dropped after it;
    /// the backward pass gathers it again and recomputes `block` (activation checkpointing,
    /// as [`nn::recompute_fn`](crate::nn::recompute_fn): `block` must be deterministic, and
    /// gradients must be computed through the accelerator, not `loss.backward()`), then
    /// reduce-scatters the unit's gradients. Every rank must run the same units in the same
    /// order. Below stage 3 `block` runs once on the model's variables.
    pub fn run<F>(&self, unit: &str, x: &Tensor, block: F) -> Result<Tensor>
    where
        F: Fn(VarBuilder<'static>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let idx = self.inner.layout.unit_index(unit)?;
        if !self.is_sharded() {
            return Ok(block(self.inner.whole_builder(idx), x)?);
        }
        let inner = Arc::clone(&self.inner);
        let replaying = Arc::new(AtomicBool::new(false));
        let slot: Arc<Mutex<Option<Vec<Tensor>>>> = Arc::default();
        let f = {
            let (inner, replaying, slot) = (inner.clone(), replaying.clone(), slot.clone());
            move |x: &Tensor| -> candle_core::Result<Tensor> {
                // The first pass keeps nothing of the block: views of the gathered buffer do;
                // the recomputation gathers variables, whose gradients are the unit's.
                let replay = replaying.load(Ordering::Relaxed);
                let u = &inner.units[idx];
                let tensors = u.gather(inner.collective.as_ref(), inner.compute, replay)?;
                if replay && u.trainable() {
                    *lock(&slot) = Some(tensors.iter().map(|(_, t)| t.clone()).collect());
                }
                block(inner.builder(idx, tensors), x)
            }
        };
        let after = move |grads: &mut GradStore| -> candle_core::Result<()> {
            let Some(vars) = lock(&slot).take() else {
                return Ok(());
            };
            let gs: Vec<Option<Tensor>> = vars.iter().map(|v| grads.remove(v)).collect();
            drop(vars);
            Ok(inner.reduce_unit(idx, gs)?)
        };
        // Recorded even when the first pass tracked nothing (its parameters were plain views):
        // the recomputation gives a trainable unit its gradients.
        let record = self.inner.units[idx].trainable();
        let y = crate::nn::recompute_then(Arc::new(f), Arc::new(after), x, record)?;
        replaying.store(true, Ordering::Relaxed);
        Ok(y)
    }

    /// The parameters of `unit`, held until the backward pass ends (the embeddings and head of
    /// a language model, used outside any one block): at stage 3 all-gathered now, kept by the
    /// graph that uses them, and their gradients reduce-scattered when the backward pass ends.
    /// Every rank must gather the same units in the same order. Below stage 3 the model's own
    /// variables.
    pub fn gather(&self, unit: &str) -> Result<VarBuilder<'static>> {
        let idx = self.inner.layout.unit_index(unit)?;
        if !self.is_sharded() {
            return Ok(self.inner.whole_builder(idx));
        }
        let u = &self.inner.units[idx];
        let tensors = u.gather(self.inner.collective.as_ref(), self.inner.compute, true)?;
        if u.trainable() {
            lock(&u.held).push(tensors.iter().map(|(_, t)| t.id()).collect());
        }
        Ok(self.inner.builder(idx, tensors))
    }
}

/// Below stage 3 the model's variables; at stage 3 none (no whole variable exists), and
/// checkpoints and model folders go through
/// [`sharded_parameters`](Parameters::sharded_parameters): each rank's pieces are saved and
/// loaded, folders are streamed one unit at a time.
impl Parameters for ShardedModel {
    fn named_parameters(&self) -> Vec<(String, Var)> {
        self.inner.whole_named()
    }

    fn sharded_parameters(&self) -> Option<&dyn ShardedParameters> {
        if self.is_sharded() {
            Some(self)
        } else {
            None
        }
    }
}

impl ShardedParameters for ShardedModel {
    fn unit_specs(&self) -> Vec<UnitSpec> {
        self.inner
            .layout
            .units
            .iter()
            .map(|u| {
                let members = u.members.iter().map(|m| (m.name.clone(), m.shape.clone()));
                (u.name.clone(), u.dtype, members.collect())
            })
            .collect()
    }

    fn local_pieces(&self) -> Result<Vec<(String, usize, Tensor)>> {
        let (n, me) = self.inner.place();
        let mut out = Vec::new();
        for u in &self.inner.units {
            for p in u.layout.pieces(n, me) {
                let t = u
                    .shard
                    .as_tensor()
                    .narrow(0, p.in_shard.start, p.in_shard.len())?;
                out.push((
                    u.layout.members[p.member].name.clone(),
                    p.in_param.start,
                    t.force_contiguous()?,
                ));
            }
        }
        Ok(out)
    }

    fn local_ranges(&self) -> Vec<(String, std::ops::Range<usize>)> {
        let (n, me) = self.inner.place();
        let mut out = Vec::new();
        for u in &self.inner.units {
            for p in u.layout.pieces(n, me) {
                out.push((u.layout.members[p.member].name.clone(), p.in_param));
            }
        }
        out
    }

    fn write_local(&self, values: &[(String, usize, Tensor)]) -> Result<()> {
        let (n, me) = self.inner.place();
        for (name, start, t) in values {
            fill::write_pieces(
                &self.inner.layout,
                &self.inner.units,
                name,
                t,
                *start,
                n,
                me,
            )?;
        }
        self.inner.after_step()
    }

    fn gather_unit(&self, unit: usize) -> Result<Vec<(String, Tensor)>> {
        let u = self.inner.units.get(unit).ok_or_else(|| {
            Error::invalid("ZeRO-3 unit", format!("index {unit} is out of range"))
        })?;
        self.inner.gather_unit_whole(u)
    }

    fn agree(&self, what: &str, result: Result<()>) -> Result<()> {
        fill::agree(self.inner.collective.as_ref(), what, result)
    }
}

/// See `fill::from_vars`: the sharded model of a model's variables.
pub(crate) fn from_vars(b: Build<'_>, named: Vec<(String, Var)>) -> Result<ShardedModel> {
    fill::from_vars(b, named).map(ShardedModel::from_parts)
}

/// See `fill::from_source`: the sharded model of a parameter list, filled from `source`.
pub(crate) fn from_source(
    b: Build<'_>,
    dtype: DType,
    build: &dyn Fn(VarBuilder<'_>) -> candle_core::Result<()>,
    source: ShardSource<'_>,
) -> Result<ShardedModel> {
    fill::from_source(b, dtype, build, source).map(ShardedModel::from_parts)
}

impl ShardedModel {
    /// The model made of `p`.
    fn from_parts(p: Parts) -> Self {
        ShardedModel::from_inner(Inner::new(
            p.collective,
            p.layout,
            p.units,
            p.whole,
            p.compute,
            p.device,
            p.ids,
        ))
    }
}

/// An error for a feature ZeRO-3 does not support yet, naming it.
pub(crate) fn unsupported(what: &str, how: &str) -> Error {
    Error::invalid(
        "zero_stage",
        format!("stage 3 does not support {what} yet; {how}"),
    )
}
