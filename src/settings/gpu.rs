//! GPU discovery, for a build with the `cuda` feature. A build without it uses `gpu_stub.rs`,
//! which has the same API and reports that CUDA was not built in.
//!
//! **One stream per GPU.** [`device`] gives every caller in the process the same Candle device
//! for an ordinal, created with its own CUDA stream (`Device::new_cuda_with_stream`), so work
//! queued by any thread (the training thread, the data loader's prefetch thread, a DP replica) on
//! that GPU runs in the order it was queued. Candle's `Device::new_cuda` would instead use the
//! per-thread default stream, with no ordering between a batch copied on the prefetch thread and
//! its use on the training thread.
//!
//! **No cross-stream event tracking.** Creating a second stream switches cudarc into its
//! multi-stream mode, where every allocation records an event and every kernel argument records
//! and waits on events (about ten driver calls per Candle op), to order uses across streams. With
//! one stream per GPU there is nothing to order, so [`device`] turns that tracking off. The
//! invariant that makes this sound, kept by this crate: every tensor on a GPU is created, used
//! and freed on that GPU's one stream (Candle's kernels, cuBLAS, NCCL and the fused optimizer
//! kernels all queue on `device.cuda_stream()`), and host copies go through the same stream. A
//! tensor made on a `Device::new_cuda` of the user's own is another device: Candle refuses to mix
//! the two, and NCCL operations refuse it.
//!
//! **Memory pool.** The driver's stream-ordered allocator (which cudarc uses) gives freed memory
//! back to the system at every synchronization with the default release threshold of 0; a
//! training step frees and reallocates the same sizes every time, so [`device`] raises the
//! threshold of the GPU's default pool to "keep everything" (as PyTorch's caching allocator does).
//! `ACCELERATE_RS_CUDA_POOL_RELEASE_MB` sets a finite threshold instead (for GPUs shared with other
//! processes).

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
                super::env::cuda_visible_devices_note()
            ),
        });
    }
    let d = Device::new_cuda_with_stream(ordinal)?;
    let cuda = d.as_cuda_device()?;
    // SAFETY: turning the tracking off is sound when no tensor is used on two streams (see the
    // module docs): this device has one stream and every GPU operation of the crate queues on it;
    // it applies to allocations made from now on, and nothing has been allocated on this new
    // device's stream yet.
    unsafe { cuda.disable_event_tracking() };
    keep_pool_memory(&d, ordinal)?;
    devices.insert(ordinal, d.clone());
    Ok(d)
}

/// The release threshold [`device`] gives the GPU's default memory pool:
/// `ACCELERATE_RS_CUDA_POOL_RELEASE_MB` in MiB, else `u64::MAX` (keep freed memory in the pool).
pub fn expected_pool_release_threshold() -> Result<u64> {
    let mb =
        crate::settings::parse::process_env::<usize>(crate::settings::env::CUDA_POOL_RELEASE_MB)?;
    Ok(release_threshold_bytes(mb.map(|mb| mb as u64)))
}

/// The pool threshold in bytes for a setting in MiB (none: keep everything).
pub(crate) fn release_threshold_bytes(mb: Option<u64>) -> u64 {
    mb.map_or(u64::MAX, |mb| mb.saturating_mul(1 << 20))
}

/// Raises the release threshold of `device`'s default memory pool (see the module docs). A GPU
/// without memory pools (where cudarc allocates synchronously) has nothing to tune.
fn keep_pool_memory(device: &Device, ordinal: usize) -> Result<()> {
    use cudarc::driver::{result, sys};
    let mut threshold = expected_pool_release_threshold()?;
    if !device
        .as_cuda_device()?
        .cuda_stream()
        .context()
        .has_async_alloc()
    {
        return Ok(());
    }
    let what = format!("the memory pool of GPU {ordinal}");
    let pool = default_pool(device, &what)?;
    // SAFETY: `pool` is this device's default pool, and the release threshold attribute takes a
    // pointer to a u64 (`threshold`, alive for the call).
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .map_err(|e| Error::NotAvailable {
        what,
        reason: format!("the CUDA driver refused to set its release threshold: {e:?}"),
    })
}

/// How accelerate-rs set up a device of [`device`]: read back from cudarc and the driver, so
/// that a device check (`accelerate-rs test`) can tell that the settings took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSetup {
    /// Whether cudarc's cross-stream event tracking is on: off on every device of [`device`]
    /// (one stream per GPU, see the module docs).
    pub event_tracking: bool,
    /// The release threshold of the GPU's default memory pool, in bytes: `u64::MAX` (keep freed
    /// memory) unless `ACCELERATE_RS_CUDA_POOL_RELEASE_MB` says otherwise; `None` when the GPU
    /// has no stream-ordered memory pool.
    pub pool_release_threshold: Option<u64>,
}

