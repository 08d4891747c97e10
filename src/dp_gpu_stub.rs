//! TEMPORARY STUB, to be deleted: stands in for `crate::collective::gpu_group` and
//! `crate::collective::gpu_device` (NCCL in-process communicators, `cuda` feature) until they
//! land. Both always answer [`Error::NotAvailable`] for CUDA. The only call sites are in
//! `src/dp.rs` (`gpu_replicas`); switch them to `crate::collective::...` and delete this file and
//! its `mod` line in `src/lib.rs`.

use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;

use crate::collective::Collective;
use crate::error::{Error, Result};

fn no_cuda() -> Error {
    Error::NotAvailable {
        what: "CUDA".into(),
        reason: "accelerate-rs was built without CUDA (the `cuda` feature)".into(),
    }
}

/// One NCCL-backed collective per GPU ordinal (stub: never available).
pub(crate) fn gpu_group(
    _ordinals: &[usize],
    _timeout: Duration,
) -> Result<Vec<Arc<dyn Collective>>> {
    Err(no_cuda())
}

/// The device of GPU `ordinal` (stub: never available).
pub(crate) fn gpu_device(_ordinal: usize) -> Result<Device> {
    Err(no_cuda())
}
