//! GPU discovery, for a build with the `cuda` feature. A build without it uses `gpu_stub.rs`,
//! which has the same API and reports that CUDA was not built in.
//!
//! **One stream per GPU.** [`device`] gives every caller in the process the same Candle device
//! for an ordinal, created with its own CUDA stream (`Device::new_cuda_with_stream`), so work
//! queued by any thread (the training thread, the data loader's prefetch thread, a DP replica) on
//! that GPU runs in the order it was queued. Candle's `Device::new_cuda` would instead use the
//! per-thread default stream, with no ordering between a batch copied on the prefetch thread and
//! its use on the training thread.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::Device;
use once_cell::sync::Lazy;

use crate::error::{Error, Result};

/// Whether this build can drive GPUs.
pub const BUILT_WITH_CUDA: bool = true;

/// The process's device (and stream) per GPU ordinal.
static DEVICES: Lazy<Mutex<HashMap<usize, Device>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Number of GPUs this process can see (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize> {
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| Error::NotAvailable {
        what: "CUDA".into(),
        reason: format!("cannot query the GPUs (is the NVIDIA driver installed?): {e:?}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The Candle device for GPU `ordinal` (an index among the visible GPUs): the same device, on one
/// stream of its own, for every call in this process.
pub fn device(ordinal: usize) -> Result<Device> {
    let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
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
    let d = Device::new_cuda_with_stream(ordinal)?;
    devices.insert(ordinal, d.clone());
    Ok(d)
}

/// A stable identity of the GPU behind `device` (its UUID), equal for two ranks exactly when
/// they drive the same physical GPU, whatever their `CUDA_VISIBLE_DEVICES`.
pub fn identity(device: &Device) -> Result<Vec<u8>> {
    let cuda = device.as_cuda_device()?;
    let uuid = cuda
        .cuda_stream()
        .context()
        .uuid()
        .map_err(|e| Error::NotAvailable {
            what: format!("the UUID of {device:?}"),
            reason: format!("the CUDA driver refused it: {e:?}"),
        })?;
    Ok(uuid.bytes.iter().map(|&b| b as u8).collect())
}

/// The PCI bus id of the GPU behind `device`: `domain:bus:device` in hex, as `nvidia-smi`
/// prints it (`0000:17:00`). MIG slices of one GPU share it, and NCCL tells GPUs apart by it
/// (with the host), so GPU sharing is decided on it.
pub fn pci_bus_id(device: &Device) -> Result<String> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let cuda = device.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    let get = |attr: A, what: &str| {
        ctx.attribute(attr).map_err(|e| Error::NotAvailable {
            what: format!("the PCI {what} of {device:?}"),
            reason: format!("the CUDA driver refused it: {e:?}"),
        })
    };
    let domain = get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, "domain")?;
    let bus = get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, "bus id")?;
    let dev = get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, "device id")?;
    Ok(format!("{domain:04x}:{bus:02x}:{dev:02x}"))
}
