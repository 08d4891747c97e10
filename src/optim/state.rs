//! What every optimizer shares: its state for checkpoints ([`OptimizerState`],
//! [`StatefulOptimizer`], ZeRO's [`StateShard`] and [`Shard`]), and the checks and error
//! conversion of its constructors.

use std::ops::Range;

use candle_core::{Tensor, Var};

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

/// An optimizer whose state can go into a checkpoint: [`AdamW`](super::AdamW),
/// [`Sgd`](super::Sgd), and the wrappers
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

/// ZeRO-3: one parameter of a sharded model and this rank's pieces of it, for
/// [`AdamW`](super::AdamW)'s and [`Sgd`](super::Sgd)'s `rebase`: each piece is `(shard,
/// elements of the shard, first element in the parameter)`, the shard being the flat `Var` of
/// the parameter's unit that this rank keeps.
#[derive(Clone, Debug)]
pub(crate) struct ParamPieces {
    /// The whole parameter's id, when the optimizer may have been built over it.
    pub(crate) id: Option<candle_core::TensorId>,
    /// Its dimensions.
    pub(crate) shape: Vec<usize>,
    /// Its dtype (the shard's).
    pub(crate) dtype: candle_core::DType,
    /// Its device (the shard's).
    pub(crate) device: candle_core::Device,
    /// Whether weight decay applies, for an optimizer built over no parameters.
    pub(crate) decays: bool,
    /// This rank's pieces.
    pub(crate) pieces: Vec<(Var, Range<usize>, usize)>,
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

/// Wraps a crate error for [`candle_nn::Optimizer`] methods, which return Candle's `Result`.
pub(crate) fn candle_err(e: Error) -> candle_core::Error {
    e.into()
}
