//! The slot engine under [`AdamW`](super::AdamW) and [`Sgd`](super::Sgd): one slot per parameter
//! (the parameter, the part of it this rank updates under ZeRO, whether weight decay applies,
//! and its named state tensors), the step count and the fused switch, with everything that does
//! not depend on the update rule: parameter groups, ZeRO sharding, the checkpoint state in the
//! unsharded layout (`"{i}.{kind}"`), this rank's slices of it, and loading a state back.
//!
//! An optimizer describes its state with a [`SlotSpec`] (its name in errors, the kinds of its
//! state tensors, and whether a state lists every tensor) and keeps only its update rule and its
//! hyper-parameters.

use std::ops::Range;

use candle_core::{DType, Device, Shape, Tensor, TensorId, Var};

use super::{check_lr, fused, OptimizerState, ParamPieces, Shard, StateShard};
use crate::error::{Error, Result};

/// What an optimizer keeps per parameter.
#[derive(Debug)]
pub(crate) struct SlotSpec<const K: usize> {
    /// The optimizer's name in errors (`"AdamW"`).
    pub(crate) optimizer: &'static str,
    /// The kinds of its state tensors, in the order a state lists them (`["m", "v"]`): the
    /// tensor of kind `k` for parameter `i` is named `"{i}.{k}"`.
    pub(crate) kinds: [&'static str; K],
    /// Whether a state lists every tensor of every parameter (zeros where none was allocated
    /// yet) and loading needs them all (AdamW), or lists only the tensors that exist and loading
    /// takes any of them (Sgd, whose momentum buffer appears on a parameter's first gradient).
    pub(crate) complete: bool,
}

/// One parameter and its state.
#[derive(Debug)]
pub(crate) struct Slot<const K: usize> {
    /// The parameter.
    pub(crate) var: Var,
    /// ZeRO: the elements of the flattened `var` this rank updates (`None`: all).
    range: Option<Range<usize>>,
    /// ZeRO-3: the parameter this slot is a piece of (its index in the unsharded layout) and
    /// the piece's first element in it; `var` is then a unit's shard, not the parameter.
    /// `None`: `var` is the parameter itself.
    place: Option<(usize, usize)>,
    /// The state tensors, one per kind of the [`SlotSpec`], allocated on the parameter's first
    /// gradient (so that a sharded optimizer never holds the whole state) or by a loaded state.
    pub(crate) state: [Option<Tensor>; K],
    /// Whether weight decay applies to this parameter (`no_weight_decay_on`).
    pub(crate) decays: bool,
}

impl<const K: usize> Slot<K> {
    /// The part of the parameter this slot updates: all of it, or under ZeRO sharding elements
    /// `range` of the flattened parameter (a view sharing its storage, so in-place updates land
    /// in the parameter).
    pub(crate) fn param_view(&self) -> candle_core::Result<Tensor> {
        match &self.range {
            None => Ok(self.var.as_tensor().clone()),
            Some(r) => self
                .var
                .as_tensor()
                .flatten_all()?
                .narrow(0, r.start, r.len()),
        }
    }

    /// The gradient of this slot's part: the whole gradient, or elements `range` of it. A
    /// gradient that already has `range.len()` elements is this rank's slice (ZeRO stage 2).
    pub(crate) fn grad_view(&self, g: &Tensor) -> candle_core::Result<Tensor> {
        match &self.range {
            None => Ok(g.clone()),
            Some(r) if g.elem_count() == r.len() => g.flatten_all(),
            Some(r) => g.flatten_all()?.narrow(0, r.start, r.len()),
        }
    }

