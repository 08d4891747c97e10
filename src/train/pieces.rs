//! The contract between a model whose parameters are sharded over the ranks (ZeRO-3's
//! [`ShardedModel`](crate::ShardedModel)) and the code that saves and loads models:
//! checkpoints write and read each rank's pieces, model folders are streamed one unit at a time.
//! Reached through [`Parameters::sharded_parameters`](crate::Parameters::sharded_parameters);
//! not implementable outside the crate (the trait cannot be named there).

use std::ops::Range;

use candle_core::{DType, Tensor};

use crate::error::Result;

/// One unit of a sharded model: its name, dtype and parameters (name, shape), in the order of
/// its flat vector.
pub type UnitSpec = (String, DType, Vec<(String, Vec<usize>)>);

/// A model sharded over the ranks (see [the module](self)).
pub trait ShardedParameters {
    /// The units, in order.
    fn unit_specs(&self) -> Vec<UnitSpec>;
    /// This rank's pieces: `(parameter, first element, values)`, 1-D, copies.
    fn local_pieces(&self) -> Result<Vec<(String, usize, Tensor)>>;
    /// The elements of each parameter this rank keeps: `(parameter, elements of the flattened
    /// parameter)`.
    fn local_ranges(&self) -> Vec<(String, Range<usize>)>;
    /// Writes `values` (`(parameter, first element, 1-D values)`, each inside one of
    /// [`local_ranges`](Self::local_ranges)) into this rank's shards.
    fn write_local(&self, values: &[(String, usize, Tensor)]) -> Result<()>;
    /// Unit `unit`'s parameters, whole, by name: a collective (every rank calls it, in the
    /// same order).
    fn gather_unit(&self, unit: usize) -> Result<Vec<(String, Tensor)>>;
    /// Every rank returns an error when `result` is an error on any rank (a collective), naming
    /// the first rank that failed; `what` says what was being done.
    fn agree(&self, what: &str, result: Result<()>) -> Result<()>;
}
