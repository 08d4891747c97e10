//! The integration tests, one binary (Candle is linked once): one module per area, helpers in
//! `common`.

mod common;

mod accumulate;
mod batch_size;
mod batching;
mod checkpoint;
mod checkpoint_complete;
mod checkpoint_floats;
mod checkpoint_integrity;
mod checkpointing;
mod collectives;
mod cuda_emulation;
mod data_loader;
mod data_warnings;
mod ddp;
mod dp;
mod each_node;
mod elastic;
mod examples;
mod faults;
mod frozen;
mod fused_optim;
mod linear4bit;
mod lora;
mod memory;
mod mixed_precision;
#[cfg(feature = "mpi")]
mod mpi;
mod multinode;
mod nn;
mod nonfinite;
mod ops;
mod optim;
mod quant;
mod sampler;
mod save_targets;
mod scripts;
mod self_launch;
mod shm;
mod streaming_loader;
mod token_weights;
mod tracking;
mod weights;
mod zero;
mod zero_overflow;