/// Reads back how `device` (a device of [`device`]) is set up: event tracking and the memory
/// pool's release threshold.
pub fn device_setup(device: &Device) -> Result<DeviceSetup> {
    use cudarc::driver::{result, sys};
    let cuda = device.as_cuda_device().map_err(|_| Error::NotAvailable {
        what: "the GPU's setup".into(),
        reason: format!("{device:?} is not a GPU"),
    })?;
    let ctx = cuda.cuda_stream().context().clone();
    let pool_release_threshold = if ctx.has_async_alloc() {
        let pool = default_pool(device, "the GPU's memory pool")?;
        let mut threshold = 0u64;
        // SAFETY: `pool` is this device's default pool, and the release threshold attribute is
        // a u64 written through the pointer (`threshold`, alive for the call).
        unsafe {
            result::mem_pool::get_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .map_err(|e| Error::NotAvailable {
            what: "the GPU's memory pool".into(),
            reason: format!("the CUDA driver refused to read its release threshold: {e:?}"),
        })?;
        Some(threshold)
    } else {
        None
    };
    Ok(DeviceSetup {
        event_tracking: ctx.is_event_tracking(),
        pool_release_threshold,
    })
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

/// What a GPU's memory pool holds for this process (the driver's stream-ordered allocator, which
/// Candle's CUDA backend allocates every tensor from): PyTorch's `memory_allocated`,
/// `max_memory_allocated` and `memory_reserved`.
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

/// The default memory pool of the GPU behind `device`, or a [`Error::NotAvailable`] naming why
/// there is none (a CPU device, a GPU without stream-ordered allocation).
fn default_pool(device: &Device, what: &str) -> Result<cudarc::driver::sys::CUmemoryPool> {
    let cuda = device.as_cuda_device().map_err(|_| Error::NotAvailable {
        what: what.into(),
        reason: format!("{device:?} is not a GPU"),
    })?;
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return Err(Error::NotAvailable {
            what: what.into(),
            reason: format!(
                "{device:?} has no stream-ordered memory pool (Candle allocates with cuMemAlloc)"
            ),
        });
    }
    // SAFETY: `cu_device()` is a device handle the driver gave cudarc for this context.
    unsafe { cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device()) }.map_err(|e| {
        Error::NotAvailable {
            what: what.into(),
            reason: format!("the CUDA driver refused the default memory pool: {e:?}"),
        }
    })
}

/// How much of its GPU's memory `device` (a device of [`device`]) holds now and held at most:
/// read from the driver's pool counters, without waiting for queued work (call
/// `device.synchronize()` first for a figure that includes it).
pub fn pool_memory(device: &Device) -> Result<PoolMemory> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let what = "GPU memory statistics";
    let pool = default_pool(device, what)?;
    let get = |attr: A| -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: `pool` is a valid pool of this device; the usage attributes are u64 counters,
        // written through a pointer to `v`, alive for the call.
        unsafe {
            cudarc::driver::result::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast())
        }
        .map_err(|e| Error::NotAvailable {
            what: what.into(),
            reason: format!("the CUDA driver refused the pool attribute {attr:?}: {e:?}"),
        })?;
        Ok(v)
    };
    Ok(PoolMemory {
        in_use: get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        peak: get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        reserved: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
    })
}

/// Starts [`PoolMemory::peak`] again from what is in use now (PyTorch's
/// `reset_peak_memory_stats`).
pub fn reset_peak_memory(device: &Device) -> Result<()> {
    use cudarc::driver::sys::CUmemPool_attribute as A;
    let what = "resetting the GPU memory peak";
    let pool = default_pool(device, what)?;
    let mut zero = 0u64;
    // SAFETY: `pool` is a valid pool of this device; the high-water attributes can only be set
    // to 0, passed as a u64 through a pointer alive for the call.
    unsafe {
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    }
    .map_err(|e| Error::NotAvailable {
        what: what.into(),
        reason: format!("the CUDA driver refused it: {e:?}"),
    })
}

/// Gives the memory that `device`'s pool keeps for reuse back to the GPU once the work queued so
/// far is done (PyTorch's `empty_cache`): after running out of memory, so that the next, smaller
/// attempt is not refused for memory the pool holds but cannot fit it into. A CPU device, or a
/// GPU without a pool, has nothing to give back.
pub fn release_cached_memory(device: &Device) -> Result<()> {
    if !device.is_cuda() {
        return Ok(());
    }
    let pool = match default_pool(device, "releasing cached GPU memory") {
        Ok(pool) => pool,
        Err(_) => return Ok(()),
    };
    device.synchronize()?;
    // SAFETY: `pool` is a valid pool of this device; trimming only returns unused memory.
    unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) }.map_err(|e| Error::NotAvailable {
        what: "releasing cached GPU memory".into(),
        reason: format!("the CUDA driver refused to trim the memory pool: {e:?}"),
    })
}
