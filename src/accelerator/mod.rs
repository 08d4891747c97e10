//! The facade, the top floor: [`Accelerator`], the object a training script creates first. It
//! knows the process's place in the run, owns the collective and the gradient engine, prepares
//! the model, optimizer and data loader, and hands out averaged gradients in
//! [`backward`](Accelerator::backward). Its builder is in `builder.rs`, DP (one thread per
//! replica) in `dp.rs`, the collectives for users in `ops.rs`, checkpoints in `checkpoint.rs`.

mod base;
mod batch_size;
mod builder;
mod checkpoint;
mod connect;
pub(crate) mod dp;
mod ops;
mod sharded;
mod spawn;

pub use base::Accelerator;
pub use builder::AcceleratorBuilder;
