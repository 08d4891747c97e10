//! Training machinery, the middle floor: parameters and gradient buckets, gradient accumulation,
//! the optimizer wrappers, mixed precision, learning-rate schedules and the checkpoint format.

pub(crate) mod batch_size;
pub(crate) mod clip;
pub(crate) mod grad_sync;
pub(crate) mod init;
pub(crate) mod loss_scaler;
pub(crate) mod missing;
pub(crate) mod mixed_precision;
pub(crate) mod optimizer;
pub(crate) mod params;
pub(crate) mod pieces;
pub(crate) mod reducer;
pub mod scheduler;
pub(crate) mod shapes;
pub(crate) mod token_weights;
pub(crate) mod weights;
pub(crate) mod zero3;
