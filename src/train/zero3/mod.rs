//! ZeRO stage 3 (PyTorch's FSDP, DeepSpeed's stage 3): the parameters are sharded too. See
//! [`ShardedModel`] and the section "ZeRO-3 / FSDP" of ARCHITECTURE.md: the model is cut into
//! units ([`WrapPolicy`]); each rank keeps 1/N of every unit's flat vector; a unit's parameters
//! exist only while it runs ([`ShardedModel::run`], recomputed in the backward pass) or, for a
//! held unit ([`ShardedModel::gather`]), until the backward pass ends; its gradients are
//! reduce-scattered as soon as they are known.

mod fill;
mod layout;
mod unit;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::optim::ParamPieces;
use crate::train::loss_scaler::LossScaler;
use crate::train::weights::ParamSpec;

use crate::train::params::Parameters;
use crate::train::pieces::{ShardedParameters, UnitSpec};
pub(crate) use fill::Build;
use fill::Parts;
pub use fill::ShardSource;
use layout::ShardLayout;
pub use layout::WrapPolicy;
use unit::Unit;

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

/// The state of a [`ShardedModel`], shared with the gradient engine.
pub(crate) struct Inner {
    collective: Arc<dyn Collective>,
    layout: ShardLayout,
    /// Stage 3: one per unit of the layout. Empty below stage 3.
    units: Vec<Unit>,
    /// Below stage 3: the model's variables, by name.
    whole: HashMap<String, Var>,
    /// The dtype units are gathered in (bf16 under mixed precision; the shards stay f32).
    compute: DType,
    device: Device,
    /// The whole parameters' ids, when the model was made from variables (`rebase` pairs an
    /// optimizer built over them with the shards).
    ids: HashMap<String, candle_core::TensorId>,
    /// This micro-step's shard gradients, averaged over the ranks (keyed by the shards).
    collected: Mutex<GradStore>,
    /// What the gradients are divided by before they are reduced (an f16 loss scale).
    divide: Mutex<f64>,
    /// fp16 (units gathered in f16): the dynamic loss scale, and the steps it skipped.
    scaler: Option<Mutex<(LossScaler, u64)>>,
    /// Parameters (by name) the optimizer does not decay, for an optimizer built over none.
    no_decay: Mutex<Vec<String>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel")
            .field("units", &self.layout.units.len())
            .field("sharded", &!self.units.is_empty())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The parameters of one gathered unit, as a [`VarBuilder`]'s backend: a name outside the unit,
/// or a shape other than the parameter's, is an error naming both.
struct Gathered {
    unit: String,
    tensors: HashMap<String, Tensor>,
}

impl SimpleBackend for Gathered {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, device)?;
        if t.shape() != &shape {
            candle_core::bail!(
                "ZeRO-3 unit `{}`: parameter `{name}` is {:?}, asked for {shape:?}",
                self.unit,
                t.dims()
            );
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.tensors.get(name) {
            Some(t) => t.to_dtype(dtype),
            None => {
                let mut names: Vec<&String> = self.tensors.keys().collect();
                names.sort();
                let shown: Vec<&str> = names.iter().take(4).map(|s| s.as_str()).collect();
                candle_core::bail!(
                    "ZeRO-3 unit `{}` has no parameter `{name}` (it holds {} parameter(s): {}{}): \
                     build each block from its own unit, or change the wrap policy",
                    self.unit,
                    names.len(),
                    shown.join(", "),
                    if names.len() > 4 { ", ..." } else { "" }
                )
            }
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
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
                let tensors = inner.units[idx].gather(inner.collective.as_ref(), inner.compute)?;
                if replaying.load(Ordering::Relaxed) && inner.units[idx].trainable() {
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
        let y = crate::nn::recompute_then(Arc::new(f), Arc::new(after), x)?;
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
        let tensors = u.gather(self.inner.collective.as_ref(), self.inner.compute)?;
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

impl Inner {
    /// `(world size, rank)`.
    fn place(&self) -> (usize, usize) {
        (self.collective.world_size(), self.collective.rank())
    }

    /// Builds the inner state from its parts (see `fill.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        collective: Arc<dyn Collective>,
        layout: ShardLayout,
        units: Vec<Unit>,
        whole: HashMap<String, Var>,
        compute: DType,
        device: Device,
        ids: HashMap<String, candle_core::TensorId>,
    ) -> Self {
        Inner {
            collective,
            layout,
            units,
            whole,
            compute,
            device,
            ids,
            collected: Mutex::new(GradStore::default()),
            divide: Mutex::new(1.0),
            scaler: (compute == DType::F16).then(|| Mutex::new((LossScaler::default(), 0))),
            no_decay: Mutex::new(Vec::new()),
        }
    }

    /// fp16: the loss scale of the coming backward pass (`None` in f32 and bf16).
    pub(crate) fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| lock(s).0.scale())
    }

    /// fp16: the agreed verdict of a step's gradients moves the loss scale (halved after an
    /// overflow, which skips the step; doubled after the growth interval of clean steps).
    pub(crate) fn update_scale(&self, finite: bool) {
        if let Some(s) = &self.scaler {
            let mut s = lock(s);
            s.0.update(finite);
            if !finite {
                s.1 += 1;
            }
        }
    }

    /// fp16: the steps skipped for overflowing gradients so far.
    pub(crate) fn skipped_steps(&self) -> u64 {
        self.scaler.as_ref().map_or(0, |s| lock(s).1)
    }

    /// fp16: puts a checkpoint's loss scale back (scale, clean steps in a row).
    pub(crate) fn restore_scale(&self, scale: f64, clean_steps: u64) {
        if let Some(s) = &self.scaler {
            lock(s).0.restore(scale, clean_steps);
        }
    }

    /// fp16: the loss scale's state to checkpoint (scale, clean steps in a row).
    pub(crate) fn scale_state(&self) -> Option<(f64, u64)> {
        self.scaler.as_ref().map(|s| {
            let s = lock(s);
            (s.0.scale(), s.0.clean_steps())
        })
    }

    fn builder(&self, idx: usize, tensors: Vec<(String, Tensor)>) -> VarBuilder<'static> {
        let backend = Gathered {
            unit: self.layout.units[idx].name.clone(),
            tensors: tensors.into_iter().collect(),
        };
        VarBuilder::from_backend(Box::new(backend), self.compute, self.device.clone())
    }