    /// Writes `next` (computed out of place) into this slot's part of the parameter.
    pub(crate) fn write_param(&self, next: &Tensor) -> candle_core::Result<()> {
        match &self.range {
            None => self.var.set(next),
            Some(r) => {
                self.var
                    .as_tensor()
                    .flatten_all()?
                    .slice_set(&next.contiguous()?, 0, r.start)
            }
        }
    }
}

/// The slots of an optimizer, with its step count and fused switch.
#[derive(Debug)]
pub(crate) struct Slots<const K: usize> {
    spec: &'static SlotSpec<K>,
    slots: Vec<Slot<K>>,
    step: u64,
    fused: bool,
    /// ZeRO: every parameter before the optimizer was cut down to this rank's slices, in index
    /// order (empty unless sharded), so that checkpoints keep the unsharded layout.
    origin: Vec<Origin>,
    /// Whether the optimizer was cut down to this rank's slices (it may own none of them).
    sharded: bool,
}

/// A parameter of the unsharded layout, kept by a sharded optimizer: what a checkpoint needs of
/// it, without holding the parameter itself (ZeRO-3 keeps no whole parameter).
#[derive(Debug)]
struct Origin {
    /// The whole parameter's id, when the optimizer was built over it.
    id: Option<TensorId>,
    shape: Shape,
    dtype: DType,
    device: Device,
}

impl Origin {
    fn of(var: &Var) -> Self {
        Origin {
            id: Some(var.id()),
            shape: var.shape().clone(),
            dtype: var.dtype(),
            device: var.device().clone(),
        }
    }
}

impl<const K: usize> Slots<K> {
    /// A slot for each float parameter of `vars` (the others are dropped, as Candle does), no
    /// state yet, weight decay on everywhere, fused kernels as the `fused_optim` setting says.
    pub(crate) fn new(spec: &'static SlotSpec<K>, vars: Vec<Var>) -> Result<Self> {
        let slots = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| Slot {
                var,
                range: None,
                place: None,
                state: std::array::from_fn(|_| None),
                decays: true,
            })
            .collect();
        Ok(Slots {
            spec,
            slots,
            step: 0,
            fused: fused::default_on()?,
            origin: Vec::new(),
            sharded: false,
        })
    }

    /// Counts a step and hands out the slots to update.
    pub(crate) fn begin_step(&mut self) -> (u64, &mut [Slot<K>]) {
        self.step += 1;
        (self.step, &mut self.slots)
    }

    /// Optimizer steps taken so far.
    pub(crate) fn step_count(&self) -> u64 {
        self.step
    }

    /// Whether steps use the fused kernels where they apply.
    pub(crate) fn fused(&self) -> bool {
        self.fused
    }

    /// Turns the fused kernels on or off.
    pub(crate) fn set_fused(&mut self, on: bool) {
        self.fused = on;
    }

    /// Turns weight decay off for the slots of `vars`.
    pub(crate) fn no_weight_decay_on(&mut self, vars: &[Var]) {
        for slot in &mut self.slots {
            if vars.iter().any(|v| v.id() == slot.var.id()) {
                slot.decays = false;
            }
        }
    }

    /// Per parameter, in index order: whether weight decay applies to it.
    pub(crate) fn decaying(&self) -> Vec<bool> {
        self.slots.iter().map(|s| s.decays).collect()
    }

    /// The parameters, in index order.
    pub(crate) fn vars(&self) -> Vec<&Var> {
        self.slots.iter().map(|s| &s.var).collect()
    }

    /// Whether only this rank's slices of the parameters are kept (ZeRO stages 1 to 3).
    pub(crate) fn is_sharded(&self) -> bool {
        self.sharded
    }

    /// A sharded slot's parameter (index in the unsharded layout) and first element in it.
    fn place(&self, s: &Slot<K>) -> Option<(usize, usize)> {
        if s.place.is_some() {
            return s.place;
        }
        let i = self.origin.iter().position(|o| o.id == Some(s.var.id()))?;
        Some((i, s.range.as_ref().map_or(0, |r| r.start)))
    }

