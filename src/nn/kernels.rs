//! The switch and the counter of `nn`'s CUDA kernels (no-ops without the `cuda` feature).

#[cfg(feature = "cuda")]
use super::cuda;

/// Set by [`set_device_nodes_on_cpu`].
static NODES_ON_CPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A test switch: the graph nodes a GPU takes (`rope_attention`, `swiglu_linear`, a bias-free
/// `Linear` and `linear_cross_entropy`) are taken on the CPU too, with the CPU's kernels, so
/// that tests without a GPU run the GPU's graph. Process-wide; off by default.
#[doc(hidden)]
pub fn set_device_nodes_on_cpu(on: bool) {
    NODES_ON_CPU.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_device_nodes_on_cpu`] is on.
#[doc(hidden)]
pub fn device_nodes_on_cpu() -> bool {
    NODES_ON_CPU.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether this build has the CUDA kernels (the `cuda` feature).
pub const CUDA_KERNELS_BUILT: bool = cfg!(feature = "cuda");

/// Number of this module's CUDA kernels launched by this process (0 without the `cuda`
/// feature): a check can tell that the kernels really ran rather than the composed ops.
pub fn cuda_kernel_launches() -> u64 {
    #[cfg(feature = "cuda")]
    {
        cuda::launches()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Switches the CUDA kernels on or off for the ops called from now on (overriding
/// `ACCELERATE_RS_NN_CUDA`); ops already in a graph keep the path they took. Does nothing
/// without the feature.
pub fn set_cuda_kernels(on: bool) {
    #[cfg(feature = "cuda")]
    cuda::set_enabled(on);
    #[cfg(not(feature = "cuda"))]
    let _ = on;
}
