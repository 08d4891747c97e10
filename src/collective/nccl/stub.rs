//! NCCL collectives in a build without the `cuda` feature: the same API as `nccl.rs`; every
//! constructor explains that CUDA was not built in, so no value of this type can exist.

use std::time::Duration;

use candle_core::Device;

use crate::collective::{Buffer, BufferMut, Collective, OwnedBuffer, ReduceOp, TcpOptions};
use crate::error::{Error, Result};

/// One rank of an NCCL group. This build has no CUDA: it cannot be constructed.
#[derive(Debug)]
pub struct NcclCollective {
    never: std::convert::Infallible,
}

impl NcclCollective {
    /// DDP over NCCL: always an error in this build.
    pub fn connect(_opts: &TcpOptions, _device: &Device) -> Result<Self> {
        Err(built_without_cuda())
    }

    /// DDP over an already connected host collective: always an error in this build.
    pub fn over(
        _host: std::sync::Arc<dyn Collective>,
        _device: &Device,
        _timeout: Duration,
    ) -> Result<Self> {
        Err(built_without_cuda())
    }

    /// DP over NCCL: always an error in this build.
    pub fn group(_ordinals: &[usize], _timeout: Duration) -> Result<Vec<(Device, NcclCollective)>> {
        Err(built_without_cuda())
    }

    /// The diagnostic switch that calls NCCL at world size 1 (no value exists in this build).
    pub fn force_calls(self) -> Self {
        match self.never {}
    }

    /// Number of operations completed through NCCL (no value exists in this build).
    pub fn nccl_calls(&self) -> u64 {
        match self.never {}
    }

    /// The GPU this rank drives.
    pub fn device(&self) -> &Device {
        match self.never {}
    }
}

/// The "built without CUDA" error of `gpu_stub.rs`.
fn built_without_cuda() -> Error {
    match crate::settings::gpu::device_count() {
        Err(e) => e,
        Ok(_) => Error::NotAvailable {
            what: "NCCL".into(),
            reason: "this accelerate-rs was built without the `cuda` feature".into(),
        },
    }
}

uninhabited_collective!(NcclCollective);
