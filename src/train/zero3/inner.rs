//! The state of a ZeRO-3 model ([`Inner`]), shared by the [`ShardedModel`](super::ShardedModel)
//! a script holds and the gradient engine: the units and their shards, the gradients collected
//! in the backward pass, the loss scale; and the backend a gathered unit's parameters are read
//! through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::collective::Collective;
use crate::error::Result;
use crate::optim::ParamPieces;
use crate::train::loss_scaler::LossScaler;

use super::layout::ShardLayout;
use super::unit::Unit;

/// The state of a [`ShardedModel`], shared with the gradient engine.
pub(crate) struct Inner {
    pub(super) collective: Arc<dyn Collective>,
    pub(super) layout: ShardLayout,
    /// Stage 3: one per unit of the layout. Empty below stage 3.
    pub(super) units: Vec<Unit>,
    /// Below stage 3: the model's variables, by name.
    pub(super) whole: HashMap<String, Var>,
    /// The dtype units are gathered in (bf16 under mixed precision; the shards stay f32).
    pub(super) compute: DType,
    pub(super) device: Device,
    /// The whole parameters' ids, when the model was made from variables (`rebase` pairs an
    /// optimizer built over them with the shards).
    pub(super) ids: HashMap<String, candle_core::TensorId>,
    /// This micro-step's shard gradients, averaged over the ranks (keyed by the shards).
    pub(super) collected: Mutex<GradStore>,
    /// What the gradients are divided by before they are reduced (an f16 loss scale).
    pub(super) divide: Mutex<f64>,
    /// fp16 (units gathered in f16): the dynamic loss scale, and the steps it skipped.
    pub(super) scaler: Option<Mutex<(LossScaler, u64)>>,
    /// Parameters (by name) the optimizer does not decay, for an optimizer built over none.
    pub(super) no_decay: Mutex<Vec<String>>,
    /// Bytes handed to the units' reduce-scatters so far (gradients and presence flags).
    reduced: AtomicU64,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel")
            .field("units", &self.layout.units.len())
            .field("sharded", &!self.units.is_empty())
            .finish()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The parameters of one gathered unit, as a [`VarBuilder`]'s backend: a name outside the unit,
/// or a shape other than the parameter's, is an error naming both.
pub(super) struct Gathered {
    pub(super) unit: String,
    pub(super) tensors: HashMap<String, Tensor>,
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

impl Inner {
    /// `(world size, rank)`.
    pub(super) fn place(&self) -> (usize, usize) {
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
            reduced: AtomicU64::new(0),
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

    pub(super) fn builder(
        &self,
        idx: usize,
        tensors: Vec<(String, Tensor)>,
    ) -> VarBuilder<'static> {
        let backend = Gathered {
            unit: self.layout.units[idx].name.clone(),
            tensors: tensors.into_iter().collect(),
        };
        VarBuilder::from_backend(Box::new(backend), self.compute, self.device.clone())
    }

    /// Below stage 3: a builder over the unit's own variables.
    pub(super) fn whole_builder(&self, idx: usize) -> VarBuilder<'static> {
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
    pub(super) fn reduce_unit(&self, idx: usize, grads: Vec<Option<Tensor>>) -> Result<()> {
        let unit = &self.units[idx];
        let divide = *lock(&self.divide);
        let chunk = unit.reduce(self.collective.as_ref(), grads, divide)?;
        if self.collective.world_size() > 1 {
            let elements = unit.layout.len + unit.layout.members.len();
            let bytes = elements * unit.shard.dtype().size_in_bytes();
            self.reduced.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        let mut collected = lock(&self.collected);
        let sum = match collected.get(unit.shard.as_tensor()) {
            Some(g) => (g + &chunk)?,
            None => chunk,
        };
        collected.insert(unit.shard.as_tensor(), sum);
        Ok(())
    }

    /// Bytes of gradients (and presence flags) this rank has handed to the units'
    /// reduce-scatters since the model was sharded: nothing when alone.
    pub(crate) fn reduced_bytes(&self) -> u64 {
        self.reduced.load(Ordering::Relaxed)
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
