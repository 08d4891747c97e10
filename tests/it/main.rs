//! The integration tests, one binary (Candle is linked once): one module per area, helpers in
//! `common`.

mod common;

mod accumulate;
mod checkpoint;
mod cli_config;
mod cli_env;
mod cli_test;
mod collectives;
mod data_loader;
mod ddp;
mod dp;
mod examples;
mod faults;
mod fused_optim;
mod launch;
mod mixed_precision;
mod multinode;
mod ops;
mod optim;
mod sampler;
mod scripts;
mod shm;
mod tracking;
