//! GPU discovery in a build without the `cuda` feature: the same API as `gpu.rs`, every call
//! explaining that CUDA was not built in.

use candle_core::Device;

use crate::error::{Error, Result};

/// Whether this build can drive GPUs.
pub const BUILT_WITH_CUDA: bool = false;

fn not_built() -> Error {
    Error::NotAvailable {
        what: "CUDA".into(),
        reason: "this accelerate-rs was built without the `cuda` feature; rebuild with `cargo build --features cuda`, or run on the CPU (`.cpu(true)`, `--cpu`, ACCELERATE_RS_USE_CPU=1 or `use_cpu = true`)".into(),
    }
}

/// Number of GPUs this process can see: always an error in this build.
pub fn device_count() -> Result<usize> {
    Err(not_built())
}

/// The Candle device for GPU `ordinal`: always an error in this build.
pub fn device(_ordinal: usize) -> Result<Device> {
    Err(not_built())
}

/// The identity of the GPU behind a device: always an error in this build.
pub fn identity(_device: &Device) -> Result<Vec<u8>> {
    Err(not_built())
}

/// The PCI bus id of the GPU behind a device: always an error in this build.
pub fn pci_bus_id(_device: &Device) -> Result<String> {
    Err(not_built())
}