    /// Below stage 3: a builder over the unit's own variables.
    fn whole_builder(&self, idx: usize) -> VarBuilder<'static> {
        let tensors = self.layout.units[idx]
            .members
            .iter()
            .filter_map(|m| {
                let v = self.whole.get(&m.name)?;
                Some((m.name.clone(), v.as_tensor().clone()))
            })
            .collect();
        self.builder(idx, tensors)
    }

    /// Reduce-scatters one unit's gradients and adds this rank's chunk to the micro-step's.
    fn reduce_unit(&self, idx: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        let unit = &self.units[idx];
        let divide = *lock(&self.divide);
        let chunk = unit.reduce(self.collective.as_ref(), grads, divide)?;
        let mut collected = lock(&self.collected);
        let sum = match collected.get(unit.shard.as_tensor()) {
            Some(g) => (g + &chunk)?,
            None => chunk,
        };
        collected.insert(unit.shard.as_tensor(), sum);
        Ok(())
    }

    /// Before a backward pass: the gradients will be divided by `divide` (1, or an f16 loss
    /// scale) before they are reduced.
    pub(crate) fn begin_backward(&self, divide: f64) {
        *lock(&self.divide) = divide;
        *lock(&self.collected) = GradStore::default();
    }

    /// After a backward pass whose store is `grads`: reduce-scatters the held units'
    /// gradients, then hands out this micro-step's shard gradients (averaged over the ranks).
    pub(crate) fn finish_backward(&self, grads: &GradStore) -> Result<GradStore> {
        for (idx, unit) in self.units.iter().enumerate() {
            let gathers = std::mem::take(&mut *lock(&unit.held));
            if gathers.is_empty() {
                continue;
            }
            let mut sums: Vec<Option<Tensor>> = vec![None; unit.layout.members.len()];
            for ids in &gathers {
                for (sum, id) in sums.iter_mut().zip(ids) {
                    if let Some(g) = grads.get_id(*id) {
                        *sum = Some(match sum.take() {
                            Some(s) => (s + g)?,
                            None => g.clone(),
                        });
                    }
                }
            }
            self.reduce_unit(idx, sums)?;
        }
        Ok(std::mem::take(&mut *lock(&self.collected)))
    }

    /// The shards of the trainable units, named `<unit>#shard`: what gradient stores hold.
    pub(crate) fn shard_vars(&self) -> Vec<(String, Var)> {
        self.units
            .iter()
            .filter(|u| u.trainable())
            .map(|u| (format!("{}#shard", u.layout.name), u.shard.clone()))
            .collect()
    }

    /// After the optimizer stepped the shards (or a checkpoint was loaded into them): offload
    /// refreshes each unit's device copy.
    pub(crate) fn after_step(&self) -> Result<()> {
        self.units.iter().try_for_each(Unit::refresh)
    }

    /// The names of the trainable units' parameters, in name order.
    pub(crate) fn parameter_names(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .units
            .iter()
            .filter(|u| u.trainable())
            .flat_map(|u| u.layout.members.iter().map(|m| m.name.clone()))
            .collect();
        out.sort();
        out
    }

    /// The trainable parameters no rank gave a gradient since the last call, by name.
    pub(crate) fn take_missing(&self) -> Vec<String> {
        let mut out = Vec::new();
        for u in self.units.iter().filter(|u| u.trainable()) {
            for (m, present) in u.layout.members.iter().zip(u.take_present()) {
                if !present {
                    out.push(m.name.clone());
                }
            }
        }
        out.sort();
        out
    }

    /// The first parameter piece of this rank whose gradient in `grads` is not finite, with
    /// what it holds.
    pub(crate) fn first_non_finite(&self, grads: &GradStore) -> Result<Option<(String, String)>> {
        let (n, me) = (self.collective.world_size(), self.collective.rank());
        for u in self.units.iter().filter(|u| u.trainable()) {
            let Some(g) = grads.get(u.shard.as_tensor()) else {
                continue;
            };
            for p in u.layout.pieces(n, me) {
                let part = g.narrow(0, p.in_shard.start, p.in_shard.len())?;
                if let Some(detail) = crate::train::clip::non_finite(&part)? {
                    return Ok(Some((u.layout.members[p.member].name.clone(), detail)));
                }
            }
        }
        Ok(None)
    }

    /// Every parameter with this rank's pieces of it, for the optimizer's `rebase`.
    pub(crate) fn param_pieces(&self) -> Vec<ParamPieces> {
        let (n, me) = (self.collective.world_size(), self.collective.rank());
        let no_decay = lock(&self.no_decay).clone();
        let mut out: Vec<(String, ParamPieces)> = Vec::new();
        for u in self.units.iter().filter(|u| u.trainable()) {
            let mut by_member: Vec<Vec<(Var, std::ops::Range<usize>, usize)>> =
                vec![Vec::new(); u.layout.members.len()];
            for p in u.layout.pieces(n, me) {
                by_member[p.member].push((u.shard.clone(), p.in_shard, p.in_param.start));
            }
            for (m, pieces) in u.layout.members.iter().zip(by_member) {
                out.push((
                    m.name.clone(),
                    ParamPieces {
                        id: self.ids.get(&m.name).copied(),
                        shape: m.shape.clone(),
                        dtype: u.shard.dtype(),
                        device: u.shard.device().clone(),
                        decays: !no_decay.contains(&m.name),
                        pieces,
                    },
                ));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out.into_iter().map(|(_, p)| p).collect()
    }

    /// One unit's parameters, whole (all-gathered in the shards' dtype), by name.
    pub(crate) fn gather_unit_whole(&self, u: &Unit) -> Result<Vec<(String, Tensor)>> {
        let flat = u.gather_flat(self.collective.as_ref(), u.shard.dtype(), true)?;
        let mut out = Vec::with_capacity(u.layout.members.len());
        for m in &u.layout.members {
            let t = flat
                .narrow(0, m.offset, m.len)?
                .reshape(m.shape.as_slice())?;
            out.push((m.name.clone(), t.force_contiguous()?));
        }
        Ok(out)
    }

    /// Below stage 3: the model's variables, by name.
    pub(crate) fn whole_named(&self) -> Vec<(String, Var)> {
        let mut out: Vec<(String, Var)> = self
            .whole
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// An error for a feature ZeRO-3 does not support yet, naming it.
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

pub(crate) fn unsupported(what: &str, how: &str) -> Error {
    Error::invalid(
        "zero_stage",
        format!("stage 3 does not support {what} yet; {how}"),
    )
}