    /// Bytes of state tensors this rank holds.
    pub(crate) fn state_bytes(&self) -> usize {
        self.slots
            .iter()
            .flat_map(|s| &s.state)
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// ZeRO: keeps only `shards` (this rank's slices of the parameters), slicing the state
    /// tensors already there; the other parameters' slots are dropped. Once only.
    pub(crate) fn shard(&mut self, shards: &[Shard]) -> Result<()> {
        if self.is_sharded() {
            return Ok(());
        }
        self.origin = self.slots.iter().map(|s| Origin::of(&s.var)).collect();
        self.sharded = true;
        let mut slots = Vec::new();
        for slot in self.slots.drain(..) {
            for shard in shards.iter().filter(|s| s.var.id() == slot.var.id()) {
                let r = shard.range.clone();
                let mut state: [Option<Tensor>; K] = std::array::from_fn(|_| None);
                for (cut, t) in state.iter_mut().zip(&slot.state) {
                    if let Some(t) = t {
                        // Compact (`copy` of a view would clone the whole state tensor).
                        let piece = t.flatten_all()?.narrow(0, r.start, r.len())?;
                        *cut = Some(piece.force_contiguous()?);
                    }
                }
                slots.push(Slot {
                    var: slot.var.clone(),
                    range: Some(r),
                    place: None,
                    state,
                    decays: slot.decays,
                });
            }
        }
        self.slots = slots;
        Ok(())
    }

    /// ZeRO-3: moves the optimizer onto the units' shards. `params` lists every parameter of
    /// the sharded model with this rank's pieces of it. An optimizer built over the whole
    /// parameters keeps its order (the `i` of its state's names), weight-decay flags and any
    /// state already there (cut to the pieces); its parameters must all be in `params` (the
    /// error names the first that is not). An optimizer built over no parameters takes every
    /// one of `params`, in their order, with their weight-decay flags. Once only.
    pub(crate) fn rebase(&mut self, params: &[ParamPieces]) -> Result<()> {
        if self.is_sharded() {
            return Err(Error::invalid(
                format!("{} (ZeRO-3)", self.spec.optimizer),
                "the optimizer is already sharded: give `prepare_sharded` a fresh optimizer",
            ));
        }
        let old: Vec<Slot<K>> = self.slots.drain(..).collect();
        let mut plan: Vec<(&ParamPieces, bool, [Option<Tensor>; K])> = Vec::new();
        if old.is_empty() {
            for p in params {
                plan.push((p, p.decays, std::array::from_fn(|_| None)));
            }
        } else {
            for (i, slot) in old.into_iter().enumerate() {
                let Some(p) = params.iter().find(|p| p.id == Some(slot.var.id())) else {
                    return Err(Error::invalid(
                        format!("{} parameter #{i}", self.spec.optimizer),
                        format!(
                            "a {:?}{:?} variable that is not a parameter of the sharded model: build the optimizer over the model's variables (or over none)",
                            slot.var.dtype(),
                            slot.var.dims()
                        ),
                    ));
                };
                plan.push((p, slot.decays, slot.state));
            }
        }
        self.origin.clear();
        for (i, (p, decays, state)) in plan.into_iter().enumerate() {
            self.origin.push(Origin {
                id: p.id,
                shape: Shape::from_dims(&p.shape),
                dtype: p.dtype,
                device: p.device.clone(),
            });
            for (shard, in_shard, start) in &p.pieces {
                let mut cut: [Option<Tensor>; K] = std::array::from_fn(|_| None);
                for (c, t) in cut.iter_mut().zip(&state) {
                    if let Some(t) = t {
                        let n = in_shard.len();
                        *c = Some(t.flatten_all()?.narrow(0, *start, n)?.force_contiguous()?);
                    }
                }
                self.slots.push(Slot {
                    var: shard.clone(),
                    range: Some(in_shard.clone()),
                    place: Some((i, *start)),
                    state: cut,
                    decays,
                });
            }
        }
        self.sharded = true;
        Ok(())
    }

    /// The kinds a sharded state lists: all of the spec's, or none when the optimizer keeps no
    /// state with its present settings (`keeps_state` false: Sgd without momentum).
    fn kinds_in_force(&self, keeps_state: bool) -> &'static [&'static str] {
        if keeps_state {
            &self.spec.kinds
        } else {
            &[]
        }
    }

    /// The state for a checkpoint, with learning rate `lr`: a snapshot (the tensors are copied,
    /// since later steps write into them). Unsharded: `"{i}.{kind}"` for every parameter `i`
    /// and kind, zeros where not allocated yet ([`SlotSpec::complete`]), or only the tensors
    /// that exist. Sharded: every tensor in the unsharded layout (none when `keeps_state` is
    /// false), holding this rank's slices and zeros elsewhere, so that summed over the ranks
    /// (each element is some rank's) it is the whole state.
    pub(crate) fn state(&self, lr: f64, keeps_state: bool) -> Result<OptimizerState> {
        let mut tensors = Vec::new();
        if self.is_sharded() {
            for (i, o) in self.origin.iter().enumerate() {
                for (k, kind) in self.kinds_in_force(keeps_state).iter().enumerate() {
                    let mut full = Tensor::zeros(o.shape.elem_count(), o.dtype, &o.device)?;
                    for s in &self.slots {
                        let (Some((j, start)), Some(part)) = (self.place(s), &s.state[k]) else {
                            continue;
                        };
                        if j == i {
                            let part = part.flatten_all()?;
                            let r = start..start + part.elem_count();
                            full = full.slice_assign(&[r], &part)?;
                        }
                    }
                    tensors.push((format!("{i}.{kind}"), full.reshape(o.shape.clone())?));
                }
            }
        } else {
            for (i, s) in self.slots.iter().enumerate() {
                for (kind, t) in self.spec.kinds.iter().zip(&s.state) {
                    let t = match t {
                        Some(t) => t.copy()?,
                        None if self.spec.complete => {
                            Tensor::zeros(s.var.shape(), s.var.dtype(), s.var.device())?
                        }
                        None => continue,
                    };
                    tensors.push((format!("{i}.{kind}"), t));
                }
            }
        }
        Ok(OptimizerState {
            step: self.step,
            lr,
            tensors,
        })
    }

