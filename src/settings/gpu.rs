//! GPU discovery, for a build with the `cuda` feature. A build without it uses `gpu_stub.rs`,
//! which has the same API and reports that CUDA was not built in.

use candle_core::Device;

use crate::error::{Error, Result};

/// Whether this build can drive GPUs.
pub const BUILT_WITH_CUDA: bool = true;

/// Number of GPUs this process can see (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize> {
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| Error::NotAvailable {
        what: "CUDA".into(),
        reason: format!("cannot query the GPUs (is the NVIDIA driver installed?): {e:?}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The Candle device for GPU `ordinal` (an index among the visible GPUs).
pub fn device(ordinal: usize) -> Result<Device> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::NotAvailable {
            what: format!("GPU {ordinal}"),
            reason: format!(
                "only {n} GPU(s) are visible{}",
                crate::env::cuda_visible_devices_note()
            ),
        });
    }
    Ok(Device::new_cuda(ordinal)?)
}
