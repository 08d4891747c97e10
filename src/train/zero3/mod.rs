//! ZeRO stage 3 (PyTorch's FSDP, DeepSpeed's stage 3): the parameters are sharded too. See
//! [`ShardedModel`] and the section "ZeRO-3 / FSDP" of ARCHITECTURE.md: the model is cut into
//! units ([`WrapPolicy`]); each rank keeps 1/N of every unit's flat vector; a unit's parameters
//! exist only while it runs ([`ShardedModel::run`], recomputed in the backward pass) or, for a
//! held unit ([`ShardedModel::gather`]), until the backward pass ends; its gradients are
//! reduce-scattered as soon as they are known.

mod fill;
mod inner;
mod layout;
mod model;
mod unit;

pub(crate) use fill::Build;
pub use fill::ShardSource;
pub(crate) use inner::Inner;
pub use layout::WrapPolicy;
pub use model::ShardedModel;
pub(crate) use model::{from_source, from_vars, unsupported};
