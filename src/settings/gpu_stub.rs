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

/// What a GPU's memory pool holds for this process (see the `cuda` build's documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolMemory {
    /// Bytes allocated to live tensors now.
    pub in_use: u64,
    /// The most bytes allocated at once since the pool was created or
    /// [`reset_peak_memory`] was last called.
    pub peak: u64,
    /// Bytes the pool holds from the GPU now: in use, plus freed memory kept for reuse.
    pub reserved: u64,
}

/// A GPU's memory statistics: always an error in this build.
pub fn pool_memory(_device: &Device) -> Result<PoolMemory> {
    Err(not_built())
}

/// Resets a GPU's memory peak: always an error in this build.
pub fn reset_peak_memory(_device: &Device) -> Result<()> {
    Err(not_built())
}

/// Gives a GPU's cached memory back: nothing to do in this build (every device is a CPU).
pub fn release_cached_memory(_device: &Device) -> Result<()> {
    Ok(())
}

/// How accelerate-rs set up a GPU device (see the `cuda` build's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSetup {
    /// Whether cudarc's cross-stream event tracking is on.
    pub event_tracking: bool,
    /// The release threshold of the GPU's default memory pool, in bytes.
    pub pool_release_threshold: Option<u64>,
}

/// How a GPU device is set up: always an error in this build.
pub fn device_setup(_device: &Device) -> Result<DeviceSetup> {
    Err(not_built())
}

/// The release threshold a GPU's memory pool should have: always an error in this build.
pub fn expected_pool_release_threshold() -> Result<u64> {
    Err(not_built())
}