    /// ZeRO: this rank's slices of the state (`None` unless sharded), for a checkpoint in which
    /// every rank writes its own file; `keeps_state` as in [`state`](Self::state).
    pub(crate) fn state_shard(&self, lr: f64, keeps_state: bool) -> Result<Option<StateShard>> {
        if !self.is_sharded() {
            return Ok(None);
        }
        let kinds = self.kinds_in_force(keeps_state);
        let mut layout = Vec::with_capacity(kinds.len() * self.origin.len());
        for (i, o) in self.origin.iter().enumerate() {
            for kind in kinds {
                layout.push((format!("{i}.{kind}"), o.shape.dims().to_vec()));
            }
        }
        let mut pieces = Vec::new();
        for s in &self.slots {
            let (Some((i, start)), Some(r)) = (self.place(s), &s.range) else {
                continue;
            };
            for (kind, t) in kinds.iter().zip(&s.state) {
                let piece = match t {
                    Some(t) => t.flatten_all()?.copy()?,
                    None => Tensor::zeros(r.len(), s.var.dtype(), s.var.device())?,
                };
                pieces.push((format!("{i}.{kind}"), start, piece));
            }
        }
        Ok(Some(StateShard {
            step: self.step,
            lr,
            layout,
            pieces,
        }))
    }

    /// Restores the tensors and the step count of a state taken with [`state`](Self::state) on
    /// an optimizer over parameters of the same shapes, in the same order (the caller sets the
    /// learning rate, checked here). Tensors are copied to the parameters' device and dtype.
    /// Errors, naming the offending tensor, on a missing ([`SlotSpec::complete`]), duplicate,
    /// unknown or misshapen tensor, or on a wrong count; on error nothing changes.
    pub(crate) fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let name = self.spec.optimizer;
        if self.is_sharded() {
            return self.load_sharded(state);
        }
        check_lr(&format!("{name} state lr"), state.lr)?;
        let (n, kinds) = (self.slots.len(), &self.spec.kinds);
        let count = state.tensors.len();
        if self.spec.complete && count != K * n {
            let each = kinds.map(|k| format!("`{{i}}.{k}`")).join(" and ");
            return Err(Error::invalid(
                format!("{name} state"),
                format!(
                    "has {count} tensors, but this optimizer has {n} parameters and expects {} \
                     ({each} for each)",
                    K * n
                ),
            ));
        }
        if count > K * n {
            return Err(Error::invalid(
                format!("{name} state"),
                format!("has {count} tensors, but this optimizer has only {n} parameters"),
            ));
        }
        let mut fitted: Vec<[Option<Tensor>; K]> =
            (0..n).map(|_| std::array::from_fn(|_| None)).collect();
        for (tensor_name, tensor) in &state.tensors {
            let (i, k) = match parse_name(tensor_name) {
                Some((i, kind)) if i < n => match kinds.iter().position(|k| *k == kind) {
                    Some(k) => (i, k),
                    None => return Err(unknown_name(name, tensor_name, kinds, n)),
                },
                _ => return Err(unknown_name(name, tensor_name, kinds, n)),
            };
            if fitted[i][k].is_some() {
                return Err(Error::invalid(
                    format!("{name} state tensor `{tensor_name}`"),
                    "appears twice",
                ));
            }
            let var = &self.slots[i].var;
            fitted[i][k] = Some(fit_tensor(
                name,
                tensor_name,
                tensor,
                var.shape(),
                var.dtype(),
                var.device(),
            )?);
        }
        if self.spec.complete {
            for (i, state) in fitted.iter().enumerate() {
                if let Some((kind, _)) = kinds.iter().zip(state).find(|(_, t)| t.is_none()) {
                    return Err(Error::invalid(
                        format!("{name} state tensor `{i}.{kind}`"),
                        "is missing",
                    ));
                }
            }
        }
        for (slot, state) in self.slots.iter_mut().zip(fitted) {
            slot.state = state;
        }
        self.step = state.step;
        Ok(())
    }
}

