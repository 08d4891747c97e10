//! [`Overrides`]: what the builder's calls set, before the environment and the config file.

use std::path::PathBuf;
use std::time::Duration;

use candle_core::Device;

use crate::settings::{MissingGradients, MixedPrecision, NonFinite, Transport};

/// Values set by builder calls; `None` defers to the environment, then the config file.
#[derive(Clone, Debug, Default)]
pub(crate) struct Overrides {
    pub cpu: Option<bool>,
    pub timeout: Option<Duration>,
    pub bucket_cap_mb: Option<f64>,
    pub tune_malloc: Option<bool>,
    pub transport: Option<Transport>,
    pub missing_gradients: Option<MissingGradients>,
    pub nonfinite: Option<NonFinite>,
    pub zero_stage: Option<usize>,
    pub offload_optimizer: Option<bool>,
    pub split_batches: Option<bool>,
    pub config_file: Option<PathBuf>,
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub local_rank: Option<usize>,
    pub local_world_size: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub secret: Option<String>,
    pub mixed_precision: Option<MixedPrecision>,
    pub gradient_accumulation_steps: Option<usize>,
    /// A collective was handed in: no rendezvous address is needed.
    pub external_collective: bool,
    /// DP replicas asked for with `data_parallel` (`None` defers to `ACCELERATE_RS_DATA_PARALLEL`).
    pub data_parallel: Option<usize>,
    /// Set by `AcceleratorBuilder::run` for each DP replica: its device. The state then resolves
    /// to [`DistributedType::Dp`](super::DistributedType::Dp) on that device.
    pub replica_device: Option<Device>,
    /// Worker processes a program started on its own runs as (`processes`, see
    /// `settings/processes.rs`).
    pub processes: Option<usize>,
}
