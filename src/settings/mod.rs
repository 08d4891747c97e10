//! Settings, the bottom floor: the resolved process state ([`ProcessState`]), the config file
//! ([`ConfigFile`]), the names of every environment variable ([`env`]), GPU discovery,
//! [`Transport`], and the one precedence ([`parse::pick`]) and strict parser
//! ([`parse::env_value`]) every setting goes through. Nothing here imports the floors above.

pub(crate) mod config;
pub(crate) mod defaults;
pub(crate) mod env;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(not(feature = "cuda"))]
#[path = "gpu_stub.rs"]
pub mod gpu;
mod groups;
pub mod limits;
pub(crate) mod memory;
mod missing_gradients;
mod nonfinite;
mod overrides;
pub(crate) mod parse;
pub(crate) mod place;
mod processes;
pub(crate) mod runtime;
pub(crate) mod state;
mod transport;
pub(crate) mod worker_env;

pub use config::{ConfigFile, MixedPrecision};
pub use missing_gradients::MissingGradients;
pub use nonfinite::NonFinite;
pub(crate) use overrides::Overrides;
pub use place::DistributedType;
pub(crate) use processes::{self_launch, SelfLaunch};
pub use state::ProcessState;
pub use transport::Transport;
