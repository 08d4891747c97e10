//! Optimizers whose state can be saved and restored: [`AdamW`] and [`Sgd`] (with momentum,
//! Nesterov and weight decay).
//!
//! Both implement [`candle_nn::Optimizer`], so they drop into
//! [`Accelerator::prepare`](crate::Accelerator::prepare) and
//! [`AcceleratedOptimizer::backward_step`](crate::AcceleratedOptimizer::backward_step) like
//! Candle's own. On top of that they expose their state for checkpoints:
//! [`state`](AdamW::state) returns an [`OptimizerState`] (step count, learning rate and the named
//! per-parameter moment tensors) and [`load_state`](AdamW::load_state) puts one back, checking
//! that it fits the parameters. A run resumed from a state continues bit-identically to one that
//! was never interrupted.
//!
//! Tensor names use the parameter's index in the list given to `new` (after dropping the
//! non-float ones, as Candle does): `"{i}.m"` and `"{i}.v"` for AdamW's first and second moments,
//! `"{i}.momentum"` for SGD's momentum buffer. Pass the parameters in the same order when
//! restoring (e.g. sorted by name, as [`Parameters`](crate::Parameters) does).
//!
//! On the CPU both update every parameter in one fused, in-place pass (parameter, gradient and
//! state read once and written where they are, no tensor allocated per step). On CUDA (f32, bf16
//! and f16) one kernel launch per parameter does the same, with the CPU kernels' arithmetic (bf16
//! and f16 computed in f32); it is compiled with NVRTC at first use for the GPU's architecture,
//! and if that fails the optimizers warn once and fall back. Elsewhere, or with fusion off
//! ([`AdamW::set_fused`], `ACCELERATE_RS_FUSED_OPTIM=0`), they run the same formulas as tensor
//! ops. Because the state is written in place,
//! [`state`](AdamW::state) copies it: a state taken is a snapshot that later steps do not change.

mod adamw;
mod fused;
#[cfg(feature = "cuda")]
mod fused_cuda;
#[cfg(not(feature = "cuda"))]
#[path = "fused_cuda_stub.rs"]
mod fused_cuda;
mod sgd;

pub use adamw::AdamW;
pub use candle_nn::ParamsAdamW;
pub(crate) use fused::sq_sum;
pub use sgd::{Sgd, SgdConfig};

pub use fused_cuda::launches as cuda_kernel_launches;

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};

/// An optimizer's state, for checkpoints: what is needed, besides the parameters, to continue
/// training exactly where it stopped.
#[derive(Clone, Debug)]
pub struct OptimizerState {
    /// Optimizer steps taken so far.
    pub step: u64,
    /// The learning rate in force.
    pub lr: f64,
    /// Named per-parameter tensors (`"{i}.m"`, `"{i}.v"`, `"{i}.momentum"`), in parameter order.
    pub tensors: Vec<(String, Tensor)>,
}

impl OptimizerState {
    /// The tensor stored under `name`, if any.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
}

/// An optimizer whose state can go into a checkpoint: [`AdamW`], [`Sgd`], and the wrappers
/// [`AcceleratedOptimizer`](crate::AcceleratedOptimizer) and
/// [`MixedPrecisionOptimizer`](crate::MixedPrecisionOptimizer) around one of them (each
/// implements it beside its own code).
pub trait StatefulOptimizer {
    /// A snapshot of the state (see [`OptimizerState`]).
    fn optimizer_state(&self) -> Result<OptimizerState>;
    /// Puts a state back; errors (changing nothing) when it does not fit the parameters.
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()>;
    /// Whether [`optimizer_state`](Self::optimizer_state) is a collective that every rank must
    /// call (a ZeRO-sharded optimizer gathers its slices); the checkpoint writers then take the
    /// state on every rank. Default false.
    fn state_needs_every_rank(&self) -> bool {
        false
    }
    /// ZeRO: this rank's slices of the state when the optimizer holds only those (then every
    /// rank writes its own file; see the module docs). Default `None`: the whole state comes
    /// from [`optimizer_state`](Self::optimizer_state).
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        Ok(None)
    }
}

/// One rank's part of a ZeRO-sharded optimizer's state (`zero_stage` 1 or 2), for
/// checkpoints where every rank writes its own file: the pieces of the state this rank holds,
/// and the layout of the whole state they are cut from. The pieces of all ranks tile every
/// tensor of [`layout`](Self::layout) exactly once, so a checkpoint reassembles the whole
/// [`OptimizerState`] from them at any world size.
#[derive(Clone, Debug)]
pub struct StateShard {
    /// Optimizer steps taken so far (the same on every rank).
    pub step: u64,
    /// The learning rate in force.
    pub lr: f64,
    /// Every tensor of the whole state, in order: its name and shape.
    pub layout: Vec<(String, Vec<usize>)>,
    /// This rank's pieces: `(name, start, piece)`, the 1-D `piece` holding elements
    /// `start..start + piece.elem_count()` of the flattened tensor `name`.
    pub pieces: Vec<(String, usize, Tensor)>,
}