impl<const K: usize> Slots<K> {
    /// [`load_state`](Self::load_state) into a sharded optimizer: each slot takes its piece of
    /// the whole state's tensors (same checks: names, shapes, count; nothing changes on error).
    fn load_sharded(&mut self, state: &OptimizerState) -> Result<()> {
        let name = self.spec.optimizer;
        check_lr(&format!("{name} state lr"), state.lr)?;
        let (n, kinds) = (self.origin.len(), &self.spec.kinds);
        let mut by_name: std::collections::HashMap<&str, &Tensor> = Default::default();
        for (tensor_name, tensor) in &state.tensors {
            let Some((i, kind)) = parse_name(tensor_name).filter(|(i, _)| *i < n) else {
                return Err(unknown_name(name, tensor_name, kinds, n));
            };
            if !kinds.contains(&kind) {
                return Err(unknown_name(name, tensor_name, kinds, n));
            }
            if tensor.shape() != &self.origin[i].shape {
                return Err(Error::invalid(
                    format!("{name} state tensor `{tensor_name}`"),
                    format!(
                        "has shape {:?}, but its parameter has shape {:?}",
                        tensor.dims(),
                        self.origin[i].shape.dims()
                    ),
                ));
            }
            if by_name.insert(tensor_name, tensor).is_some() {
                return Err(Error::invalid(
                    format!("{name} state tensor `{tensor_name}`"),
                    "appears twice",
                ));
            }
        }
        if self.spec.complete && by_name.len() != K * n {
            return Err(Error::invalid(
                format!("{name} state"),
                format!(
                    "has {} tensors, but this optimizer has {n} parameters and expects {}",
                    by_name.len(),
                    K * n
                ),
            ));
        }
        let mut fitted: Vec<[Option<Tensor>; K]> = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let (Some((i, start)), Some(r)) = (self.place(s), &s.range) else {
                fitted.push(std::array::from_fn(|_| None));
                continue;
            };
            let mut cut: [Option<Tensor>; K] = std::array::from_fn(|_| None);
            for (c, kind) in cut.iter_mut().zip(kinds) {
                let key = format!("{i}.{kind}");
                if let Some(t) = by_name.get(key.as_str()) {
                    let piece = t
                        .flatten_all()?
                        .narrow(0, start, r.len())?
                        .force_contiguous()?;
                    *c = Some(fit_tensor(
                        name,
                        &key,
                        &piece,
                        &Shape::from_dims(&[r.len()]),
                        s.var.dtype(),
                        s.var.device(),
                    )?);
                }
            }
            fitted.push(cut);
        }
        for (slot, state) in self.slots.iter_mut().zip(fitted) {
            slot.state = state;
        }
        self.step = state.step;
        Ok(())
    }
}

/// The error of a state tensor whose name is not `"{i}.{kind}"` for a parameter `i < n` and
/// one of `kinds`.
fn unknown_name(optimizer: &str, name: &str, kinds: &[&str], n: usize) -> Error {
    let expected = kinds
        .iter()
        .map(|k| format!("`{{i}}.{k}`"))
        .collect::<Vec<_>>()
        .join(" or ");
    Error::invalid(
        format!("{optimizer} state tensor `{name}`"),
        format!("unknown name: expected {expected} with i < {n}"),
    )
}

/// Splits `"{i}.{kind}"` into the parameter index and the kind.
fn parse_name(name: &str) -> Option<(usize, &str)> {
    let (index, kind) = name.split_once('.')?;
    Some((index.parse().ok()?, kind))
}

/// Checks a loaded tensor against its parameter and brings it to the parameter's dtype and device
/// (a fresh copy, so the caller's tensor is never aliased).
fn fit_tensor(
    optimizer: &str,
    name: &str,
    tensor: &Tensor,
    shape: &Shape,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    if tensor.shape() != shape {
        return Err(Error::invalid(
            format!("{optimizer} state tensor `{name}`"),
            format!(
                "has shape {:?}, but its parameter has shape {:?}",
                tensor.dims(),
                shape.dims()
            ),
        ));
    }
    if !tensor.dtype().is_float() {
        return Err(Error::invalid(
            format!("{optimizer} state tensor `{name}`"),
            format!("has non-float dtype {:?}", tensor.dtype()),
        ));
    }
    let t = tensor.to_device(device)?.to_dtype(dtype)?;
    // `to_device`/`to_dtype` return the same storage when nothing changes: copy so that the
    // optimizer never shares storage with a tensor the caller may still hold (a `Var`).
    Ok(t.copy()?)
}
