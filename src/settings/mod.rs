//! Settings, the bottom floor: the resolved process state, the config file, the names of the
//! environment variables and GPU discovery.

pub mod config;
pub mod env;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(not(feature = "cuda"))]
#[path = "gpu_stub.rs"]
pub mod gpu;
pub mod state;