/// ZeRO: `StateShard` of sharded slots. `origin` lists every parameter in index order; `slots`
/// gives each of this rank's slices as its parameter, its range, and the state tensors it
/// holds under their kinds (`"m"`, `"v"`, `"momentum"`; `None`: not allocated yet, zeros).
pub(crate) fn state_shard<'a>(
    step: u64,
    lr: f64,
    origin: &[candle_core::Var],
    kinds: &[&str],
    slots: impl Iterator<
        Item = (
            &'a candle_core::Var,
            &'a Option<std::ops::Range<usize>>,
            Vec<&'a Option<Tensor>>,
        ),
    >,
) -> Result<StateShard> {
    let mut layout = Vec::with_capacity(kinds.len() * origin.len());
    for (i, var) in origin.iter().enumerate() {
        for kind in kinds {
            layout.push((format!("{i}.{kind}"), var.dims().to_vec()));
        }
    }
    let mut pieces = Vec::new();
    for (var, range, state) in slots {
        let (Some(i), Some(r)) = (origin.iter().position(|v| v.id() == var.id()), range) else {
            continue;
        };
        for (kind, t) in kinds.iter().zip(state) {
            let piece = match t {
                Some(t) => t.flatten_all()?.copy()?,
                None => Tensor::zeros(r.len(), var.dtype(), var.device())?,
            };
            pieces.push((format!("{i}.{kind}"), r.start, piece));
        }
    }
    Ok(StateShard {
        step,
        lr,
        layout,
        pieces,
    })
}

/// Checks that `lr` is a usable learning rate.
pub(crate) fn check_lr(name: &str, lr: f64) -> Result<()> {
    if !lr.is_finite() || lr < 0.0 {
        return Err(Error::invalid(
            name,
            format!("must be a finite number >= 0, got {lr}"),
        ));
    }
    Ok(())
}

/// Splits `"{i}.{kind}"` into the parameter index and the kind.
pub(crate) fn parse_name(name: &str) -> Option<(usize, &str)> {
    let (index, kind) = name.split_once('.')?;
    Some((index.parse().ok()?, kind))
}

/// Checks a loaded tensor against its parameter and brings it to the parameter's dtype and device
/// (a fresh copy, so the caller's tensor is never aliased).
pub(crate) fn fit_tensor(
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

/// Wraps a crate error for [`candle_nn::Optimizer`] methods, which return Candle's `Result`.
pub(crate) fn candle_err(e: Error) -> candle_core::Error {
    e.into()
}

/// The part of a parameter an optimizer slot updates: all of it, or under ZeRO sharding
/// elements `range` of the flattened parameter (a view sharing its storage, so in-place updates
/// land in the parameter).
pub(crate) fn param_view(
    var: &candle_core::Var,
    range: &Option<std::ops::Range<usize>>,
) -> candle_core::Result<Tensor> {
    match range {
        None => Ok(var.as_tensor().clone()),
        Some(r) => var.as_tensor().flatten_all()?.narrow(0, r.start, r.len()),
    }
}

/// The gradient of a slot's part: the whole gradient, or elements `range` of it. A gradient
/// that already has `range.len()` elements is this rank's slice (ZeRO stage 2).
pub(crate) fn grad_view(
    g: &Tensor,
    range: &Option<std::ops::Range<usize>>,
) -> candle_core::Result<Tensor> {
    match range {
        None => Ok(g.clone()),
        Some(r) if g.elem_count() == r.len() => g.flatten_all(),
        Some(r) => g.flatten_all()?.narrow(0, r.start, r.len()),
    }
}

/// Writes `next` (computed out of place) into a slot's part of the parameter.
pub(crate) fn write_param(
    var: &candle_core::Var,
    range: &Option<std::ops::Range<usize>>,
    next: &Tensor,
) -> candle_core::Result<()> {
    match range {
        None => var.set(next),
        Some(r) => var
            .as_tensor()
            .flatten_all()?
            .slice_set(&next.contiguous()?, 0, r.start),
    }
}

/// The error of a checkpoint of a sharded optimizer (not supported yet).
pub(crate) fn sharded_state_err(what: &str) -> Error {
    Error::invalid(
        format!("{what} state"),
        "this optimizer is sharded (zero_stage 1 or 2) and holds only this rank's slices: load a \
         checkpoint before the first optimizer step (the optimizer is cut into slices then, \
         keeping the loaded state), and save it through the accelerator's optimizer wrapper, \
         which gathers the slices",
    )
}

/// Under ZeRO, `shards` (this rank's slices) as the parameters' ranges: for each of `vars`,
/// the slices of it this rank owns.
pub(crate) fn shard_ranges(
    var: &candle_core::Var,
    shards: &[crate::train::params::Shard],
) -> Vec<std::ops::Range<usize>> {
    shards
        .iter()
        .filter(|s| s.var.id() == var.id())
        .map(|s| s.range.clone())
        .collect()
}
