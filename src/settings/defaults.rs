//! The defaults of the settings that the config file, the resolver and the command line share.

use std::time::Duration;

/// Default timeout of every collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Default gradient bucket cap, in MiB.
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;
/// Default rendezvous port (torchrun's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
